"""Reproduction suites: one sweep file per (paper, scale) plus a report that puts the paper's numbers beside ours.

A suite is ``train_configs/suites/<suite>/<scale>.toml`` (an ordinary sweep file). :func:`reproduce` plans and runs
it with the sweep engine (:mod:`outlier_titan.study.runner`; Slurm through ``scripts/sweep.py run --slurm``),
evaluates every finished point with ``scripts/evaluate.py`` where its report is missing, collects the table
(:mod:`outlier_titan.study.results`) and writes ``report.md`` with figures. The papers' numbers are data in
:mod:`outlier_titan.study.papers`; every number of ours comes from the collected table, the run folders'
``metrics.jsonl`` or the evaluation reports, and each verdict is computed from those numbers.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

from outlier_titan.errors import UserError
from outlier_titan.observe.logger import read_metrics
from outlier_titan.study.papers import SUITE_INFO, SuiteInfo
from outlier_titan.study.plan import point_dir

REPO = Path(__file__).resolve().parents[2]
SUITES = tuple(SUITE_INFO)
SMOKE_ONLY = ("sinks2025",)  # suites without their cpu / gpu scales yet
SCALES = ("smoke", "cpu", "search", "synthetic", "gpu")
"""``search``: the calibration search of the cpu scale (issue 10), where a suite has one: the seeds' levers on
the cpu recipe, evaluated and reported like a suite, so the settings tried and the peaks they gave are kept.
``synthetic``: the suite's grid on the synthetic Bigram-Backcopy task (``data.source = "bigram_backcopy"``), where
a suite has one: a small-scale testbed for the attention sink, which natural text at cpu scale does not make."""
OPTIONAL_SCALES = {"search": "calibration search", "synthetic": "synthetic-task suite"}
# scripts/evaluate.py settings per scale: validation tokens, sequences per pass, calibration batches and seeds
EVAL_ARGS = {"smoke": dict(tokens=512, batch_size=4, calib_batches=1, calib_seeds=1),
             "cpu": dict(tokens=65536, batch_size=8, calib_batches=4, calib_seeds=3),
             "gpu": dict(tokens=1_048_576, batch_size=16, calib_batches=4, calib_seeds=3)}
EVAL_ARGS["search"] = EVAL_ARGS["synthetic"] = EVAL_ARGS["cpu"]  # judged like the cpu scale


def suite_file(suite: str, scale: str) -> Path:
    """The sweep file of a suite at a scale."""
    if suite not in SUITES:
        raise UserError(f"--suite {suite!r} is not a suite; choose one of {', '.join(SUITES)}")
    if scale not in SCALES:
        raise UserError(f"--scale {scale!r} is not a scale; choose one of {', '.join(SCALES)}")
    path = REPO / "train_configs" / "suites" / suite / f"{scale}.toml"
    if scale in OPTIONAL_SCALES and not path.is_file():
        have = sorted(p.parent.name for p in (REPO / "train_configs" / "suites").glob(f"*/{scale}.toml"))
        raise UserError(f"suite {suite} has no {OPTIONAL_SCALES[scale]} (train_configs/suites/{suite}/{scale}.toml)"
                        f"; suites with one: {', '.join(have) or 'none'}")
    if not path.is_file() and suite in SMOKE_ONLY:
        raise UserError(f"suite {suite} has only the smoke scale so far; use --scale smoke")
    if not path.is_file():
        raise UserError(f"suite file {path} is missing; restore it from git")
    return path


# ------------------------------------------------------------------------------------------------ running

def evaluate_points(sweep_dir: Path, manifest: dict[str, Any], info: SuiteInfo, scale: str) -> list[str]:
    """Runs ``scripts/evaluate.py`` on the final checkpoint of every finished point without its report;
    returns the names of points whose evaluation failed (their log is ``<point>/eval.log``)."""
    from outlier_titan.study.runner import is_finished

    failed = []
    a = EVAL_ARGS[scale]
    for e in manifest["points"]:
        folder = point_dir(sweep_dir, e["name"])
        ckpt = folder / "checkpoints" / f"step-{e['steps']}"
        if not is_finished(folder, e) or (folder / "eval" / f"step-{e['steps']}.json").is_file():
            continue
        cmd = [sys.executable, str(REPO / "scripts" / "evaluate.py"), "--checkpoint", str(ckpt), "--device", "cpu"
               if scale != "gpu" else "auto", "--schemes", ",".join(info.schemes), "--tokens", str(a["tokens"]),
               "--batch-size", str(a["batch_size"]), "--calib-batches", str(a["calib_batches"]),
               "--calib-seeds", str(a["calib_seeds"])]
        with (folder / "eval.log").open("w") as log:
            rc = subprocess.call(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        if rc != 0:
            failed.append(e["name"])
    return failed


# ------------------------------------------------------------------------------------------------ numbers

def _eval_report(folder: Path, steps: int) -> dict[str, Any] | None:
    path = folder / "eval" / f"step-{steps}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def tokens_to_reach(records: dict[int, dict], tokens_per_step: int, target: float) -> float | None:
    """Tokens at which the validation loss first reaches ``target`` (linear between evaluations), or None."""
    prev = None
    for step in sorted(records):
        v = _num(records[step].get("val_loss"))
        if v is None:
            continue
        if v <= target:
            if prev is None or prev[1] == v:
                return float(step * tokens_per_step)
            s0, v0 = prev
            frac = (v0 - target) / (v0 - v)
            return (s0 + frac * (step - s0)) * tokens_per_step
        prev = (step, v)
    return None


def ours(suite: str, rows: list[dict[str, Any]], sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """Adds our value of every metric of the suite's table to each collected row (in place)."""
    entries = {e["name"]: e for e in manifest["points"]}
    for r in rows:
        e = entries[r["point"]]
        rep = _eval_report(point_dir(sweep_dir, e["name"]), e["steps"])
        r["ppl"] = _num((rep or {}).get("full_precision", {}).get("ppl"))
        r["first_share"] = r.get("final_first_token_argmax_share")
        for m in ("kurtosis_first", "kurtosis_rest", "max_abs_first", "max_abs_rest", "kurtosis_neuron_rms",
                  "sink_rate", "massive_ratio", "value_drain"):
            r[m] = r.get(f"final_{m}")
        r["d_int4"] = r.get("ptq_delta_ppl_int4_zeropoint")
        r["d_int8_coarse"] = r.get("ptq_delta_ppl_int8_coarse")
        r["d_w8a8"] = r.get("ptq_delta_ppl_w8a8_static")
        r["tokens_per_step"] = e["tokens"] // e["steps"]
    if suite == "franke2025":
        base = select(rows, {"model.name": "pre_ln"})
        for r in rows:
            r["speedup"] = r["step_time_ratio"] = r["tokens_to_target"] = None
        if base and base.get("final_val_loss") is not None:
            for r in rows:
                recs = read_metrics(point_dir(sweep_dir, r["point"]) / "metrics.jsonl")
                t = tokens_to_reach(recs, r["tokens_per_step"], base["final_val_loss"])
                r["tokens_to_target"] = t
                r["speedup"] = base["tokens"] / t if t else None
                if r.get("tokens_per_s") and base.get("tokens_per_s"):
                    r["step_time_ratio"] = base["tokens_per_s"] / r["tokens_per_s"]


