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
STEPS = 40
SLURM_LOCAL = [str(REPO / "scripts" / "slurm_local.sh")]


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


def run_args(tmp: Path, name: str, *extra: str) -> list[str]:
    """The debug config, tiny, FSDP over 2 ranks, a checkpoint every 10 steps; ``extra`` overrides win."""
    return ["train_configs/debug.toml", *TINY, "--parallelism.dp_shard", "2", "--training.steps", str(STEPS),
            "--job.dump_folder", str(tmp), "--job.name", name, "--checkpoint.enable", "true",
            "--checkpoint.interval", "10", *extra]


def sbatch(tmp: Path, name: str, *export: str, extra: tuple[str, ...] = (), ranks_per_node: int = 1) -> str:
    cmd = ["sbatch", "--parsable", f"--chdir={REPO}", "--nodes=2", "--gpus-per-node=0", "--cpus-per-task=1",
           ",".join(["--export=ALL", f"GPUS_PER_NODE={ranks_per_node}", *export]), f"--output={tmp}/slurm-%j.out",
           "scripts/multinode.slurm", *run_args(tmp, name, *extra)]
    return subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, check=True).stdout.strip()


def standalone(tmp: Path, name: str, nproc: int, *extra: str) -> dict[int, float]:
    """Losses of the same run on this host: ``python -m outlier_titan.launch --standalone``."""
    config, *overrides = run_args(tmp, name, *extra)
    ref = subprocess.run([sys.executable, "-m", "outlier_titan.launch", "--standalone", f"--nproc_per_node={nproc}",
                          "train.py", "--config", config, *overrides], cwd=REPO, env=ENV, capture_output=True,
                         text=True, timeout=300)
    assert ref.returncode == 0, ref.stderr[-3000:]
    return losses(tmp / name)


def wait_for_end(job_id: str, limit_s: float) -> str:
    t0 = time.monotonic()
    while (state := job_state(job_id)) not in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"):
        assert time.monotonic() - t0 < limit_s, f"job {job_id} still {state} after {limit_s} s"
        time.sleep(1)
    return state


def wait_for_idle_nodes(limit_s: float) -> None:
    """Until both nodes are idle (a node revived by ``slurm_local.sh revive`` takes a moment to be used again)."""
    t0 = time.monotonic()
    while True:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True, env=ENV, timeout=10)
        if out.stdout.split() == ["idle", "idle"]:
            return
        assert time.monotonic() - t0 < limit_s, f"nodes not idle after {limit_s} s: {out.stdout.split()}"
        time.sleep(1)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    """Losses of the same run under ``python -m outlier_titan.launch --standalone --nproc_per_node 2``."""
    return standalone(tmp_path_factory.mktemp("ref"), "ref", 2)


def job_state(job_id: str) -> str:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, env=ENV)
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f).get("JobState", "?")


