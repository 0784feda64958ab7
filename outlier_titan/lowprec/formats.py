"""The number formats of low-precision training and their casts, numerically what torchao computes.

A :class:`Cast` names an element format (OCP 8-bit FP E4M3 / E5M2, OCP MX v1.0 FP4 E2M1) and how its scale is
chosen: one FP32 scale per tensor or per row (torchao's ``Float8LinearConfig`` recipes), one E8M0 power of two per
32 elements (OCP MX v1.0), or one E4M3 scale per 16 elements times an FP32 tensor scale (NVFP4, NVIDIA 2025,
arXiv 2509.25149). :func:`fake_quantize` rounds onto that grid and back, so a GEMM of fake-quantised operands in
high precision equals the low-precision GEMM up to its accumulation order. Every step follows torchao 0.18's order
of operations (``hp_tensor_to_float8_dynamic``, ``to_mx`` + ``MXTensor.dequantize``, ``nvfp4_quantize`` +
``NVFP4Tensor.dequantize``), so the casts are equal to torchao's bit for bit; tests/test_lowprec_formats.py checks
them against torchao and against a float64 reference written from the specs. Two deliberate departures, both where
torchao's result is not a number one would train with: an all-zero tensor under NVFP4 gives zeros (torchao divides
by a zero tensor scale), and an MX block whose amax is below 2^-118 (E4M3) uses the E8M0 scale 2^-127 for both the
cast and the dequantisation (torchao casts with 2^-126 and dequantises with 2^-127)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from outlier_titan.linalg import is_power_of_two, sylvester_hadamard


@dataclass(frozen=True)
class Element:
    """A floating-point element format without inf/NaN codes: exponent and mantissa bits, the largest finite
    magnitude, the smallest normal exponent, and the largest power of two it holds (OCP MX v1.0's emax_elem)."""

    ebits: int
    mbits: int
    max: float
    emin: int
    emax: int
    dtype: torch.dtype | None = None  # the torch dtype whose saturating cast is the round-to-nearest-even

    @property
    def top_step(self) -> float:
        """The grid spacing just below the max: beyond max + top_step / 2 only saturation keeps a value finite."""
        return 2.0 ** (self.emax - self.mbits)


ELEMENTS = {
    "e4m3": Element(4, 3, 448.0, -6, 8, torch.float8_e4m3fn),  # OCP FP8 E4M3 ("fn": no inf, one NaN code)
    "e5m2": Element(5, 2, 57344.0, -14, 15, torch.float8_e5m2),
    "e2m1": Element(2, 1, 6.0, 0, 2),  # OCP MX v1.0 FP4: +-{0, .5, 1, 1.5, 2, 3, 4, 6}
}
SCALINGS = ("tensor", "row", "block")
SCALES = ("fp32", "pow2", "e8m0", "e4m3")
FP8_EPS = 1e-12  # torchao.float8's clamp on amax before max / amax
E4M3_TINY = 2.0**-6  # torchao's NVFP4 clamp on the E4M3 block scale (finfo(float8_e4m3fn).tiny)
E8M0_MIN_EXP = -127
SR_PRESCALE = 0.75  # Tseng et al. 2025 (arXiv 2502.20586): MX blocks times 3/4 before stochastic rounding


@dataclass(frozen=True)
class Cast:
    """How one GEMM operand is cast: element format, scale granularity (``row``: one scale per slice along the
    cast's axis; ``block``: one per ``block`` consecutive elements along it), and the scale's own format."""

    element: str
    scaling: str
    block: int = 0
    scale: str = "fp32"
    block_2d: bool = False

    def __post_init__(self):
        problems = []
        if self.element not in ELEMENTS:
            problems.append(f"element {self.element!r} is not one of {sorted(ELEMENTS)}")
        if self.scaling not in SCALINGS:
            problems.append(f"scaling {self.scaling!r} is not one of {list(SCALINGS)}")
        if self.scale not in SCALES:
            problems.append(f"scale {self.scale!r} is not one of {list(SCALES)}")
        if (self.scaling == "block") != (self.block > 0):
            problems.append(f"block={self.block} needs scaling='block' (and block scaling a block > 0)")
        if (self.scale in ("e8m0", "e4m3")) != (self.scaling == "block"):
            problems.append(f"scale {self.scale!r} with scaling {self.scaling!r}: e8m0/e4m3 scales are per block, "
                            "fp32/pow2 per tensor or row")
        if self.scale == "e4m3" and self.element != "e2m1":
            problems.append("an E4M3 block scale (NVFP4) needs element 'e2m1'")
        if self.block_2d and self.scaling != "block":
            problems.append("block_2d needs scaling='block'")
        if problems:
            raise ValueError(f"Cast{self.element, self.scaling, self.block, self.scale}: " + "; ".join(problems))

    @property
    def name(self) -> str:
        """Short label, e.g. ``e4m3/row/pow2``, ``e2m1/block32/e8m0``, ``e2m1/block16x16/e4m3``."""
        gran = f"block{self.block}x{self.block}" if self.block_2d else (
            f"block{self.block}" if self.scaling == "block" else self.scaling)
        return f"{self.element}/{gran}/{self.scale}"


def pow2(k: torch.Tensor) -> torch.Tensor:
    """2**k in float32, exactly, for integer ``k`` in [-149, 127] (built from the bits: no libm rounding)."""
    k = k.to(torch.int32)
    normal = torch.bitwise_left_shift(k.clamp(min=-126) + 127, 23)
    subnormal = torch.bitwise_left_shift(torch.ones_like(k), (k + 149).clamp(min=0, max=22))
    return torch.where(k >= -126, normal, subnormal).view(torch.float32)


def exponent(a: torch.Tensor) -> torch.Tensor:
    """floor(log2(a)) of float32 ``a >= 0`` read from the exponent field (int32): -127 for 0 and subnormals,
    as torchao's ``to_mx`` computes it."""
    return (torch.bitwise_right_shift(a.view(torch.int32), 23) & 0xFF) - 127


def check_finite(x: torch.Tensor, what: str = "fake_quantize") -> None:
    """One-line ValueError if ``x`` holds NaN or inf (skipped while torch.compile traces: it would break the graph)."""
    if not torch.compiler.is_compiling() and not bool(torch.isfinite(x).all()):
        bad = int((~torch.isfinite(x)).sum())
        raise ValueError(f"{what}: the tensor {tuple(x.shape)} holds {bad} NaN/inf values; a cast needs finite "
                         "inputs (find where they come from: the step before diverged)")


def round_nearest_even(y: torch.Tensor, element: Element) -> torch.Tensor:
    """float32 ``y`` rounded to nearest, ties to even, onto the element grid; magnitudes above its max saturate."""
    if element.dtype is not None:
        return y.clamp(-element.max, element.max).to(element.dtype).to(torch.float32)
    a = y.abs().clamp(max=element.max)
    step = grid_step(a, element)
    return torch.copysign(torch.round(a / step) * step, y)  # torch.round: half to even; a / step is exact


def round_stochastic(y: torch.Tensor, element: Element, generator: torch.Generator | None) -> torch.Tensor:
    """float32 ``y`` rounded to one of its two grid neighbours, up with probability (|y| - lower) / step, so that
    E[q(y)] = y inside the grid; magnitudes above the max saturate."""
    a = y.abs().clamp(max=element.max)
    step = grid_step(a, element)
    u = torch.rand(a.shape, generator=generator, device=a.device, dtype=torch.float32)
    return torch.copysign((torch.floor(a / step + u) * step).clamp(max=element.max), y)


def grid_step(a: torch.Tensor, element: Element) -> torch.Tensor:
    """The grid spacing around ``a >= 0``: 2^(max(floor(log2 a), emin) - mbits) (subnormals share emin's step)."""
    return pow2(exponent(a).clamp(min=element.emin) - element.mbits)


def blocked(x: torch.Tensor, cast: Cast, axis: int) -> torch.Tensor:
    """``x`` with ``axis`` moved last and split into blocks: (..., n / block, block), or for 2-D blocks of a
    matrix (rows / block, block, n / block, block). One-line ValueError when a length is not a multiple."""
    x = x.movedim(axis, -1)
    b = cast.block
    if cast.block_2d:
        if x.dim() != 2 or x.shape[0] % b:
            raise ValueError(f"{cast.name}: 2-D blocks need a matrix whose both sides are multiples of {b}, "
                             f"got shape {tuple(x.shape)} (use 1-D blocks or pad)")
    if x.shape[-1] % b:
        raise ValueError(f"{cast.name}: length {x.shape[-1]} along axis {axis} is not a multiple of the block {b} "
                         "(choose a size divisible by it or leave this layer in high precision)")
    if cast.block_2d:
        return x.reshape(x.shape[0] // b, b, x.shape[1] // b, b)
    return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)


def unblocked(xb: torch.Tensor, shape: torch.Size, axis: int) -> torch.Tensor:
    """Inverse of :func:`blocked` for a tensor of original ``shape``."""
    moved = list(shape)
    moved.append(moved.pop(axis))
    return xb.reshape(moved).movedim(-1, axis)


def amax_keep(xb: torch.Tensor, cast: Cast) -> torch.Tensor:
    """max |x| per scale group (kept dims) of a blocked (or, for tensor / row, axis-last) tensor."""
    if cast.scaling == "tensor":
        return xb.abs().amax().reshape([1] * xb.dim())
    if cast.block_2d:
        return xb.abs().amax(dim=(1, 3), keepdim=True)
    return xb.abs().amax(dim=-1, keepdim=True)


def encode_decode(xf: torch.Tensor, cast: Cast, tensor_amax: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(multiplier m, scale d, divide): the cast computes q(xf * m) and dequantises as q / d (``divide``, FP8:
    torchao's ``_data / scale``) or q * d. ``xf`` is float32, blocked (or axis-last); m and d broadcast to it.
    ``tensor_amax`` replaces max|xf| where the cast has a per-tensor scale (see :func:`fake_quantize`)."""
    element = ELEMENTS[cast.element]
    if tensor_amax is not None:
        tensor_amax = tensor_amax.to(device=xf.device, dtype=torch.float32).reshape(())
    amax = amax_keep(xf, cast)
    if cast.scaling == "tensor" and tensor_amax is not None:
        amax = tensor_amax.reshape(amax.shape)
    if cast.scale in ("fp32", "pow2"):  # torchao.float8.float8_utils.amax_to_scale
        s = (element.max / amax.double().clamp(min=FP8_EPS)).float()
        if cast.scale == "pow2":
            s = pow2(exponent(s))  # _round_scale_down_to_power_of_2: exp2(floor(log2(s)))
        return s, s, True
    if cast.scale == "e8m0":  # torchao to_mx, ScaleCalculationMode.FLOOR (OCP MX v1.0 section 6.3)
        k = (exponent(amax) - element.emax).clamp(min=E8M0_MIN_EXP)
        return pow2(-k), pow2(k), False
    # NVFP4 (torchao nvfp4_quantize with a per-tensor scale): FP32 tensor scale amax / (448 * 6), E4M3 block scale
    t_amax = xf.abs().amax() if tensor_amax is None else tensor_amax
    tensor_scale = t_amax / (ELEMENTS["e4m3"].max * element.max)
    tensor_scale = torch.where(tensor_scale > 0, tensor_scale, torch.ones_like(tensor_scale))  # all-zero tensor
    block_scale = ((amax / element.max) / tensor_scale).clamp(E4M3_TINY, ELEMENTS["e4m3"].max)
    block_scale = block_scale.to(torch.float8_e4m3fn).to(torch.float32)
    return (1.0 / tensor_scale) / block_scale, tensor_scale * block_scale, False


def cast_groups(x: torch.Tensor, cast: Cast, axis: int = -1, stochastic: bool = False,
                generator: torch.Generator | None = None, tensor_amax: torch.Tensor | None = None):
    """The cast in its grouped layout (axis last; blocks split off): (xf, y = xf * m, codes q, dequantised float32,
    scale d, divide). Dequantisation is q / d when ``divide`` (FP8), else q * d."""
    element = ELEMENTS[cast.element]
    xf = x.to(torch.float32)
    xf = blocked(xf, cast, axis) if cast.scaling == "block" else xf.movedim(axis, -1)
    m, d, divide = encode_decode(xf, cast, tensor_amax)
    y = xf * m
    if not stochastic:
        q = round_nearest_even(y, element)
        return xf, y, q, (q / d if divide else q * d), d, divide
    if cast.scale == "e8m0":  # E8M0's floor puts amax / scale in [2^emax, 2^(emax+1)): above the max. Tseng et al.
        q = round_stochastic(y * SR_PRESCALE, element, generator)  # 2025 scale by 3/4 first so that nothing
        return xf, y, q, (q * d) / SR_PRESCALE, d, divide  # saturates and the rounding stays unbiased
    q = round_stochastic(y, element, generator)
    return xf, y, q, (q / d if divide else q * d), d, divide


def fake_quantize(x: torch.Tensor, cast: Cast, axis: int = -1, *, stochastic: bool = False,
                  generator: torch.Generator | None = None, tensor_amax: torch.Tensor | None = None,
                  check: bool = True) -> torch.Tensor:
    """Quantise then dequantise (same shape and dtype): what a GEMM in that format computes with. Scales are
    computed along ``axis`` (the GEMM's contraction axis); ``stochastic`` rounds the elements stochastically
    (unbiased; E8M0-scaled blocks are first scaled by 3/4 so that none saturates, Tseng et al. 2025, and the
    result is scaled back), the scales stay deterministic. ``tensor_amax``: max|x| of the whole tensor when ``x``
    is a shard of it (all-reduced by the caller), for the casts with a per-tensor scale (FP8 tensorwise, NVFP4's
    FP32 scale; the others ignore it), so that a sharded cast equals the unsharded one. One-line ValueError on
    NaN / inf; ``check=False`` (training) skips that test and its device sync, and non-finite values spread through
    the cast's scale instead, as in a real low-precision GEMM, for the divergence guard to see."""
    if check:
        check_finite(x)
    _, _, _, deq, _, _ = cast_groups(x, cast, axis, stochastic, generator, tensor_amax)
    out = unblocked(deq, x.shape, axis) if cast.scaling == "block" else deq.movedim(-1, axis)
    return out.to(x.dtype)


def cast_stats(x: torch.Tensor, cast: Cast, axis: int = -1, *, tensor_amax: torch.Tensor | None = None
               ) -> dict[str, torch.Tensor]:
    """Sums and maxima of one round-to-nearest cast (0-dim float64, so ranks / shards reduce before finalising):
    amax, scale_min / scale_max (the dequantisation scales chosen, value = code x scale), n, nonzero, underflow
    (nonzero elements that become 0), saturated (scaled beyond the max by more than half the top grid step: set to
    the max by saturation, not by rounding), sig_sq
    (sum x^2), err_sq (sum (x - q(x))^2), block_dr (largest max|x| / min nonzero |x| inside one block of the
    cast's block size; 32 along the axis for tensor / row casts). ``tensor_amax`` as for :func:`fake_quantize`."""
    check_finite(x, "cast_stats")
    element = ELEMENTS[cast.element]
    xf, y, q, deq, d, divide = cast_groups(x, cast, axis, False, None, tensor_amax)
    scale = (1.0 / d.double()) if divide else d.double()
    x64, err = xf.double(), (xf.double() - deq.double())
    f64 = dict(dtype=torch.float64, device=x.device)
    return {
        "amax": xf.abs().amax().double() if xf.numel() else torch.zeros((), **f64),
        "scale_min": scale.min(), "scale_max": scale.max(),
        "n": torch.tensor(float(xf.numel()), **f64),
        "nonzero": (xf != 0).sum().double(),
        "underflow": ((xf != 0) & (q == 0)).sum().double(),
        "saturated": (y.abs() > element.max + element.top_step / 2).sum().double(),
        "sig_sq": (x64 * x64).sum(), "err_sq": (err * err).sum(),
        "block_dr": block_dynamic_range(x, cast, axis),
    }


def block_dynamic_range(x: torch.Tensor, cast: Cast, axis: int = -1) -> torch.Tensor:
    """Largest max|x| / min nonzero |x| over the cast's blocks (32 along ``axis`` for tensor / row casts, the
    last block zero-padded); 0 when every block is zero. float64, 0-dim."""
    a = x.to(torch.float32).abs()
    if cast.scaling == "block":
        a = blocked(a, cast, axis)
        dims = (1, 3) if cast.block_2d else (-1,)
    else:
        a = a.movedim(axis, -1)
        pad = (-a.shape[-1]) % 32
        a = torch.nn.functional.pad(a, (0, pad)).reshape(*a.shape[:-1], -1, 32)
        dims = (-1,)
    big = a.amax(dim=dims)
    small = torch.where(a > 0, a, torch.full_like(a, float("inf"))).amin(dim=dims)
    ratio = torch.where(big > 0, big.double() / small.double(), torch.zeros_like(big, dtype=torch.float64))
    return ratio.max() if ratio.numel() else torch.zeros((), dtype=torch.float64, device=x.device)


@lru_cache(maxsize=16)
def hadamard32(size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix of ``size`` in float32 on ``device``, built once per size and device
    (no host-to-device copy in each backward)."""
    return sylvester_hadamard(size).to(device=device, dtype=torch.float32)


def random_signs(size: int, generator: torch.Generator | None = None, device=None) -> torch.Tensor:
    """``size`` independent +-1 (float32) from ``generator``: the diagonal of a random Hadamard transform."""
    bits = torch.randint(0, 2, (size,), generator=generator, device=device)
    return (bits * 2 - 1).to(torch.float32)


def random_hadamard(x: torch.Tensor, size: int, axis: int = -1, generator: torch.Generator | None = None, *,
                    signs: torch.Tensor | None = None) -> torch.Tensor:
    """Blockwise random Hadamard transform along ``axis``: every ``size`` consecutive elements times
    H diag(s) / sqrt(size) (Sylvester H, random signs s from ``generator`` unless ``signs`` are given). The matrix
    is orthogonal, so transforming both operands of a GEMM along its contraction axis with the same signs leaves
    the exact product unchanged while spreading a block's outliers over it (Tseng et al. 2025, arXiv 2502.20586;
    NVIDIA 2025, arXiv 2509.25149). Computed in float32, returned in ``x``'s dtype."""
    if not is_power_of_two(size):
        raise ValueError(f"random_hadamard: size {size} is not a power of two (the papers use 16, 32 or 64)")
    n = x.shape[axis]
    if n % size:
        raise ValueError(f"random_hadamard: length {n} along axis {axis} is not a multiple of the size {size}")
    if signs is None:
        signs = random_signs(size, generator, x.device)
    q = hadamard32(size, x.device) * signs.to(device=x.device, dtype=torch.float32)  # H diag(s) / sqrt(size)
    xm = x.to(torch.float32).movedim(axis, -1)
    out = (xm.reshape(*xm.shape[:-1], n // size, size) @ q.T).reshape(xm.shape)  # each block b -> H diag(s) b
    return out.movedim(-1, axis).to(x.dtype)