def matches(row: dict[str, Any], sel: dict[str, Any]) -> bool:
    return all(row.get(k) == v for k, v in sel.items())


def select(rows: list[dict[str, Any]], sel: dict[str, Any]) -> dict[str, Any] | None:
    """The first point (manifest order) whose axes equal ``sel``; points of a suite that vary other axes (e.g.
    a learning-rate lever) contribute their first value."""
    for r in rows:
        if matches(r, sel):
            return r
    return None


def fmt(v: Any) -> str:
    """How every number appears in the report (the test parses the same format)."""
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ------------------------------------------------------------------------------------------------ verdicts

Claim = tuple[str, bool | None, str]


def _need(*vals: Any) -> bool:
    return all(v is not None for v in vals)


def claims_kaul(rows: list[dict[str, Any]]) -> list[Claim]:
    base = select(rows, {"optimizer.name": "adam", "model.softmax": "softmax", "model.norm": "layernorm"})
    s1 = select(rows, {"optimizer.name": "adam", "model.softmax": "softmax1", "model.norm": "layernorm"})
    rem = select(rows, {"optimizer.name": "orthoadam", "model.softmax": "softmax1", "model.norm": "rmsnorm_single"})
    out: list[Claim] = []
    text = "first-token argmax share: baseline (Adam, softmax, LayerNorm) ≥ 0.3 and softmax-1 ≤ 0.05"
    if base and s1 and _need(base.get("first_share"), s1.get("first_share")):
        ok = base["first_share"] >= 0.3 and s1["first_share"] <= 0.05
        out.append((text, ok, f"baseline {fmt(base['first_share'])} ({base['point']}), softmax-1 "
                              f"{fmt(s1['first_share'])} ({s1['point']})"))
    else:
        out.append((text, None, "a point or its probe metric is missing"))
    text = ("kurtosis (other tokens, final): baseline ≥ 5× that of OrthoAdam + softmax-1 + RMSNorm-S at a "
            "validation loss within 2%")
    if base and rem and _need(base.get("kurtosis_rest"), rem.get("kurtosis_rest"), base.get("final_val_loss"),
                                rem.get("final_val_loss")):
        ratio = base["kurtosis_rest"] / rem["kurtosis_rest"] if rem["kurtosis_rest"] else math.inf
        dloss = (rem["final_val_loss"] - base["final_val_loss"]) / base["final_val_loss"]
        out.append((text, ratio >= 5 and abs(dloss) <= 0.02,
                    f"baseline {fmt(base['kurtosis_rest'])}, remedy {fmt(rem['kurtosis_rest'])} (ratio "
                    f"{fmt(ratio)}); val loss {fmt(base['final_val_loss'])} vs {fmt(rem['final_val_loss'])} "
                    f"({dloss:+.2%})"))
    else:
        out.append((text, None, "a point or its metrics are missing"))
    text = "int4 zero-point Δppl of the remedy below a third of the baseline's"
    if base and rem and _need(base.get("d_int4"), rem.get("d_int4")):
        out.append((text, rem["d_int4"] < base["d_int4"] / 3,
                    f"baseline {fmt(base['d_int4'])}, remedy {fmt(rem['d_int4'])}"))
    else:
        out.append((text, None, "an evaluation report is missing"))
    return out


