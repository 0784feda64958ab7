"""Numbers over seeds and verdicts that respect their spread, valid at a handful of seeds.

A suite runs every point at several training seeds (3 to 5: too few for any resampling method, whose percentile
interval over 3 seeds is about their range). Everything here is t-based and exact for normal data:

* :func:`estimate` turns one metric's per-seed values into mean ± sd (sample sd, n − 1), the values kept for the
  appendix; :func:`interval` is the 95 % Student-t interval of the mean.
* :func:`ratio_verdict` — claim "A ≥ k × B": the **Welch t-test of mean(A) − k·mean(B)** (Welch–Satterthwaite
  degrees of freedom), sign-safe where B may be ≤ 0 (a Δppl). Its 95 % interval decides: wholly above 0
  reproduced, wholly below 0 not reproduced, else inconclusive. Beside it the ratio of means with the interval
  obtained by inverting the same test over the factor (Fieller's construction with Welch's df), so the printed
  interval lies above k exactly when the verdict is "reproduced".
* :func:`at_most_verdict` — claim "D ≤ tol" for a per-seed quantity (a paired relative loss change): the
  t-interval of its mean, reproduced when the interval lies at or below ``tol``; a remedy that does better never
  fails it (the claim is one-sided).
* :func:`threshold_verdict` — "mean ≥ t" or "mean ≤ t": the t-interval of the mean against t.
* :func:`rank_correlation_verdict` — "larger x goes with larger y" over pooled (arm, seed) pairs: Spearman's ρ
  and its Fisher-z interval (the one interval here that is not t-based; it needs about ten pairs).
* :func:`effect_present` — whether a baseline shows the effect a remedy is meant to remove (its t-interval lies
  above a floor). Where it does not, the claim *cannot be tested* and no ratio is formed.

Every verdict compares a two-sided 95 % interval with its threshold, so each direction ("reproduced", "not
reproduced") is called wrongly at most 2.5 % of the time at the claim's boundary. ``tests/test_stats.py``
simulates normal seeds with a known ratio to check the coverage and the boundary rate at 3 and 5 seeds.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, UNTESTABLE, MISSING = (
    "reproduced", "not reproduced", "inconclusive", "cannot be tested", "not determined")
VERDICTS = (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE, UNTESTABLE, MISSING)
CONFIDENCE = 0.95
RATIO_TEST = "Welch t-test of mean(A) − k·mean(B)"
MEAN_TEST = "t-interval of the mean over seeds"


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


def _t(df, confidence: float = CONFIDENCE):
    """The two-sided Student-t quantile (array-friendly)."""
    from scipy import stats

    return stats.t.ppf(0.5 + confidence / 2, df)


def interval(e: Estimate, confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student-t interval of the mean; None for fewer than two seeds (no spread to judge)."""
    if e.n < 2:
        return None
    half = float(_t(e.n - 1, confidence)) * e.sd / math.sqrt(e.n)
    return e.mean - half, e.mean + half


# ------------------------------------------------------------------------------------------------ A ≥ k·B

def welch(ma, va, n, mb, vb, m, k):
    """Welch's test of ``mean(A) − k·mean(B)`` from the means, sample variances and seed counts (numpy arrays or
    scalars): (difference, standard error, Welch–Satterthwaite degrees of freedom)."""
    ua, ub = np.asarray(va) / n, np.asarray(k) ** 2 * np.asarray(vb) / m
    se2 = ua + ub
    with np.errstate(divide="ignore", invalid="ignore"):
        df = se2 ** 2 / (ua ** 2 / (n - 1) + ub ** 2 / (m - 1))
    df = np.where(np.isfinite(df), df, np.minimum(n, m) - 1.0)  # both variances zero: any df, the se is 0
    return np.asarray(ma) - np.asarray(k) * np.asarray(mb), np.sqrt(se2), df


def _accepts(ma, va, n, mb, vb, m, rho, confidence):
    """Whether Welch's test does not reject ``mean(A) = rho·mean(B)`` (elementwise)."""
    d, se, df = welch(ma, va, n, mb, vb, m, rho)
    return np.abs(d) <= _t(df, confidence) * se


