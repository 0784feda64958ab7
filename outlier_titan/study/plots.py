"""Plots of a scaling-law fit (matplotlib, Agg): loss vs compute, N_opt/D_opt vs compute, hparam optimum vs N."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from outlier_titan.study.fit import FitResult, PowerLaw


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(lo: float, hi: float, pad: float = 0.15) -> np.ndarray:
    """Log-spaced x from ``lo`` to ``hi`` widened by ``pad`` decades' fraction on each side."""
    a, b = np.log10(lo), np.log10(hi)
    w = max(b - a, 1e-6) * pad
    return np.logspace(a - w, b + w, 200)


def _curve(ax, law: PowerLaw, x: np.ndarray, color, label: str) -> None:
    lo, hi = law.band(x)
    ax.plot(x, law(x), color=color, label=label)
    ax.fill_between(x, lo, hi, color=color, alpha=0.2, linewidth=0)


def plot_loss_vs_compute(res: FitResult, path: str | Path) -> Path:
    """All points (faint), the frontier (filled) and the fitted L(C) with its 95% band, one colour per family."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for k, f in enumerate(res.families):
        color = f"C{k}"
        ax.scatter(f.compute, f.loss, s=14, color=color, alpha=0.35)
        ax.scatter(f.compute[f.front], f.loss[f.front], s=30, color=color, edgecolor="k", linewidth=0.5)
        law = f.loss_law
        label = f"{f.name}: L = " + (f"{law.offset:.3g} + " if law.irreducible else "") + \
            f"{law.coef:.3g}·C^-{-law.exponent:.3g}"
        _curve(ax, law, _grid(f.compute.min(), f.compute.max()), color, label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"compute C ({res.columns['compute']})")
    ax.set_ylabel(res.columns["loss"])
    ax.set_title("loss vs compute (frontier: min per log bin; 95% band)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_compute_optimal(res: FitResult, path: str | Path) -> Path:
    """Two panels: N_opt(C) and D_opt(C) with the frontier points and 95% bands."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for k, f in enumerate(res.families):
        color = f"C{k}"
        x = _grid(f.compute.min(), f.compute.max())
        fc = f.compute[f.front]
        for ax, law, pts, sym in ((axes[0], f.n_opt, f.params[f.front], "N"), (axes[1], f.d_opt,
                                                                                f.tokens[f.front], "D")):
            ax.scatter(fc, pts, s=30, color=color, edgecolor="k", linewidth=0.5)
            _curve(ax, law, x, color, f"{f.name}: {sym}_opt = {law.coef:.3g}·C^{law.exponent:.3g}")
    for ax, what in zip(axes, (f"N_opt ({res.columns['params']})", f"D_opt ({res.columns['tokens']})")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel(f"compute C ({res.columns['compute']})")
        ax.set_ylabel(what)
        ax.legend(fontsize=8)
    fig.suptitle("compute-optimal allocation (frontier points; 95% band)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_hparam(res: FitResult, path: str | Path) -> Path:
    """The per-size optimum of the hyperparameter against N with its power law (edge/grid optima hollow)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for k, f in enumerate(res.families):
        color = f"C{k}"
        sizes = f.hparam["sizes"]
        n = np.array([r["params"] for r in sizes])
        h = np.array([r["optimum"] for r in sizes])
        inside = np.array([r["how"] == "interp" for r in sizes])
        ax.scatter(n[inside], h[inside], s=30, color=color, edgecolor="k", linewidth=0.5)
        if (~inside).any():
            ax.scatter(n[~inside], h[~inside], s=30, facecolor="none", edgecolor=color)
        law = f.hparam_law
        _curve(ax, law, _grid(n.min(), n.max()), color, f"{f.name}: {law.coef:.3g}·N^{law.exponent:.3g}")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel(f"N ({res.columns['params']})")
    ax.set_ylabel(f"optimal {res.columns['hparam']}")
    ax.set_title("optimum per size (hollow: not bracketed; 95% band)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)
