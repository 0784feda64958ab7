"""A float64 reference for the low-precision casts, written from the specs and deliberately not from the fast
code: the element grid is enumerated from (ebits, mbits, bias) (OCP 8-bit FP spec; OCP MX v1.0 section 5.3.3 for
E2M1), rounding searches that grid for the nearest value and breaks ties towards the even mantissa, the E8M0 scale
is 2^(floor(log2 amax) - emax_elem) from ``math.frexp`` (OCP MX v1.0 section 6.3), NVFP4 is an E4M3 block scale
amax_b / 6 / s_t rounded onto the E4M3 grid times an FP32 tensor scale s_t = amax / (448 * 6) (NVIDIA 2025,
arXiv 2509.25149, section 2). Scales the recipes store in FP32 are rounded to FP32; everything else is exact."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# (ebits, mbits, bias, codes that are not finite numbers: (exponent field, mantissa field) pairs, or "top" for
# IEEE-style inf/NaN at the all-ones exponent)
SPECS = {"e4m3": (4, 3, 7, {(15, 7)}), "e5m2": (5, 2, 15, "top"), "e2m1": (2, 1, 1, set())}


@dataclass
class Grid:
    values: torch.Tensor  # the non-negative finite values, ascending, float64
    even: torch.Tensor  # whether each value's mantissa field is even (ties round to it)

    @property
    def max(self) -> float:
        return float(self.values[-1])


def grid(element: str) -> Grid:
    """Every non-negative finite value of the element format, enumerated from its bit fields."""
    ebits, mbits, bias, special = SPECS[element]
    vals, even = [], []
    for e in range(2 ** ebits):
        if special == "top" and e == 2 ** ebits - 1:
            continue
        for m in range(2 ** mbits):
            if special != "top" and (e, m) in special:
                continue
            v = (m / 2 ** mbits) * 2.0 ** (1 - bias) if e == 0 else (1 + m / 2 ** mbits) * 2.0 ** (e - bias)
            vals.append(v)
            even.append(m % 2 == 0)
    return Grid(torch.tensor(vals, dtype=torch.float64), torch.tensor(even))


def round_to_grid(v: torch.Tensor, g: Grid) -> torch.Tensor:
    """Nearest grid value of float64 ``v`` by search, ties to the even mantissa, magnitudes above the max set to
    it (the saturating conversion)."""
    a = v.abs().clamp(max=g.max)
    hi = torch.searchsorted(g.values, a).clamp(1, len(g.values) - 1)
    lo_v, hi_v = g.values[hi - 1], g.values[hi]
    d_lo, d_hi = a - lo_v, hi_v - a
    take_hi = (d_hi < d_lo) | ((d_hi == d_lo) & g.even[hi])
    return torch.copysign(torch.where(take_hi, hi_v, lo_v), v)


def neighbours(v: torch.Tensor, g: Grid) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid values just below and just above |v| (equal when |v| is on the grid), signed like v."""
    a = v.abs().clamp(max=g.max)
    hi = torch.searchsorted(g.values, a)
    on = g.values[hi.clamp(max=len(g.values) - 1)] == a
    lo_v = torch.where(on, a, g.values[(hi - 1).clamp(min=0)])
    hi_v = g.values[hi.clamp(max=len(g.values) - 1)]
    return torch.copysign(lo_v, v), torch.copysign(hi_v, v)


def midpoint_distance(v: torch.Tensor, g: Grid) -> torch.Tensor:
    """Relative distance of |v| to the nearest rounding boundary (midpoint between grid neighbours)."""
    vals = g.values
    mids = (vals[1:] + vals[:-1]) / 2
    a = v.abs()
    i = torch.searchsorted(mids, a).clamp(0, len(mids) - 1)
    near = torch.minimum((a - mids[i]).abs(), (a - mids[(i - 1).clamp(min=0)]).abs())
    return near / a.clamp(min=1e-300)


def fp32(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float32).to(torch.float64)


@dataclass
class RefCast:
    scaled: torch.Tensor  # exact x / scale (float64), in the grouped layout
    codes: torch.Tensor  # the element values chosen (float64)
    scale: torch.Tensor  # the dequantisation scale per group (value = code * scale), float64
    deq: torch.Tensor  # codes * scale (float64, exact)


