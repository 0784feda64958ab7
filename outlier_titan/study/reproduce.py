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
import math
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from outlier_titan.errors import UserError
from outlier_titan.observe.logger import read_metrics
from outlier_titan.packaged import configs_dir
from outlier_titan.provenance import code_version
from outlier_titan.study import stats
from outlier_titan.study.papers import SUITE_INFO, SuiteInfo
from outlier_titan.study.plan import point_dir
from outlier_titan.study.stats import Estimate, estimate

SUITES = tuple(SUITE_INFO)
SCALES = ("smoke", "cpu", "search", "synthetic", "tiles", "gpu")
"""``search``: the calibration search of the cpu scale (issue 10), where a suite has one: the seeds' levers on
the cpu recipe, evaluated and reported like a suite, so the settings tried and the peaks they gave are kept.
``synthetic``: the suite's grid on the synthetic Bigram-Backcopy task (``data.source = "bigram_backcopy"``), where
a suite has one: a small-scale testbed for the attention sink, which natural text at cpu scale does not make.
``tiles``: the tile-size study, where a suite has one: the cpu recipe's baseline and remedy with the remedy's
rotation over whole axes and in shard-local tiles of 128, 64 and 32, reported against the tile edge."""
OPTIONAL_SCALES = {"search": "calibration search", "synthetic": "synthetic-task suite", "tiles": "tile-size study"}
# scripts/evaluate.py settings per scale: validation tokens, sequences per pass, calibration batches and seeds
EVAL_ARGS = {"smoke": dict(tokens=512, batch_size=4, calib_batches=1, calib_seeds=1),
             # 16 calibration batches (16k tokens): at 4, a W8A8 point's three calibration seeds spread 77-225 PPL
             "cpu": dict(tokens=65536, batch_size=8, calib_batches=16, calib_seeds=3),
             "gpu": dict(tokens=1_048_576, batch_size=16, calib_batches=4, calib_seeds=3)}
EVAL_ARGS["search"] = EVAL_ARGS["synthetic"] = EVAL_ARGS["tiles"] = EVAL_ARGS["cpu"]  # judged like the cpu scale


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


# ------------------------------------------------------------------------------------------------ running

def evaluate_points(sweep_dir: Path, manifest: dict[str, Any], info: SuiteInfo, scale: str,
                    parallel: int = 1) -> list[str]:
    """Runs ``scripts/evaluate.py`` on the final checkpoint of every finished point without its report, ``parallel``
    at a time (the CPU threads shared out as for the sweep's trainers); returns the names of points whose
    evaluation failed (their log is ``<point>/eval.log``)."""
    import time

    from outlier_titan.study.runner import is_finished, trainer_environment

    a = EVAL_ARGS[scale]
    todo = []
    for e in manifest["points"]:
        folder = point_dir(sweep_dir, e["name"])
        if not is_finished(folder, e) or _evaluated(folder / "eval" / f"step-{e['steps']}.json", info.all_schemes):
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
                 scale: str) -> tuple[list[str], list[str]]:
    """Takes over the finished, evaluated points of an earlier run from its report folder (``source/runs/<point>/``,
    written on this or another machine), so a suite too long for one machine's session can be finished in parts,
    and a study can take the points it shares with another suite. A planned point that is unfinished here takes
    the run of the same name, else any run of ``source`` with the same config, when that run's recorded config
    equals the planned one (:data:`ADOPT_IGNORES` aside), its ``metrics.jsonl`` holds the whole run and its
    evaluation report covers every scheme with this scale's evaluation settings. Its logs and evaluation report
    (with the hidden-state picture, where the report kept one) are copied into the run folder, whose
    ``sweep_state.json`` keeps the original record plus ``adopted_from``. An adopted point has no checkpoint: it
    is neither trained nor evaluated again.

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
        if not _evaluated(src / f"step-{steps}.json", schemes):
            return f"its evaluation report step-{steps}.json is missing or lacks a scheme of the suite"
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
        write_state(folder, {**read_state(src), "adopted_from": str(source), "adopted_point": name})
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


def finished(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of finished points (``status`` done; a row without a status, e.g. a test table, counts as done):
    a point still running or interrupted counts in no number, sentence or seed list of a report."""
    return [r for r in rows if r.get("status", "done") == "done"]


