"""Numbers over seeds and verdicts that respect their spread.

A suite runs every point at several training seeds. :func:`estimate` turns one metric's per-seed values into
mean ± sd (sample sd, n − 1) with the values kept for the appendix; :func:`interval` is the 95 % Student-t
interval of the mean. The verdict helpers decide a claim from intervals, never from two means alone:

* :func:`ratio_verdict` — "A ≥ k × B": a percentile bootstrap over seeds (every resample enumerated when there
  are few seeds, so the interval is deterministic) of mean(A) − k·mean(B). Reproduced when the whole 95 %
  interval is ≥ 0 (for positive B: the ratio's interval lies above k), not reproduced when it is wholly < 0,
  inconclusive otherwise.
* :func:`threshold_verdict` — "mean ≥ t" or "mean ≤ t": the t-interval of the mean against t.
* :func:`effect_present` — whether a baseline shows the effect a remedy is meant to remove (its t-interval lies
  above a floor). Where it does not, the claim *cannot be tested at this scale* and no ratio is formed.

Each verdict is one of :data:`VERDICTS` with a detail string that prints the numbers and names the test.
"""

from __future__ import annotations

import itertools
import math
import statistics
from dataclasses import dataclass, field

import numpy as np

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, UNTESTABLE, MISSING = (
    "reproduced", "not reproduced", "inconclusive at this scale", "cannot be tested at this scale", "not determined")
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, UNTESTABLE, MISSING)
CONFIDENCE = 0.95


@dataclass(frozen=True)
class Estimate:
    """One metric over seeds: the mean, the sample sd (None for one seed) and the per-seed values."""

    values: tuple[float, ...]
    mean: float = field(init=False)
    sd: float | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mean", statistics.fmean(self.values))
        object.__setattr__(self, "sd", statistics.stdev(self.values) if len(self.values) > 1 else None)

    @property
    def n(self) -> int:
        return len(self.values)

    def text(self) -> str:
        """``mean ± sd`` (4 significant digits), or the single value with ``(1 seed)``."""
        if self.sd is None:
            return f"{self.mean:.4g} (1 seed)"
        return f"{self.mean:.4g} ± {self.sd:.2g}"


def estimate(values) -> Estimate | None:
    """The finite values as an :class:`Estimate`; None when there are none."""
    vals = tuple(float(v) for v in values if v is not None and math.isfinite(float(v)))
    return Estimate(vals) if vals else None


def interval(e: Estimate, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student-t interval of the mean; None for fewer than two seeds (no spread to judge)."""
    if e.n < 2:
        return None
    from scipy import stats

    half = stats.t.ppf(0.5 + confidence / 2, e.n - 1) * e.sd / math.sqrt(e.n)
    return e.mean - half, e.mean + half


def _resample_means(values: tuple[float, ...], rng: np.random.Generator, draws: int) -> np.ndarray:
    v = np.asarray(values, dtype=np.float64)
    n = len(v)
    if n ** n <= draws:  # every resample with replacement, once each
        idx = np.array(list(itertools.product(range(n), repeat=n)))
    else:
        idx = rng.integers(0, n, size=(draws, n))
    return v[idx].mean(axis=1)


def _bootstrap(a: Estimate, b: Estimate, fn, confidence: float, draws: int = 20000) -> tuple[float, float]:
    """Percentile interval of ``fn(mean(a*), mean(b*))`` over resamples of each side's seeds (independently)."""
    rng = np.random.default_rng(0)
    ma, mb = _resample_means(a.values, rng, draws), _resample_means(b.values, rng, draws)
    if ma.size * mb.size <= 4_000_000:
        ma, mb = np.repeat(ma, mb.size), np.tile(mb, ma.size)
    else:
        n = min(ma.size, mb.size)
        ma, mb = ma[:n], mb[:n]
    with np.errstate(divide="ignore", invalid="ignore"):
        vals = fn(ma, mb)
    vals = np.where(np.isnan(vals), np.inf, vals)
    lo, hi = np.quantile(vals, [(1 - confidence) / 2, (1 + confidence) / 2])
    return float(lo), float(hi)


def ratio_interval(a: Estimate, b: Estimate, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Percentile bootstrap interval of mean(a) / mean(b), resampling the seeds of each side independently;
    None when a side has one seed. Exhaustive (hence deterministic) for up to 5 seeds a side."""
    if a.n < 2 or b.n < 2:
        return None
    return _bootstrap(a, b, lambda x, y: x / y, confidence)


def _fmt_iv(iv: tuple[float, float] | None) -> str:
    return "no interval (one seed)" if iv is None else f"95% interval [{iv[0]:.4g}, {iv[1]:.4g}]"


def ratio_verdict(a: Estimate | None, b: Estimate | None, k: float) -> tuple[str, str]:
    """Claim ``mean(a) ≥ k · mean(b)``, decided by the bootstrap interval over seeds of mean(a) − k · mean(b)
    (sign-safe where b may be ≤ 0, e.g. a Δppl); the ratio and its interval are printed beside it."""
    if a is None or b is None:
        return MISSING, "a point or its metric is missing"
    ratio = a.mean / b.mean if b.mean > 0 else math.inf
    riv = ratio_interval(a, b) if b.mean > 0 else None
    detail = (f"{a.text()} vs {b.text()}: ratio {ratio:.3g}"
              + (f", {_fmt_iv(riv)}" if riv else "") + f" (bootstrap over seeds), needed ≥ {k:g}")
    if a.n < 2 or b.n < 2:
        return INCONCLUSIVE, detail + "; one seed: no interval"
    lo, hi = _bootstrap(a, b, lambda x, y: x - k * y, CONFIDENCE)
    if lo >= 0:
        return REPRODUCED, detail
    if hi < 0:
        return NOT_REPRODUCED, detail
    return INCONCLUSIVE, detail


def threshold_verdict(e: Estimate | None, threshold: float, above: bool) -> tuple[str, str]:
    """Claim ``mean ≥ threshold`` (``above``) or ``mean ≤ threshold`` from the t-interval of the mean."""
    if e is None:
        return MISSING, "a point or its metric is missing"
    iv = interval(e)
    detail = f"{e.text()}, {_fmt_iv(iv)} (t over seeds), needed {'≥' if above else '≤'} {threshold:g}"
    if iv is None:
        return INCONCLUSIVE, detail
    lo, hi = iv
    holds, fails = (lo >= threshold, hi < threshold) if above else (hi <= threshold, lo > threshold)
    return (REPRODUCED if holds else NOT_REPRODUCED if fails else INCONCLUSIVE), detail


def effect_present(e: Estimate | None, floor: float) -> bool:
    """Whether the t-interval of ``e`` lies wholly above ``floor`` (one seed: its value above the floor)."""
    if e is None:
        return False
    iv = interval(e)
    return (iv[0] if iv else e.mean) > floor


def combine(*verdicts: tuple[str, str]) -> str:
    """All parts of a claim hold: reproduced only if every part is; not reproduced if some part is; missing
    data wins over the rest."""
    kinds = [v for v, _ in verdicts]
    if MISSING in kinds:
        return MISSING
    if NOT_REPRODUCED in kinds:
        return NOT_REPRODUCED
    if all(k == REPRODUCED for k in kinds):
        return REPRODUCED
    return INCONCLUSIVE
