"""Reproduction suites: one sweep file per (paper, scale) plus a report that puts the paper's numbers beside ours.

A suite is ``train_configs/suites/<suite>/<scale>.toml`` (an ordinary sweep file). :func:`reproduce` plans and runs
it with the sweep engine (:mod:`outlier_titan.study.runner`; Slurm through ``scripts/sweep.py run --slurm``),
evaluates every finished point with ``scripts/evaluate.py`` where its report is missing, collects the table
(:mod:`outlier_titan.study.results`) and writes ``report.md`` with figures. The papers' numbers are data in
:mod:`outlier_titan.study.papers`; every number of ours comes from the collected table, the run folders'
``metrics.jsonl`` or the evaluation reports, and each verdict is computed from those numbers.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from outlier_titan.errors import UserError
from outlier_titan.observe.logger import read_metrics
from outlier_titan.packaged import configs_dir
from outlier_titan.provenance import code_version
from outlier_titan.study import facts, lr_search, stats
from outlier_titan.study.claims import CLAIMS, THRESHOLDS, ours_park, sinks_table
from outlier_titan.study.groups import aggregate, fmt, matches, num, seed_band, select
from outlier_titan.study.papers import SUITE_INFO, SuiteInfo
from outlier_titan.study.plan import point_dir
from outlier_titan.study.results import logged_key
from outlier_titan.study.rules import LOSS_COST, REDUCTION_FACTOR, RULES_TEXT, get, reduction, sources
from outlier_titan.study.stats import Estimate

SUITES = tuple(SUITE_INFO)
SCALES = ("smoke", "cpu", "search", "lr", "synthetic", "tiles", "gpu")
"""``search``: the calibration search of the cpu scale, where a suite has one: the seeds' levers on
the cpu recipe, evaluated and reported like a suite, so the settings tried and the peaks they gave are kept.
``synthetic``: the suite's grid on the synthetic Bigram-Backcopy task (``data.source = "bigram_backcopy"``), where
a suite has one: a small-scale testbed for the attention sink, which the embedded corpus (Python source) does not make at cpu scale.
``tiles``: the tile-size study, where a suite has one: the cpu recipe's baseline and remedy with the remedy's
rotation over whole axes and in shard-local tiles of 128, 64 and 32, reported against the tile edge."""
OPTIONAL_SCALES = {"search": "calibration search", "lr": "learning-rate search", "synthetic": "synthetic-task suite",
                   "tiles": "tile-size study"}
# scripts/evaluate.py settings per scale: validation tokens, sequences per pass, calibration batches and seeds
EVAL_ARGS = {"smoke": dict(tokens=512, batch_size=4, calib_batches=1, calib_seeds=1),
             # 16 calibration batches (16k tokens): at 4, a W8A8 point's three calibration seeds spread 77-225 PPL
             "cpu": dict(tokens=65536, batch_size=8, calib_batches=16, calib_seeds=3),
             "gpu": dict(tokens=1_048_576, batch_size=16, calib_batches=4, calib_seeds=3)}
EVAL_ARGS["search"] = EVAL_ARGS["lr"] = EVAL_ARGS["synthetic"] = EVAL_ARGS["tiles"] = EVAL_ARGS["cpu"]  # as cpu


def suite_scales(suite: str) -> list[str]:
    """The scales (in :data:`SCALES` order) whose sweep file the suite has."""
    return [s for s in SCALES if (configs_dir() / "suites" / suite / f"{s}.toml").is_file()]


def suite_file(suite: str, scale: str) -> Path:
    """The sweep file of a suite at a scale."""
    if suite not in SUITES:
        raise UserError(f"--suite {suite!r} is not a suite; choose one of {', '.join(SUITES)}")
    if scale not in SCALES:
        raise UserError(f"--scale {scale!r} is not a scale; choose one of {', '.join(SCALES)}")
    path = configs_dir() / "suites" / suite / f"{scale}.toml"
    if scale in OPTIONAL_SCALES and not path.is_file():
        have = sorted(p.parent.name for p in (configs_dir() / "suites").glob(f"*/{scale}.toml"))
        raise UserError(f"suite {suite} has no {OPTIONAL_SCALES[scale]} (train_configs/suites/{suite}/{scale}.toml)"
                        f"; suites with one: {', '.join(have) or 'none'}")
    if not path.is_file():
        have = suite_scales(suite)
        if have:
            raise UserError(f"suite {suite} has no {scale} scale (train_configs/suites/{suite}/{scale}.toml); its "
                            f"scales: {', '.join(have)}")
        raise UserError(f"suite file {path} is missing; reinstall the package (or restore it from git)")
    return path


def _suite_keys(suite: str, scale: str) -> dict[str, Any]:
    from outlier_titan.config.manager import tomllib

    path = configs_dir() / "suites" / suite / f"{scale}.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def lr_report(suite: str, scale: str) -> Path | None:
    """The lr search report a scale takes its learning rates from (its suite file's ``lr_from``), or None."""
    source = _suite_keys(suite, scale).get("lr_from")
    return Path("reports") / f"{suite}-{source}" if source else None


def suite_sweep(suite: str, scale: str):
    """The suite's sweep at a scale, each tuned setting at the learning rate its lr search chose (``lr_from``)."""
    from outlier_titan.study.spec import load_sweep

    sweep = load_sweep(suite_file(suite, scale))
    report = lr_report(suite, scale)
    if report is not None:
        lr_search.apply_choice(sweep, lr_search.read_choice(report))
    return sweep


def lr_choice(suite: str, scale: str, manifest: dict[str, Any]) -> str:
    """How the learning rates of the planned points (``manifest``) were chosen: from the lr search the suite file
    names (``lr_from``), else the suite file's own words (``lr_choice``), or ""."""
    report = lr_report(suite, scale)
    if report is None:
        return str(_suite_keys(suite, scale).get("lr_choice", ""))
    choice = lr_search.read_choice(report)
    return lr_search.header_line(choice, str(report), lr_search.untuned_points(manifest, choice))


# ------------------------------------------------------------------------------------------------ running

def evaluate_points(sweep_dir: Path, manifest: dict[str, Any], info: SuiteInfo, scale: str,
                    parallel: int = 1) -> list[str]:
    """Runs ``scripts/evaluate.py`` on the final checkpoint of every finished point without its report, ``parallel``
    at a time (the CPU threads shared out as for the sweep's trainers); returns the names of points whose
    evaluation failed (their log is ``<point>/eval.log``)."""
    import time

    from outlier_titan.study.runner import is_finished, trainer_environment

    from outlier_titan.study.runner import read_state

    a = EVAL_ARGS[scale]
    todo = []
    for e in manifest["points"]:
        folder = point_dir(sweep_dir, e["name"])
        if not is_finished(folder, e) or _evaluated(folder / "eval" / f"step-{e['steps']}.json", info.all_schemes):
            continue
        if read_state(folder).get("adopted_from"):  # no checkpoint here: its evaluation is the adopted one
            continue
        todo.append((e["name"], folder, [
            sys.executable, "-m", "outlier_titan.tools.evaluate", "--checkpoint",
            str(folder / "checkpoints" / f"step-{e['steps']}"), "--device", "cpu" if scale != "gpu" else "auto",
            "--schemes", ",".join(info.all_schemes), "--tokens", str(a["tokens"]), "--batch-size",
            str(a["batch_size"]), "--calib-batches", str(a["calib_batches"]), "--calib-seeds", str(a["calib_seeds"])]))
    env = trainer_environment(min(parallel, max(1, len(todo))), 1)
    failed, running = set(), []
    try:
        while todo or running:
            while todo and len(running) < parallel:
                name, folder, cmd = todo.pop(0)
                log = (folder / "eval.log").open("w")
                running.append((name, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                       stdin=subprocess.DEVNULL, env=env), log))
            time.sleep(0.2)
            for item in [r for r in running if r[1].poll() is not None]:
                running.remove(item)
                item[2].close()
                if item[1].returncode != 0:
                    failed.add(item[0])
    finally:  # Ctrl-C: the evaluations in flight end with this process
        for _, proc, log in running:
            proc.terminate()
            proc.wait()
            log.close()
    return [e["name"] for e in manifest["points"] if e["name"] in failed]