def aggregate(rows: list[dict[str, Any]], axes: list[str]) -> list[dict[str, Any]]:
    """One group per setting (the axes without ``seed``), in manifest order: its axis values, ``points`` and
    ``seeds`` (lists, in seed order), and every numeric metric of its rows as an :class:`Estimate` over seeds.
    A point not finished (``status`` other than ``done``: still running, interrupted) is left out, so that an
    in-progress report never averages a partial run."""
    keys = [a for a in axes if a != "seed"]
    groups: dict[tuple, dict[str, Any]] = {}
    rows = finished(rows)
    for r in sorted(rows, key=lambda r: (r.get("seed") is None, r.get("seed") or 0)):
        g = groups.setdefault(tuple(repr(r.get(a)) for a in keys),
                              {**{a: r.get(a) for a in keys}, "points": [], "seeds": [], "_rows": []})
        g["points"].append(r["point"])
        g["seeds"].append(r.get("seed"))
        g["_rows"].append(r)
    order = {r["point"]: i for i, r in enumerate(rows)}
    out = []
    for g in sorted(groups.values(), key=lambda g: min(order[p] for p in g["points"])):
        members = g.pop("_rows")
        metrics = {k for r in members for k, v in r.items() if _num(v) is not None and k not in keys
                   and k not in ("seed", "point", "status")}
        for k in sorted(metrics):
            g[k] = estimate(_num(r.get(k)) for r in members)
        g["point"] = g["points"][0].rsplit("_s", 1)[0] if len(g["points"]) > 1 else g["points"][0]
        out.append(g)
    return out


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
    """How every number appears in the report (the test parses the same format): mean ± sd over seeds for an
    :class:`Estimate`."""
    if v is None:
        return "—"
    if isinstance(v, Estimate):
        return v.text()
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


# ------------------------------------------------------------------------------------------------ verdicts

Claim = tuple[str, str, str]
"""(the claim, its verdict (one of :data:`stats.VERDICTS`), the numbers and the test that decided it)."""

PTQ_FLOOR = 0.01
"""A baseline's quantisation damage counts as an effect when its Δppl interval lies above 1 % of its PPL; below
that the remedy's claim cannot be tested at this scale (a ratio of two noises)."""


def _get(group: dict[str, Any] | None, key: str) -> Estimate | None:
    v = (group or {}).get(key)
    return v if isinstance(v, Estimate) else None


def _paired_relative(a: dict[str, Any], b: dict[str, Any], key: str) -> Estimate | None:
    """(b − a) / a per seed that both groups ran (same seed: same initialisation and data order)."""
    ea, eb = _get(a, key), _get(b, key)
    if ea is None or eb is None or a["seeds"] != b["seeds"] or ea.n != len(a["seeds"]) or eb.n != len(b["seeds"]):
        return None
    return estimate((y - x) / x for x, y in zip(ea.values, eb.values))


def _ptq_claim(text: str, base: dict | None, rem: dict | None, key: str, k: float) -> Claim:
    """``Δppl(remedy) < Δppl(baseline) / k``, testable only where the baseline's Δppl shows an effect."""
    b, r, ppl = _get(base, key), _get(rem, key), _get(base, "ppl")
    if b is None or r is None or ppl is None:
        return text, stats.MISSING, "an evaluation report is missing"
    if not stats.effect_present(b, PTQ_FLOOR * ppl.mean):
        return text, stats.UNTESTABLE, (f"the baseline's Δppl {b.text()} on PPL {ppl.text()} is not above "
                                        f"{PTQ_FLOOR:.0%} of its PPL (t-interval over seeds): no quantisation "
                                        f"damage for the remedy to remove")
    return (text, *stats.ratio_verdict(b, r, k))


