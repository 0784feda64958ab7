"""Scaling-law fits on a collected sweep table (the method of Franke et al. 2025, arXiv 2505.22014).

Pipeline (``fit_table``): the ``done`` rows of each family → minimum loss per log-spaced compute bin (the
frontier) → ``L(C) = A0·C^(−α)`` (or ``E + A0·C^(−α)``) → ``N_opt(C) = N0·C^(α_N)`` and
``D_opt(C) = D0·C^(α_D)`` through the frontier points' sizes and token counts → 95% intervals (delta method,
or bootstrap) → z-tests of equal exponents between families → optionally the per-size optimum of one
hyperparameter column and a power law in N through it.

Every power law is fitted to ``log y`` (least squares in log space): the noise of losses, sizes and learning
rates is relative rather than additive, the pure power law becomes a straight line (a unique optimum and an
exact covariance), and the points at small compute, whose losses are largest, do not dominate the fit.
"""

from __future__ import annotations

import csv
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import interpolate, optimize, stats

from outlier_titan.errors import UserError

LEVEL = 0.95
MIN_BINS = 3
# Outcome columns of the collected table (sweep.py collect); every other column but point/status/seed describes
# the configuration, and rows equal in all of those are repeats (seeds) of one configuration.
MEASURED = ("final_val_loss", "best_val_loss", "final_train_loss", "wall_s", "tokens_per_s")
MEASURED_PREFIXES = ("final_", "peak_", "ptq_")


@dataclass
class PowerLaw:
    """``y = offset + coef·x^exponent`` with the covariance of its fitted parameters.

    The parameters are ``theta = (a, exponent[, offset])`` with ``coef·x^exponent = exp(a + exponent·(ln x −
    ln x_ref))``; centring at ``x_ref`` (the geometric mean of the fitted x) keeps ``a`` and the exponent nearly
    uncorrelated. ``dof`` is the number of points minus the number of parameters (the t quantile uses it).
    ``boot`` holds the bootstrap replicates of theta when the intervals come from a bootstrap.
    """

    coef: float
    exponent: float
    offset: float = 0.0
    irreducible: bool = False
    cov: np.ndarray | None = None
    dof: int = 0
    x_ref: float = 1.0
    n: int = 0
    boot: np.ndarray | None = None
    rmse_log: float = float("nan")

    @classmethod
    def from_constants(cls, coef: float, exponent: float, offset: float = 0.0) -> "PowerLaw":
        """A law from published constants (no uncertainty)."""
        return cls(coef=float(coef), exponent=float(exponent), offset=float(offset), irreducible=offset != 0.0)

    @property
    def theta(self) -> np.ndarray:
        a = math.log(self.coef) + self.exponent * math.log(self.x_ref)
        return np.array([a, self.exponent] + ([self.offset] if self.irreducible else []))

    def __call__(self, x) -> np.ndarray:
        x = np.asarray(x, dtype=float)
        return self.offset + self.coef * x ** self.exponent

    def _log_model(self, x: np.ndarray, theta: np.ndarray) -> np.ndarray:
        u = np.exp(theta[0] + theta[1] * (np.log(x) - math.log(self.x_ref)))
        return np.log(theta[2] + u) if self.irreducible else np.log(u)

    def _log_jacobian(self, x: np.ndarray) -> np.ndarray:
        """d ln y / d theta at x, shape (len(x), p)."""
        lx = np.log(x) - math.log(self.x_ref)
        if not self.irreducible:
            return np.stack([np.ones_like(lx), lx], axis=1)
        u = self.coef * x ** self.exponent
        m = self.offset + u
        return np.stack([u / m, u * lx / m, 1.0 / m], axis=1)

    def _t(self, level: float) -> float:
        return float(stats.t.ppf(0.5 + level / 2, self.dof)) if self.dof > 0 else float("inf")

    def band(self, x, level: float = LEVEL) -> tuple[np.ndarray, np.ndarray]:
        """Pointwise interval of the fitted curve at ``x`` (delta method in log space, or bootstrap percentiles)."""
        x = np.asarray(x, dtype=float)
        if self.boot is not None:
            curves = np.stack([np.exp(self._log_model(x, th)) for th in self.boot])
            q = (1 - level) / 2
            return np.quantile(curves, q, axis=0), np.quantile(curves, 1 - q, axis=0)
        if self.cov is None:
            y = self(x)
            return y, y
        jac = self._log_jacobian(x)
        sd = np.sqrt(np.einsum("ij,jk,ik->i", jac, self.cov, jac))
        ly = np.log(self(x))
        t = self._t(level)
        return np.exp(ly - t * sd), np.exp(ly + t * sd)

    @property
    def exponent_var(self) -> float:
        """Variance of the exponent (from the covariance, or the bootstrap replicates)."""
        if self.boot is not None:
            return float(np.var(self.boot[:, 1], ddof=1))
        return float(self.cov[1, 1]) if self.cov is not None else float("nan")

    def intervals(self, level: float = LEVEL) -> dict[str, tuple[float, float]]:
        """``{"coef", "exponent"[, "offset"]} -> (low, high)``; ``coef``'s is the image of its log's interval."""
        names = ["coef", "exponent"] + (["offset"] if self.irreducible else [])
        lr = math.log(self.x_ref)
        if self.boot is not None:
            q = (1 - level) / 2
            cols = {"coef": np.exp(self.boot[:, 0] - self.boot[:, 1] * lr), "exponent": self.boot[:, 1]}
            if self.irreducible:
                cols["offset"] = self.boot[:, 2]
            return {k: (float(np.quantile(cols[k], q)), float(np.quantile(cols[k], 1 - q))) for k in names}
        if self.cov is None:
            return {k: (float("nan"), float("nan")) for k in names}
        t = self._t(level)
        # ln coef = a − exponent·ln x_ref: a linear map of theta, so this delta method is exact.
        g = np.zeros(len(self.theta))
        g[0], g[1] = 1.0, -lr
        sd_lc = math.sqrt(max(float(g @ self.cov @ g), 0.0))
        lc = math.log(self.coef)
        out = {"coef": (math.exp(lc - t * sd_lc), math.exp(lc + t * sd_lc))}
        sd_e = math.sqrt(max(float(self.cov[1, 1]), 0.0))
        out["exponent"] = (self.exponent - t * sd_e, self.exponent + t * sd_e)
        if self.irreducible:
            sd_o = math.sqrt(max(float(self.cov[2, 2]), 0.0))
            out["offset"] = (self.offset - t * sd_o, self.offset + t * sd_o)
        return out


