"""The report's tables and sections that are not a suite's own: per-point peaks and worst layers, the
residual-stream anatomy, the quantisation table, the tile grids the points used and the tile-size study."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any

from outlier_titan.observe.logger import read_metrics
from outlier_titan.study.groups import format_value, matches, num, first_match
from outlier_titan.study.plan import point_dir
from outlier_titan.study.results import logged_key
from outlier_titan.study.rules import LOSS_COST, REDUCTION_FACTOR, estimate_of, reduction
from outlier_titan.study.stats import Estimate
from outlier_titan.study.suites.base import SuiteInfo


def worst_layer_peaks(records: dict[int, dict], metric: str) -> tuple[float, int, int] | None:
    """(value, layer, step) of the largest ``outliers/layer_<i>/<metric>`` over every probe step, or None."""
    best = None
    pat = re.compile(rf"^outliers/layer_(\d+)/{re.escape(metric)}$")
    for step, rec in records.items():
        for k, v in rec.items():
            m = pat.match(k)
            if m and num(v) is not None and (best is None or v > best[0]):
                best = (float(v), int(m.group(1)), step)
    return best


def peaks_table(sweep_dir: Path, rows: list[dict[str, Any]], metrics: list[str]) -> list[str]:
    """Markdown: per point and metric, the final and peak (over probe steps) mean over blocks, and the worst
    layer's peak with its layer and step (outliers peak early and in early layers, He et al. 2024)."""
    head = "| point | " + " | ".join(f"{m}: final / peak / worst layer (layer, step)" for m in metrics) + " |"
    lines = [head, "|---|" + "---|" * len(metrics)]
    for r in rows:
        path = point_dir(sweep_dir, r["point"]) / "metrics.jsonl"
        recs = read_metrics(path) if path.is_file() else {}
        cells = []
        for m in metrics:
            key = logged_key(recs, m)
            series = [v for v in (num(recs[s].get(f"outliers/{key}")) for s in sorted(recs)) if v is not None] \
                if key else []
            w = worst_layer_peaks(recs, key) if key else None
            worst = f"{format_value(w[0])} ({w[1]}, {w[2]})" if w else "—"
            final, peak = (series[-1], max(series)) if series else (None, None)
            cells.append(f"{format_value(final)} / {format_value(peak)} / {worst}")
        lines.append(f"| {r['point']} | " + " | ".join(cells) + " |")
    return lines


def anatomy_section(out: Path, rows: list[dict[str, Any]]) -> list[str]:
    """Markdown, for the points whose copied run folder (``runs/<point>/``) holds ``scripts/anatomy.py``'s output:
    per checkpoint, the residual stream's largest |x| (its block) and the most large entries per sequence in any
    block. Empty when no point has one."""
    table = []
    for r in rows:
        path = out / "runs" / r["point"] / "anatomy.json"
        if not path.is_file():
            continue
        a = json.loads(path.read_text())
        cells = []
        for step, blocks in sorted(a["steps"].items(), key=lambda kv: int(kv[0])):
            block, worst = max(blocks.items(), key=lambda kv: kv[1]["max_abs"])
            large = max(b["per_sequence"] for b in blocks.values())
            cells.append(f"{step}: {format_value(worst['max_abs'])} ({block}), {format_value(large)}")
        table.append(f"| [{r['point']}](runs/{r['point']}/anatomy.md) | {a['factor']:g} | {'; '.join(cells)} |")
    if not table:
        return []
    return ["## Where the large activations sit (`scripts/anatomy.py`)", "",
            "Per checkpoint the run kept, on the same validation sequences: the residual stream's largest |x| (the "
            "block holding it) and the most large entries per sequence in any block (large: above the factor times "
            "the sequence's median |x| at that block, Sun et al. 2024). The tokens, positions and channels that carry "
            "them are in each point's `anatomy.md`.", "",
            "| point | factor | step: max \\|x\\| (block), large entries per sequence |", "|---|---|---|", *table, ""]



