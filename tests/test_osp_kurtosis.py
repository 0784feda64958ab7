"""Outlier-Safe Pre-Training's excess kurtosis (outlier_titan/observe/osp_kurtosis.py) against a plain float64
reference on constructed cases, and the 4-bit schemes on a model with the embedding projection (quantised as the
deployed, merged model)."""

import math

import pytest
import torch

from outlier_titan.models.init import Initializer
from outlier_titan.models.pre_ln.model import PreLNArgs, PreLNTransformer
from outlier_titan.observe.osp_kurtosis import osp_excess_kurtosis, osp_token_excess_kurtosis
from outlier_titan.quant.ptq import linear_targets, quantized
from outlier_titan.quant.rotation import rotate


def _reference(vec: list[float]) -> float:
    """max(0, mean(x^4) / s^4 - 3) with the unbiased sample sd s, in plain Python floats."""
    n = len(vec)
    mean = sum(vec) / n
    var = sum((v - mean) ** 2 for v in vec) / (n - 1)
    return max(0.0, sum(v ** 4 for v in vec) / n / var ** 2 - 3)


def test_token_formula_matches_a_plain_float64_reference():
    # one spike among 8 channels: mean x^4 = 1250, unbiased var 12.5 -> 1250 / 156.25 - 3 = 5 exactly
    spike = [10.0] + [0.0] * 7
    assert _reference(spike) == 5.0
    # +-1 channels: 1 / (4/3)^2 - 3 < 0 -> clipped to 0 (a Gaussian-like or flatter token adds nothing)
    flat = [1.0, -1.0, 1.0, -1.0]
    # the fourth moment is uncentred: a constant offset raises it (centred Pearson kurtosis would not move)
    offset = [v + 3.0 for v in [2.0, -1.0, 0.5, 4.0, -3.0, 1.0]]
    rand = torch.randn(5, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64).pow(3).tolist()
    rows = [spike, flat + [0.0] * 4, offset + [0.0] * 2] + [r[:8] for r in rand]
    got = osp_token_excess_kurtosis(torch.tensor(rows, dtype=torch.float32))
    assert got.dtype == torch.float64
    want = [_reference(r) for r in rows]
    assert got.tolist() == pytest.approx(want, rel=1e-6)  # float32 inputs, float64 maths
    assert got[0].item() == pytest.approx(5.0, rel=1e-12) and got[1] == 0.0 and got[2] > 0


def _model(**kw):
    kw = {"tie_embeddings": False, **kw}
    m = PreLNTransformer(PreLNArgs(dim=16, n_layers=2, n_heads=2, vocab_size=32, max_seq_len=8, norm="rmsnorm",
                                   pos_encoding="rope", mlp="swiglu", bias=False, **kw)).double()
    m.init_weights(Initializer(3, "cpu"))
    with torch.no_grad():  # make the channels unequal, so the kurtosis is not clipped to 0 everywhere
        m.tok_embeddings.weight[:, 0] *= 8
    return m


def _hidden_states_alone(m, token: int) -> list[torch.Tensor]:
    """The Hugging Face hidden states of one token fed alone, computed by hand: the embedding output (after the
    projection), each block's output but the last, the final norm's output."""
    x = m.tok_embeddings.weight[token][None, None]
    if m.embed_proj is not None:
        x = m.embed_proj(x)
    states = [x]
    for block in m.layers.values():
        x = block(x)
        states.append(x)
    states[-1] = m.norm(x)
    return [s[0, 0] for s in states]


@pytest.mark.parametrize("embed_proj", [False, True])
def test_each_token_alone_over_every_hidden_state_matches_the_reference(embed_proj):
    m = _model(embed_proj=embed_proj)
    if embed_proj:
        with torch.no_grad():
            m.embed_proj.weight.add_(0.3 * torch.randn(16, 16, generator=torch.Generator().manual_seed(2),
                                                       dtype=torch.float64))
    seqs = torch.randint(0, 32, (3, 8), generator=torch.Generator().manual_seed(1))
    got = osp_excess_kurtosis(m, [seqs[:2], seqs[2]])
    per = []
    with torch.no_grad():
        for seq in seqs.tolist():
            states = [_hidden_states_alone(m, t) for t in seq]  # [T][L + 1]
            per.append([sum(_reference(states[t][i].tolist()) for t in range(len(seq))) / len(seq)
                        for i in range(3)])
    want = sum(sum(r) for r in per) / (3 * 3)
    assert got["osp_kurtosis"] == pytest.approx(want, rel=1e-12)
    for i in range(3):
        assert got[f"osp_kurtosis_layer_{i}"] == pytest.approx(sum(r[i] for r in per) / 3, rel=1e-12)
    assert got["osp_kurtosis"] > 0
    # every token alone: the order of the tokens does not matter; in context (one length-8 sequence) it does
    shuffled = osp_excess_kurtosis(m, [seqs[:, torch.randperm(8, generator=torch.Generator().manual_seed(5))]])
    assert shuffled["osp_kurtosis"] == pytest.approx(got["osp_kurtosis"], rel=1e-12)
    with torch.no_grad():
        h = []
        handles = [b.register_forward_pre_hook(lambda _m, a: h.append(a[0])) for b in m.layers.values()]
        m(seqs)
        for hd in handles:
            hd.remove()
    in_context = float(osp_token_excess_kurtosis(h[1]).mean())
    assert in_context != pytest.approx(got["osp_kurtosis_layer_1"], rel=1e-6)


@pytest.mark.parametrize("tie", [False, True])
def test_embedding_projection_is_quantised_as_the_merged_model(tie):
    """The projection is folded into the embedding on export, so the 4-bit schemes leave it (and its input, the
    embedding) in full precision, and the QuaRot rotation keeps the function of a model that has it (a tied head
    reads the unprojected embedding)."""
    m = _model(embed_proj=True, tie_embeddings=tie)
    with torch.no_grad():
        m.embed_proj.weight.add_(0.3 * torch.randn(16, 16, generator=torch.Generator().manual_seed(2),
                                                   dtype=torch.float64))
    assert not {"embed_proj", "head_proj"} & set(linear_targets(m, include_head=True))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = m(tokens)
        rot, info = rotate(m, seed=0)
        assert rot.embed_proj is None and "embedding projections folded" in info["residual_rotation"]
        torch.testing.assert_close(rot(tokens), want, rtol=1e-10, atol=1e-10)
        assert torch.equal(m(tokens), want)  # the original is untouched
        with quantized(m, "w4a4kv4_rtn_hadamard", seed=0) as q:
            assert math.isfinite(float(q["model"](tokens).abs().max()))