def claims_kaul(groups: list[dict[str, Any]]) -> list[Claim]:
    base = select(groups, {"optimizer.name": "adam", "model.softmax": "softmax", "model.norm": "layernorm"})
    s1 = select(groups, {"optimizer.name": "adam", "model.softmax": "softmax1", "model.norm": "layernorm"})
    rem = select(groups, {"optimizer.name": "orthoadam", "model.softmax": "softmax1", "model.norm": "rmsnorm_single"})
    out: list[Claim] = []
    text = "first-token argmax share: baseline (Adam, softmax, LayerNorm) ≥ 0.3 and softmax-1 ≤ 0.05"
    sink = stats.threshold_verdict(_get(base, "first_share"), 0.3, above=True)
    if sink[0] == stats.NOT_REPRODUCED:
        out.append((text, stats.UNTESTABLE, f"the baseline forms no sink: {sink[1]}"))
    else:
        gone = stats.threshold_verdict(_get(s1, "first_share"), 0.05, above=False)
        out.append((text, stats.combine(sink, gone), f"baseline {sink[1]}; softmax-1 {gone[1]}"))
    text = ("kurtosis (other tokens, final): baseline ≥ 5× that of OrthoAdam + softmax-1 + RMSNorm-S at a "
            "validation loss within 2%")
    kurt = stats.ratio_verdict(_get(base, "kurtosis_rest"), _get(rem, "kurtosis_rest"), 5)
    dloss = _paired_relative(base, rem, "final_val_loss") if base and rem else None
    if dloss is None:
        loss = (stats.MISSING, "the val losses of both points at the same seeds are missing")
    else:
        iv = stats.interval(dloss)
        lo, hi = iv if iv else (dloss.mean, dloss.mean)
        v = (stats.REPRODUCED if -0.02 <= lo and hi <= 0.02 else
             stats.NOT_REPRODUCED if lo > 0.02 or hi < -0.02 else stats.INCONCLUSIVE)
        loss = (v, f"val loss change {dloss.mean:+.2%} ± {(dloss.sd or 0):.2%}"
                   + (f", 95% interval [{lo:+.2%}, {hi:+.2%}]" if iv else "") + " (paired by seed, t)")
    out.append((text, stats.combine(kurt, loss), f"{kurt[1]}; {loss[1]}"))
    out.append(_ptq_claim("int4 zero-point Δppl of the remedy below a third of the baseline's", base, rem,
                          "d_int4", 3))
    return out


def claims_he(groups: list[dict[str, Any]]) -> list[Claim]:
    base = select(groups, {"model.block": "pre_ln", "optimizer.name": "adamw"})
    rem = select(groups, {"model.block": "op", "optimizer.name": "soap"})
    text = "peak neuron-RMS kurtosis: Pre-LN + AdamW ≥ 5× that of OP + SOAP"
    out: list[Claim] = [(text, *stats.ratio_verdict(_get(base, "peak_kurtosis_neuron_rms"),
                                                    _get(rem, "peak_kurtosis_neuron_rms"), 5))]
    out.append(_ptq_claim("W8A8 Δppl of OP + SOAP below a third of Pre-LN + AdamW's", base, rem, "d_w8a8", 3))
    return out


def claims_franke(groups: list[dict[str, Any]]) -> list[Claim]:
    """A seed whose anGPT never reaches GPT+'s final loss has a speed-up below 1 of unknown size: it enters the
    interval as 1.0, an upper bound, so it can only favour the claim; a "reproduced" is then withheld."""
    an = select(groups, {"model.name": "angpt"})
    text = "anGPT reaches GPT+'s final validation loss with fewer tokens (speed-up > 1, per seed against GPT+)"
    sp, finished = _get(an, "speedup"), _get(an, "final_val_loss")
    if an is not None and sp is None and finished is not None:
        return [(text, stats.NOT_REPRODUCED, "anGPT never reached GPT+'s final val loss at any seed")]
    never = (finished.n - sp.n) if sp is not None and finished is not None else 0
    if not never:
        return [(text, *stats.threshold_verdict(sp, 1.0, above=True))]
    verdict, detail = stats.threshold_verdict(Estimate(sp.values + (1.0,) * never), 1.0, above=True)
    if verdict == stats.REPRODUCED:
        verdict = stats.INCONCLUSIVE
    return [(text, verdict, f"{detail}; {never} of {finished.n} seeds never reached GPT+'s final val loss (a "
                            "speed-up below 1 there, counted as 1, an upper bound)")]


