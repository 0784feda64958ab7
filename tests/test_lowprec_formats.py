"""The low-precision casts: fast code == torchao 0.18 bit for bit == a float64 reference from the specs
(tests/lowprec_reference.py), on random and adversarial tensors; stochastic rounding; cast_stats; the random
Hadamard transform; the recipes against torchao's Float8LinearConfig."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch

from outlier_titan.lowprec import formats as F
from outlier_titan.lowprec.formats import Cast, cast_stats, fake_quantize, random_hadamard, random_signs
from outlier_titan.lowprec.recipes import PRECISIONS, RECIPES
from tests import lowprec_reference as R

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_CASTS = [Cast(e, g, scale=s) for e in FP8 for g in ("tensor", "row") for s in ("fp32", "pow2")]
MX_CASTS = [Cast(e, "block", 32, "e8m0") for e in ("e4m3", "e5m2", "e2m1")]
NVFP4 = Cast("e2m1", "block", 16, "e4m3")
NVFP4_2D = Cast("e2m1", "block", 16, "e4m3", block_2d=True)
ALL_CASTS = FP8_CASTS + MX_CASTS + [NVFP4]


@pytest.fixture(scope="module")
def torchao():
    logging.disable(logging.WARNING)  # torchao's import logs missing CUDA/C++ kernels on CPU
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import torchao  # noqa: F401
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import LinearMMConfig
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32
        from torchao.prototype.mx_formats.mx_tensor import MXTensor
        from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    logging.disable(logging.NOTSET)

    def cast(x: torch.Tensor, c: Cast) -> torch.Tensor:
        """torchao's quantise-dequantise of x along its last axis, in x's dtype."""
        if c.scale in ("fp32", "pow2"):
            gran = ScalingGranularity.TENSORWISE if c.scaling == "tensor" else ScalingGranularity.AXISWISE
            t = hp_tensor_to_float8_dynamic(x, FP8[c.element], LinearMMConfig(), scaling_granularity=gran,
                                            axiswise_dim=-1 if c.scaling == "row" else None,
                                            round_scales_to_power_of_2=c.scale == "pow2")
            return t.to_original_precision().to(x.dtype)
        if c.scale == "e8m0":
            dtype = FP8.get(c.element, torch.float4_e2m1fn_x2)
            return MXTensor.to_mx(x, dtype, c.block).dequantize(x.dtype)
        scale = per_tensor_amax_to_scale(x.abs().max())
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(x.dtype)

    cast.f4_unpacked_to_f32 = f4_unpacked_to_f32
    return cast


def heavy_tailed(*shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * torch.exp(2 * torch.randn(*shape, generator=g))).to(dtype)


def ref_args(c: Cast, axis: int = -1) -> dict:
    return dict(element=c.element, scaling=c.scaling, block=c.block, scale=c.scale, block_2d=c.block_2d, axis=axis)


def fast_parts(x: torch.Tensor, c: Cast, axis: int = -1):
    """(codes, dequantisation scale) of the fast cast, float64 in x's shape."""
    xf, _, q, _, d, divide = F.cast_groups(x, c, axis)
    scale = (1.0 / d.double()) if divide else d.double()
    scale = scale.expand_as(xf)
    back = (lambda t: F.unblocked(t, x.shape, axis)) if c.scaling == "block" else (lambda t: t.movedim(-1, axis))
    return back(q.double()), back(scale)


def ref_parts(x: torch.Tensor, c: Cast, axis: int = -1):
    r = R.reference_cast(x, **ref_args(c, axis))
    back = lambda t: R.ungroup(t.expand_as(r.codes), x.shape, c.scaling, c.block, c.block_2d, axis)  # noqa: E731
    return back(r.codes), back(r.scale), back(r.scaled)


