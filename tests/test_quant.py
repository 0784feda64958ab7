"""Quantisers against hand-computed small examples, and the PTQ schemes on small modules and the debug model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from outlier_titan.quant import quantizers as qz
from outlier_titan.quant.ptq import SCHEMES, linear_targets, quantized


def close(a, b, atol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64),
                          atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------- absmax int8


def test_absmax_int8_per_output_channel_hand_example():
    w = torch.tensor([[1.27, -0.5, 0.254], [-2.54, 1.0, 0.035]])
    # row 0: s = 1.27/127 = 0.01 -> codes 127, -50, 25 (25.4) ; row 1: s = 0.02 -> -127, 50, 2 (1.75)
    expect = [[1.27, -0.5, 0.25], [-2.54, 1.0, 0.04]]
    assert close(qz.absmax_quantize(w, 8, reduce_dims=(1,)), expect)


def test_absmax_int8_per_tensor_hand_example():
    w = torch.tensor([[2.54, -1.0], [0.035, 0.011]])
    # s = 2.54/127 = 0.02 -> codes 127, -50, 2 (1.75), 1 (0.55)
    assert close(qz.absmax_quantize(w, 8), [[2.54, -1.0], [0.04, 0.02]])


def test_absmax_per_token_and_per_feature_channel():
    x = torch.tensor([[[1.27, 0.1], [0.254, 2.54]]])  # [B=1, T=2, D=2]
    # per token: token 0 s = 0.01 -> (1.27, 0.10); token 1 s = 0.02 -> (0.26 (12.7 -> 13), 2.54)
    assert close(qz.absmax_quantize(x, 8, reduce_dims=(-1,)), [[[1.27, 0.1], [0.26, 2.54]]])
    # per feature channel: channel 0 s = 0.01 -> (1.27, 0.25); channel 1 s = 0.02 -> (0.1, 2.54)
    assert close(qz.absmax_quantize(x, 8, reduce_dims=(0, 1)), [[[1.27, 0.1], [0.25, 2.54]]])


def test_absmax_zero_slice_and_error_bound():
    assert close(qz.absmax_quantize(torch.zeros(2, 3), 8, reduce_dims=(1,)), torch.zeros(2, 3))
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(0))
    y = qz.absmax_quantize(x, 8, reduce_dims=(1,))
    half_step = x.abs().amax(1, keepdim=True) / 127 / 2
    assert bool(((y - x).abs() <= half_step * (1 + 1e-5)).all())


# ---------------------------------------------------------------------------------------------- zeropoint int4


def test_zeropoint_int4_known_vector():
    x = torch.tensor([-1.0, 0.0, 0.5, 2.0])
    # lo = -1, hi = 2: s = 3/15 = 0.2, z = round(5) = 5; codes 0, 5, 7, 15 -> -1.0, 0.0, 0.4, 2.0
    assert close(qz.zeropoint_quantize(x, 4), [-1.0, 0.0, 0.4, 2.0])


def test_zeropoint_int4_per_output_channel():
    w = torch.tensor([[-1.0, 0.0, 0.5, 2.0], [-0.2, 0.55, 0.12, 0.37]])
    # row 1: lo = -0.2, hi = 0.55: s = 0.05, z = 4; codes 0, 15, 6 (2.4 + 4), 11 (7.4 + 4)
    assert close(qz.zeropoint_quantize(w, 4, reduce_dims=(1,)), [[-1.0, 0.0, 0.4, 2.0], [-0.2, 0.55, 0.1, 0.35]])
    # per tensor the whole matrix shares lo = -1, hi = 2 (s = 0.2, z = 5): row 1 codes 4, 8, 6, 7
    assert close(qz.zeropoint_quantize(w, 4), [[-1.0, 0.0, 0.4, 2.0], [-0.2, 0.6, 0.2, 0.4]])


def test_zeropoint_has_16_levels():
    x = torch.linspace(-3, 12, 1001)  # s = 1, z = 3: codes 0..15 all used
    assert len(torch.unique(qz.zeropoint_quantize(x, 4))) == 16


# ---------------------------------------------------------------------------------------------- He et al. 2024 W8A8


def test_mse_clip_tiny_vector_by_hand():
    # 2 bits: grid [-2, 1], s = c. Candidates c = 1, 2, 3, 4 (amax 4, n = 4):
    #   c=1: 4 -> 1 (err 9), 2 -> 1 (err 1 x4)          -> 13
    #   c=2: 4 -> code 1 -> 2 (err 4), 2 -> 2 (err 0)     -> 4   <- minimum
    #   c=3: 4 -> 3 (err 1), 2 -> round(0.67) = 1 -> 3    -> 5
    #   c=4: 4 -> 4 (err 0), 2 -> round(0.5) = 0 -> 0      -> 16
    x = torch.tensor([4.0, 2.0, 2.0, 2.0, 2.0])
    assert qz.mse_symmetric_clip(x, bits=2, n_candidates=4) == pytest.approx(2.0)


def test_mse_clip_int8_beats_or_equals_absmax():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4000, generator=g) * 0.02
    x[0] = 1.0  # a rare outlier: clipping it is cheaper than a coarse grid for everything else
    c = qz.mse_symmetric_clip(x, 8)
    assert 0 < c < 1.0

    def mse(clip):
        return float((qz.symmetric_quantize(x.double(), clip, 8) - x.double()).square().mean())

    assert mse(c) < mse(1.0)


def test_symmetric_int8_grid_is_signed_256_levels():
    x = torch.tensor([-1.2, -1.0, 0.5, 1.0, 1.2])
    # clip 1.0: s = 1/127; -1.2 -> -128 (bottom of the grid), 1.2 -> 127
    assert close(qz.symmetric_quantize(x, 1.0, 8), [-128 / 127, -1.0, 64 / 127, 1.0, 1.0])


def test_asymmetric_params_and_quantize_hand_example():
    s, z = qz.asymmetric_params(-1.0, 3.0, 8)
    assert s == pytest.approx(4.0 / 255) and z == 64.0  # round(63.75)
    y = qz.asymmetric_quantize(torch.tensor([-1.0, 0.0, 3.0, 5.0]), s, z, 8)
    assert close(y, [-64 * 4 / 255, 0.0, 191 * 4 / 255, 191 * 4 / 255])
    s2, z2 = qz.asymmetric_params(0.5, 2.0, 8)  # lo forced to 0
    assert s2 == pytest.approx(2.0 / 255) and z2 == 0.0


def test_percentile_matches_numpy():
    x = torch.randn(10007, generator=torch.Generator().manual_seed(2))
    for q in (0.001, 1.0, 50.0, 99.999):
        assert qz.percentile(x, q) == pytest.approx(float(np.percentile(x.numpy().astype(np.float64), q)),
                                                    rel=1e-5, abs=1e-6)


def test_running_min_max_momentum():
    r = qz.RunningMinMax(momentum=0.9, pct=None)
    r.update(torch.tensor([-1.0, 0.0, 2.0]))
    r.update(torch.tensor([-3.0, 4.0]))
    assert (r.lo, r.hi) == (pytest.approx(-1.2), pytest.approx(2.2))


# ---------------------------------------------------------------------------------------------- schemes on modules


class Toy(nn.Module):
    def __init__(self, tied: bool = False):
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.tok_embeddings = nn.Embedding(11, 6)
        self.proj = nn.Linear(6, 6, bias=True)
        self.output = None if tied else nn.Linear(6, 11, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, tokens):
        h = self.proj(self.tok_embeddings(tokens))
        return h @ self.tok_embeddings.weight.T if self.output is None else self.output(h)


def test_scheme_fine_equals_hand_composition_and_restores_weights():
    m = Toy()
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    before = {k: v.clone() for k, v in m.state_dict().items()}
    ref_logits = m(tokens)
    with torch.no_grad(), quantized(m, "int8_fine") as info:
        got = m(tokens)
    assert info["head"] == "quantised" and info["linear_layers"] == 2
    with torch.no_grad():
        x = before["tok_embeddings.weight"][tokens]
        qx = qz.absmax_quantize(x, 8, reduce_dims=(0, 1))
        h = F.linear(qx, qz.absmax_quantize(before["proj.weight"], 8, reduce_dims=(1,)), before["proj.bias"])
        expect = F.linear(qz.absmax_quantize(h, 8, reduce_dims=(0, 1)),
                          qz.absmax_quantize(before["output.weight"], 8, reduce_dims=(1,)))
    assert torch.allclose(got, expect, atol=1e-6)
    assert not torch.allclose(got, ref_logits, atol=1e-6)
    for k, v in m.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(m(tokens), ref_logits)
    assert all(not lin._forward_hooks and not lin._forward_pre_hooks for lin in linear_targets(m, True).values())


def test_scheme_coarse_quantises_outputs_per_tensor():
    m = Toy()
    tokens = torch.tensor([[1, 2, 3]])
    seen = {}
    with torch.no_grad(), quantized(m, "int8_coarse"):
        # registered after the scheme's hooks, so it sees the quantised output
        m.proj.register_forward_hook(lambda _m, _a, out: seen.setdefault("y", out))
        m(tokens)
    y = seen["y"]
    assert torch.equal(y, qz.absmax_quantize(y, 8))  # already on the per-tensor int8 grid
    codes = y / (y.abs().max() / 127)
    assert torch.allclose(codes, codes.round(), atol=1e-4)


def test_int4_weights_only_and_tied_head_stays_fp():
    m = Toy(tied=True)
    emb = m.tok_embeddings.weight.clone()
    with torch.no_grad(), quantized(m, "int4_zeropoint") as info:
        assert info["head"].startswith("fp") and info["linear_layers"] == 1
        assert torch.equal(m.tok_embeddings.weight, emb)
        w = m.proj.weight
        assert all(len(torch.unique(row)) <= 16 for row in w)
        assert not m.proj._forward_pre_hooks


def test_w8a8_static_calibrates_and_keeps_head_fp():
    m = Toy()
    head = m.output.weight.clone()
    emb, w, b = m.tok_embeddings.weight.detach(), m.proj.weight.detach().clone(), m.proj.bias.detach()
    calib = [torch.tensor([[1, 2, 3, 4]]), torch.tensor([[5, 6, 7, 8]])]
    # the recipe by hand: MSE-clipped int8 weights, then running (momentum 0.9) 99.999 % ranges of the
    # linear's input and output in full precision, then uint8 asymmetric fake quant of both
    wq = qz.symmetric_quantize(w, qz.mse_symmetric_clip(w, 8), 8)
    r_in, r_out = qz.RunningMinMax(), qz.RunningMinMax()
    for t in calib:
        r_in.update(emb[t])
        r_out.update(F.linear(emb[t], wq, b))
    probe = torch.tensor([[9, 10, 2]])
    expect = qz.asymmetric_quantize(F.linear(qz.asymmetric_quantize(emb[probe], *r_in.params()), wq, b),
                                    *r_out.params())
    seen = {}
    with torch.no_grad(), quantized(m, "w8a8_static", calib_batches=calib) as info:
        assert info["head"] == "fp" and info["linear_layers"] == 1
        assert torch.equal(m.output.weight, head)
        assert torch.equal(m.proj.weight, wq)
        m.output.register_forward_pre_hook(lambda _m, a: seen.setdefault("x", a[0]))
        m(probe)
    assert torch.allclose(seen["x"], expect, atol=1e-6)
    with pytest.raises(ValueError):
        with quantized(m, "w8a8_static"):
            pass


def test_every_scheme_runs_on_the_debug_model():
    from outlier_titan.config.job_config import Model
    from outlier_titan.models.init import Initializer
    from outlier_titan.models.registry import model_args

    spec, args = model_args(Model(name="pre_ln", flavor="debug_llama"), vocab_size=512, seq_len=16)
    m = spec.build(args)
    m.init_weights(Initializer(0, "cpu"))
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = m(tokens)
        for name in SCHEMES:
            with quantized(m, name, calib_batches=[tokens]) as info:
                out = info["model"](tokens)
            assert torch.isfinite(out).all(), name
            if SCHEMES[name].edit is not None and not info["edit"]["zeroed"]:  # no super weight: nothing to zero
                assert torch.equal(out, ref), name
            else:
                assert 0 < (out - ref).abs().max() < ref.abs().max(), name
            assert info["linear_layers"] == 4 * 7 + SCHEMES[name].head, name
            assert info["kv_cache"] == (4 if SCHEMES[name].kv_bits else 0), name
            assert (info["model"] is m) == (not SCHEMES[name].rotate), name
        assert torch.equal(m(tokens), ref)


def test_w8a8_static_quantises_the_residual_stream_at_block_boundaries():
    import dataclasses

    from outlier_titan.config.job_config import Model
    from outlier_titan.models.init import Initializer
    from outlier_titan.models.registry import model_args

    spec, args = model_args(Model(name="pre_ln", flavor="debug_llama"), vocab_size=512, seq_len=16)
    m = spec.build(args)
    m.init_weights(Initializer(0, "cpu"))
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(0))
    blocks = list(m.layers.values())
    with torch.no_grad():
        seen = []
        with quantized(m, "w8a8_static", calib_batches=[tokens]) as info:
            handles = [blocks[0].register_forward_pre_hook(lambda _m, a: seen.append(a[0]))]
            handles += [b.register_forward_hook(lambda _m, _a, out: seen.append(out)) for b in blocks]
            m(tokens)
            for h in handles:
                h.remove()
        assert info["residual_points"] == len(blocks) + 1 and len(seen) == len(blocks) + 1
        for x in seen:  # each point lies on its own uint8 grid
            assert 16 < x.unique().numel() <= 256
        # an outlier channel in the residual stream hurts only where the stream itself is quantised
        m.tok_embeddings.weight[:, 3] *= 1000.0
        ref = m(tokens)
        without = dataclasses.replace(SCHEMES["w8a8_static"], quantize_residual=False)
        err = {}
        for scheme in (SCHEMES["w8a8_static"], without):
            with quantized(m, scheme, calib_batches=[tokens]):
                err[scheme.quantize_residual] = float((m(tokens) - ref).abs().mean())
        assert err[True] > 2 * err[False], err


def test_weight_cache_reuses_quantised_weights():
    m = Toy()
    cache = {}
    calib = [torch.tensor([[1, 2, 3]])]
    with torch.no_grad(), quantized(m, "w8a8_static", calib, weight_cache=cache):
        first = m.proj.weight.clone()
    assert set(cache) == {"proj"} and torch.equal(cache["proj"], first)
    cache["proj"] = torch.full_like(first, 0.5)  # a cached value is used as is
    with torch.no_grad(), quantized(m, "w8a8_static", calib, weight_cache=cache):
        assert torch.equal(m.proj.weight, cache["proj"])
    assert not torch.equal(m.proj.weight, cache["proj"])  # restored


def test_a_registered_scheme_is_usable_by_name_and_listed_by_the_tool():
    import outlier_titan.quant.ptq as ptq
    from outlier_titan.errors import UserError
    from outlier_titan.tools import evaluate as ev

    saved = dict(ptq.SCHEMES)
    try:
        toy = ptq.register_scheme(ptq.Scheme("toy_w8", "toy: int8 weights per tensor",
                                             lambda w: qz.absmax_quantize(w, 8, reduce_dims=None), None, False, True))
        with pytest.raises(UserError, match="already registered"):
            ptq.register_scheme(toy)
        assert ptq.get_scheme("toy_w8") is toy and list(ptq.SCHEMES)[-1] == "toy_w8"
        assert ev.parse(["--checkpoint", "x"]).schemes is None  # the default: every scheme registered when it runs
        assert "toy_w8: toy: int8 weights per tensor" in ptq.scheme_help()  # what --schemes' help lists
        with pytest.raises(UserError) as e:
            ptq.check_schemes(["toy_w8", "int3"], "--schemes")
        assert str(e.value).startswith("--schemes: unknown int3; available: int8_fine,") and "toy_w8" in str(e.value)
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 8, bias=False))
        w = m[0].weight.detach().clone()
        with quantized(m, "toy_w8"):
            assert torch.equal(m[0].weight, qz.absmax_quantize(w, 8, reduce_dims=None))
        assert torch.equal(m[0].weight, w)
    finally:
        ptq.SCHEMES.clear()
        ptq.SCHEMES.update(saved)