SINK_METRICS = (("sink_rate", "Sink^0.3"), ("first_share", "first-token argmax share"))
"""The two sink measures a remedy is judged on: the attention sink (Gu et al. 2024's share of heads whose mean
weight on the first key exceeds 0.3) and the share of (query, head) pairs whose most-attended key is the first
token (Kaul et al. 2024's %First)."""
SINK_REMOVED = 0.05
"""A remedy removes a sink when the t-interval over seeds of its measure lies at or below this; the baseline has
one to remove when its interval lies wholly above it."""


def _sink_claim(variant: str, opt: Any, base: dict[str, Any] | None, g: dict[str, Any], key: str,
                label: str) -> Claim:
    """One remedy, one optimizer, one sink measure: removed (interval ≤ :data:`SINK_REMOVED`), kept (interval
    above it) or inside the noise; untestable where that optimizer's softmax baseline shows no sink."""
    with_opt = f" with {opt}" if opt is not None else ""
    text = f"{variant}{with_opt} removes the {label} sink of softmax{with_opt} ({label} ≤ {SINK_REMOVED:g})"
    b, r = _get(base, key), _get(g, key)
    if b is None or r is None:
        return text, stats.MISSING, "a point or its probe metric is missing"
    diff = (estimate(y - x for x, y in zip(b.values, r.values))
            if base["seeds"] == g["seeds"] and b.n == r.n == len(g["seeds"]) else None)
    dloss = _paired_relative(base, g, "final_val_loss")
    extra = ((f"; change vs the baseline {diff.text()} (paired by seed)" if diff else "")
             + (f"; val loss change {dloss.mean:+.2%} ± {(dloss.sd or 0):.2%} (relative, paired by seed)"
                if dloss else ""))
    if not stats.effect_present(b, SINK_REMOVED):
        return text, stats.UNTESTABLE, (f"the baseline forms no sink at this scale ({label} {b.text()}, t-interval "
                                        f"not above {SINK_REMOVED:g}); {variant} {r.text()}{extra}")
    v, d = stats.threshold_verdict(r, SINK_REMOVED, above=False)
    return text, v, f"baseline {b.text()}; {variant} {d}{extra}"


def _sink_claims(groups: list[dict[str, Any]]) -> dict[tuple[Any, Any, str], Claim]:
    """Every remedy's claim per sink measure and optimizer, keyed ``(variant, optimizer, measure key)``, in report
    order (measure, then the groups' order)."""
    out: dict[tuple[Any, Any, str], Claim] = {}
    for key, label in SINK_METRICS:
        for g in groups:
            variant, opt = g.get("model.attention"), g.get("optimizer.name")
            if variant != "softmax":
                base = select(groups, {"model.attention": "softmax", "optimizer.name": opt})
                out[variant, opt, key] = _sink_claim(variant, opt, base, g, key, label)
    return out


def claims_sinks(groups: list[dict[str, Any]]) -> list[Claim]:
    """Per remedy, per optimizer (where the suite varies ``optimizer.name``) and per sink measure
    (:data:`SINK_METRICS`): whether it removes the sink of the softmax baseline trained with the same optimizer,
    with the change against that baseline and the validation-loss cost, both paired by seed."""
    return list(_sink_claims(groups).values())


def sinks_table(groups: list[dict[str, Any]]) -> list[str]:
    """Markdown: one row per attention variant and optimizer, each sink measure (mean ± sd over seeds) with its
    verdict from :func:`claims_sinks` in short form, and the validation loss with its change against that
    optimizer's softmax baseline (relative, paired by seed)."""
    short = {stats.REPRODUCED: "removed", stats.NOT_REPRODUCED: "kept", stats.INCONCLUSIVE: "inside the noise",
             stats.UNTESTABLE: "no baseline sink", stats.MISSING: "missing"}
    verdicts = {k: short[c[1]] for k, c in _sink_claims(groups).items()}
    head = ["| attention | optimizer | " + " | ".join(label for _, label in SINK_METRICS)
            + " | val loss | val loss change vs softmax |", "|---|---|" + "---|" * (len(SINK_METRICS) + 2)]
    body = []
    for g in groups:
        variant, opt = g.get("model.attention"), g.get("optimizer.name")
        base = select(groups, {"model.attention": "softmax", "optimizer.name": opt})
        cells = [fmt(_get(g, key)) + (" (baseline)" if variant == "softmax" else f" ({verdicts[variant, opt, key]})")
                 for key, _ in SINK_METRICS]
        d = _paired_relative(base, g, "final_val_loss") if base and variant != "softmax" else None
        change = f"{d.mean:+.2%} ± {(d.sd or 0):.2%}" if d else "—"
        body.append(f"| {variant} | {opt if opt is not None else '—'} | " + " | ".join(cells)
                    + f" | {fmt(_get(g, 'final_val_loss'))} | {change} |")
    return head + body


# --- park2025 (Outlier-Safe Pre-Training, Park et al. 2025) ---

PARK_KURTOSIS_FLOOR = 1.0
"""The OSP script's excess kurtosis of a point counts as an outlier effect when its t-interval lies above 1 (a
Gaussian token gives 0; one dominant channel of D gives about D - 3); below that a ratio compares noise."""
PARK_K = 5.0
"""Every kurtosis claim asks for a factor of 5 (the paper's factors are far larger: Adam / OSP 1818.56 / 0.04,
Muon / Muon + SSNorm 1575.12 / 66.69, Muon + SSNorm / OSP 66.69 / 0.04)."""
PARK_LOSS_TOL = 0.02


def ours_park(rows: list[dict[str, Any]]) -> None:
    """park2025's own columns (in place): the OSP script's excess kurtosis of the evaluation, and per 4-bit scheme
    its Δppl and quantised PPL (the paper prints the quantised PPL)."""
    for r in rows:
        r["osp_kurtosis"] = r.get("eval_osp_kurtosis")
        for scheme in ("w4a4kv4_rtn", "w4a4kv4_rtn_hadamard"):
            d = r.get(f"ptq_delta_ppl_{scheme}")
            r[f"d_{scheme}"] = d
            r[f"ppl_{scheme}"] = r["ppl"] + d if d is not None and r.get("ppl") is not None else None


def _park_ratio_claim(text: str, a: dict | None, b: dict | None, key: str, floor: float, what: str) -> Claim:
    """``key(a) ≥ PARK_K × key(b)``; cannot be tested where ``a`` itself shows no effect (its interval not above
    ``floor``)."""
    ea, eb = _get(a, key), _get(b, key)
    if ea is None or eb is None:
        return text, stats.MISSING, "a point or its metric is missing"
    if not stats.effect_present(ea, floor):
        return text, stats.UNTESTABLE, (f"{what} {ea.text()} is not above {floor:g} (t-interval over seeds): no "
                                        f"outliers for the remedy to remove; the remedy's {eb.text()}")
    return (text, *stats.ratio_verdict(ea, eb, PARK_K))


def _park_loss_claim(text: str, base: dict | None, other: dict | None) -> Claim:
    """``other`` costs at most PARK_LOSS_TOL of ``base``'s final validation loss (one-sided: the claims are "without
    sacrificing performance" and "keeps full Muon's loss"; a lower loss holds them): the relative change, paired by
    seed, with its t-interval; reproduced when the interval lies below +PARK_LOSS_TOL, not reproduced when it lies
    wholly above."""
    d = _paired_relative(base, other, "final_val_loss") if base and other else None
    if d is None:
        return text, stats.MISSING, "the val losses of both points at the same seeds are missing"
    iv = stats.interval(d)
    detail = f"val loss change {d.mean:+.2%} ± {(d.sd or 0):.2%}"
    if iv is None:
        return text, stats.INCONCLUSIVE, detail + " (one seed: no interval)"
    lo, hi = iv
    detail += f", 95% interval [{lo:+.2%}, {hi:+.2%}] (paired by seed, t), needed ≤ {PARK_LOSS_TOL:+.0%}"
    v = stats.REPRODUCED if hi <= PARK_LOSS_TOL else stats.NOT_REPRODUCED if lo > PARK_LOSS_TOL else stats.INCONCLUSIVE
    return text, v, detail