def groups(x: torch.Tensor, scaling: str, block: int, block_2d: bool, axis: int) -> torch.Tensor:
    """float64 x with axis last, split into (..., groups, group size) by plain index arithmetic."""
    x = x.double().movedim(axis, -1).contiguous()
    if scaling == "tensor":
        return x.reshape(1, -1)
    if scaling == "row":
        return x.reshape(-1, x.shape[-1])
    if block_2d:
        rows, cols = x.shape
        out = [x[r:r + block, c:c + block].reshape(-1) for r in range(0, rows, block) for c in range(0, cols, block)]
        return torch.stack(out)
    return x.reshape(-1, block)


def ungroup(g: torch.Tensor, shape, scaling: str, block: int, block_2d: bool, axis: int) -> torch.Tensor:
    moved = list(shape)
    moved.append(moved.pop(axis))
    if block_2d:
        rows, cols = moved
        out = torch.empty(rows, cols, dtype=g.dtype)
        i = 0
        for r in range(0, rows, block):
            for c in range(0, cols, block):
                out[r:r + block, c:c + block] = g[i].reshape(block, block)
                i += 1
        return out.movedim(-1, axis)
    return g.reshape(moved).movedim(-1, axis)


def reference_cast(x: torch.Tensor, element: str, scaling: str, block: int = 0, scale: str = "fp32",
                   block_2d: bool = False, axis: int = -1) -> RefCast:
    """The spec's cast of ``x`` (any float dtype), in the grouped layout of :func:`groups`."""
    g = grid(element)
    xg = groups(x, scaling, block, block_2d, axis)
    amax = xg.abs().amax(dim=-1, keepdim=True)
    if scale in ("fp32", "pow2"):  # the FP8 recipes: multiplier max / amax stored in FP32 (torchao's eps 1e-12)
        mult = fp32(g.max / amax.clamp(min=1e-12))
        if scale == "pow2":
            mult = torch.tensor([[2.0 ** (math.frexp(float(m))[1] - 1)] for m in mult.flatten()], dtype=torch.float64)
        codes = round_to_grid(xg * mult, g)
        return RefCast(xg * mult, codes, 1.0 / mult, codes / mult)
    if scale == "e8m0":  # X = 2^(floor(log2 amax) - emax_elem), E8M0 holds 2^-127 .. 2^127
        emax_elem = math.frexp(g.max)[1] - 1
        ks = [max(math.frexp(float(a))[1] - 1 - emax_elem, -127) if a > 0 else -127 for a in amax.flatten()]
        s = torch.tensor([[2.0 ** k] for k in ks], dtype=torch.float64)
    else:  # NVFP4: FP32 tensor scale s_t = amax / (448 * 6); E4M3 block scale of amax_b / 6 / s_t (>= 2^-6)
        t_amax = float(x.double().abs().max())
        s_t = fp32(torch.tensor(t_amax / (448.0 * 6.0), dtype=torch.float64)) if t_amax > 0 else 1.0
        s = round_to_grid((amax / 6.0 / s_t).clamp(min=2.0 ** -6, max=448.0), grid("e4m3")) * s_t
    codes = round_to_grid(xg / s, g)
    return RefCast(xg / s, codes, s, codes * s)


def reference_fake_quantize(x: torch.Tensor, element: str, scaling: str, block: int = 0, scale: str = "fp32",
                            block_2d: bool = False, axis: int = -1) -> torch.Tensor:
    """The dequantised tensor in x's shape, float64 (exact code x scale)."""
    r = reference_cast(x, element, scaling, block, scale, block_2d, axis)
    return ungroup(r.deq, x.shape, scaling, block, block_2d, axis)


def reference_block_dr(x: torch.Tensor, block: int, block_2d: bool = False, axis: int = -1) -> float:
    """max over blocks of max|x| / min nonzero |x|, by a plain loop (the tail block of a non-multiple length is
    what is left)."""
    xm = x.double().movedim(axis, -1)
    if block_2d:
        blocks = [xm[r:r + block, c:c + block].reshape(-1) for r in range(0, xm.shape[0], block)
                  for c in range(0, xm.shape[1], block)]
    else:
        rows = xm.reshape(-1, xm.shape[-1])
        blocks = [row[i:i + block] for row in rows for i in range(0, len(row), block)]
    best = 0.0
    for b in blocks:
        nz = b.abs()[b != 0]
        if len(nz):
            best = max(best, float(nz.max() / nz.min()))
    return best
