"""scripts/analyze.py on synthetic run folders: merging records, per-layer profiles, the PNG and the summary."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest



def analyze():
    return importlib.import_module("outlier_titan.tools.analyze")


def write_run(folder: Path, kurt_scale: float) -> Path:
    folder.mkdir(parents=True)
    lines = []
    for step in range(0, 101, 10):
        lines.append({"step": step, "loss": 5.0 - step / 50, "lr": 1e-3, "grad_norm": 1.0,
                      "tokens_per_second": 1000.0})
        if step % 50 == 0:  # validation and probe records arrive as separate lines of the same step
            lines.append({"step": step, "val_loss": 5.5 - step / 50, "val_ppl": 1.0})
            rec = {"step": step, "outliers/kurtosis_first": kurt_scale * (1 + step),
                   "outliers/kurtosis_rest": 3.0, "outliers/first_token_argmax_share": 0.5,
                   "outliers/max_abs_first": "nan"}
            for i in range(3):
                rec[f"outliers/layer_{i}/residual_rms"] = (i + 1) * (step + 1)
            lines.append(rec)
    (folder / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    return folder


def test_read_run_merges_steps_and_profiles(tmp_path):
    a = analyze()
    recs = a.read_run(write_run(tmp_path / "adamw", 10.0))
    assert recs[50]["loss"] == pytest.approx(4.0) and recs[50]["outliers/kurtosis_first"] == 510.0
    assert a.series(recs, "outliers/kurtosis_first") == ([0, 50, 100], [10.0, 510.0, 1010.0])
    assert a.series(recs, "outliers/max_abs_first") == ([], [])  # non-finite values are skipped
    assert a.layer_profile(recs, "residual_rms") == (100, [0, 1, 2], [101.0, 202.0, 303.0])
    assert a.layer_profile(recs, "kurtosis_neuron_rms") == (None, [], [])


def test_two_runs_side_by_side_png(tmp_path, capsys):
    a = analyze()
    r1 = write_run(tmp_path / "adamw", 10.0)
    r2 = write_run(tmp_path / "orthoadam", 0.01)
    out = tmp_path / "plots" / "compare.png"
    assert a.main([str(r1), str(r2), "--out", str(out)]) == 0
    img = mpimg.imread(out)
    assert img.ndim == 3 and img.shape[0] > 300 and img.shape[1] > 1000
    table = capsys.readouterr().out
    assert "| metric | adamw | orthoadam |" in table
    assert "| outliers/kurtosis_first | 1010 (step 100) | 1.01 (step 100) |" in table
    assert "| outliers/signal_prop_cos | - | - |" in table
    assert "| val_loss | 3.5 (step 100) | 3.5 (step 100) |" in table  # drawn dashed on the loss panel


def test_missing_metrics_file(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl not found"):
        analyze().main([str(tmp_path), "--out", str(tmp_path / "x.png")])


def test_read_metrics_keeps_the_last_run_of_each_step_after_a_resume(tmp_path):
    from outlier_titan.observe.logger import MetricsLogger, read_metrics

    run = tmp_path / "run"
    logger = MetricsLogger(run, rank=0, tensorboard=False)
    for step in (1, 2, 3, 4):  # the first attempt got to step 4, its checkpoint was at step 2
        logger.log(step, {"loss": 10.0 + step})
    logger.mark_resume(2)
    for step in (3, 4, 5):
        logger.log(step, {"loss": 20.0 + step})
    logger.close()
    (run / "metrics.jsonl").open("a").write('{"step": 6, "loss"\n')  # a torn last line
    records = read_metrics(run / "metrics.jsonl")
    assert sorted(records) == [1, 2, 3, 4, 5]
    assert [records[s]["loss"] for s in sorted(records)] == [11.0, 12.0, 23.0, 24.0, 25.0]
