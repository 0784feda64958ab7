"""The sinks2025 suite at the smoke scale through scripts/reproduce.py: every attention variant trains, is
evaluated, and the report's sink-rate cells and per-remedy verdicts come from the runs' own metrics."""

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from outlier_titan.observe.logger import read_metrics
from outlier_titan.study.reproduce import claims_sinks, fmt

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_sinks2025_smoke_report_comes_from_the_runs(tmp_path):
    sweep_dir, out = tmp_path / "sweep", tmp_path / "report"
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "reproduce.py"), "--suite", "sinks2025", "--scale",
                           "smoke", "--sweep-dir", str(sweep_dir), "--out", str(out)], capture_output=True, text=True,
                          timeout=1200, env={**os.environ, "OMP_NUM_THREADS": "1"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with (out / "results.csv").open() as f:
        rows = {r["point"]: r for r in csv.DictReader(f)}
    assert set(rows) == {"softmax", "softmax1", "sink_logit", "gated_head", "gated_elementwise", "softpick",
                         "sigmoid", "relu", "clipped_softmax"}
    report = (out / "report.md").read_text()
    for name, row in rows.items():
        assert row["status"] == "done"
        records = read_metrics(sweep_dir / "points" / name / "metrics.jsonl")
        probe = [records[s] for s in sorted(records) if "outliers/sink_rate" in records[s]]
        assert float(row["final_sink_rate"]) == pytest.approx(probe[-1]["outliers/sink_rate"])
        assert float(row["final_value_drain"]) == pytest.approx(probe[-1]["outliers/value_drain"])
    for name in ("softpick", "sigmoid"):  # the paper rows: 0 % sink rate beside ours
        line = next(ln for ln in report.splitlines() if f"| {name} |" in ln and "abstract" in ln)
        assert f"0 / {fmt(float(rows[name]['final_sink_rate']))}" in line
    verdicts = re.findall(r"^- \*\*(reproduced|not reproduced|not determined) at this scale\*\* — (.*)$", report,
                          re.M)
    assert len(verdicts) == 8  # one per remedy


def test_sinks_verdicts_follow_the_numbers():
    base = {"point": "softmax", "model.attention": "softmax", "sink_rate": 0.5, "final_val_loss": 2.0}
    rows = [base, {"point": "softpick", "model.attention": "softpick", "sink_rate": 0.0, "final_val_loss": 2.2},
            {"point": "relu", "model.attention": "relu", "sink_rate": 0.75, "final_val_loss": 1.9},
            {"point": "sigmoid", "model.attention": "sigmoid", "sink_rate": None}]
    got = {text.split()[0]: (ok, detail) for text, ok, detail in claims_sinks(rows)}
    assert got["softpick"][0] is True and "+10.00%" in got["softpick"][1]
    assert got["relu"][0] is False and "-5.00%" in got["relu"][1]
    assert got["sigmoid"][0] is None
    base["sink_rate"] = 0.0  # no sink in the baseline: nothing to remove, no verdict
    assert all(ok is None for _, ok, _ in claims_sinks(rows))