def tile_study_section(groups: list[dict[str, Any]], info: SuiteInfo, fig_dir: Path,
                       scale_phrase: str = "at this scale") -> list[str]:
    """The tile-size study: per tile edge of the remedy, the verdict of the suite's main claim against the baseline
    by the rule set's :func:`~outlier_titan.study.rules.reduction` (gate, Welch test, loss cost),
    a table of the study's metrics (mean ± sd over seeds) and ``figures/tile_study.png`` (metric vs tile edge, error
    bars one sd, the baseline as a band)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base_sel, rem_sel, claim_metric, metrics = info.tile_study
    base = first_match(groups, base_sel)
    remedies = sorted((g for g in groups if matches(g, rem_sel)),
                      key=lambda g: -(g["optimizer.tile_size"] or 10 ** 9))  # whole axes first, then shrinking
    label = lambda g: "whole" if not g["optimizer.tile_size"] else str(g["optimizer.tile_size"])  # noqa: E731
    lines = ["## Tile-size study", "",
             f"The remedy ({', '.join(f'{a}={v}' for a, v in rem_sel.items())}) with its rotation over whole axes "
             f"(the published method) and in shard-local tiles; the baseline is {base['point'] if base else '—'}. "
             f"Verdict per tile edge, by the rule set below: '{claim_metric} (final) of the baseline ≥ "
             f"{REDUCTION_FACTOR.value:g}× the remedy's, at a val loss at most {LOSS_COST.value:.0%} above the "
             f"baseline's'.", ""]
    for g in remedies:
        _, v, d = reduction("", base, g, claim_metric)
        lines.append(f"- tile {label(g)}: **{v}** {scale_phrase} — {d}.")
    lines += ["", "| tile edge | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for g in ([base] if base else []) + remedies:
        name = "baseline" if g is base else label(g)
        lines.append(f"| {name} | " + " | ".join(format_value(g.get(m)) for m in metrics) + " |")
    fig, axs = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.2))
    xs = list(range(len(remedies)))
    for ax, m in zip(axs, metrics):
        ests = [estimate_of(g, m) for g in remedies]
        pts = [(x, e) for x, e in zip(xs, ests) if e is not None]
        if pts:
            ax.errorbar([x for x, _ in pts], [e.mean for _, e in pts], yerr=[e.sd or 0 for _, e in pts],
                        marker="o", capsize=3, label="remedy")
        b = estimate_of(base, m)
        if b is not None:
            ax.axhspan(b.mean - (b.sd or 0), b.mean + (b.sd or 0), color="C3", alpha=0.2)
            ax.axhline(b.mean, color="C3", lw=1, label="baseline")
        ax.set_xticks(xs, [label(g) for g in remedies])
        ax.set_xlabel("tile edge")
        ax.set_title(m, fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axs:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
            break
    fig.tight_layout()
    fig_dir.mkdir(parents=True, exist_ok=True)
    fig.savefig(fig_dir / "tile_study.png", dpi=110)
    plt.close(fig)
    return lines + ["", "![tile study](figures/tile_study.png)", ""]


def ptq_table(groups: list[dict[str, Any]], info: SuiteInfo, rows: list[dict[str, Any]] = ()) -> list[str]:
    """Markdown: per setting and scheme, Δppl as mean ± sd over training seeds, and the calibration spread (the
    mean over training seeds of the PPL's sd over calibration seeds) where the scheme is calibrated or rotated.
    The paper's own schemes come first; the added 4-bit ones are marked. Below it, what the rotated schemes did to
    the residual stream of each setting (from the points' evaluation reports, ``rows``)."""
    schemes = info.all_schemes
    names = [s if s in info.schemes else f"{s} (added)" for s in schemes]
    head = ["## Quantisation: Δppl over training seeds (calibration spread)", ""]
    if len(schemes) > len(info.schemes):
        head += ["Columns marked *(added)* are 4-bit schemes every suite evaluates beside its paper's own (their "
                 "recipes: `scripts/evaluate.py --help`); no verdict rests on them.", ""]
    head += ["| setting | PPL | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(schemes)]
    body = []
    for g in groups:
        cells = []
        for scheme in schemes:
            d, c = g.get(f"ptq_delta_ppl_{scheme}"), g.get(f"ptq_calib_sd_{scheme}")
            cells.append(format_value(d) + (f" (calib. sd {c.mean:.2g})" if isinstance(c, Estimate) else ""))
        body.append(f"| {g['point']} | {format_value(g.get('ppl'))} | " + " | ".join(cells) + " |")
    rotations: dict[str, list[str]] = {}
    for g in groups if any(s.endswith("_hadamard") for s in schemes) else []:
        for text in dict.fromkeys(r["ptq_rotation"] for r in rows if r["point"] in g["points"]
                                  and r.get("ptq_rotation")):
            rotations.setdefault(text, []).append(g["point"])
    notes = [""] if rotations else []
    for text, settings in rotations.items():
        notes.append(f"Rotated schemes (`_hadamard`) on {', '.join(settings)}: {text}.")
    return head + body + notes + [""]


def tile_grid_section(manifest: dict[str, Any]) -> list[str]:
    """The report's statement of the tile grid each OrthoAdam / SOAP setting and each block / block_periodic Muon
    setting used, per parameter class, from the points' own resolved configs (one rank)."""
    from outlier_titan.config.manager import parse_args
    from outlier_titan.models.registry import build_meta_model
    from outlier_titan.models.roles import roles_of
    from outlier_titan.optim.builder import build_param_groups
    from outlier_titan.optim.muon import block_plans
    from outlier_titan.optim.tile_optimizers import describe_plans, describe_tile_grid
    from outlier_titan.study.spec import _vocab_size

    out, seen = [], set()
    for e in manifest["points"]:
        with tempfile_toml(e["config"]) as path:
            cfg = parse_args(["--config", path])
        opt = cfg.optimizer
        block_muon = opt.name == "muon" and opt.muon_layout != "full"
        if opt.name not in ("orthoadam", "soap") and not block_muon:
            continue
        key = (opt.name, opt.muon_layout if block_muon else "", opt.tile_size, tuple(opt.tile_size_overrides),
               opt.vocab_axis, opt.one_d, cfg.model.name, cfg.model.dim, cfg.model.n_layers)
        if key in seen:
            continue
        seen.add(key)
        _, _, model = build_meta_model(cfg.model, _vocab_size(cfg.data.tokenizer), cfg.training.seq_len)
        if block_muon:
            every = f", a whole-matrix step every {opt.muon_full_every}" if opt.muon_layout == "block_periodic" else ""
            out += [f"**Block grid, muon {opt.muon_layout}** (Newton-Schulz on shard-local blocks{every}; a named "
                    f"variant of whole-matrix Muon; first point {e['name']}): "
                    + "; ".join(describe_plans(block_plans(model, opt))) + ".", ""]
            continue
        kind = "whole axes (as published)" if opt.tile_size == 0 else \
            f"shard-local tiles of {opt.tile_size} (a named variant)"
        out += [f"**Tile grid, {opt.name}** ({kind}; first point {e['name']}): "
                + "; ".join(describe_tile_grid(build_param_groups(model, opt), opt, roles_of(model))) + ".", ""]
    return out


@contextlib.contextmanager
def tempfile_toml(text: str):
    """A resolved config's TOML text as a temporary file (the config loader reads files)."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.toml"
        path.write_text(text)
        yield str(path)