def _fit_theta(lx: np.ndarray, ly: np.ndarray, irreducible: bool, want_cov: bool):
    """Least squares of ln y on theta (see ``PowerLaw``); lx is centred ln x. Returns (theta, cov)."""
    b0, a0 = np.polyfit(lx, ly, 1)
    if not irreducible:
        def f(z, a, b):
            return a + b * z
        p0, bounds = [a0, b0], (-np.inf, np.inf)
    else:
        ymin = float(np.exp(ly.min()))

        def f(z, a, b, e):
            return np.log(e + np.exp(a + b * z))
        e0 = 0.5 * ymin
        b0, a0 = np.polyfit(lx, np.log(np.exp(ly) - e0), 1)
        p0, bounds = [a0, b0, e0], ([-np.inf, -np.inf, 0.0], [np.inf, np.inf, ymin])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optimize.OptimizeWarning)
        warnings.simplefilter("ignore", RuntimeWarning)
        theta, cov = optimize.curve_fit(f, lx, ly, p0=p0, bounds=bounds, maxfev=20000)
    if not want_cov or not np.all(np.isfinite(cov)):
        cov = None
    return theta, cov


def fit_power_law(x, y, *, irreducible: bool = False, bootstrap: int = 0, seed: int = 0,
                  what: str = "power law") -> PowerLaw:
    """Fit ``y = [E +] A·x^b`` in log space (``scipy.optimize.curve_fit``) with 95% intervals.

    Needs at least ``p + 1`` points with distinct x (p = 2, or 3 with ``irreducible``) so that the residual
    variance, and with it an interval, exists. ``bootstrap=B > 0`` replaces the delta-method intervals by
    percentiles of B refits on points resampled with replacement (resamples with fewer than p distinct x, or
    whose refit does not converge, are drawn again).
    """
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    p = 3 if irreducible else 2
    if np.any(x <= 0) or np.any(y <= 0):
        raise UserError(f"{what}: values must be positive for a power-law fit (log space)")
    if len(np.unique(x)) < p + 1:
        raise UserError(f"{what}: {len(np.unique(x))} distinct points, a fit with "
                        f"{'an irreducible term ' if irreducible else ''}needs at least {p + 1}")
    x_ref = float(np.exp(np.log(x).mean()))
    lx, ly = np.log(x) - math.log(x_ref), np.log(y)
    try:
        theta, cov = _fit_theta(lx, ly, irreducible, want_cov=True)
    except RuntimeError as e:  # curve_fit: no convergence
        raise UserError(f"{what}: the fit did not converge ({str(e).splitlines()[0]})"
                        + ("; try without --irreducible" if irreducible else "")) from None
    law = PowerLaw(coef=float(np.exp(theta[0] - theta[1] * math.log(x_ref))), exponent=float(theta[1]),
                   offset=float(theta[2]) if irreducible else 0.0, irreducible=irreducible, cov=cov,
                   dof=len(x) - p, x_ref=x_ref, n=len(x))
    law.rmse_log = float(np.sqrt(np.mean((law._log_model(x, theta) - ly) ** 2)))
    if bootstrap > 0:
        rng = np.random.default_rng(seed)
        reps, tries = [], 0
        while len(reps) < bootstrap:
            tries += 1
            if tries > 20 * bootstrap:
                raise UserError(f"{what}: only {len(reps)} of {bootstrap} bootstrap refits succeeded in {tries - 1} "
                                "resamples; use the delta method (no --bootstrap) or more points")
            idx = rng.integers(0, len(x), len(x))
            if len(np.unique(x[idx])) < p:
                continue
            try:
                th, _ = _fit_theta(lx[idx], ly[idx], irreducible, want_cov=False)
            except RuntimeError:
                continue
            reps.append(th)
        law.boot = np.array(reps)
    return law


