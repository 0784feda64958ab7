"""Reproduction suites: one sweep file per (paper, scale) plus a report that puts the paper's numbers beside ours.

A suite is ``train_configs/suites/<suite>/<scale>.toml`` (an ordinary sweep file, :mod:`.suite_files`) and a
module of :mod:`outlier_titan.study.suites` with the paper's numbers and claims. ``scripts/reproduce.py`` plans
and runs the sweep with the sweep engine (:mod:`outlier_titan.study.runner`; Slurm through ``scripts/sweep.py run
--slurm``), may take points over from report folders (:mod:`.adopt`), and calls :func:`build_report`: every
finished point is evaluated with ``scripts/evaluate.py`` where its report is missing (:mod:`.evaluations`), the
table is collected (:mod:`outlier_titan.study.results`), the report's columns are derived from it
(:func:`add_report_metrics`) and ``report.md`` is written with figures (:mod:`.report`). Every number of ours comes
from the collected table, the run folders' ``metrics.jsonl`` or the evaluation reports, and each verdict is
computed from those numbers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outlier_titan.observe import metrics
from outlier_titan.study.evaluations import eval_report, evaluate_points
from outlier_titan.study.groups import num
from outlier_titan.study.plan import point_dir
from outlier_titan.study.report import write_report
from outlier_titan.study.suites import SUITES


def add_report_metrics(suite: str, rows: list[dict[str, Any]], sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """Adds our value of every metric of the suite's tables and claims to each collected row (in place): the
    evaluation's PPL, the last probe step's metrics, the paper's PTQ schemes' Δppl, then the suite's own columns."""
    entries = {e["name"]: e for e in manifest["points"]}
    for r in rows:
        e = entries[r["point"]]
        rep = eval_report(point_dir(sweep_dir, e["name"]), e["steps"])
        r["ppl"] = num((rep or {}).get("full_precision", {}).get("ppl"))
        r["first_share"] = r.get("final_first_token_argmax_share")
        for m in metrics.shown("collect"):  # the probe's registered metrics at the last probe step
            r[m] = r.get(f"final_{m}")
        r["d_int4"] = r.get("ptq_delta_ppl_int4_zeropoint")
        r["d_int8_coarse"] = r.get("ptq_delta_ppl_int8_coarse")
        r["d_w8a8"] = r.get("ptq_delta_ppl_w8a8_static")
        r["tokens_per_step"] = e["tokens"] // e["steps"]
    add_suite_metrics = SUITES[suite].add_metrics
    if add_suite_metrics is not None:  # from the logs of the finished points (a suite run in parts has others)
        add_suite_metrics([r for r in rows if r["status"] == "done"], sweep_dir, manifest)


def build_report(suite: str, scale: str, sweep_dir: Path, out: Path, parallel: int = 1) -> Path:
    """Evaluates the finished points that lack a report (``parallel`` at a time), collects, and writes the
    report."""
    from outlier_titan.study.plan import read_manifest
    from outlier_titan.study.results import collect, write_tables

    manifest = read_manifest(sweep_dir)
    failed = evaluate_points(sweep_dir, manifest, SUITES[suite].info, scale, parallel)
    columns, rows = collect(sweep_dir, manifest)
    write_tables(sweep_dir, columns, rows)
    add_report_metrics(suite, rows, sweep_dir, manifest)
    return write_report(suite, scale, sweep_dir, out, manifest, columns, rows, failed)
