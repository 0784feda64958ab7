"""Fake quantisers (quantise, then dequantise, in floating point) as pure tensor functions.

Kaul et al. 2024 (LLM.int8 conventions, §6.2 of its spec):

* absmax, b bits, symmetric: ``s = max|T| / (2^(b-1) - 1)``, ``q = clamp(round(T / s), -(2^(b-1)-1), 2^(b-1)-1)``,
  ``T^ = s q``; the max is taken per slice (``reduce_dims``: the dims the max runs over; None = whole tensor).
* zeropoint, b bits, asymmetric: ``s = (hi - lo) / (2^b - 1)``, ``z = round(-lo / s)``,
  ``q = clamp(round(T / s) + z, 0, 2^b - 1)``, ``T^ = s (q - z)``: the minimum maps to code 0.

He et al. 2024 (Bondarenko et al.'s W8A8 recipe, §7 of its spec):

* weights: symmetric signed int8 on [-128, 127] with ``s = c / 127``, the clip ``c`` chosen by an MSE grid
  search over ``c = max|W| * i / n`` (i = 1..n, n = 100);
* activations: asymmetric uint8 on [0, 255], ``s = (hi - lo) / 255``, ``z = round(-lo / s)`` clamped to the
  grid, with lo forced <= 0 and hi >= eps; static (lo, hi) from a running min/max (momentum 0.9) of the
  (0.001 %, 99.999 %) percentiles of calibration batches (:class:`RunningMinMax`).

4-bit schemes (QuaRot's conventions, Ashkboos et al. 2024, arXiv 2404.00456): weights int4 symmetric absmax per
output channel (grid [-7, 7]); activations int4 symmetric absmax per token (:func:`absmax_quantize` with
``reduce_dims=(-1,)``); K and V int4 asymmetric min/max per head, token and group of ``group_size`` channels of the
head dim (:func:`group_zeropoint_quantize`). No clipping ratios: plain round-to-nearest.

Rounding is round-half-to-even (``torch.round``) everywhere; a zero range gives scale 1 (no division by 0).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch


def _reduce_amax(x: torch.Tensor, reduce_dims: Sequence[int] | None) -> torch.Tensor:
    if reduce_dims is None:
        return x.abs().amax()
    return x.abs().amax(dim=tuple(reduce_dims), keepdim=True)


def _safe(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def absmax_quantize(x: torch.Tensor, bits: int = 8, reduce_dims: Sequence[int] | None = None) -> torch.Tensor:
    """Symmetric absmax fake-quant; ``reduce_dims`` = dims the absmax runs over (None: per tensor).

    A weight ``W [out, in]`` per output channel: ``reduce_dims=(1,)``; activations ``X [..., in]`` per token:
    ``(-1,)``; per input feature channel: every dim but the last.
    """
    qmax = 2 ** (bits - 1) - 1
    xf = x.float()
    scale = _safe(_reduce_amax(xf, reduce_dims) / qmax)
    return (torch.clamp(torch.round(xf / scale), -qmax, qmax) * scale).to(x.dtype)


def zeropoint_quantize(x: torch.Tensor, bits: int = 4, reduce_dims: Sequence[int] | None = None) -> torch.Tensor:
    """Asymmetric min/max fake-quant onto ``[0, 2^bits - 1]``; the minimum maps to code 0."""
    levels = 2 ** bits - 1
    xf = x.float()
    if reduce_dims is None:
        lo, hi = xf.amin(), xf.amax()
    else:
        lo = xf.amin(dim=tuple(reduce_dims), keepdim=True)
        hi = xf.amax(dim=tuple(reduce_dims), keepdim=True)
    scale = _safe((hi - lo) / levels)
    zero = torch.round(-lo / scale)
    q = torch.clamp(torch.round(xf / scale) + zero, 0, levels)
    return ((q - zero) * scale).to(x.dtype)


def group_zeropoint_quantize(x: torch.Tensor, bits: int = 4, group_size: int | None = None) -> torch.Tensor:
    """Asymmetric min/max fake-quant of groups of ``group_size`` consecutive entries of the last dim (None: the
    whole last dim, one group per row); the last dim must be a multiple of ``group_size``."""
    d = x.shape[-1]
    g = d if group_size is None else group_size
    if g < 1 or d % g:
        raise ValueError(f"group size {g} does not divide the last dim {d}")
    y = zeropoint_quantize(x.reshape(*x.shape[:-1], d // g, g), bits, reduce_dims=(-1,))
    return y.reshape(x.shape)


def symmetric_quantize(x: torch.Tensor, clip: float | torch.Tensor, bits: int = 8) -> torch.Tensor:
    """Signed symmetric fake-quant with a given clip: ``s = clip / (2^(b-1)-1)``, grid ``[-2^(b-1), 2^(b-1)-1]``."""
    qmax = 2 ** (bits - 1) - 1
    scale = _safe(torch.as_tensor(clip, dtype=torch.float32, device=x.device) / qmax)
    q = torch.clamp(torch.round(x.float() / scale), -qmax - 1, qmax)
    return (q * scale).to(x.dtype)


def mse_symmetric_clip(x: torch.Tensor, bits: int = 8, n_candidates: int = 100,
                       chunk_elements: int = 1 << 24) -> float:
    """The clip ``max|x| * i / n`` (i = 1..n) that minimises the MSE of :func:`symmetric_quantize` (first
    minimum on ties), evaluated in float64, candidates in chunks of about ``chunk_elements`` values."""
    xd = x.detach().to(torch.float64).reshape(-1)
    amax = float(xd.abs().max()) if xd.numel() else 0.0
    if amax == 0.0:
        return 0.0
    qmax = 2 ** (bits - 1) - 1
    clips = amax * torch.arange(1, n_candidates + 1, dtype=torch.float64, device=xd.device) / n_candidates
    per_chunk = max(1, chunk_elements // xd.numel())
    errs = []
    for c in clips.split(per_chunk):
        s = (c / qmax)[:, None]
        errs.append((torch.clamp(torch.round(xd / s), -qmax - 1, qmax) * s - xd).square().mean(1))
    return float(clips[int(torch.cat(errs).argmin())])


def asymmetric_params(lo: float, hi: float, bits: int = 8, eps: float = 1e-8) -> tuple[float, float]:
    """(scale, zero point) of an asymmetric uint grid covering [lo, hi]; lo forced <= 0, hi >= eps."""
    levels = 2 ** bits - 1
    lo, hi = min(float(lo), 0.0), max(float(hi), eps)
    scale = (hi - lo) / levels
    zero = min(max(float(round(-lo / scale)), 0.0), float(levels))
    return scale, zero


def asymmetric_quantize(x: torch.Tensor, scale: float, zero: float, bits: int = 8) -> torch.Tensor:
    """Fake-quant onto ``[0, 2^bits - 1]`` with a given scale and zero point."""
    levels = 2 ** bits - 1
    q = torch.clamp(torch.round(x.float() / scale) + zero, 0, levels)
    return ((q - zero) * scale).to(x.dtype)


def percentile(x: torch.Tensor, q: float) -> float:
    """The q-th percentile (0..100) of all entries, linear interpolation between order statistics (numpy's
    default); exact for any size (``torch.quantile`` refuses large inputs)."""
    flat = x.detach().reshape(-1).float()
    n = flat.numel()
    if n == 0:
        raise ValueError("percentile of an empty tensor")
    pos = q / 100.0 * (n - 1)
    lo_i = int(math.floor(pos))
    hi_i = min(lo_i + 1, n - 1)
    v_lo = float(torch.kthvalue(flat, lo_i + 1).values)
    if hi_i == lo_i or pos == lo_i:
        return v_lo
    v_hi = float(torch.kthvalue(flat, hi_i + 1).values)
    return v_lo + (pos - lo_i) * (v_hi - v_lo)


class RunningMinMax:
    """Static activation range: per batch the (100 - p, p) percentiles (or the raw min/max with p = None),
    then ``r = momentum * r + (1 - momentum) * new`` (the first batch sets r)."""

    def __init__(self, momentum: float = 0.9, pct: float | None = 99.999):
        self.momentum, self.pct = momentum, pct
        self.lo: float | None = None
        self.hi: float | None = None

    def update(self, x: torch.Tensor) -> None:
        if self.pct is None:
            lo, hi = float(x.min()), float(x.max())
        else:
            lo, hi = percentile(x, 100.0 - self.pct), percentile(x, self.pct)
        if self.lo is None:
            self.lo, self.hi = lo, hi
        else:
            m = self.momentum
            self.lo = m * self.lo + (1 - m) * lo
            self.hi = m * self.hi + (1 - m) * hi

    def params(self, bits: int = 8) -> tuple[float, float]:
        if self.lo is None:
            raise RuntimeError("RunningMinMax has seen no calibration data")
        return asymmetric_params(self.lo, self.hi, bits)