def test_enumerated_grids_are_the_formats_values(torchao):
    """The reference's grids, enumerated from the bit fields, are exactly the finite values of torch's FP8 dtypes
    and of torchao's FP4 decoder."""
    for name, dtype in FP8.items():
        every = torch.arange(256, dtype=torch.uint8).view(dtype).to(torch.float64)
        finite = every[torch.isfinite(every) & (every >= 0)].unique()
        assert torch.equal(R.grid(name).values, finite), name
    fp4 = torchao.f4_unpacked_to_f32(torch.arange(16, dtype=torch.uint8)).double()
    assert torch.equal(R.grid("e2m1").values, fp4[fp4 >= 0].unique())
    assert R.grid("e2m1").values.tolist() == [0, .5, 1, 1.5, 2, 3, 4, 6]
    assert (R.grid("e4m3").max, R.grid("e5m2").max) == (448.0, 57344.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("c", ALL_CASTS, ids=lambda c: c.name)
def test_fast_cast_equals_torchao_bit_for_bit(torchao, c, dtype):
    x = heavy_tailed(64, 128, seed=1, dtype=dtype)
    out = fake_quantize(x, c)
    assert out.dtype == dtype and out.shape == x.shape
    assert torch.equal(out, torchao(x, c))
    # along the first axis: torchao's cast of the transpose, transposed back
    assert torch.equal(fake_quantize(x, c, axis=0), torchao(x.t().contiguous(), c).t())


@pytest.mark.parametrize("c", ALL_CASTS + [NVFP4_2D], ids=lambda c: c.name)
def test_fast_cast_equals_float64_reference(c):
    """Codes and scales equal the spec's, exactly where the scale is a power of two (MX, pow2); with FP32 / NVFP4
    scales torchao's FP32 products may round an element lying within 2^-20 of a rounding boundary the other way,
    so there (only there) a code may differ."""
    x = heavy_tailed(64, 64, seed=2)
    codes, scale = fast_parts(x, c)
    r_codes, r_scale, r_scaled = ref_parts(x, c)
    assert torch.equal(scale, R.fp32(r_scale) if c.scale == "e4m3" else r_scale)  # NVFP4's d = fp32(s_t * s_b)
    differ = codes != r_codes
    if c.scale in ("pow2", "e8m0"):
        assert not differ.any()
        assert torch.equal(fake_quantize(x, c).double(), R.reference_fake_quantize(x, **ref_args(c)))
    else:
        near = R.midpoint_distance(r_scaled, R.grid(c.element)) < 2.0**-20
        assert not (differ & ~near).any() and int(differ.sum()) <= 2


def _adversarial_mx(element: str) -> torch.Tensor:
    """Blocks of 32 whose scale is exactly 1 (amax in [2^emax, 2^(emax+1))): every grid midpoint (ties to even),
    subnormal midpoints, the max and just above, an all-zero block, and a block spanning 2^-20 .. 2^emax."""
    g = R.grid(element)
    emax = F.ELEMENTS[element].emax
    anchor = 2.0**emax
    mids = ((g.values[1:] + g.values[:-1]) / 2).tolist()
    vals = [v * s for v in mids for s in (1, -1)]
    vals += [g.max, -g.max, g.max * 1.01, min(g.max * 1.2, 2 * anchor * 0.99)]  # above the max saturates
    vals += [g.values[1] / 4, g.values[1] * 0.75, -g.values[1] / 2]  # below the smallest subnormal
    blocks = []
    for i in range(0, len(vals), 31):
        chunk = vals[i:i + 31]
        blocks.append([anchor] + chunk + [0.0] * (31 - len(chunk)))
    blocks.append([0.0] * 32)
    blocks.append([anchor] + [2.0 ** -k for k in range(1, 32)])
    return torch.tensor(blocks, dtype=torch.float32)


@pytest.mark.parametrize("element", ["e4m3", "e5m2", "e2m1"])
def test_mx_adversarial_equal_reference_and_torchao(torchao, element):
    c = Cast(element, "block", 32, "e8m0")
    x = _adversarial_mx(element)
    ref = R.reference_fake_quantize(x, **ref_args(c))
    out = fake_quantize(x, c)
    assert torch.equal(out.double(), ref)
    assert torch.equal(out, torchao(x, c))
    assert torch.equal(fake_quantize(x.bfloat16(), c), torchao(x.bfloat16(), c))
    assert not out[-2].any()  # the all-zero block stays zero
    g = R.grid(element)
    assert out[0, 1:3].tolist() == R.round_to_grid(x[0, 1:3].double(), g).tolist()


@pytest.mark.parametrize("element", ["e4m3", "e5m2"])
def test_fp8_ties_subnormals_and_saturation(torchao, element):
    """Per-tensor power-of-two scale 1 (amax = max): grid midpoints round to even, subnormal midpoints too."""
    g = R.grid(element)
    mids = ((g.values[1:] + g.values[:-1]) / 2)
    x = torch.cat([torch.tensor([g.max]), mids, -mids, g.values[1:4] / 2]).to(torch.float32)
    c = Cast(element, "tensor", scale="pow2")
    out = fake_quantize(x, c)
    assert torch.equal(out.double(), R.round_to_grid(x.double(), g))
    assert torch.equal(out, torchao(x, c))
    even = R.round_to_grid(mids, g)  # every tie went to the neighbour with an even mantissa
    assert all(bool(g.even[(g.values == v).nonzero()[0, 0]]) for v in even.abs())


def test_nvfp4_adversarial_equal_reference_and_torchao(torchao):
    """Tensor amax 2688 (FP32 scale exactly 1) and block amaxes 6 * 2^i (E4M3 scales 2^i): every E2M1 midpoint is
    an exact tie in every pipeline and must go to the even code; a tiny block clamps its scale at 2^-6."""
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    row = [torch.tensor([2688.0] + [0.0] * 15)]
    for i in (0, 1, -3):
        row.append(torch.cat([torch.tensor([6.0]), mids, -mids, torch.tensor([0.0])]) * 2.0**i)
    row.append(torch.tensor([1e-3, 2e-3, -1e-4] + [0.0] * 13))
    x = torch.cat(row)[None, :]
    out = fake_quantize(x, NVFP4)
    assert torch.equal(out.double(), R.reference_fake_quantize(x, **ref_args(NVFP4)))
    assert torch.equal(out, torchao(x, NVFP4))
    assert out[0, 17:24].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert not out[0, 64:].any()  # 1e-3 / 2^-6 = 0.064 underflows


def test_nvfp4_2d_blocks_equal_torchao_when_every_row_holds_the_tile_max(torchao):
    """A 16x16 tile's scale is its amax; if every 1x16 row segment of the tile holds that amax, torchao's 1-D
    NVFP4 cast chooses the same scales, so the 2-D cast must equal it."""
    x = heavy_tailed(32, 64, seed=3)
    tiles = x.reshape(2, 16, 4, 16).abs().amax(dim=(1, 3))
    x.reshape(2, 16, 4, 16)[:, :, :, 0] = tiles[:, None, :]
    assert torch.equal(fake_quantize(x, NVFP4_2D), torchao(x, NVFP4))
    y = heavy_tailed(32, 64, seed=4)
    assert not torch.equal(fake_quantize(y, NVFP4_2D), fake_quantize(y, NVFP4))  # 2-D really differs otherwise


@pytest.mark.parametrize("c", ALL_CASTS + [NVFP4_2D], ids=lambda c: c.name)
def test_a_sharded_cast_equals_the_whole_cast_given_the_tensor_amax(c):
    """Shards along the non-contraction axis (FSDP / TP), each cast with the whole tensor's amax, put back
    together, equal the cast of the whole tensor; without it a per-tensor scale would differ per shard."""
    x = heavy_tailed(64, 64, seed=9)
    x[40, 5] = 1e4  # the tensor's amax lives in the second shard
    whole = fake_quantize(x, c)
    shards = [fake_quantize(part, c, tensor_amax=x.abs().amax()) for part in x.split(32, dim=0)]
    assert torch.equal(torch.cat(shards), whole)
    stats = [cast_stats(part, c, tensor_amax=x.abs().amax()) for part in x.split(32, dim=0)]
    assert sum(float(s["err_sq"]) for s in stats) == pytest.approx(float(cast_stats(x, c)["err_sq"]), rel=1e-9)
    if (c.scaling, c.scale) == ("tensor", "fp32") or c.scale == "e4m3":  # (a power-of-two rescale is exact)
        assert not torch.equal(fake_quantize(x[:32], c), whole[:32])  # the local amax gives another cast


def test_nvfp4_2d_weight_is_the_same_matrix_along_either_axis():
    """16 x 16 tiles: the weight cast along in-features (forward) and along out-features (dgrad) is one matrix."""
    w = heavy_tailed(48, 32, seed=10)
    assert torch.equal(fake_quantize(w, NVFP4_2D, axis=-1), fake_quantize(w, NVFP4_2D, axis=0))
    assert not torch.equal(fake_quantize(w, NVFP4, axis=-1), fake_quantize(w, NVFP4, axis=0))


def test_nvfp4_all_zero_tensor_is_zero_and_tiny_blocks_hit_the_scale_floor():
    assert not fake_quantize(torch.zeros(2, 32), NVFP4).any()
    x = torch.zeros(1, 32)
    x[0, 0], x[0, 16] = 1000.0, 1e-4  # second block's scale clamps at 2^-6 of the tensor scale: 1e-4 underflows
    out = fake_quantize(x, NVFP4)
    assert out[0, 0] == pytest.approx(1000.0, rel=1e-6) and out[0, 16] == 0.0
    codes, scale = fast_parts(x, NVFP4)
    r_codes, r_scale, _ = ref_parts(x, NVFP4)
    assert torch.equal(codes, r_codes) and torch.equal(scale, R.fp32(r_scale))
    assert scale[0, 16] == R.fp32(torch.tensor(2.0**-6 * 1000.0 / 2688.0, dtype=torch.float64))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_inputs_are_refused_in_one_line(bad):
    x = torch.ones(4, 32)
    x[1, 3] = bad
    for fn in (lambda: fake_quantize(x, MX_CASTS[0]), lambda: cast_stats(x, NVFP4)):
        with pytest.raises(ValueError, match="1 NaN/inf") as err:
            fn()
        assert "\n" not in str(err.value)


def test_bad_shapes_and_casts_are_refused_in_one_line():
    with pytest.raises(ValueError, match="length 40 along axis -1 is not a multiple of the block 32") as err:
        fake_quantize(torch.ones(2, 40), MX_CASTS[0])
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="2-D blocks need a matrix"):
        fake_quantize(torch.ones(2, 16, 16), NVFP4_2D)
    with pytest.raises(ValueError, match="element 'e3m3' is not one of"):
        Cast("e3m3", "tensor")
    with pytest.raises(ValueError, match="per block"):
        Cast("e4m3", "row", scale="e8m0")
    with pytest.raises(ValueError, match="needs scaling='block'"):
        Cast("e4m3", "row", block=32)
    with pytest.raises(ValueError, match="not a power of two"):
        random_hadamard(torch.ones(4, 24), 24)