def claims_he(rows: list[dict[str, Any]]) -> list[Claim]:
    base = select(rows, {"model.block": "pre_ln", "optimizer.name": "adamw"})
    rem = select(rows, {"model.block": "op", "optimizer.name": "soap"})
    out: list[Claim] = []
    text = "peak neuron-RMS kurtosis: Pre-LN + AdamW ≥ 5× that of OP + SOAP"
    if base and rem and _need(base.get("peak_kurtosis_neuron_rms"), rem.get("peak_kurtosis_neuron_rms")):
        b, r = base["peak_kurtosis_neuron_rms"], rem["peak_kurtosis_neuron_rms"]
        ratio = b / r if r else math.inf
        out.append((text, ratio >= 5, f"Pre-LN + AdamW {fmt(b)} ({base['point']}), OP + SOAP {fmt(r)} "
                                      f"({rem['point']}), ratio {fmt(ratio)}"))
    else:
        out.append((text, None, "a point or its probe metric is missing"))
    text = "W8A8 Δppl of OP + SOAP below a third of Pre-LN + AdamW's"
    if base and rem and _need(base.get("d_w8a8"), rem.get("d_w8a8")):
        out.append((text, rem["d_w8a8"] < base["d_w8a8"] / 3,
                    f"Pre-LN + AdamW {fmt(base['d_w8a8'])}, OP + SOAP {fmt(rem['d_w8a8'])}"))
    else:
        out.append((text, None, "an evaluation report is missing"))
    return out


