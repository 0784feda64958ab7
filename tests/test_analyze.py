"""scripts/analyze.py on synthetic run folders: merging records, per-layer profiles, the PNG and the summary."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest



def analyze():
    return importlib.import_module("outlier_titan.tools.analyze")


def write_run(folder: Path, kurt_scale: float, optimizer: str | None = None, seed: int = 0) -> Path:
    """A run folder with synthetic records; with ``optimizer`` also a config.toml (runs of one optimizer differ only
    in their seed and name)."""
    folder.mkdir(parents=True)
    if optimizer is not None:
        (folder / "config.toml").write_text(f'[job]\nname = "{folder.name}"\n\n[optimizer]\nname = "{optimizer}"\n\n'
                                            f'[training]\nsteps = 100\nseed = {seed}\n')
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


def test_axes_are_linear_unless_a_metric_spans_more_than_a_decade():
    a = analyze()
    assert not a.log_axis([2.70, 2.75, 2.88])  # the narrow kurtosis range a log axis labelled 2.7 x 10^0
    assert not a.log_axis([1.0, 10.0])  # one decade exactly
    assert a.log_axis([1.0, 10.5])
    assert not a.log_axis([-1.0, 100.0]) and not a.log_axis([0.0, 100.0]) and not a.log_axis([])
    assert a.log_axis([1.0, float("nan"), 50.0])


def test_figure_axes_titles_and_seed_bands(tmp_path, capsys):
    a = analyze()
    runs = [write_run(tmp_path / f"adamw_s{seed}", scale, "adamw", seed) for seed, scale in enumerate((1.0, 2.0, 3.0))]
    runs.append(write_run(tmp_path / "orthoadam_s0", 0.001, "orthoadam"))
    groups = a.group_runs(runs)
    assert list(groups) == ["adamw", "orthoadam_s0"] and len(groups["adamw"]) == 3
    fig = a.draw(groups, ["kurtosis_rest", "kurtosis_first"], ["residual_rms"])
    panels = {ax.get_title().split("\n")[0]: ax for ax in fig.axes if ax.get_title()}
    # kurtosis_rest is 3.0 everywhere, kurtosis_first spans 0.001 to 303, residual_rms per layer 101 to 303
    assert {t: ax.get_yscale() for t, ax in panels.items()} == {
        "loss": "linear", "kurtosis_rest": "linear", "kurtosis_first": "log",
        "residual_rms per layer (last probe)": "linear"}
    assert all(ax.get_title().endswith("\nlower is better") for ax in panels.values())
    first = panels["kurtosis_first"]
    assert [line.get_label() for line in first.get_lines()] == ["adamw (3 seeds)", "orthoadam_s0"]
    assert list(first.get_lines()[0].get_ydata()) == [2.0, 102.0, 202.0]  # the seeds' mean
    (band,) = first.collections  # one band: the group of three; a single run has none
    assert band.get_paths()[0].vertices[:, 1].min() == 1.0 and band.get_paths()[0].vertices[:, 1].max() == 303.0
    table = a.summary(groups, ["kurtosis_first"])
    assert "| outliers/kurtosis_first | 202 [101, 303] (step 100) | 0.101 (step 100) |" in table
    out = tmp_path / "compare.png"
    assert a.main([*map(str, runs), "--out", str(out), "--metrics", "kurtosis_first"]) == 0
    assert "| metric | adamw | orthoadam_s0 |" in capsys.readouterr().out and out.is_file()


def test_missing_metrics_file(tmp_path):
    with pytest.raises(SystemExit, match="metrics.jsonl not found"):
        analyze().main([str(tmp_path), "--out", str(tmp_path / "x.png")])
    run = write_run(tmp_path / "adamw_s0", 1.0, "adamw")
    with pytest.raises(SystemExit, match="given more than once; name each run once"):
        analyze().main([str(run), str(tmp_path / "." / "adamw_s0"), "--out", str(tmp_path / "x.png")])


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