def ratio_bounds(ma, va, n, mb, vb, m, confidence: float = CONFIDENCE, span: float = 1e6):
    """The interval of factors rho that Welch's test of ``mean(A) − rho·mean(B)`` does not reject, around the
    ratio of means (vectorised over trials; ``mean(B)`` must be non-zero). Each end is searched outward from the
    ratio in doubling steps, then bisected; an end beyond ``span`` times the ratio's scale is infinite (mean(B)
    not distinguishable from 0)."""
    ma, va, mb, vb = (np.asarray(x, dtype=np.float64) for x in (ma, va, mb, vb))
    r = ma / mb
    scale = np.maximum(np.abs(r), 1e-12)
    ends = []
    for sign in (-1.0, 1.0):
        inner, step = r.copy(), scale * 1e-3
        outer = np.full_like(r, np.inf)
        open_ = np.ones(r.shape, dtype=bool)
        while open_.any() and (step <= span * scale).any():
            trial = r + sign * step
            ok = _accepts(ma, va, n, mb, vb, m, trial, confidence)
            found = open_ & ~ok
            outer = np.where(found, trial, outer)
            inner = np.where(open_ & ok, trial, inner)
            open_ &= ok
            open_ &= step * 2 <= span * scale
            step = step * 2
        bounded = np.isfinite(outer)
        lo, hi = np.where(bounded, inner, 0.0), np.where(bounded, outer, 0.0)
        for _ in range(60):  # bisection between the last accepted and the first rejected factor
            mid = (lo + hi) / 2
            ok = _accepts(ma, va, n, mb, vb, m, mid, confidence)
            lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
        ends.append(np.where(bounded, (lo + hi) / 2, sign * np.inf))
    return ends[0], ends[1]


def ratio_verdict(a: Estimate | None, b: Estimate | None, k: float) -> tuple[str, str]:
    """Claim ``mean(a) ≥ k · mean(b)``, decided by :func:`welch`'s 95 % interval of mean(a) − k·mean(b); the
    detail prints the ratio of means and its test-inverted interval (:func:`ratio_bounds`) and names the test."""
    if a is None or b is None:
        return MISSING, "a point or its metric is missing"
    if a.n < 2 or b.n < 2:
        ratio = f"ratio {a.mean / b.mean:.3g}, " if b.mean else ""
        return INCONCLUSIVE, f"{a.text()} vs {b.text()}: {ratio}one seed: no interval, needed ≥ {k:g}"
    va, vb = a.sd ** 2, b.sd ** 2
    d, se, df = (float(x) for x in welch(a.mean, va, a.n, b.mean, vb, b.n, k))
    half = float(_t(df)) * se
    lo, hi = d - half, d + half
    detail = f"{a.text()} vs {b.text()}: "
    if b.mean != 0:
        rlo, rhi = (float(x) for x in ratio_bounds(a.mean, va, a.n, b.mean, vb, b.n))
        detail += f"ratio {a.mean / b.mean:.3g}, 95% interval [{rlo:.3g}, {rhi:.3g}]; "
    detail += (f"mean(A) − {k:g}·mean(B) = {d:.3g}, 95% interval [{lo:.3g}, {hi:.3g}] ({RATIO_TEST}, "
               f"df {df:.1f}, {a.n} and {b.n} seeds), needed ≥ {k:g}×")
    return (REPRODUCED if lo > 0 else NOT_REPRODUCED if hi < 0 else INCONCLUSIVE), detail


# ------------------------------------------------------------------------------------------------ one mean