SR_CASES = {  # cast, a tensor whose rows are identical copies (so every row shares the scales)
    "fp8_row": (Cast("e4m3", "row", scale="pow2"), [448.0, 0.3, -1.7, 13.1, 200.5, 0.004, 37.3, 0.0]),
    "mxfp4": (MX_CASTS[2], [7.0, 0.3, -1.7, 2.6, 5.9, 0.04, -3.3, 4.5] * 4),  # 7 would saturate at 6 without 3/4
    "nvfp4": (NVFP4, [6.0, 0.3, -1.7, 2.6, 5.1, 0.04, -3.3, 4.5] * 2),
}


@pytest.mark.parametrize("case", SR_CASES)
def test_stochastic_rounding_is_unbiased_and_returns_a_neighbour(case):
    c, row = SR_CASES[case]
    draws = 4000
    x = torch.tensor(row, dtype=torch.float32).repeat(draws, 1)
    out = fake_quantize(x, c, stochastic=True, generator=torch.Generator().manual_seed(0)).double()
    # the grid the stochastic cast rounds on, in x's units: the reference scale (times 4/3 for E8M0's pre-scale)
    _, scale, _ = ref_parts(x[:1], c)
    unit = {"e8m0": scale[0] / F.SR_PRESCALE, "e4m3": R.fp32(scale[0])}.get(c.scale, scale[0])
    lo, hi = R.neighbours(torch.tensor(row, dtype=torch.float64) / unit, R.grid(c.element))
    lo, hi = R.fp32(lo * unit), R.fp32(hi * unit)
    assert ((out == lo) | (out == hi)).all()
    step = (hi - lo).abs()
    # mean within 5 standard errors of x (variance of a two-point draw <= step^2 / 4)
    tol = 5 * step / 2 / draws**0.5 + 1e-6 * x[0].double().abs()
    assert ((out.mean(0) - x[0].double()).abs() <= tol).all()
    both = (out == lo).any(0) & (out == hi).any(0)
    assert both[lo != hi].all()  # off-grid values really are rounded both ways
    rne = fake_quantize(x[:1], c).double()[0]  # round-to-nearest is biased on the same values: the test can fail
    assert ((rne - x[0].double()).abs() > tol).any()


