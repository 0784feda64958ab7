"""``scripts/multinode.slurm`` across two hosts: the two-node local cluster (``scripts/slurm_local.sh start --nodes
2``: each node its own network and UTS namespace, own address and hostname). Skipped when it does not answer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.launch import REPO, TINY
from tests.test_slurm import losses, slurm_log

CONF = Path(os.environ.get("SLURM_LOCAL_NODES_DIR", "/tmp/outlier_titan-slurm-nodes")) / "slurm.conf"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "SLURM_CONF": str(CONF)}
STEPS = 20


def _reason() -> str | None:
    if not shutil.which("sbatch") or not CONF.is_file():
        return "no two-node local Slurm; run scripts/slurm_local.sh start --nodes 2"
    out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=ENV, timeout=10)
    states = out.stdout.split()
    if out.returncode or len(states) < 2 or any(s.rstrip("*~#") not in ("idle", "mix", "alloc") for s in states):
        return f"the two-node local Slurm is not up (sinfo: {(out.stdout + out.stderr).strip()[:200]})"
    return None


_REASON = _reason()
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def run_args(tmp: Path, name: str) -> list[str]:
    return ["train_configs/debug.toml", *TINY, "--parallelism.dp_shard", "2", "--training.steps", str(STEPS),
            "--job.dump_folder", str(tmp), "--job.name", name, "--checkpoint.enable", "true",
            "--checkpoint.interval", "1000"]


def job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, env=ENV)
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f).get("JobState", "?")


def test_two_nodes_one_rank_each_equal_the_standalone_launcher(tmp_path):
    """Issue 29: multinode.slurm on 2 nodes x 1 rank (rendezvous over the bridge at the first node's NodeAddr)
    gives the losses of ``python -m outlier_titan.launch --standalone --nproc_per_node 2`` bit for bit, and
    its start-up line shows each rank on its own host."""
    config, *overrides = run_args(tmp_path, "ref")
    ref = subprocess.run([sys.executable, "-m", "outlier_titan.launch", "--standalone", "--nproc_per_node=2",
                          "train.py", "--config", config, *overrides], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    cmd = ["sbatch", "--parsable", f"--chdir={REPO}", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
           "--export=ALL,GPUS_PER_NODE=1", f"--output={tmp_path}/slurm-%j.out", "scripts/multinode.slurm",
           *run_args(tmp_path, "a")]
    job_id = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, check=True).stdout.strip()
    t0 = time.monotonic()
    while (state := job_state(job_id)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() - t0 < 300, f"job {job_id} still {state}"
        time.sleep(1)
    log = slurm_log(tmp_path, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert "hosts: node1 rank 0 | node2 rank 1" in log, log[-3000:]
    assert "rendezvous=10.77.0.11:" in log, log[-3000:]
    assert losses(tmp_path / "a") == losses(tmp_path / "ref")