def claims_franke(rows: list[dict[str, Any]]) -> list[Claim]:
    base = select(rows, {"model.name": "pre_ln"})
    an = select(rows, {"model.name": "angpt"})
    text = "anGPT reaches GPT+'s final validation loss with fewer tokens"
    if not (base and an and _need(base.get("final_val_loss"))):
        return [(text, None, "a point or its validation loss is missing")]
    if an.get("tokens_to_target") is None:
        return [(text, False, f"anGPT never reached GPT+'s final val loss {fmt(base['final_val_loss'])} "
                              f"within {fmt(an['tokens'])} tokens")]
    return [(text, an["tokens_to_target"] < base["tokens"],
             f"GPT+ final val loss {fmt(base['final_val_loss'])} after {fmt(base['tokens'])} tokens; anGPT reaches "
             f"it after {fmt(an['tokens_to_target'])} tokens (speed-up {fmt(an['speedup'])})")]


def claims_sinks(rows: list[dict[str, Any]]) -> list[Claim]:
    """Per remedy: its sink rate below the softmax baseline's, with its validation-loss cost. Determined only
    where the baseline has a sink (sink rate > 0) at this scale."""
    base = select(rows, {"model.attention": "softmax"})
    out: list[Claim] = []
    for r in rows:
        variant = r.get("model.attention")
        if variant == "softmax":
            continue
        text = f"{variant} removes the softmax baseline's attention sink (lower Sink^0.3)"
        if not (base and _need(base.get("sink_rate"), r.get("sink_rate"))):
            out.append((text, None, "a point or its probe metric is missing"))
            continue
        cost = ""
        if _need(base.get("final_val_loss"), r.get("final_val_loss")):
            cost = (f"; val loss {fmt(r['final_val_loss'])} vs {fmt(base['final_val_loss'])} "
                    f"({(r['final_val_loss'] - base['final_val_loss']) / base['final_val_loss']:+.2%})")
        if base["sink_rate"] <= 0:
            out.append((text, None, f"the baseline has no sink at this scale (Sink^0.3 = 0); {variant} "
                                    f"{fmt(r['sink_rate'])}{cost}"))
            continue
        out.append((text, r["sink_rate"] < base["sink_rate"],
                    f"baseline {fmt(base['sink_rate'])}, {variant} {fmt(r['sink_rate'])}{cost}"))
    return out


CLAIMS: dict[str, Callable[[list[dict[str, Any]]], list[Claim]]] = {
    "kaul2024": claims_kaul, "he2024": claims_he, "franke2025": claims_franke, "sinks2025": claims_sinks}


# ------------------------------------------------------------------------------------------------ figures