def test_stochastic_rounding_is_reproducible_from_the_generator():
    x = heavy_tailed(8, 64, seed=5)
    a = fake_quantize(x, NVFP4, stochastic=True, generator=torch.Generator().manual_seed(7))
    b = fake_quantize(x, NVFP4, stochastic=True, generator=torch.Generator().manual_seed(7))
    c = fake_quantize(x, NVFP4, stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("c", [FP8_CASTS[1], FP8_CASTS[2], MX_CASTS[0], MX_CASTS[2], NVFP4, NVFP4_2D],
                         ids=lambda c: c.name)
def test_cast_stats_match_a_direct_float64_count(c):
    x = heavy_tailed(32, 64, seed=6)
    x[3, :32] = 0.0  # an all-zero block
    x[5, 7] = 1e-30  # a value that underflows in every format
    s = cast_stats(x, c)
    assert all(v.dtype == torch.float64 and v.dim() == 0 for v in s.values())
    r_codes, r_scale, r_scaled = ref_parts(x, c)
    x64 = x.double()
    deq = r_codes * r_scale
    top = R.grid(c.element).values[-2:]
    beyond = top[1] + (top[1] - top[0]) / 2  # where only saturation keeps a value at the max
    stored = R.fp32(r_scale) if c.scale == "e4m3" else r_scale  # NVFP4's scale product is stored in FP32
    expect = {
        "amax": x64.abs().max(), "n": x.numel(), "nonzero": (x64 != 0).sum(),
        "underflow": ((x64 != 0) & (r_codes == 0)).sum(), "saturated": (r_scaled.abs() > beyond).sum(),
        "sig_sq": (x64**2).sum(), "scale_min": stored.min(), "scale_max": stored.max(),
        "block_dr": R.reference_block_dr(x, c.block or 32, c.block_2d),
    }
    for key, want in expect.items():
        assert float(s[key]) == pytest.approx(float(want), rel=1e-9), key
    assert float(s["err_sq"]) == pytest.approx(float(((x64 - deq) ** 2).sum()), rel=1e-6)
    assert s["underflow"] >= 1 and s["nonzero"] < s["n"]
    assert (s["saturated"] > 0) == (c.scale == "e8m0")  # only E8M0's floor sends amax / X beyond the max


def test_block_dynamic_range_pads_a_partial_last_block():
    x = torch.ones(1, 40)
    x[0, 35] = 1e-3  # in the zero-padded tail block of 8 elements
    assert float(F.block_dynamic_range(x, FP8_CASTS[0])) == pytest.approx(1e3)
    assert float(F.block_dynamic_range(torch.zeros(3, 8), FP8_CASTS[0])) == 0.0


def test_random_hadamard_is_orthogonal_and_keeps_the_wgrad_product():
    g = torch.Generator().manual_seed(0)
    dy, x = torch.randn(64, 24, generator=g), heavy_tailed(64, 40, seed=7)
    signs = random_signs(16, torch.Generator().manual_seed(1))
    hdy, hx = random_hadamard(dy, 16, 0, signs=signs), random_hadamard(x, 16, 0, signs=signs)
    torch.testing.assert_close(hdy.T @ hx, dy.T @ x, rtol=1e-5, atol=1e-4)  # dW = dy^T x unchanged
    # against the explicit float64 block-diagonal matrix diag(Q, Q, Q, Q), Q = H diag(s) / 4
    h = torch.tensor([[(-1) ** bin(i & j).count("1") for j in range(16)] for i in range(16)], dtype=torch.float64)
    q = h * signs.double() / 4
    big = torch.block_diag(*[q] * 4)
    torch.testing.assert_close(hx.double(), big @ x.double(), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(big @ big.T, torch.eye(64, dtype=torch.float64))
    spike = torch.zeros(16, 1)
    spike[3] = 8.0
    assert torch.allclose(random_hadamard(spike, 16, 0, signs=signs).abs(), torch.full((16, 1), 2.0))
    a = random_hadamard(x, 16, 0, torch.Generator().manual_seed(3))
    assert torch.equal(a, random_hadamard(x, 16, 0, torch.Generator().manual_seed(3)))
    assert random_hadamard(x.bfloat16(), 16, 0, signs=signs).dtype == torch.bfloat16


def test_recipes_are_torchaos_float8_configs(torchao):
    from torchao.float8.config import Float8LinearConfig, ScalingGranularity

    gran = {ScalingGranularity.TENSORWISE: "tensor", ScalingGranularity.AXISWISE: "row"}
    for name in ("fp8_rowwise", "fp8_tensorwise"):
        recipe = RECIPES[name]
        cfg = Float8LinearConfig.from_recipe_name(recipe.torchao_float8)
        for ours, theirs in ((recipe.input, cfg.cast_config_input), (recipe.weight, cfg.cast_config_weight),
                             (recipe.grad_output, cfg.cast_config_grad_output)):
            assert FP8[ours.element] == theirs.target_dtype, name
            assert ours.scaling == gran[theirs.scaling_granularity], name
            assert (ours.scale == "pow2") == cfg.round_scales_to_power_of_2, name


def test_recipe_table():
    assert PRECISIONS == ("bf16", "fp8_rowwise", "fp8_tensorwise", "mxfp8", "mxfp4", "nvfp4")
    assert all(r.name == k and r.help for k, r in RECIPES.items())
    mx4, nv4 = RECIPES["mxfp4"], RECIPES["nvfp4"]
    assert {mx4.input.name, mx4.weight.name, mx4.grad_output.name} == {"e2m1/block32/e8m0"}
    assert mx4.stochastic_grad and mx4.wgrad_hadamard == 64 and "2502.20586" in mx4.help
    assert (nv4.weight.name, nv4.input.name) == ("e2m1/block16x16/e4m3", "e2m1/block16/e4m3")
    assert nv4.stochastic_grad and nv4.wgrad_hadamard == 16 and nv4.keep_last_fraction == 0.15
    assert "2509.25149" in nv4.help
    assert RECIPES["mxfp8"].weight == Cast("e4m3", "block", 32, "e8m0") and not RECIPES["mxfp8"].stochastic_grad
    with pytest.raises(dataclasses.FrozenInstanceError):
        RECIPES["mxfp8"].name = "x"


@pytest.mark.parametrize("c", [FP8_CASTS[3], MX_CASTS[2], NVFP4], ids=lambda c: c.name)
def test_fake_quantize_traces_in_one_graph(c):
    x = heavy_tailed(8, 64, seed=8)
    torch._dynamo.reset()
    compiled = torch.compile(lambda a: fake_quantize(a, c), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), fake_quantize(x, c))
