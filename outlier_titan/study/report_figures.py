"""The report's trajectory figures: per setting, the mean over seeds of a logged metric and the band between
the seeds' minimum and maximum."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outlier_titan.observe.logger import read_metrics
from outlier_titan.study.groups import aggregate, num, seed_band
from outlier_titan.study.plan import point_dir
from outlier_titan.study.suites.base import SuiteInfo


def trajectory_figures(sweep_dir: Path, rows: list[dict[str, Any]], info: SuiteInfo, fig_dir: Path,
                       axes: list[str]) -> list[Path]:
    """Kurtosis per setting vs step, first-token argmax share vs step, loss vs tokens: per setting the mean over
    its seeds as a line and the band between the seeds' minimum and maximum."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    settings: dict[str, list[tuple[dict, int]]] = {}
    for g in aggregate(rows, axes):
        for name in g["points"]:
            path = point_dir(sweep_dir, name) / "metrics.jsonl"
            tps = next(r["tokens_per_step"] for r in rows if r["point"] == name)
            if path.is_file():
                settings.setdefault(g["point"], []).append((read_metrics(path), tps))
    panels = [(f"outliers/{info.kurtosis}", "step", info.kurtosis.replace("_", " "), "kurtosis.png", True),
              ("outliers/first_token_argmax_share", "step", "first-token argmax share", "first_token.png", False),
              ("loss", "tokens", "loss (solid: train, dashed: validation)", "loss.png", False)]
    paths = []
    fig_dir.mkdir(parents=True, exist_ok=True)
    for key, xlabel, ylabel, fname, logy in panels:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for n, (name, runs) in enumerate(settings.items()):
            colour = f"C{n % 10}"
            keys = [key, "val_loss"] if key == "loss" else [key]
            for k, style in zip(keys, ("-", "--")):
                per_seed = [{s: v for s in recs if (v := num(recs[s].get(k))) is not None} for recs, _ in runs]
                steps, mean, lo, hi = seed_band([(list(d), list(d.values())) for d in per_seed])
                if not steps:
                    continue
                x = np.array(steps, dtype=float) * (runs[0][1] if xlabel == "tokens" else 1)
                ax.plot(x, mean, style, color=colour, marker="." if len(steps) < 30 else None,
                        label=f"{name} ({len(runs)} seeds)" if style == "-" else None)
                if len(runs) > 1:
                    ax.fill_between(x, lo, hi, color=colour, alpha=0.15, linewidth=0)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title("mean over seeds; band: their minimum to maximum", fontsize=9)
        if logy and any(ax.get_lines()):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if any(ax.get_lines()):
            ax.legend(fontsize=7)
        fig.tight_layout()
        path = fig_dir / fname
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths
