"""Weights & Biases beside TensorBoard: a debug run logged by the real wandb in offline mode, read back with wandb's
own transaction-log reader (``wandb leet inspect --json``), and the runs where W&B cannot start."""

import json
import math
import subprocess
import sys

import pytest

from outlier_titan.config.manager import tomllib
from outlier_titan.observe.logger import read_metrics
from tests.launch import TINY, train

pytest.importorskip("wandb")  # the test extra installs it

pytestmark = pytest.mark.dist

RUN = [*TINY, "--metrics.wandb", "true", "--observe.every", "2", "--observe.batch_size", "2", "--checkpoint.enable",
       "true", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "6", "--metrics.wandb_project", "tests"]


def wandb_records(run_file) -> list[dict]:
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    return [json.loads(line) for line in out.splitlines() if line.strip()]


@pytest.mark.extended
def test_offline_run_holds_the_scalars_images_and_config_and_a_resume_on_two_ranks_continues_it(tmp_path,
                                                                                                  monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    train(tmp_path, *RUN, "--training.steps", "4").check()
    resumed = train(tmp_path, *RUN, "--training.steps", "6", nproc=2).check()  # rank 0 alone logs to W&B
    assert "resumed from" in resumed.stdout
    run_dir = resumed.run_dir
    run_id = (run_dir / "wandb_run_id").read_text().strip()
    launches = sorted((run_dir / "wandb").glob("offline-run-*"))
    assert len(launches) == 2

    history: dict[int, dict] = {}
    for launch, steps in zip(launches, (4, 6)):
        records = wandb_records(next(launch.glob("run-*.wandb")))
        (run,) = [r["run"] for r in records if r["type"] == "run"]
        assert run["run_id"] == run_id and run["project"] == "tests"
        config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
        assert config["training"]["steps"] == steps
        for r in records:
            if r["type"] == "history":
                item = r["history"]["item"]
                history.setdefault(int(item["step"]), {}).update(item)
    assert config == tomllib.loads((run_dir / "config.toml").read_text())

    metrics = read_metrics(run_dir / "metrics.jsonl")
    assert sorted(history) == sorted(metrics) == list(range(1, 7))
    for step, record in metrics.items():
        scalars = {k: v for k, v in record.items()
                   if k not in ("time", "elapsed") and isinstance(v, (int, float)) and math.isfinite(v)}
        logged = {k: v for k, v in history[step].items() if not k.startswith("_") and "." not in k}
        assert logged == scalars, step
    for step in (2, 4, 6):
        for name in ("outliers/attention_map", "outliers/hidden_magnitude"):
            assert history[step][f"{name}._type"] == "image-file"
            launch = launches[0] if step <= 4 else launches[1]
            assert (launch / "files" / history[step][f"{name}.path"]).is_file()


@pytest.mark.parametrize("case, reason", [("no package", "the wandb package is not installed"),
                                          ("no login", "not logged in to W&B")])
def test_run_without_wandb_trains_and_says_so_in_one_line(tmp_path, monkeypatch, case, reason):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a W&B key
    if case == "no package":  # a package on the path that fails to import hides the installed wandb
        hide = tmp_path / "hide" / "wandb"
        hide.mkdir(parents=True)
        (hide / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
        monkeypatch.setenv("PYTHONPATH", str(hide.parent))
    run = train(tmp_path, *TINY, "--training.steps", "2", "--metrics.wandb", "true").check()
    warnings = [line for line in run.stderr.splitlines() if "metrics.wandb" in line]
    assert len(warnings) == 1, run.stderr[-3000:]
    assert warnings[0].startswith(f"warning: metrics.wandb = true but {reason}")
    assert warnings[0].endswith("training goes on without W&B")
    assert sorted(run.losses) == [1, 2]
    assert not (run.run_dir / "wandb").exists()
