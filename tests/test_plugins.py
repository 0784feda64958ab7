"""Five components from one file each outside the package (tests/plugins/: an optimizer, an attention variant, a
metric, a PTQ scheme and a model spec) through the user's commands: ``train.py --job.plugins`` at 1 rank and FSDP 2
(the same losses), the probe's metric in metrics.jsonl and the console, a resume, ``outlier-titan-evaluate`` with
the plug-in scheme, and a sweep planned, run and collected with the plug-in metric in its results table. No edit
inside the package."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.launch import REPO, TINY, assert_losses_close, train

PLUGINS = [REPO / "tests" / "plugins" / f"toy_{k}.py" for k in ("optimizer", "attention", "metric", "ptq", "spec")]
TOYS = ["--job.plugins", ",".join(map(str, PLUGINS)), "--model.name", "toy", "--model.attention", "toy_temperature",
        "--model.attention_toy_temperature", "3.0", "--optimizer.name", "signsgd", "--optimizer.lr", "3e-3",
        "--optimizer.signsgd_beta", "0.8"]
PROBE = ["--observe.every", "4", "--observe.batch_size", "4"]


def _env() -> dict:
    import os

    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plugins")
    steps = ["--training.steps", "8", "--checkpoint.enable", "true", "--checkpoint.interval", "8"]
    one = train(tmp, *TINY, *TOYS, *PROBE, *steps, name="one").check()
    two = train(tmp, *TINY, *TOYS, *PROBE, *steps, name="two", nproc=2).check()
    return tmp, one, two


def test_the_toys_train_equally_at_1_and_2_ranks_with_the_plugin_metric(runs):
    _, one, two = runs
    assert len(one.losses) == 8
    assert_losses_close(one.losses, two.losses, rtol=1e-5)
    assert one.losses[8] < one.losses[1]
    probe = [r for r in one.records if "outliers/peak_to_rms" in r]
    assert [r["step"] for r in probe] == [4, 8] and "outliers/layer_0/peak_to_rms" in probe[0]
    for a, b in zip(probe, (r for r in two.records if "outliers/peak_to_rms" in r)):
        assert a["outliers/peak_to_rms"] == pytest.approx(b["outliers/peak_to_rms"], rel=1e-4)
    assert "peak/RMS" in one.stdout
    saved = (one.run_dir / "config.toml").read_text()
    assert str(PLUGINS[0]) in saved and 'name = "toy"' in saved


def test_a_resume_imports_the_recorded_plugins(runs, tmp_path):
    tmp, one, _ = runs
    # the run's own config records the plug-ins' absolute paths: resume from another working directory
    more = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(one.run_dir / "config.toml"),
                           "--training.steps", "10", "--lr_scheduler.total_steps", "8"], cwd=tmp_path,
                          capture_output=True, text=True, env=_env(), timeout=600)
    assert more.returncode == 0, more.stderr[-3000:]
    assert "resumed from" in more.stdout and "step     10/10" in more.stdout


def test_evaluate_runs_the_plugin_scheme_and_metric(runs, tmp_path):
    _, one, _ = runs
    out = tmp_path / "eval.json"
    proc = subprocess.run([sys.executable, "-m", "outlier_titan.tools.evaluate", "--checkpoint", str(one.run_dir),
                           "--schemes", "w6a16_toy", "--tokens", "2048", "--batch-size", "4", "--seq-len", "64",
                           "--calib-seeds", "1", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [e["scheme"] for e in report["schemes"]] == ["w6a16_toy"]
    assert report["schemes"][0]["ppl"] != report["full_precision"]["ppl"]
    assert "outliers/peak_to_rms" in report["probe"]


@pytest.mark.extended
def test_a_sweep_of_the_toys_collects_the_plugin_metric(tmp_path):
    sweep = tmp_path / "toys.toml"
    plugins = ", ".join(f'"{p}"' for p in PLUGINS)
    sweep.write_text(f"""base = "{REPO / 'train_configs' / 'debug.toml'}"
name = "toy_s{{seed}}"
seeds = [0, 1]

[fixed]
job.plugins = [{plugins}]
model.name = "toy"
model.attention = "toy_temperature"
optimizer.name = "signsgd"
optimizer.lr = 3e-3
training.steps = 4
training.seq_len = 64
training.global_batch_size = 8
lr_scheduler.warmup_steps = 2
metrics.log_every = 1
metrics.tensorboard = false
eval.every = 0
observe.every = 4
observe.batch_size = 4
checkpoint.enable = false
""")

    def sweep_cli(*args):
        proc = subprocess.run([sys.executable, str(REPO / "scripts" / "sweep.py"), *args], cwd=tmp_path,
                              capture_output=True, text=True, env=_env(), timeout=900)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        return proc

    sweep_cli("plan", str(sweep), "--out", "out")
    sweep_cli("run", "out", "--local")
    sweep_cli("collect", "out")
    table = (tmp_path / "out" / "results.csv").read_text().splitlines()
    header = table[0].split(",")
    assert "final_peak_to_rms" in header and len(table) == 3
    col = header.index("final_peak_to_rms")
    assert all(float(row.split(",")[col]) > 1 for row in table[1:])