def claims_park2025(groups: list[dict[str, Any]]) -> list[Claim]:
    """Park et al. 2025's claims on the suite's settings (selected by ``job.name``): the OSP recipe removes the
    kurtosis Adam grows (both measures), SSNorm and EmbProj each take a step of it, its 4-bit damage is small
    against Adam's, at Adam's loss; and MuonBP's claim that block steps with periodic full ones keep full Muon's
    loss (Khaled et al. 2025)."""
    g = {name: select(groups, {"job.name": name}) for name in ("adam", "muon", "muon_ssnorm", "osp",
                                                                 "osp_block_periodic")}
    k = f"{PARK_K:g}"
    out = [
        _park_ratio_claim(f"excess kurtosis (OSP script): Adam ≥ {k}× the OSP recipe's (Muon + SSNorm + EmbProj)",
                          g["adam"], g["osp"], "osp_kurtosis", PARK_KURTOSIS_FLOOR, "Adam's excess kurtosis"),
        _park_ratio_claim(f"neuron-RMS kurtosis (final): Adam ≥ {k}× the OSP recipe's", g["adam"], g["osp"],
                          "kurtosis_neuron_rms", PARK_K, "Adam's neuron-RMS kurtosis (≥ 1 by definition)"),
        _park_ratio_claim(f"SSNorm's step (OSP script's kurtosis): Muon ≥ {k}× Muon + SSNorm", g["muon"],
                          g["muon_ssnorm"], "osp_kurtosis", PARK_KURTOSIS_FLOOR, "Muon's excess kurtosis"),
        _park_ratio_claim(f"EmbProj's step (OSP script's kurtosis): Muon + SSNorm ≥ {k}× Muon + SSNorm + EmbProj",
                          g["muon_ssnorm"], g["osp"], "osp_kurtosis", PARK_KURTOSIS_FLOOR,
                          "Muon + SSNorm's excess kurtosis"),
        _ptq_claim("W4A4KV4 RTN Δppl of the OSP recipe below a third of Adam's", g["adam"], g["osp"],
                   "d_w4a4kv4_rtn", 3),
        _ptq_claim("W4A4KV4 RTN + Hadamard (QuaRot) Δppl of the OSP recipe below a third of Adam's", g["adam"],
                   g["osp"], "d_w4a4kv4_rtn_hadamard", 3),
        _park_loss_claim(f"the OSP recipe's val loss at most {PARK_LOSS_TOL:.0%} above Adam's", g["adam"], g["osp"]),
        _park_loss_claim(f"MuonBP: block_periodic Muon's val loss at most {PARK_LOSS_TOL:.0%} above full Muon's (OSP "
                         f"recipe; Khaled et al. 2025)", g["osp"], g["osp_block_periodic"]),
    ]
    return out

# --- end park2025 ---


CLAIMS: dict[str, Callable[[list[dict[str, Any]]], list[Claim]]] = {  # on the groups of :func:`aggregate`
    "kaul2024": claims_kaul, "he2024": claims_he, "franke2025": claims_franke, "sinks2025": claims_sinks,
    "park2025": claims_park2025}


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
                per_seed = [{s: v for s in recs if (v := _num(recs[s].get(k))) is not None} for recs, _ in runs]
                steps = sorted(set.intersection(*(set(d) for d in per_seed))) if per_seed else []
                if not steps:
                    continue
                vals = np.array([[d[s] for s in steps] for d in per_seed])
                x = np.array(steps, dtype=float) * (runs[0][1] if xlabel == "tokens" else 1)
                ax.plot(x, vals.mean(0), style, color=colour, marker="." if len(steps) < 30 else None,
                        label=f"{name} ({len(runs)} seeds)" if style == "-" else None)
                if len(runs) > 1:
                    ax.fill_between(x, vals.min(0), vals.max(0), color=colour, alpha=0.15, linewidth=0)
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
            if m and _num(v) is not None and (best is None or v > best[0]):
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
            series = [v for v in (_num(recs[s].get(f"outliers/{m}")) for s in sorted(recs)) if v is not None]
            w = worst_layer_peaks(recs, m)
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


