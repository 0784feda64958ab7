"""``sweep.py status`` and ``collect``: one line per point, and the sweep's results table.

Column contract of the collected table (``SWEEP_DIR/results.csv``, ``.md``, ``.parquet`` with pyarrow):
``point``, ``status``, one column per axis named by its dotted key (``model.dim``, ``tokens_per_param``,
``seed``, ...; ``seed`` always), ``params``, ``flops_per_token``, ``tokens``, ``flops``, ``final_val_loss``,
``best_val_loss``, ``final_train_loss``, ``wall_s``, ``tokens_per_s``; when the probe ran, ``final_<metric>``
and ``peak_<metric>`` (maximum over probe steps) for each metric of :func:`probe_metrics`; when
``scripts/evaluate.py`` ran on the point (``<run>/eval/step-<N>.json``, newest step), ``ptq_delta_ppl_<scheme>``
and, for schemes calibrated at several seeds, ``ptq_calib_sd_<scheme>`` (the sd of the PPL over calibration seeds),
and ``eval_<key>`` for each whole-model measure of the evaluation (``eval_osp_kurtosis``: Park et al. 2025's excess
kurtosis of the evaluation's probe sequences).
Every point of the manifest is one row, in manifest order; missing values are empty.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any

from outlier_titan.observe import metrics as registry
from outlier_titan.observe.logger import read_metrics
from outlier_titan.study.groups import num
from outlier_titan.study.plan import fmt_count, point_dir
from outlier_titan.study.runner import point_status


def probe_metrics() -> tuple[str, ...]:
    """Probe metrics (``outliers/<name>`` in metrics.jsonl, the mean over blocks) collected as final_/peak_ columns:
    the registered ones shown in results (:mod:`outlier_titan.observe.metrics`)."""
    return registry.shown("collect")


def __getattr__(name: str):
    # the registry grows when plug-ins load, so these are read when asked for, not at import
    if name == "PROBE_METRICS":
        return probe_metrics()
    if name == "LEGACY_PROBE_NAMES":
        return registry.legacy_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


BASE_COLUMNS = ("params", "flops_per_token", "tokens", "flops", "final_val_loss", "best_val_loss",
                "final_train_loss", "wall_s", "tokens_per_s")


def status_lines(sweep_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """One line per point: name, status, last step / total, last loss, error."""
    rows = []
    for e in manifest["points"]:
        s = point_status(sweep_dir, e)
        loss = f"{s['last_loss']:.4f}" if s["last_loss"] is not None else "-"
        rows.append([e["name"], s["status"], f"{s['last_step']}/{e['steps']}", loss, s["error"]])
    width = [max(len(r[i]) for r in rows + [["point", "status", "step", "loss", ""]]) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(["point", "status", "step", "loss"], width))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r[:4], width)) + (f"  {r[4]}" if r[4] else "") for r in rows]
    counts = {}
    for r in rows:
        counts[r[1]] = counts.get(r[1], 0) + 1
    lines.append(", ".join(f"{n} {k}" for k, n in counts.items()))
    return [ln.rstrip() for ln in lines]


def logged_key(records: dict[int, dict], metric: str) -> str | None:
    """The name under which a run's ``metrics.jsonl`` logged ``metric`` as it is defined now (``outliers/<name>``,
    ``outliers/layer_<i>/<name>``), or None where the run logged only an older definition of it
    (the registered metrics' ``legacy`` names: a run that logged the old name and not the new one logged the old
    definition, so its values are collected under the name that definition has now)."""
    names = registry.legacy_names()
    legacy = {old for old, new in names.items() if not any(f"outliers/{new}" in r for r in records.values())}
    if metric in legacy:
        return None
    return next((old for old, new in names.items() if new == metric and old in legacy), metric)


def point_row(sweep_dir: Path, entry: dict[str, Any], axes: list[str]) -> dict[str, Any]:
    folder = point_dir(sweep_dir, entry["name"])
    st = point_status(sweep_dir, entry)
    row: dict[str, Any] = {"point": entry["name"], "status": st["status"]}
    for a in axes:
        row[a] = entry["axes"].get(a)
    if "seed" not in row:
        from outlier_titan.config.manager import tomllib

        row["seed"] = tomllib.loads(entry["config"]).get("training", {}).get("seed")
    for k in ("params", "flops_per_token", "tokens", "flops"):
        row[k] = entry[k]
    metrics = folder / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else {}
    steps = sorted(records)
    val = [(s, num(records[s].get("val_loss"))) for s in steps if num(records[s].get("val_loss")) is not None]
    train = [(s, num(records[s].get("loss"))) for s in steps if num(records[s].get("loss")) is not None]
    tps = [num(records[s].get("tokens_per_second")) for s in steps if s > 1]
    tps = [t for t in tps if t is not None]
    row["final_val_loss"] = val[-1][1] if val else None
    row["best_val_loss"] = min(v for _, v in val) if val else None
    row["final_train_loss"] = train[-1][1] if train else None
    row["wall_s"] = round(st["wall_s"], 2) if st["wall_s"] else None
    row["tokens_per_s"] = statistics.median(tps) if tps else None
    for m in probe_metrics():
        key = logged_key(records, m)
        if key is None:
            continue
        series = [num(records[s].get(f"outliers/{key}")) for s in steps]
        series = [v for v in series if v is not None]
        if series:
            row[f"final_{m}"] = series[-1]
            row[f"peak_{m}"] = max(series)
    report = _newest_eval(folder)
    for e in registry.evaluations():
        value = num(((report or {}).get(e.key) or {}).get(e.key))
        if value is not None:
            row[e.column] = value
    if report is not None:  # the code that evaluated the point ("" for a report made before reports recorded it)
        row["eval_code"] = report.get("code") or ""
        row["eval_versions"] = (f"Python {report['python']}, torch {report['torch']}" if report.get("python")
                                else "")
    if (report or {}).get("updated"):  # schemes re-run later with `scripts/evaluate.py --update` (not a column)
        row["eval_updated"] = report["updated"]
    for e in (report or {}).get("schemes", []):
        row[f"ptq_delta_ppl_{e['scheme']}"] = num(e.get("delta"))
        if "rotation" in e and "ptq_rotation" not in row:  # what a rotated (_hadamard) scheme did to this model
            row["ptq_rotation"] = e["rotation"].get("residual_rotation")
        if len(e.get("ppl_runs", [])) > 1:  # calibrated schemes: the spread over calibration seeds
            row[f"ptq_calib_sd_{e['scheme']}"] = num(e.get("ppl_std"))
    return row


def _newest_eval(folder: Path) -> dict[str, Any] | None:
    """The newest ``scripts/evaluate.py`` report of the run (default path ``<run>/eval/step-<N>.json``)."""
    best, best_step = None, -1
    for path in (folder / "eval").glob("step-*.json"):
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        step = report.get("step", -1)
        if isinstance(report.get("schemes"), list) and step > best_step:
            best, best_step = report, step
    return best


def collect(sweep_dir: str | Path, manifest: dict[str, Any]) -> tuple[list[str], list[dict[str, Any]]]:
    """(columns, rows): one row per point of the manifest, columns per the module's contract."""
    sweep_dir = Path(sweep_dir)
    axes = list(manifest["axes"])
    rows = [point_row(sweep_dir, e, axes) for e in manifest["points"]]
    columns = ["point", "status", *axes, *([] if "seed" in axes else ["seed"]), *BASE_COLUMNS]
    extra = []
    for prefix in ("final_", "peak_"):
        extra += [f"{prefix}{m}" for m in probe_metrics() if any(f"{prefix}{m}" in r for r in rows)]
    ptq = sorted({k for r in rows for k in r if k.startswith("ptq_delta_ppl_")})
    extra += [e.column for e in registry.evaluations() if any(e.column in r for r in rows)]
    return columns + extra + ptq, rows