def at_most_verdict(e: Estimate | None, tol: float, what: str, pct: bool = True,
                    paired: bool = True) -> tuple[str, str]:
    """One-sided claim "``e`` is at most ``tol``" (e.g. a paired relative loss change: the remedy costs at most
    2 %): reproduced when the 95 % t-interval lies at or below ``tol``, not reproduced when it lies wholly above,
    inconclusive otherwise. Doing better than ``tol`` never fails the claim."""
    if e is None:
        return MISSING, f"{what}: not at the same seeds, or missing"
    f = (lambda x: f"{x:+.2%}") if pct else (lambda x: f"{x:.4g}")  # noqa: E731
    detail = f"{what} {f(e.mean)} ± {f(e.sd or 0).lstrip('+')}"
    iv = interval(e)
    if iv is None:
        return INCONCLUSIVE, detail + " (one seed: no interval)"
    lo, hi = iv
    detail += (f", 95% interval [{f(lo)}, {f(hi)}] ({MEAN_TEST}{', paired by seed' if paired else ''}), "
               f"needed ≤ {f(tol)}")
    return (REPRODUCED if hi <= tol else NOT_REPRODUCED if lo > tol else INCONCLUSIVE), detail


def threshold_verdict(e: Estimate | None, threshold: float, above: bool) -> tuple[str, str]:
    """Claim ``mean ≥ threshold`` (``above``) or ``mean ≤ threshold`` from the t-interval of the mean."""
    if e is None:
        return MISSING, "a point or its metric is missing"
    iv = interval(e)
    ivs = "no interval (one seed)" if iv is None else f"95% interval [{iv[0]:.4g}, {iv[1]:.4g}]"
    detail = f"{e.text()}, {ivs} ({MEAN_TEST}), needed {'≥' if above else '≤'} {threshold:g}"
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


# ------------------------------------------------------------------------------------------------ a rank order

RANK_TEST = "Spearman's rank correlation, Fisher-z interval with Fieller, Hartley and Pearson's (1957) variance 1.06 / (n − 3)"


def _ranks(values: list[float]) -> np.ndarray:
    """1-based ranks, ties given their mean rank."""
    v = np.asarray(values, dtype=float)
    order = np.argsort(v, kind="stable")
    ranks = np.empty(len(v))
    ranks[order] = np.arange(1, len(v) + 1)
    for x in np.unique(v):
        tie = v == x
        ranks[tie] = ranks[tie].mean()
    return ranks


def rank_correlation_verdict(xs: list[float], ys: list[float], what: str) -> tuple[str, str]:
    """Claim "larger x goes with larger y": Spearman's ρ with its 95 % interval (z = atanh ρ, se √(1.06 / (n − 3)),
    adequate from about n = 10); reproduced when the interval lies above 0, not reproduced when below, else
    inconclusive. Fewer than 6 pairs, or no spread in either variable: inconclusive, saying why."""
    n = len(xs)
    if n != len(ys) or n < 6:
        return INCONCLUSIVE, f"{what}: {n} pairs, too few for an interval"
    rx, ry = _ranks(xs), _ranks(ys)
    if rx.std() == 0 or ry.std() == 0:
        return INCONCLUSIVE, f"{what}: no spread in one of the two variables"
    rho = float(np.corrcoef(rx, ry)[0, 1])
    from scipy import stats

    half = float(stats.norm.ppf(0.5 + CONFIDENCE / 2)) * math.sqrt(1.06 / (n - 3))
    z = math.atanh(max(min(rho, 1 - 1e-12), -1 + 1e-12))
    lo, hi = math.tanh(z - half), math.tanh(z + half)
    detail = f"{what}: ρ = {rho:+.2f} over {n} pairs, 95% interval [{lo:+.2f}, {hi:+.2f}] ({RANK_TEST}), needed > 0"
    return (REPRODUCED if lo > 0 else NOT_REPRODUCED if hi < 0 else INCONCLUSIVE), detail


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


def chance_calls(verdicts: list[str]) -> str:
    """The sentence on how many of a report's decided verdicts chance alone could give."""
    decided = sum(v in (REPRODUCED, NOT_REPRODUCED, INCONCLUSIVE) for v in verdicts)
    if not decided:
        return ("No verdict is decided here (every claim cannot be tested or lacks its points), so none is a chance "
                "call.")
    return (f"{decided} verdict{'s' * (decided != 1)} decided at 95 % (each direction at 2.5 %): were every claim "
            f"exactly at its threshold, about {0.025 * decided:.2g} would read \"reproduced\" and as many \"not "
            f"reproduced\" by chance alone (no multiplicity correction is applied).")