def trained_by(sweep_dir: Path, rows: list[dict[str, Any]]) -> str:
    """The report's sentence on the code that trained the finished points (``code`` of each ``sweep_state.json``;
    a point still running or interrupted is not counted)."""
    from outlier_titan.study.runner import read_state

    codes: dict[str, int] = {}
    adopted: dict[str, list[tuple[str, str]]] = {}  # report folder -> (our point, its name there)
    missing = several = 0
    for r in finished(rows):
        state = read_state(point_dir(sweep_dir, r["point"]))
        recorded = state.get("code", [])
        missing += not recorded
        several += len(set(recorded)) > 1
        for c in recorded:
            codes[c] = codes.get(c, 0) + 1
        if state.get("adopted_from"):
            adopted.setdefault(state["adopted_from"], []).append((r["point"], state.get("adopted_point", r["point"])))
    took = ""
    for src, pairs in adopted.items():
        renamed = [f"{ours} = {theirs}" for ours, theirs in pairs if ours != theirs]
        took += (f" {len(pairs)} point{'s were' if len(pairs) != 1 else ' was'} trained and evaluated by an earlier "
                 f"run and adopted from its report folder `{src}` (`--adopt`"
                 + (f"; under another name there: {', '.join(renamed)}" if renamed else "") + ").")
    if not codes:
        return "the code that trained the points is not recorded in their `sweep_state.json`." + took
    parts = [f"{c} ({n} point{'s' * (n != 1)})" for c, n in codes.items()]
    return ("points trained at code " + ", ".join(parts)
            + (f" ({several} point{'s' * (several != 1)} resumed at other code, counted under each)" if several else "")
            + (f"; {missing} point{'s' * (missing != 1)} without a record" if missing else "") + "." + took)


def evaluated_by(rows: list[dict[str, Any]]) -> str:
    """The report's sentence on the code that evaluated the finished points (``code`` of each evaluation report,
    carried as ``eval_code``), or "" when none was evaluated."""
    evaluated = [r for r in finished(rows) if "eval_code" in r]
    codes = Counter(r["eval_code"] for r in evaluated if r["eval_code"])
    missing = len(evaluated) - sum(codes.values())
    parts = [f"{c} ({n} point{'s' * (n != 1)})" for c, n in codes.items()]
    if missing:
        parts.append(f"not recorded for {missing} point{'s' * (missing != 1)} (evaluated before evaluation "
                     f"reports recorded their code, 2026-11-28)")
    return f" Evaluated at code {', '.join(parts)}." if parts else ""