def trajectory_figures(sweep_dir: Path, rows: list[dict[str, Any]], info: SuiteInfo, fig_dir: Path) -> list[Path]:
    """Kurtosis per variant vs step, first-token argmax share vs step, loss vs tokens (one line per point)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = {r["point"]: (read_metrics(point_dir(sweep_dir, r["point"]) / "metrics.jsonl"), r["tokens_per_step"])
              for r in rows if (point_dir(sweep_dir, r["point"]) / "metrics.jsonl").is_file()}
    panels = [(f"outliers/{info.kurtosis}", "step", info.kurtosis.replace("_", " "), "kurtosis.png", True),
              ("outliers/first_token_argmax_share", "step", "first-token argmax share", "first_token.png", False),
              ("loss", "tokens", "loss (solid: train, dashed: validation)", "loss.png", False)]
    paths = []
    fig_dir.mkdir(parents=True, exist_ok=True)
    for key, xlabel, ylabel, fname, logy in panels:
        fig, ax = plt.subplots(figsize=(7, 4.2))
        for n, (name, (recs, tps)) in enumerate(series.items()):
            colour = f"C{n % 10}"
            keys = [key, "val_loss"] if key == "loss" else [key]
            for k, style in zip(keys, ("-", "--")):
                pts = [(s * (tps if xlabel == "tokens" else 1), _num(recs[s].get(k))) for s in sorted(recs)]
                pts = [(x, y) for x, y in pts if y is not None]
                if pts:
                    ax.plot(*zip(*pts), style, color=colour, marker="." if len(pts) < 30 else None,
                            label=name if style == "-" else None)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
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


def worst_layer_peaks(records: dict[int, dict], metric: str) -> tuple[float, int, int] | None:
    """(value, layer, step) of the largest ``outliers/layer_<i>/<metric>`` over every probe step, or None."""
    best = None
    pat = re.compile(rf"^outliers/layer_(\d+)/{re.escape(metric)}$")
    for step, rec in records.items():
        for k, v in rec.items():
            m = pat.match(k)
            if m and _num(v) is not None and (best is None or v > best[0]):
                best = (float(v), int(m.group(1)), step)
    return best


def peaks_table(sweep_dir: Path, rows: list[dict[str, Any]], metrics: list[str]) -> list[str]:
    """Markdown: per point and metric, the final and peak (over probe steps) mean over blocks, and the worst
    layer's peak with its layer and step (outliers peak early and in early layers, seed 002)."""
    head = "| point | " + " | ".join(f"{m}: final / peak / worst layer (layer, step)" for m in metrics) + " |"
    lines = [head, "|---|" + "---|" * len(metrics)]
    for r in rows:
        path = point_dir(sweep_dir, r["point"]) / "metrics.jsonl"
        recs = read_metrics(path) if path.is_file() else {}
        cells = []
        for m in metrics:
            series = [v for v in (_num(recs[s].get(f"outliers/{m}")) for s in sorted(recs)) if v is not None]
            w = worst_layer_peaks(recs, m)
            worst = f"{fmt(w[0])} ({w[1]}, {w[2]})" if w else "—"
            cells.append(f"{fmt(series[-1] if series else None)} / {fmt(max(series) if series else None)} / "
                         f"{worst}")
        lines.append(f"| {r['point']} | " + " | ".join(cells) + " |")
    return lines


# ------------------------------------------------------------------------------------------------ report

def _axes_label(row: dict[str, Any], axes: list[str]) -> str:
    return ", ".join(f"{a}={row.get(a)}" for a in axes if a != "seed")