ADOPT_IGNORES = ("job", "checkpoint")
"""Config sections that may differ between an adopted run and the planned point: where and how often a run saves
changes none of its numbers (a tile study adopts its cpu suite's whole-axis points, which keep more checkpoints)."""


ANATOMY_FILES = ("anatomy.md", "anatomy.json")  # what scripts/anatomy.py writes into a run folder, if it was run


def adopt_points(sweep_dir: Path, manifest: dict[str, Any], source: Path, schemes: tuple[str, ...],
                 scale: str, as_evaluated: bool = False) -> tuple[list[str], list[str]]:
    """Takes over the finished, evaluated points of an earlier run from its report folder (``source/runs/<point>/``,
    written on this or another machine), so a suite too long for one machine's session can be finished in parts,
    and a study can take the points it shares with another suite. A planned point that is unfinished here takes
    the run of the same name, else any run of ``source`` with the same config, when that run's recorded config
    equals the planned one (:data:`ADOPT_IGNORES` aside), its ``metrics.jsonl`` holds the whole run and its
    evaluation report covers every scheme with this scale's evaluation settings. Its logs and evaluation report
    (with the hidden-state picture, where the report kept one) are copied into the run folder, whose
    ``sweep_state.json`` keeps the original record plus ``adopted_from``. An adopted point has no checkpoint: it
    is neither trained nor evaluated again.

    ``as_evaluated``: re-rendering a report from its own runs: a point's evaluation report is taken as it was made
    (schemes added to the suite since then print as missing; other evaluation settings are kept), only its config
    and its finished run are checked.

    Returns (adopted point names, one line per run of the same name that was not adopted, saying why)."""
    from outlier_titan.study.plan import _config_diff, _defaults, _optimizer_owners
    from outlier_titan.study.runner import is_finished, read_state, run_is_complete, write_state

    runs = Path(source) / "runs"
    if not runs.is_dir():
        raise UserError(f"--adopt {source}: no runs/ folder there; name a report folder written by "
                        f"scripts/reproduce.py (it holds runs/<point>/ with each point's logs)")
    configs = {d.name: (d / "config.toml").read_text() for d in sorted(runs.iterdir()) if (d / "config.toml").is_file()}
    defaults, owners = _defaults(), _optimizer_owners()
    want = EVAL_ARGS[scale]
    adopted, refused, taken = [], [], set()

    def why_not(name: str, e: dict[str, Any]) -> str:
        src, steps = runs / name, e["steps"]
        if name not in configs:
            return "no config.toml"
        if diff := _config_diff(configs[name], e["config"], defaults, owners, ADOPT_IGNORES):
            return "its config differs from the suite's: " + "; ".join(diff)
        if read_state(src).get("status") != "done" or not run_is_complete(src / "metrics.jsonl", e):
            return "its run did not finish"
        if not _evaluated(src / f"step-{steps}.json", () if as_evaluated else schemes):
            return f"its evaluation report step-{steps}.json is missing or lacks a scheme of the suite"
        if as_evaluated:
            return ""
        ev = json.loads((src / f"step-{steps}.json").read_text())
        cal = ev.get("calibration", {})
        if (ev.get("tokens_requested"), cal.get("batches"), cal.get("seeds")) != \
                (want["tokens"], want["calib_batches"], want["calib_seeds"]):
            return (f"it was evaluated on {ev.get('tokens_requested')} tokens with {cal.get('batches')} calibration "
                    f"batches x {cal.get('seeds')} seeds, this scale evaluates {want['tokens']} with "
                    f"{want['calib_batches']} x {want['calib_seeds']}")
        return ""

    for e in manifest["points"]:
        folder = point_dir(sweep_dir, e["name"])
        if is_finished(folder, e):
            continue
        name = None
        if e["name"] in configs:
            if why := why_not(e["name"], e):
                refused.append(f"{e['name']}: {why}")
            else:
                name = e["name"]
        if name is None:  # a run of another name with this config (another suite's shared point)
            name = next((n for n in configs if n != e["name"] and n not in taken and not why_not(n, e)), None)
        if name is None:
            continue
        src, steps = runs / name, e["steps"]
        taken.add(name)
        (folder / "eval").mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "config.toml"):
            shutil.copy2(src / f, folder / f)
        for f in ANATOMY_FILES:  # only where scripts/anatomy.py was run
            if (src / f).is_file():
                shutil.copy2(src / f, folder / f)
        shutil.copy2(src / f"step-{steps}.json", folder / "eval" / f"step-{steps}.json")
        picture = Path(source) / "figures" / f"hidden_{name}.png"
        if picture.is_file():
            shutil.copy2(picture, folder / "eval" / f"step-{steps}.hidden_magnitude.png")
        state = read_state(src)  # a point the source had adopted itself keeps its first origin
        write_state(folder, {"adopted_from": str(source), "adopted_point": name, **state})
        adopted.append(e["name"] if name == e["name"] else f"{e['name']} (= {name})")
    return adopted, refused


