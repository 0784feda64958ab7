#!/usr/bin/env python
"""Plot loss and the outlier metrics of one or more runs over training, side by side (one PNG).

    outlier-titan-analyze outputs/adamw outputs/orthoadam --out compare.png

Each RUN_DIR must hold ``metrics.jsonl`` (one JSON object per logged step; records of the same step are
merged). Panels: the training loss (solid) with the validation loss (dashed, where logged), each outlier
metric (layer means, ``outliers/<name>``) against the step, and per-layer profiles at the last probe step
(``outliers/layer_<i>/<name>``). Each run is one line, labelled with its folder name. Also prints the last value of every plotted metric per run.
"""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from outlier_titan import cli  # noqa: E402
from outlier_titan.observe.logger import read_metrics  # noqa: E402

DEFAULT_METRICS = ("kurtosis_first", "kurtosis_rest", "kurtosis_neuron_rms", "max_abs_first", "max_abs_rest",
                   "max_median_ratio", "signal_prop_cos", "first_token_argmax_share",
                   "first_token_attention_mass", "residual_rms")
DEFAULT_PROFILES = ("residual_rms", "kurtosis_neuron_rms")
LOG_SCALE = ("kurtosis", "max_abs", "max_median", "residual")
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


def plot(runs: dict[str, dict[int, dict]], metrics: list[str], profiles: list[str], out: Path) -> None:
    panels = [("loss", "loss")] + [(f"outliers/{m}", m) for m in metrics] + [(None, p) for p in profiles]
    ncols = 4
    nrows = -(-len(panels) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.2 * nrows), squeeze=False)
    for ax, (key, title) in zip(axes.flat, panels):
        drawn = False
        for name, records in runs.items():
            if key is None:
                step, xs, ys = layer_profile(records, title)
                label = f"{name} (step {step})" if step is not None else name
                ax.set_xlabel("layer")
            else:
                xs, ys = series(records, key)
                label = f"{name} (train)" if key == "loss" else name
                ax.set_xlabel("step")
            if xs:
                line, = ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, ms=3, label=label)
                drawn = True
            if key == "loss":
                vx, vy = series(records, "val_loss")
                if vx:
                    ax.plot(vx, vy, ls="--", marker="s", ms=3, color=line.get_color() if xs else None,
                            label=f"{name} (validation)")
                    drawn = True
        ax.set_title(title if key is not None else f"{title} per layer (last probe)", fontsize=10)
        if key == "loss":
            ax.set_ylabel("cross entropy (nats/token)")
        if drawn:
            values = [y for line in ax.get_lines() for y in line.get_ydata()]
            positive = all(y > 0 for y in values)
            wide = positive and max(values) > 3 * min(values)  # e.g. a loss falling from 10 to 3
            if positive and (any(t in title for t in LOG_SCALE) or (key == "loss" and wide)):
                ax.set_yscale("log")
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
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def summary(runs: dict[str, dict[int, dict]], metrics: list[str]) -> str:
    keys = ["loss", "val_loss"] + [f"outliers/{m}" for m in metrics]
    head = "| metric | " + " | ".join(runs) + " |"
    lines = [head, "|---" * (len(runs) + 1) + "|"]
    for k in keys:
        cells = []
        for records in runs.values():
            xs, ys = series(records, k)
            cells.append(f"{ys[-1]:.4g} (step {xs[-1]})" if ys else "-")
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = cli.parser(__doc__)
    p.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    p.add_argument("--out", type=Path, required=True, help="PNG to write")
    p.add_argument("--metrics", default=",".join(DEFAULT_METRICS),
                   help="comma-separated outlier metrics (names after 'outliers/')")
    p.add_argument("--profiles", default=",".join(DEFAULT_PROFILES),
                   help="comma-separated metrics shown per layer at the last probe step ('' for none)")
    args = p.parse_args(argv)
    runs: dict[str, dict[int, dict]] = {}
    for run_dir in args.runs:
        name = run_dir.resolve().name
        while name in runs:
            name += "'"
        runs[name] = read_run(run_dir)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    profiles = [m.strip() for m in args.profiles.split(",") if m.strip()]
    plot(runs, metrics, profiles, args.out)
    print(summary(runs, metrics))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