def z_test(a1: float, var1: float, a2: float, var2: float) -> tuple[float, float]:
    """Two-sided z-test of H0 ``a1 == a2`` from the two estimates' variances: ``(z, p)``."""
    s, diff = var1 + var2, a1 - a2
    if not s > 0:  # exact fits (e.g. synthetic data), or no variance at all
        if math.isnan(s):
            return float("nan"), float("nan")
        return (0.0, 1.0) if diff == 0 else (math.copysign(math.inf, diff), 0.0)
    z = diff / math.sqrt(s)
    return z, float(2 * stats.norm.sf(abs(z)))


def default_bins(n_points: int) -> int:
    """About three points per compute bin, and at least ``MIN_BINS`` (two parameters plus one degree of freedom)."""
    return max(MIN_BINS, n_points // 3)


def frontier(compute, loss, bins: int) -> np.ndarray:
    """Indices of the minimum-loss point in each of ``bins`` log-spaced compute bins (empty bins dropped)."""
    c = np.asarray(compute, dtype=float)
    loss = np.asarray(loss, dtype=float)
    lc = np.log(c)
    if lc.max() == lc.min():
        return np.array([int(np.argmin(loss))])
    edges = np.linspace(lc.min(), lc.max(), bins + 1)
    which = np.clip(np.searchsorted(edges, lc, side="right") - 1, 0, bins - 1)
    picks = []
    for b in range(bins):
        members = np.flatnonzero(which == b)
        if len(members):
            picks.append(members[np.argmin(loss[members])])
    return np.array(picks, dtype=int)


# ---------------------------------------------------------------------------------------------- table


def read_table(path: str | Path) -> tuple[list[str], list[dict[str, str]]]:
    """The header and rows of a collected sweep table (CSV)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file (pass the table written by `sweep.py collect`)")
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        rows = list(reader)
        header = list(reader.fieldnames or [])
    if not header:
        raise UserError(f"{path}: empty table (no header row)")
    return header, rows


def _require_column(header: list[str], col: str, flag: str, path) -> None:
    if col not in header:
        raise UserError(f"{path}: no column '{col}' ({flag}); columns: {', '.join(header)}")


def _float_or_nan(value: str) -> float:
    """A table cell as a float; NaN where it is empty or not a number."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


@dataclass
class FamilyFit:
    """All fits of one family: its points, the frontier, the laws and the optional hyperparameter optimum."""

    name: str
    compute: np.ndarray
    loss: np.ndarray
    params: np.ndarray
    tokens: np.ndarray
    front: np.ndarray
    bins: int
    loss_law: PowerLaw
    n_opt: PowerLaw
    d_opt: PowerLaw
    hparam: dict | None = None
    hparam_law: PowerLaw | None = None


@dataclass
class FitResult:
    """The fits of every family and the z-tests between them, plus what was read."""

    table: str
    columns: dict[str, str | None]
    bins: int | None
    rows_used: int
    configs: int
    rows_skipped: dict[str, int]
    irreducible: bool
    bootstrap: int
    families: list[FamilyFit] = field(default_factory=list)
    ztests: list[dict] = field(default_factory=list)


def hparam_optimum(hp, loss) -> tuple[float, float, str]:
    """The loss-minimising value of one hyperparameter for one size: ``(value, loss, how)``.

    As in Franke et al. 2025 (§8, after Porian et al.): an Akima interpolant of loss over log(hp), minimised between the
    neighbours of the best grid value (``how="interp"``). With fewer than three values, or the best at the
    grid's edge (the optimum is not bracketed), the best grid value is returned (``how="grid"``/``"edge"``).
    """
    hp = np.asarray(hp, dtype=float)
    loss = np.asarray(loss, dtype=float)
    order = np.argsort(hp)
    hp, loss = hp[order], loss[order]
    i = int(np.argmin(loss))
    if len(hp) < 3:
        return float(hp[i]), float(loss[i]), "grid"
    if i == 0 or i == len(hp) - 1:
        return float(hp[i]), float(loss[i]), "edge"
    lh = np.log(hp)
    spline = interpolate.Akima1DInterpolator(lh, loss)
    res = optimize.minimize_scalar(lambda z: float(spline(z)), bounds=(lh[i - 1], lh[i + 1]), method="bounded")
    best = min((float(spline(res.x)), float(res.x)), (float(loss[i]), float(lh[i])))
    return math.exp(best[1]), best[0], "interp"


def _fit_hparam(name, hp, params, tokens, loss, *, bootstrap, seed):
    """Per-size optimum of ``hp`` (mean loss over repeats) and the power law in N through the bracketed ones."""
    grids: dict[float, dict[float, list[float]]] = {}
    budgets: dict[float, set[float]] = {}
    for h, n, d, lo in zip(hp, params, tokens, loss):
        grids.setdefault(n, {}).setdefault(h, []).append(lo)
        budgets.setdefault(n, set()).add(d)
    rows = []
    for n in sorted(grids):
        if len(budgets[n]) > 1:
            raise UserError(f"--hparam: family '{name}', size {n:.4g} was trained on several token budgets "
                            f"({', '.join(f'{d:.3g}' for d in sorted(budgets[n]))}); filter the table "
                            "to one budget per size")
        grid = grids[n]
        values = sorted(grid)
        opt, lo, how = hparam_optimum(values, [float(np.mean(grid[v])) for v in values])
        rows.append({"params": float(n), "optimum": opt, "loss": lo, "how": how, "values": len(values)})
    usable = [r for r in rows if r["how"] == "interp"]
    if len(usable) < 3:
        bad = [f"{r['params']:.3g} ({r['how']})" for r in rows if r["how"] != "interp"]
        raise UserError(f"--hparam: family '{name}' has {len(usable)} sizes whose optimum lies inside their grid, "
                        f"the power law in N needs at least 3" + (f"; not bracketed: {', '.join(bad)} — "
                                                                   "widen the grid (≥3 values around the best)"
                                                                   if bad else ""))
    law = fit_power_law([r["params"] for r in usable], [r["optimum"] for r in usable], bootstrap=bootstrap,
                        seed=seed, what=f"--hparam optimum vs N ({name})")
    return {"sizes": rows}, law


def fit_table(path, *, loss: str = "best_val_loss", compute: str = "flops", params: str = "params",
              tokens: str = "tokens", family: str | None = None, bins: int | None = None,
              irreducible: bool = False, bootstrap: int = 0, hparam: str | None = None,
              seed: int = 0) -> FitResult:
    """Read a collected sweep table and fit every family (see the module docstring)."""
    header, rows = read_table(path)
    for col, flag in ((loss, "--loss"), (compute, "--compute"), (params, "--params"), (tokens, "--tokens"),
                      (family, "--family"), (hparam, "--hparam")):
        if col is not None:
            _require_column(header, col, flag, path)
    if bins is not None and bins < MIN_BINS:
        raise UserError(f"--bins must be at least {MIN_BINS} (a power law with an interval needs 3 points), "
                        f"got {bins}")
    skipped = {"not done": 0, "missing values": 0}
    used_cols = {compute, params, tokens, family, hparam} - {None}
    config_cols = [h for h in header if h in used_cols or (h not in ("point", "status", "seed", loss)
                                                           and h not in MEASURED
                                                           and not h.startswith(MEASURED_PREFIXES))]
    repeats: dict[tuple, list[float]] = {}
    for r in rows:
        if "status" in header and r.get("status") != "done":
            skipped["not done"] += 1
            continue
        vals = [_float_or_nan(r.get(c)) for c in (loss, compute, params, tokens)]
        if not all(math.isfinite(v) and v > 0 for v in vals):
            skipped["missing values"] += 1
            continue
        # Seeds of one configuration are averaged: the minimum over seeds would bias the frontier low.
        repeats.setdefault(tuple(r.get(c) for c in config_cols), []).append(vals[0])
    groups: dict[str, list[dict]] = {}
    for key, losses in repeats.items():
        r = dict(zip(config_cols, key))
        v = {"loss": float(np.mean(losses)), "compute": _float_or_nan(r[compute]), "params": _float_or_nan(r[params]),
             "tokens": _float_or_nan(r[tokens]), "hparam": _float_or_nan(r[hparam]) if hparam else float("nan"),
             "repeats": len(losses)}
        groups.setdefault((r.get(family) or "(empty)") if family else "all", []).append(v)
    used = sum(v["repeats"] for g in groups.values() for v in g)
    if not groups:
        raise UserError(f"{path}: no usable rows (status done, positive finite {loss}/{compute}/{params}/{tokens}); "
                        f"skipped {skipped['not done']} not done, {skipped['missing values']} with missing values")
    result = FitResult(table=str(path), columns={"loss": loss, "compute": compute, "params": params,
                                                 "tokens": tokens, "family": family, "hparam": hparam},
                       bins=bins, rows_used=used, configs=len(repeats), rows_skipped=skipped, irreducible=irreducible, bootstrap=bootstrap)
    need = 4 if irreducible else 3
    for name in sorted(groups):
        g = groups[name]
        c, lo, n, d = (np.array([v[k] for v in g]) for k in ("compute", "loss", "params", "tokens"))
        k = bins or default_bins(len(g))
        front = frontier(c, lo, k)
        if len(front) < need:
            raise UserError(f"family '{name}': {len(g)} points gave {len(front)} non-empty compute bins of {k}; "
                            f"the fit needs at least {need} (more points at distinct compute, or --bins)")
        fc = c[front]
        law = fit_power_law(fc, lo[front], irreducible=irreducible, bootstrap=bootstrap, seed=seed,
                            what=f"loss vs compute ({name})")
        n_law = fit_power_law(fc, n[front], bootstrap=bootstrap, seed=seed, what=f"N_opt ({name})")
        d_law = fit_power_law(fc, d[front], bootstrap=bootstrap, seed=seed, what=f"D_opt ({name})")
        fam = FamilyFit(name, c, lo, n, d, front, k, law, n_law, d_law)
        if hparam:
            hp = np.array([v["hparam"] for v in g])
            ok = np.isfinite(hp) & (hp > 0)
            if not ok.any():
                raise UserError(f"--hparam {hparam}: family '{name}' has no positive values (the optimum is "
                                "interpolated in log space)")
            fam.hparam, fam.hparam_law = _fit_hparam(name, hp[ok], n[ok], d[ok], lo[ok], bootstrap=bootstrap,
                                                     seed=seed)
        result.families.append(fam)
    fams = result.families
    for i in range(len(fams)):
        for j in range(i + 1, len(fams)):
            for what, get in (("alpha", lambda f: f.loss_law), ("alpha_N", lambda f: f.n_opt),
                              ("alpha_D", lambda f: f.d_opt)):
                a, b = get(fams[i]), get(fams[j])
                z, p = z_test(a.exponent, a.exponent_var, b.exponent, b.exponent_var)
                # alpha is reported positive for the loss (L ∝ C^−α); the sign does not change z's magnitude.
                result.ztests.append({"a": fams[i].name, "b": fams[j].name, "exponent": what,
                                      "diff": abs(a.exponent - b.exponent), "z": abs(z), "p": p})
    return result