def _evaluated(report: Path, schemes: tuple[str, ...]) -> bool:
    """Whether an evaluation report exists and covers every scheme (one from an older suite file that lacked some
    is run again, whole: its numbers then come from one evaluation)."""
    if not report.is_file():
        return False
    try:
        done = {e.get("scheme") for e in json.loads(report.read_text()).get("schemes", [])}
    except (json.JSONDecodeError, AttributeError):
        return False
    return set(schemes) <= done


# ------------------------------------------------------------------------------------------------ numbers

def _eval_report(folder: Path, steps: int) -> dict[str, Any] | None:
    path = folder / "eval" / f"step-{steps}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def tokens_to_reach(records: dict[int, dict], tokens_per_step: int, target: float) -> float | None:
    """Tokens at which the validation loss first reaches ``target`` (linear between evaluations), or None."""
    prev = None
    for step in sorted(records):
        v = num(records[step].get("val_loss"))
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
        r["ppl"] = num((rep or {}).get("full_precision", {}).get("ppl"))
        r["first_share"] = r.get("final_first_token_argmax_share")
        for m in ("kurtosis_first", "kurtosis_rest", "max_abs_first", "max_abs_rest", "kurtosis_neuron_rms",
                  "sink_rate", "sink_rate_pooled", "massive_ratio", "value_drain"):
            r[m] = r.get(f"final_{m}")
        r["d_int4"] = r.get("ptq_delta_ppl_int4_zeropoint")
        r["d_int8_coarse"] = r.get("ptq_delta_ppl_int8_coarse")
        r["d_w8a8"] = r.get("ptq_delta_ppl_w8a8_static")
        r["tokens_per_step"] = e["tokens"] // e["steps"]
    if suite == "park2025":
        ours_park(rows)
    if suite == "franke2025":
        for r in rows:
            r["speedup"] = r["step_time_ratio"] = r["tokens_to_target"] = None
        for r in rows:
            base = select(rows, {"model.name": "pre_ln", "seed": r.get("seed")})  # the same seed's GPT+
            if base and base.get("final_val_loss") is not None:
                recs = read_metrics(point_dir(sweep_dir, r["point"]) / "metrics.jsonl")
                t = tokens_to_reach(recs, r["tokens_per_step"], base["final_val_loss"])
                r["tokens_to_target"] = t
                r["speedup"] = base["tokens"] / t if t else None
                if r.get("tokens_per_s") and base.get("tokens_per_s"):
                    r["step_time_ratio"] = base["tokens_per_s"] / r["tokens_per_s"]