def _md_cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else fmt_count(v)
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 1e5:
        return fmt_count(v)
    return str(v)


def write_tables(sweep_dir: str | Path, columns: list[str], rows: list[dict[str, Any]]) -> list[Path]:
    """``results.csv`` (full precision), ``results.md`` and, when pyarrow is importable, ``results.parquet``."""
    sweep_dir = Path(sweep_dir)
    written = []
    path = sweep_dir / "results.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow(["" if r.get(c) is None else r.get(c) for c in columns])
    written.append(path)
    md = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    md += ["| " + " | ".join(_md_cell(r.get(c)) for c in columns) + " |" for r in rows]
    path = sweep_dir / "results.md"
    path.write_text("\n".join(md) + "\n")
    written.append(path)
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        return written
    data = {}
    for c in columns:
        values = [r.get(c) for r in rows]
        kinds = {type(v) for v in values if v is not None}
        if str in kinds and len(kinds) > 1:  # a mixed column (e.g. an axis of numbers and names): text
            values = [None if v is None else str(v) for v in values]
        elif kinds <= {int, float} and float in kinds:
            values = [None if v is None else float(v) for v in values]
        data[c] = values
    table = pa.table(data)
    path = sweep_dir / "results.parquet"
    pq.write_table(table, path)
    written.append(path)
    return written
