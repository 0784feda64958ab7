#!/usr/bin/env python
"""Plot loss and the outlier metrics of one or more runs over training, side by side (one PNG).

    outlier-titan-analyze outputs/adamw outputs/orthoadam --out compare.png

Each RUN_DIR must hold ``metrics.jsonl`` (one JSON object per logged step; records of the same step are
merged). Panels: the training loss (solid) with the validation loss (dashed, where logged), each outlier
metric (layer means, ``outliers/<name>``) against the step, and per-layer profiles at the last probe step
(``outliers/layer_<i>/<name>``). Runs whose ``config.toml`` differ only in ``training.seed`` (and ``[job]``) form
one group, drawn as the mean over its seeds with a band from their minimum to their maximum (at the steps all
of them logged); any other run is one line. Each panel's title says which direction is better where the metric
has one; its y axis is logarithmic only when the values span more than a decade. Also prints the last value of
every plotted metric per group (mean, and the seeds' range).
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402


from outlier_titan import cli  # noqa: E402
from outlier_titan.config.manager import tomllib  # noqa: E402
from outlier_titan.observe import metrics as registry  # noqa: E402
from outlier_titan.observe.logger import read_metrics  # noqa: E402
from outlier_titan.plugins import take_plugins
from outlier_titan.study.groups import seed_band  # noqa: E402

LAYER_RE = re.compile(r"^outliers/layer_(\d+)/(.+)$")


def read_run(run_dir: Path) -> dict[int, dict]:
    """step -> merged record of the run's ``metrics.jsonl`` (see ``read_metrics``)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"error: {path} not found (is {run_dir} a run folder?)")
    return read_metrics(path)