def write_report(suite: str, scale: str, sweep_dir: Path, out: Path, manifest: dict[str, Any],
                 columns: list[str], rows: list[dict[str, Any]], eval_failed: list[str]) -> Path:
    """``out/report.md`` with figures under ``out/figures`` and each point's logs under ``out/runs``."""
    import datetime

    from outlier_titan.study.results import write_tables

    info = SUITE_INFO[suite]
    out.mkdir(parents=True, exist_ok=True)
    fig_dir = out / "figures"
    write_tables(out, columns, rows)
    # the evidence: each point's metrics log, config and evaluation report beside the report
    for r in rows:
        src = point_dir(sweep_dir, r["point"])
        dst = out / "runs" / r["point"]
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "config.toml", "sweep_state.json"):
            if (src / f).is_file():
                shutil.copy2(src / f, dst / f)
        for f in (src / "eval").glob("step-*.json") if (src / "eval").is_dir() else []:
            shutil.copy2(f, dst / f.name)
    figs = trajectory_figures(sweep_dir, rows, info, fig_dir)
    done = sum(r["status"] == "done" for r in rows)
    lines = [f"# {info.title} — {scale} scale", "",
             f"Paper: {info.citation}. Suite file: `train_configs/suites/{suite}/{scale}.toml`; sweep folder: "
             f"`{sweep_dir}`. Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by "
             f"`python scripts/reproduce.py --suite {suite} --scale {scale}`.", "",
             f"{done} of {len(rows)} points finished. Our numbers come from `results.csv` (collected from the run "
             f"folders; copies of each point's `metrics.jsonl` and evaluation report are under `runs/`). The "
             f"papers' models are far larger and trained far longer than ours, so the comparison is of "
             f"directions and ratios, not of values.", ""]
    if scale == "smoke":
        lines += ["**Smoke scale:** tiny models trained for a few steps; these runs test the pipeline and say "
                  "nothing about the phenomena.", ""]
    if scale == "search":
        lines += ["**Calibration search:** the cpu recipe under the levers the seeds name (the suite file says "
                  "which); a verdict needs the points it compares and is not determined where the search lacks "
                  "them. Read the peaks table: whether any setting grows the phenomenon at this scale.", ""]
    if scale == "synthetic":
        lines += ["**Synthetic task:** these runs train on the Bigram-Backcopy task (`data.source = "
                  "\"bigram_backcopy\"`, Guo et al. 2024), a generated token stream where only the copy after a "
                  "trigger token needs attention and every window starts with BOS, not on natural text; what they "
                  "show is the mechanism at small scale, beside (not instead of) the cpu scale's natural-text runs.",
                  ""]
    if eval_failed:
        lines += [f"Evaluation failed for: {', '.join(eval_failed)} (see `<point>/eval.log`).", ""]
    lines += ["## Verdicts", ""]
    for text, ok, detail in CLAIMS[suite](rows):
        verdict = "not determined" if ok is None else ("reproduced" if ok else "not reproduced")
        lines.append(f"- **{verdict} at this scale** — {text}: {detail}.")
    lines += ["", "## The paper's numbers beside ours", "",
              "Each row: the paper's setting, then `paper / ours` per metric (ours: the point with those axes; "
              "— where a side has no number).", ""]
    headers = list(info.metrics.values())
    lines.append("| paper row | source | our point | " + " | ".join(headers) + " |")
    lines.append("|---|---|---|" + "---|" * len(headers))
    for pr in info.rows:
        r = select(rows, pr.select)
        cells = [f"{fmt(pr.paper.get(m))} / {fmt(r.get(m) if r else None)}" for m in info.metrics]
        lines.append(f"| {pr.label} | {pr.source} | {r['point'] if r else 'not in this suite'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Ours: PPL is `scripts/evaluate.py`'s full-precision perplexity; probe metrics are the last "
              "probe step of training (mean over blocks); Δppl are `scripts/evaluate.py`'s schemes.", "",
              "## Trajectories", ""]
    for p in figs:
        lines.append(f"![{p.stem}](figures/{p.name})")
    lines += ["", "## Hidden-state magnitudes (evaluation probe, first token vs the rest)", ""]
    compared = [r for r in rows if any(matches(r, pr.select) for pr in info.rows)] or rows
    for r in compared:
        steps = manifest_steps(manifest, r["point"])
        src = point_dir(sweep_dir, r["point"]) / "eval" / f"step-{steps}.hidden_magnitude.png"
        if src.is_file():
            shutil.copy2(src, fig_dir / f"hidden_{r['point']}.png")
            lines.append(f"**{r['point']}** ({_axes_label(r, manifest['axes'])})  ")
            lines.append(f"![hidden {r['point']}](figures/hidden_{r['point']}.png)")
            lines.append("")
    lines += ["## Peaks over training and the worst layer", "",
              "From each point's `metrics.jsonl` (training probe, every `observe.every` steps).", ""]
    lines += peaks_table(sweep_dir, rows, list(dict.fromkeys([info.kurtosis, "kurtosis_neuron_rms",
                                                              "first_token_argmax_share", "max_abs_rest",
                                                              *info.extra_probe])))
    lines += ["", "## Appendix: every point (settings → final and peak metrics)", "",
              (out / "results.md").read_text().rstrip(), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def manifest_steps(manifest: dict[str, Any], name: str) -> int:
    return next(e["steps"] for e in manifest["points"] if e["name"] == name)


def build_report(suite: str, scale: str, sweep_dir: Path, out: Path) -> Path:
    """Evaluates the finished points that lack a report, collects, and writes the report."""
    from outlier_titan.study.plan import read_manifest
    from outlier_titan.study.results import collect, write_tables

    manifest = read_manifest(sweep_dir)
    failed = evaluate_points(sweep_dir, manifest, SUITE_INFO[suite], scale)
    columns, rows = collect(sweep_dir, manifest)
    write_tables(sweep_dir, columns, rows)
    ours(suite, rows, sweep_dir, manifest)
    return write_report(suite, scale, sweep_dir, out, manifest, columns, rows, failed)


# ------------------------------------------------------------------------------------------------ gpu plan

def gpu_dry_run(suite: str, tokenizer: str | None, mfu: float, peak_tflops: float, gpu_gib: float = 80.0,
                layouts: tuple[int, ...] = (1, 8)) -> str:
    """The suite's gpu-scale runs: parameters, tokens, FLOPs, per-rank memory at the largest micro-batch that
    fits ``gpu_gib`` (the trainer's ``--dry_run`` planner, :func:`outlier_titan.parallel.planning.plan`) and the
    estimated wall time on 1 and 8 GPUs at ``mfu`` of ``peak_tflops`` per GPU."""
    import copy
    import tempfile

    from outlier_titan.config.manager import ConfigError, tomllib
    from outlier_titan.errors import DataError
    from outlier_titan.parallel.planning import GiB, plan
    from outlier_titan.study.spec import load_sweep

    path = suite_file(suite, "gpu")
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer:
            # the same sweep with data.tokenizer replaced (its base made absolute so the copy resolves it)
            text = path.read_text()
            base = (path.parent / tomllib.loads(text)["base"]).resolve()
            lines = [f'base = "{base}"' if ln.startswith("base =") else ln for ln in text.splitlines()]
            if any(ln.strip() == "[fixed]" for ln in lines):
                raise UserError(f"{path} has a [fixed] table; set data.tokenizer there instead of --tokenizer")
            lines += ["[fixed]", f'"data.tokenizer" = "{tokenizer}"']
            path = Path(tmp) / path.name
            path.write_text("\n".join(lines) + "\n")
        try:
            sweep = load_sweep(path)
        except DataError as e:
            raise UserError(f"{e}; pass --tokenizer with a local BPE file to plan offline (parameters then follow "
                            f"its vocabulary)") from None
    header = (f"{'point':<34} {'params':>9} {'tokens':>9} {'FLOPs':>9}  " + "  ".join(
        f"{f'{n}GPU:micro':>10} {'GiB/rank':>9} {'wall h':>8}" for n in layouts))
    out = [f"{suite} at gpu scale: {len(sweep.points)} runs of {path.name}"
           + (f" with data.tokenizer = {tokenizer} (not the recipe's vocabulary)" if tokenizer else ""),
           f"micro = largest micro-batch per rank whose planned memory fits {gpu_gib:g} GiB (! = none fits); "
           f"wall h = FLOPs / (GPUs x {peak_tflops:g} TFLOP/s bf16 peak x MFU {mfu:g}), an assumption, not a "
           f"measurement", header]
    from outlier_titan.study.plan import fmt_count

    total = 0.0
    for p in sweep.points:
        cells = []
        for n in layouts:
            cfg = copy.deepcopy(p.cfg)
            cfg.parallelism.dp_shard, cfg.parallelism.dp_replicate, cfg.parallelism.tp = n, 1, 1
            cfg.training.device = "cuda"
            # the largest micro-batch (halving from the whole per-rank batch) whose plan fits the GPU
            micro = max(1, cfg.training.global_batch_size // n)
            while True:
                cfg.training.micro_batch_size = micro
                try:
                    pl = plan(cfg)
                except ConfigError as e:
                    raise UserError(f"point {p.name} on {n} GPU(s): {e}") from None
                if pl.total_bytes <= gpu_gib * GiB or micro == 1:
                    break
                micro //= 2
            hours = p.flops / (n * peak_tflops * 1e12 * mfu) / 3600
            fits = "" if pl.total_bytes <= gpu_gib * GiB else "!"
            cells.append(f"{micro:>10} {pl.total_bytes / GiB:>8.1f}{fits:1} {hours:>8.1f}")
        total += p.flops
        out.append(f"{p.name:<34} {fmt_count(p.params):>9} {fmt_count(p.tokens):>9} {p.flops:>9.3g}  "
                   + "  ".join(cells))
    out.append(f"total {total:.3g} FLOPs: {total / (peak_tflops * 1e12 * mfu) / 3600:.1f} GPU-hours")
    return "\n".join(out)