def test_two_nodes_one_rank_each_equal_the_standalone_launcher(tmp_path, reference):
    """Multinode.slurm on 2 nodes x 1 rank (rendezvous over the bridge at the first node's NodeAddr)
    gives the losses of ``python -m outlier_titan.launch --standalone --nproc_per_node 2`` bit for bit, and
    its start-up line shows each rank on its own host."""
    job_id = sbatch(tmp_path, "a")
    state = wait_for_end(job_id, 300)
    log = slurm_log(tmp_path, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert "hosts: node1 rank 0 | node2 rank 1" in log, log[-3000:]
    assert "rendezvous=10.77.0.11:" in log, log[-3000:]
    assert losses(tmp_path / "a") == reference
    # each node's hosts file starts with Debian's default line (the node's own name -> loopback), which the
    # rendezvous address and gloo's interface (outlier_titan.launch sets GLOO_SOCKET_IFNAME) must not follow
    assert (CONF.parent / "hosts.node1").read_text().splitlines()[0] == "127.0.1.1 node1"


@pytest.mark.parametrize("absence_s", [5, 45])
@pytest.mark.extended
def test_a_node_that_dies_and_comes_back_costs_a_requeue_not_the_run(tmp_path, reference, absence_s):
    """Node2 dies mid-run (every process killed at once); its slurmd is back 5 s later (before Slurm
    would mark it DOWN, SlurmdTimeout 30 s) or 45 s later (after). Rank 0 fails (exit 1), srun keeps waiting for
    node2's lost task, the script's watchdog ends srun STEP_GRACE_S later, the job requeues (and waits for node2),
    resumes from the newest checkpoint and ends COMPLETED with every step done and the uninterrupted run's loss at
    every step."""
    wait_for_idle_nodes(120)  # the other case's revived node2 must be back in service first
    job_id = sbatch(tmp_path, "a", "STEP_GRACE_S=5")
    metrics = tmp_path / "a" / "metrics.jsonl"
    t0 = time.monotonic()
    while not (metrics.is_file() and max(losses(tmp_path / "a"), default=0) >= 15):
        if not (time.monotonic() - t0 < 180 and job_state(job_id) in ("PENDING", "RUNNING")):
            time.sleep(2)  # the log's last lines
            log = tmp_path / f"slurm-{job_id}.out"
            pytest.fail(f"job {job_id} {job_state(job_id)} before step 15: "
                        f"{log.read_text()[-3000:] if log.is_file() else '(no log)'}")
        time.sleep(0.2)
    try:
        subprocess.run([*SLURM_LOCAL, "crash", "2"], env=ENV, check=True, capture_output=True, timeout=60)
    finally:
        time.sleep(absence_s)
        subprocess.run([*SLURM_LOCAL, "revive", "2"], env=ENV, check=True, capture_output=True, timeout=60)
    state = wait_for_end(job_id, 300)
    log = slurm_log(tmp_path, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert "ending srun" in log and "a rank or node failed (exit 1)" in log and "requeueing" in log, log[-3000:]
    assert f"{STEPS} of {STEPS} steps done" in log and log.count("restart ") == 2, log[-3000:]
    assert losses(tmp_path / "a") == reference


@pytest.mark.extended
def test_hsdp_with_soap_across_nodes_equals_one_host(tmp_path):
    """HSDP with the replicas on different nodes (dp_replicate 2 over node1 / node2, dp_shard 2 inside
    each) and SOAP (its preconditioners beside the shards) give the losses of the same 4 ranks on one host."""
    extra = ("--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2", "--optimizer.name", "soap",
             "--training.steps", "8")
    ref = standalone(tmp_path, "ref", 4, *extra)
    job_id = sbatch(tmp_path, "a", extra=extra, ranks_per_node=2)
    state = wait_for_end(job_id, 300)
    log = slurm_log(tmp_path, job_id)
    assert state == "COMPLETED", log[-3000:]
    assert "hosts: node1 ranks 0-1 | node2 ranks 2-3" in log, log[-3000:]
    assert losses(tmp_path / "a") == ref and len(ref) == 8


@pytest.mark.extended
def test_usr1_before_the_time_limit_saves_on_both_nodes_and_requeues(tmp_path, reference):
    """Slurm's warning signal (USR1 to the batch script, as --signal=B:USR1@N sends it) reaches the
    ranks on both nodes, which save one checkpoint at the same step and exit 75; the job requeues, resumes from
    it and ends COMPLETED with the uninterrupted run's losses."""
    job_id = sbatch(tmp_path, "a")
    t0 = time.monotonic()
    metrics = tmp_path / "a" / "metrics.jsonl"
    while not (metrics.is_file() and max(losses(tmp_path / "a"), default=0) >= 12):
        assert time.monotonic() - t0 < 180 and job_state(job_id) in ("PENDING", "RUNNING"), job_state(job_id)
        time.sleep(0.2)
    subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], env=ENV, check=True, timeout=30)
    state = wait_for_end(job_id, 300)
    log = slurm_log(tmp_path, job_id)
    assert state == "COMPLETED", log[-3000:]
    stopped = [line for line in log.splitlines() if "stopped before the time limit at step" in line]
    assert len(stopped) == 1 and "requeueing" in stopped[0], log[-3000:]
    assert "ranks exited with 75 " in log, log[-3000:]  # not srun's 143 for the peer it killed after the stop
    step = int(stopped[0].split("at step ")[1].split()[0])
    assert f"resumed from {tmp_path / 'a' / 'checkpoints' / f'step-{step}'}" in log, log[-3000:]
    assert losses(tmp_path / "a") == reference


@pytest.mark.extended
def test_sweep_array_points_span_two_nodes(tmp_path):
    """``sweep run --slurm --nodes 2`` runs each array point as one job on two nodes (one launcher per
    node, rendezvous on the first); the points finish and collect to the table of ``run --local --nproc 2``."""
    from tests.test_sweep import BASE, TINY, assert_same_values, read_csv, write
    from tests.test_sweep import cli as sweep

    path = write(tmp_path, f'base = "{BASE}"\nname = "d{{model.dim}}"\n{TINY}\n[grid]\nmodel.dim = [16, 32]\n')
    env = {"SLURM_CONF": str(CONF)}
    for mode in ("local", "slurm"):
        assert sweep("plan", str(path), "--out", mode, cwd=tmp_path, env=env).returncode == 0
    assert sweep("run", "local", "--local", "--nproc", "2", cwd=tmp_path, env=env).returncode == 0
    proc = sweep("run", "slurm", "--slurm", "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "1",
                 cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    job_id = proc.stdout.split("Submitted batch job")[1].split()[0]
    t0 = time.monotonic()
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True, env=ENV).stdout.strip():
        assert time.monotonic() - t0 < 300, f"job array {job_id} still queued or running after 300 s"
        time.sleep(1)
    status = sweep("status", "slurm", cwd=tmp_path, env=env).stdout.splitlines()
    assert status[-1] == "2 done", status
    logs = "".join(p.read_text() for p in (tmp_path / "slurm" / "points").rglob("*.log"))
    assert logs.count("hosts: node1 rank 0 | node2 rank 1") == 2, logs[-3000:]
    for mode in ("local", "slurm"):
        assert sweep("collect", mode, cwd=tmp_path, env=env).returncode == 0
    local, slurm = (read_csv(tmp_path / mode / "results.csv") for mode in ("local", "slurm"))
    assert len(local) == 2 and [list(r) for r in slurm] == [list(r) for r in local]
    assert_same_values(slurm, local)