def series(records: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for step in sorted(records):
        v = records[step].get(key)
        if isinstance(v, (int, float)) and math.isfinite(v):
            xs.append(step)
            ys.append(float(v))
    return xs, ys


def layer_profile(records: dict[int, dict], metric: str) -> tuple[int | None, list[int], list[float]]:
    """The per-layer values of ``metric`` at the last step that has them."""
    for step in sorted(records, reverse=True):
        layers = {}
        for k, v in records[step].items():
            m = LAYER_RE.match(k)
            if m and m.group(2) == metric and isinstance(v, (int, float)):
                layers[int(m.group(1))] = float(v)
        if layers:
            idx = sorted(layers)
            return step, idx, [layers[i] for i in idx]
    return None, [], []


def better(metric: str) -> str:
    """``'lower is better'``, ``'higher is better'`` or ``''`` (no direction) for a metric name (the loss, or a
    registered probe metric's, after ``outliers/``, ``head_input/``, ``layer_<i>/``)."""
    name = metric.rsplit("/", 1)[-1]
    lower = True if name in ("loss", "val_loss") else registry.direction(name)
    return "" if lower is None else "lower is better" if lower else "higher is better"


def log_axis(values) -> bool:
    """A logarithmic axis only for positive values that span more than a decade."""
    values = [v for v in values if math.isfinite(v)]
    return bool(values) and min(values) > 0 and max(values) > 10 * min(values)


def seed_key(run_dir: Path) -> str | None:
    """The run's config without ``[job]`` and ``training.seed`` (runs with equal keys are seeds of one
    setting), or None when the run folder has no readable ``config.toml``."""
    try:
        cfg = tomllib.loads((run_dir / "config.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None
    cfg.pop("job", None)
    cfg.get("training", {}).pop("seed", None)
    return repr(sorted((k, sorted(v.items()) if isinstance(v, dict) else v) for k, v in cfg.items()))


def group_runs(run_dirs: list[Path]) -> dict[str, list[dict[int, dict]]]:
    """label -> the records of each run of the group, in the order given; a group's label is its folders' common
    name without a trailing seed suffix (``pre_ln_adamw_s0``, ``_s1`` -> ``pre_ln_adamw``)."""
    seen = [d.resolve() for d in run_dirs]
    for d in run_dirs:
        if seen.count(d.resolve()) > 1:
            raise SystemExit(f"error: run folder {d} is given more than once; name each run once")
    groups: dict[object, list[Path]] = {}
    for i, run_dir in enumerate(run_dirs):
        key = seed_key(run_dir)
        groups.setdefault(i if key is None else key, []).append(run_dir)
    out: dict[str, list[dict[int, dict]]] = {}
    for members in groups.values():
        names = [d.resolve().name for d in members]
        label = names[0]
        if len(names) > 1:
            label = re.sub(r"[_-]+(s|seed)?$", "", os.path.commonprefix(names)) or names[0]
        while label in out:
            label += "'"
        out[label] = [read_run(d) for d in members]
    return out


def _draw_group(ax, curves, label: str, n: int, **style):
    """The group's mean line (and, with several runs, its min-max band); the line, or None when nothing is common."""
    xs, mean, lo, hi = seed_band(curves)
    if not xs:
        return None
    line, = ax.plot(xs, mean, marker="o" if len(xs) < 30 else None, ms=3, label=label, **style)
    if n > 1:
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
    return line


def draw(groups: dict[str, list[dict[int, dict]]], metrics: list[str], profiles: list[str]):
    """The comparison figure (one panel per metric; see the module's description)."""
    panels = [("loss", "loss")] + [(f"outliers/{m}", m) for m in metrics] + [(None, p) for p in profiles]
    ncols = 4
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        values = []
        for name, runs in groups.items():
            seeds = f" ({len(runs)} seeds)" if len(runs) > 1 else ""
            if key is None:
                per_run = [layer_profile(records, title) for records in runs]
                steps = sorted({step for step, _, _ in per_run if step is not None})
                at = f" (step {steps[0]})" if len(steps) == 1 else f" (steps {steps[0]}-{steps[-1]})" if steps else ""
                curves = [(xs, ys) for _, xs, ys in per_run if xs]
                line = _draw_group(ax, curves, f"{name}{seeds}{at}", len(runs))
                ax.set_xlabel("layer")
            else:
                curves = [c for c in (series(records, key) for records in runs) if c[0]]
                line = _draw_group(ax, curves, f"{name}{seeds} (train)" if key == "loss" else f"{name}{seeds}",
                                   len(runs))
                ax.set_xlabel("step")
                if key == "loss":
                    val = [c for c in (series(records, "val_loss") for records in runs) if c[0]]
                    _draw_group(ax, val, f"{name}{seeds} (validation)", len(runs), ls="--",
                                color=line.get_color() if line else None)
                    curves += val
            values += [y for _, ys in curves for y in ys]
        direction = better(title)
        shown = title if key is not None else f"{title} per layer (last probe)"
        ax.set_title(f"{shown}\n{direction}" if direction else shown, fontsize=10)
        if key == "loss":
            ax.set_ylabel("cross entropy (nats/token)")
        if ax.get_lines():
            if log_axis(values):
                ax.set_yscale("log")
                # plain numbers (20, 0.5), not 2 x 10^1; minor ticks labelled only on axes that span little
                ax.yaxis.set_major_formatter(LogFormatter(labelOnlyBase=False))
                ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1, 0.5)))
            if key is not None:
                ax.set_xlim(left=0)
            else:
                ax.xaxis.get_major_locator().set_params(integer=True)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    if any(len(runs) > 1 for runs in groups.values()):
        fig.suptitle("several seeds: their mean, and a band from their minimum to their maximum", fontsize=10)
    fig.tight_layout()
    return fig


def summary(groups: dict[str, list[dict[int, dict]]], metrics: list[str]) -> str:
    """A Markdown table of the last value of every metric per group (several seeds: mean [min, max])."""
    keys = ["loss", "val_loss"] + [f"outliers/{m}" for m in metrics]
    lines = ["| metric | " + " | ".join(groups) + " |", "|---" * (len(groups) + 1) + "|"]
    for k in keys:
        cells = []
        for runs in groups.values():
            xs, mean, lo, hi = seed_band([c for c in (series(records, k) for records in runs) if c[0]])
            if not xs:
                cells.append("-")
            elif len(runs) > 1:
                cells.append(f"{mean[-1]:.4g} [{lo[-1]:.4g}, {hi[-1]:.4g}] (step {xs[-1]})")
            else:
                cells.append(f"{mean[-1]:.4g} (step {xs[-1]})")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    argv = take_plugins(argv)
    p = cli.parser(__doc__, plugins=True)
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--metrics", default=",".join(registry.shown("plot")),
                   help="comma-separated outlier metrics (names after 'outliers/')")
    p.add_argument("--profiles", default=",".join(registry.shown("profile")),
                   help="comma-separated metrics shown per layer at the last probe step ('' for none)")
    args = p.parse_args(argv)
    groups = group_runs(args.runs)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    profiles = [m.strip() for m in args.profiles.split(",") if m.strip()]
    fig = draw(groups, metrics, profiles)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=100)
    plt.close(fig)
    print(summary(groups, metrics))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