# ------------------------------------------------------------------------------------------------ figures

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
            worst = f"{fmt(w[0])} ({w[1]}, {w[2]})" if w else "—"
            cells.append(f"{fmt(series[-1] if series else None)} / {fmt(max(series) if series else None)} / "
                         f"{worst}")
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
            cells.append(f"{step}: {fmt(worst['max_abs'])} ({block}), {fmt(large)}")
        table.append(f"| [{r['point']}](runs/{r['point']}/anatomy.md) | {a['factor']:g} | {'; '.join(cells)} |")
    if not table:
        return []
    return ["## Where the large activations sit (`scripts/anatomy.py`)", "",
            "Per checkpoint the run kept, on the same validation sequences: the residual stream's largest |x| (the "
            "block holding it) and the most large entries per sequence in any block (large: above the factor times "
            "the sequence's median |x| at that block, Sun et al. 2024). The tokens, positions and channels that carry "
            "them are in each point's `anatomy.md`.", "",
            "| point | factor | step: max \\|x\\| (block), large entries per sequence |", "|---|---|---|", *table, ""]


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
    # (a point not run here keeps the copy an earlier run left, which --adopt can take over; one that ran here
    # replaces its copy whole, so no file of an earlier run of it lingers)
    for r in rows:
        src = point_dir(sweep_dir, r["point"])
        dst = out / "runs" / r["point"]
        if not (src / "metrics.jsonl").is_file():
            continue
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "config.toml", "sweep_state.json", *ANATOMY_FILES):
            if (src / f).is_file():
                shutil.copy2(src / f, dst / f)
        for f in (src / "eval").glob("step-*.json") if (src / "eval").is_dir() else []:
            shutil.copy2(f, dst / f.name)
    figs = trajectory_figures(sweep_dir, rows, info, fig_dir, manifest["axes"])
    groups = aggregate(rows, manifest["axes"])
    seeds = sorted({s for g in groups for s in g["seeds"] if s is not None})
    done = sum(len(g["points"]) for g in groups)
    runs, scale_phrase = facts.header(sweep_dir, manifest, rows, seeds, lr_choice(suite, scale, manifest), out)
    lines = [f"# {info.title} — {scale} scale", "",
             f"Paper: {info.citation}. Suite file: `train_configs/suites/{suite}/{scale}.toml`; sweep folder: "
             f"`{sweep_dir}`. Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by "
             f"`python scripts/reproduce.py --suite {suite} --scale {scale}` at code {code_version()}.", "",
             f"{done} of {len(rows)} points finished: {len(groups)} settings × training seeds {seeds}. Every number "
             f"of ours is the mean ± sd over the finished points' seeds (per-seed values in the appendix); "
             f"verdicts are decided from t-based 95 % intervals over the seeds by one rule set (below), and the test "
             f"is named beside each. Our numbers come from `results.csv` (collected from the run folders; copies of "
             f"each point's `metrics.jsonl` and evaluation report are under `runs/`). Every verdict holds {scale_phrase}: "
             f"the papers' models are far larger and trained far longer than ours, so the comparison is of "
             f"directions and ratios, not of values.", ""] + runs
    lines += tile_grid_section(manifest)
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
                  "trigger token needs attention and every window starts with BOS, not on text; what they show is "
                  "the mechanism at small scale, beside (not instead of) the cpu scale's runs on Python source.",
                  ""]
    if scale == "tiles" and info.tile_study:
        lines += tile_study_section(groups, info, fig_dir, scale_phrase)
    if scale == "lr":
        lines += lr_search.section(lr_search.choose(rows, manifest["axes"], info.kurtosis), out)
    if eval_failed:
        lines += [f"Evaluation failed for: {', '.join(eval_failed)} (see `<point>/eval.log`).", ""]
    if suite == "sinks2025":
        lines += ["## Summary: each remedy against the softmax baseline of its optimizer", "",
                  "Each cell: mean ± sd over seeds at the last probe step, and in brackets the verdict below in "
                  "short (removed: the t-interval over seeds lies at or below 0.05, and the val loss costs at "
                  "most 2 %, else the loss cost is named; kept: the interval lies wholly above 0.05; no baseline "
                  "sink: that optimizer's softmax interval does not lie above 0.05). Sink^0.3 is Gu et al. 2024's "
                  "(per sequence, then averaged); pooled Sink^0.3 is the form the probe logged until 2026-11-28 "
                  "(averaged over sequences before the threshold), the only one runs of that time have.", ""]
        lines += sinks_table(groups) + [""]
    claims = [] if scale == "lr" else CLAIMS[suite](groups)  # a search decides learning rates, not claims
    lines += ["## Verdicts", "", RULES_TEXT if claims else "None at this scale: it chooses learning rates.", ""]
    for text, verdict, detail in claims:
        lines.append(f"- **{verdict}** {scale_phrase} — {text}: {detail}.")
    if claims:
        lines += ["", stats.chance_calls([v for _, v, _ in claims]), "",
                  "Thresholds and where they come from:", "", *sources(THRESHOLDS[suite])]
    lines += ["", "## The paper's numbers beside ours", "",
              "Each row: the paper's setting, then `paper / ours` per metric (ours: mean ± sd over seeds of the "
              "setting with those axes; — where a side has no number).", ""]
    headers = list(info.metrics.values())
    lines.append("| paper row | source | our point | " + " | ".join(headers) + " |")
    lines.append("|---|---|---|" + "---|" * len(headers))
    for pr in info.rows:
        r = select(groups, pr.select)
        cells = [f"{fmt(pr.paper.get(m))} / {fmt(r.get(m) if r else None)}" for m in info.metrics]
        lines.append(f"| {pr.label} | {pr.source} | {r['point'] if r else 'not in this suite'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Ours: PPL is `scripts/evaluate.py`'s full-precision perplexity; probe metrics are the last "
              "probe step of training (mean over blocks); Δppl are `scripts/evaluate.py`'s schemes.", ""]
    lines += ptq_table(groups, info, rows)
    lines += ["",
              "## Trajectories", ""]
    for p in figs:
        lines.append(f"![{p.stem}](figures/{p.name})")
    lines += ["", "## Hidden-state magnitudes (evaluation probe, first token vs the rest)", ""]
    first_seed = [r for r in rows if r.get("seed") == (seeds[0] if seeds else None)] or rows
    compared = [r for r in first_seed if any(matches(r, pr.select) for pr in info.rows)] or first_seed
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
    lines += [""] + anatomy_section(out, rows)
    lines += ["## Appendix: every point, every seed (settings → final and peak metrics)", "",
              (out / "results.md").read_text().rstrip(), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


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
    base = select(groups, base_sel)
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
        lines.append(f"| {name} | " + " | ".join(fmt(g.get(m)) for m in metrics) + " |")
    fig, axs = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.2))
    xs = list(range(len(remedies)))
    for ax, m in zip(axs, metrics):
        ests = [get(g, m) for g in remedies]
        pts = [(x, e) for x, e in zip(xs, ests) if e is not None]
        if pts:
            ax.errorbar([x for x, _ in pts], [e.mean for _, e in pts], yerr=[e.sd or 0 for _, e in pts],
                        marker="o", capsize=3, label="remedy")
        b = get(base, m)
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
            cells.append(fmt(d) + (f" (calib. sd {c.mean:.2g})" if isinstance(c, Estimate) else ""))
        body.append(f"| {g['point']} | {fmt(g.get('ppl'))} | " + " | ".join(cells) + " |")
    rotations: dict[str, list[str]] = {}
    for g in groups:
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


def manifest_steps(manifest: dict[str, Any], name: str) -> int:
    return next(e["steps"] for e in manifest["points"] if e["name"] == name)


def build_report(suite: str, scale: str, sweep_dir: Path, out: Path, parallel: int = 1) -> Path:
    """Evaluates the finished points that lack a report (``parallel`` at a time), collects, and writes the
    report."""
    from outlier_titan.study.plan import read_manifest
    from outlier_titan.study.results import collect, write_tables

    manifest = read_manifest(sweep_dir)
    failed = evaluate_points(sweep_dir, manifest, SUITE_INFO[suite], scale, parallel)
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
            fixed = [i for i, ln in enumerate(lines) if ln.strip() == "[fixed]"]
            if any(re.match(r'^\s*"?data\.tokenizer"?\s*=', ln) for ln in lines):
                raise UserError(f"{path} sets data.tokenizer itself; drop --tokenizer")
            if fixed:  # into the file's own [fixed] table
                lines.insert(fixed[0] + 1, f'"data.tokenizer" = "{tokenizer}"')
            else:
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