def evaluation_updates(rows: list[dict[str, Any]]) -> str:
    """The report's sentence on schemes re-run into the points' evaluation reports after the evaluation
    (``scripts/evaluate.py --update``: the ``eval_updated`` stamps :func:`results.point_row` carries), or ""."""
    runs: dict[tuple, list[str]] = {}  # (schemes re-run together, code) -> the dates, one per point
    for r in rows:
        for u in r.get("eval_updated") or []:
            runs.setdefault((tuple(u["schemes"]), u.get("code")), []).append(u["at"][:10])
    parts = [f"{', '.join(schemes)} on {len(dates)} point{'s' * (len(dates) != 1)} "
             f"({min(dates)}{' to ' + max(dates) if max(dates) != min(dates) else ''}, "
             f"{'at code ' + code if code else 'code not recorded'})"
             for (schemes, code), dates in runs.items()]
    return (" Re-run into the evaluation reports afterwards (`scripts/evaluate.py --update`): "
            + "; ".join(parts) + ".") if parts else ""


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
    lines = [f"# {info.title} — {scale} scale", "",
             f"Paper: {info.citation}. Suite file: `train_configs/suites/{suite}/{scale}.toml`; sweep folder: "
             f"`{sweep_dir}`. Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by "
             f"`python scripts/reproduce.py --suite {suite} --scale {scale}` at code {code_version()}; "
             f"{trained_by(sweep_dir, rows)}{evaluated_by(rows)}{evaluation_updates(rows)}", "",
             f"{done} of {len(rows)} points finished: {len(groups)} settings × training seeds {seeds}. Every number "
             f"of ours is the mean ± sd over the finished points' seeds (per-seed values in the appendix); "
             f"verdicts are decided from intervals over the seeds, and the test is named beside each. Our numbers "
             f"come from `results.csv` (collected from the run folders; copies of each point's `metrics.jsonl` and "
             f"evaluation report are under `runs/`). The papers' models are far larger and trained far longer than "
             f"ours, so the comparison is of directions and ratios, not of values.", ""]
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
                  "trigger token needs attention and every window starts with BOS, not on natural text; what they "
                  "show is the mechanism at small scale, beside (not instead of) the cpu scale's natural-text runs.",
                  ""]
    if scale == "tiles" and info.tile_study:
        lines += tile_study_section(groups, info, fig_dir)
    if eval_failed:
        lines += [f"Evaluation failed for: {', '.join(eval_failed)} (see `<point>/eval.log`).", ""]
    if suite == "sinks2025":
        lines += ["## Summary: each remedy against the softmax baseline of its optimizer", "",
                  "Each cell: mean ± sd over seeds at the last probe step, and in brackets the verdict below in "
                  "short (removed: the t-interval over seeds lies at or below 0.05; kept: wholly above it; no "
                  "baseline sink: that optimizer's softmax interval does not lie above 0.05).", ""]
        lines += sinks_table(groups) + [""]
    lines += ["## Verdicts", ""]
    for text, verdict, detail in CLAIMS[suite](groups):
        lines.append(f"- **{verdict}** — {text}: {detail}.")
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


def tile_study_section(groups: list[dict[str, Any]], info: SuiteInfo, fig_dir: Path) -> list[str]:
    """The tile-size study: per tile edge of the remedy, the verdict of the suite's main claim against the baseline,
    a table of the study's metrics (mean ± sd over seeds) and ``figures/tile_study.png`` (metric vs tile edge, error
    bars one sd, the baseline as a band)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base_sel, rem_sel, claim_metric, k, metrics = info.tile_study
    base = select(groups, base_sel)
    remedies = sorted((g for g in groups if matches(g, rem_sel)),
                      key=lambda g: -(g["optimizer.tile_size"] or 10 ** 9))  # whole axes first, then shrinking
    label = lambda g: "whole" if not g["optimizer.tile_size"] else str(g["optimizer.tile_size"])  # noqa: E731
    lines = ["## Tile-size study", "",
             f"The remedy ({', '.join(f'{a}={v}' for a, v in rem_sel.items())}) with its rotation over whole axes "
             f"(the published method) and in shard-local tiles; the baseline is {base['point'] if base else '—'}. "
             f"Verdict per tile edge: the claim '{claim_metric} of the baseline ≥ {k:g}× the remedy's'.", ""]
    for g in remedies:
        v, d = stats.ratio_verdict(_get(base, claim_metric), _get(g, claim_metric), k)
        lines.append(f"- tile {label(g)}: **{v}** — {d}.")
    lines += ["", "| tile edge | " + " | ".join(metrics) + " |", "|---|" + "---|" * len(metrics)]
    for g in ([base] if base else []) + remedies:
        name = "baseline" if g is base else label(g)
        lines.append(f"| {name} | " + " | ".join(fmt(g.get(m)) for m in metrics) + " |")
    fig, axs = plt.subplots(1, len(metrics), figsize=(3.2 * len(metrics), 3.2))
    xs = list(range(len(remedies)))
    for ax, m in zip(axs, metrics):
        ests = [_get(g, m) for g in remedies]
        pts = [(x, e) for x, e in zip(xs, ests) if e is not None]
        if pts:
            ax.errorbar([x for x, _ in pts], [e.mean for _, e in pts], yerr=[e.sd or 0 for _, e in pts],
                        marker="o", capsize=3, label="remedy")
        b = _get(base, m)
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
