"""softmax-1 (Kaul et al. 2024): the fused SDPA path is exact, checked in float64 against the plain formula
exp(s_i) / (1 + sum_j exp(s_j)) over each query's causal prefix, written out here independently."""

import math

import pytest
import torch
import torch.nn.functional as F

from outlier_titan.models import layers
from outlier_titan.models.layers import Attention, RotaryEmbedding, attention, explicit_attention_probs

TOL = 1e-10


def plain_softmax1_attention(q, k, v, scale):
    """Loop over queries; no max-subtraction tricks, no masks: only the visible keys enter the sum."""
    b, h, t, d = q.shape
    hk = k.shape[1]
    out = torch.zeros(b, h, t, v.shape[-1], dtype=q.dtype)
    for i in range(t):
        kh = k.repeat_interleave(h // hk, dim=1)[:, :, : i + 1]
        vh = v.repeat_interleave(h // hk, dim=1)[:, :, : i + 1]
        s = torch.einsum("bhd,bhjd->bhj", q[:, :, i], kh) * scale
        e = torch.exp(s)
        p = e / (1.0 + e.sum(-1, keepdim=True))
        out[:, :, i] = torch.einsum("bhj,bhjd->bhd", p, vh)
    return out


def _qkv(b, h, hk, t, d, logit_scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) * logit_scale).requires_grad_()
    k = torch.randn(b, hk, t, d, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(b, hk, t, d, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v


def _grads(out, upstream, tensors):
    return torch.autograd.grad(out, tensors, upstream)


@pytest.mark.parametrize("b,h,hk,t,d,logit_scale", [
    (2, 3, 3, 17, 8, 1.0),     # ordinary logits
    (1, 2, 2, 1, 4, 1.0),      # a single position: weight e^s / (1 + e^s) < 1
    (2, 4, 2, 24, 8, 4.0),     # GQA and large logits (|s| up to ~40: the stable form matters)
])
def test_fused_softmax1_equals_formula_values_and_grads(b, h, hk, t, d, logit_scale):
    q, k, v = _qkv(b, h, hk, t, d, logit_scale, seed=t)
    scale = d ** -0.5
    fused = attention(q, k, v, "softmax1")
    ref = plain_softmax1_attention(q, k, v, scale)
    assert (fused - ref).abs().max().item() < TOL
    up = torch.randn_like(ref)
    for gf, gr in zip(_grads(fused, up, (q, k, v)), _grads(ref, up, (q, k, v))):
        assert (gf - gr).abs().max().item() < TOL


def test_packed_rows_every_position_sees_sink_and_its_prefix():
    # Padding-free packing: several documents back to back in one row, no padding and no mask between
    # documents (the loader's layout). Every query, including the first token of each later document,
    # must see the sink plus exactly its causal prefix of the row; RoPE positions must not shift (the sink
    # row is prepended after RoPE inside ``attention``).
    torch.manual_seed(0)
    dim, heads, t = 32, 4, 3 + 9 + 1 + 11  # four documents of lengths 3, 9, 1, 11 packed into 24 tokens
    rope = RotaryEmbedding(dim // heads, t)
    rope.init_weights()
    att = Attention(dim, heads, heads, bias=False, variant="softmax1", rope=rope).double()
    x = torch.randn(2, t, dim, dtype=torch.float64, requires_grad=True)
    fused = att(x)
    q, k, v = att.project_qkv(x)  # RoPE applied at the real positions 0..t-1
    ref_heads = plain_softmax1_attention(q, k, v, (dim // heads) ** -0.5)
    ref = att.wo(ref_heads.transpose(1, 2).reshape(2, t, dim))
    assert (fused - ref).abs().max().item() < TOL
    up = torch.randn_like(ref)
    params = [x, att.wq.weight, att.wk.weight, att.wv.weight, att.wo.weight]
    for gf, gr in zip(_grads(fused, up, params), _grads(ref, up, params)):
        assert (gf - gr).abs().max().item() < TOL


def test_softmax1_differs_from_softmax_and_rows_sum_below_one():
    q, k, v = _qkv(1, 2, 2, 12, 8, 1.0, seed=3)
    s1 = attention(q, k, v, "softmax1")
    s0 = attention(q, k, v, "softmax")
    assert (s1 - s0).abs().max().item() > 1e-2
    p = explicit_attention_probs(q, k, "softmax1", 8 ** -0.5).double()
    sums = p.sum(-1)
    assert (sums < 1).all() and (sums > 0).all()
    # first query: e^s / (1 + e^s) exactly
    s00 = (q[0, :, 0] * k[0, :, 0]).sum(-1) * 8 ** -0.5
    assert torch.allclose(p[0, :, 0, 0], torch.sigmoid(s00), atol=1e-6)


def test_probe_path_matches_fused_path():
    q, k, v = _qkv(2, 2, 2, 10, 8, 2.0, seed=5)
    seen = []
    with_hook = attention(q, k, v, "softmax1", prob_hook=seen.append)
    assert len(seen) == 1 and seen[0].shape == (2, 2, 10, 10)
    # the probe path computes in float32
    assert (with_hook.double() - attention(q, k, v, "softmax1")).abs().max().item() < 1e-5


def test_training_path_is_one_fused_sdpa_call(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((args[0].shape, kwargs.get("is_causal")))
        return real(*args, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(1, 2, 2, 6, 4, 1.0, seed=1)
    attention(q, k, v, "softmax1")
    assert calls == [((1, 2, 7, 4), True)]  # T + 1 rows (the zero sink), causal, no explicit mask


def test_stable_form_is_not_the_row_max_shortcut():
    # The wrong "subtract the row max, add 1" shortcut computes a sink of logit max(s), not 0.
    q, k, v = _qkv(1, 1, 1, 5, 4, 3.0, seed=7)
    s = (q @ k.transpose(-1, -2)) * 0.5
    mask = torch.ones(5, 5, dtype=torch.bool).tril()
    s = s.masked_fill(~mask, -math.inf)
    e = torch.exp(s - s.amax(-1, keepdim=True))
    shortcut = (e / (1 + e.sum(-1, keepdim=True))) @ v
    exact = attention(q, k, v, "softmax1")
    assert (shortcut - exact).abs().max().item() > 1e-3
