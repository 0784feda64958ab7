"""The cluster path against a real Slurm (``scripts/slurm_local.sh start``): ``scripts/multinode.slurm`` on
1 node x 2 CPU ranks, time-limit preemption with requeue, ``scancel``, and a sweep's job array
(``sweep.py run --slurm``). Skipped when no Slurm answers."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outlier_titan.checkpoint.manager import list_checkpoints
from outlier_titan.observe.logger import read_metrics
from outlier_titan.study.slurm import never_runs
from tests.launch import REPO, TINY


def _slurm_reason() -> str | None:
    if not shutil.which("sbatch"):
        return "no Slurm client (sbatch) on PATH; scripts/slurm_local.sh start installs a local Slurm"
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 10 s"
    states = out.stdout.split()
    if out.returncode or not any(s.rstrip("*~#") in ("idle", "mix", "alloc") for s in states):
        return f"no Slurm node up (sinfo: {(out.stdout + out.stderr).strip()[:200]}); run scripts/slurm_local.sh start"
    return None


_REASON = _slurm_reason()
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
STEPS = 40


def run_args(tmp: Path, name: str, steps: int) -> list[str]:
    return ["train_configs/debug.toml", *TINY, "--parallelism.dp_shard", "2", "--training.steps", str(steps),
            "--job.dump_folder", str(tmp), "--job.name", name, "--checkpoint.enable", "true",
            "--checkpoint.interval", "1000"]


def direct(tmp: Path, name: str, steps: int, nice: bool = False) -> subprocess.Popen:
    """The same run under the launcher (torchrun) directly, without Slurm."""
    config, *overrides = run_args(tmp, name, steps)
    cmd = [*(["nice", "-n", "19"] if nice else []), sys.executable, "-m", "outlier_titan.launch", "--standalone", "--nproc_per_node=2", "train.py",
           "--config", config, *overrides]
    return subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=open(tmp / f"{name}.log", "w"), stderr=subprocess.STDOUT)


def sbatch(tmp: Path, name: str, steps: int, *flags: str, export: str = "") -> str:
    """Submits ``scripts/multinode.slurm`` on 1 node x 2 CPU ranks (``export``: more ``NAME=value,...`` for the
    script's environment); returns the job id."""
    cmd = ["sbatch", "--parsable", f"--chdir={REPO}", "--nodes=1", "--gpus-per-node=0", "--cpus-per-task=1",
           f"--export=ALL,GPUS_PER_NODE=2{',' + export if export else ''}", f"--output={tmp}/slurm-%j.out", *flags,
           "scripts/multinode.slurm", *run_args(tmp, name, steps)]
    out = subprocess.run(cmd, capture_output=True, text=True, env=ENV, cwd=REPO, check=True)
    job_id = out.stdout.strip().split(";")[0]
    reason = never_runs(job_id)
    if reason:  # at once, not after the test's timeout
        pytest.fail(reason)
    return job_id


def job(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True, check=True)
    return dict(f.split("=", 1) for f in out.stdout.split() if "=" in f)


def wait_job(job_id: str, states: tuple[str, ...], timeout: float) -> dict[str, str]:
    t0 = time.monotonic()
    while (info := job(job_id))["JobState"] not in states:
        assert time.monotonic() - t0 < timeout, f"job {job_id} still {info['JobState']} after {timeout} s"
        time.sleep(1)
    return info


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items() if "loss" in r}


def slurm_log(tmp: Path, job_id: str) -> str:
    return (tmp / f"slurm-{job_id}.out").read_text()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[dict[int, float], float]:
    """Losses of the uninterrupted run under torchrun, and its median seconds per step."""
    tmp = tmp_path_factory.mktemp("ref")
    assert direct(tmp, "ref", STEPS).wait(timeout=300) == 0, (tmp / "ref.log").read_text()[-3000:]
    records = read_metrics(tmp / "ref" / "metrics.jsonl")
    tokens = 8 * 64
    step_s = statistics.median(tokens / r["tokens_per_second"] for s, r in records.items() if s > 2)
    return losses(tmp / "ref"), step_s


def test_multinode_slurm_equals_torchrun(tmp_path, reference):
    job_id = sbatch(tmp_path, "a", STEPS)
    info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=300)
    assert info["JobState"] == "COMPLETED", slurm_log(tmp_path, job_id)[-3000:]
    assert losses(tmp_path / "a") == reference[0]


@pytest.mark.extended
def test_time_limit_preemption_requeues_until_done(tmp_path, reference):
    """--time=1 with the warning 15 s ahead: Slurm sends USR1 15-45 s into each allocation, the ranks save, the
    script requeues; the run needs ~50 s of steps (more than any one allocation gives), so at least one
    requeue, and ends COMPLETED. An allocation's share of steps varies a lot on a loaded machine (CI once got
    ~100 steps out of each of six, the uninterrupted twin competing): MAX_REQUEUES is raised so that the
    count of allocations, which is not what this test checks, cannot fail it."""
    steps = max(STEPS, min(2000, round(50 / reference[1])))
    t0 = time.monotonic()
    job_id = sbatch(tmp_path, "a", steps, "--time=1", "--signal=B:USR1@15", export="MAX_REQUEUES=30")
    ref = direct(tmp_path, "ref", steps, nice=True)  # the uninterrupted twin, meanwhile, yielding the CPUs
    info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=900)
    log = slurm_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert int(info["Restarts"]) >= 1, log[-3000:]
    assert "got SIGUSR1" in log and "requeueing job" in log
    assert ref.wait(timeout=600) == 0, (tmp_path / "ref.log").read_text()[-3000:]
    assert losses(tmp_path / "a") == losses(tmp_path / "ref")
    print(f"{steps} steps, {info['Restarts']} restarts, {time.monotonic() - t0:.0f} s")


def test_scancel_checkpoints_then_sbatch_resumes(tmp_path, reference):
    job_id = sbatch(tmp_path, "a", STEPS)
    metrics = tmp_path / "a" / "metrics.jsonl"
    t0 = time.monotonic()
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5):
        assert time.monotonic() - t0 < 300, slurm_log(tmp_path, job_id)[-3000:]
        time.sleep(0.05)
    subprocess.run(["scancel", job_id], check=True)
    info = wait_job(job_id, ("CANCELLED", "COMPLETED", "FAILED"), timeout=120)
    time.sleep(2)  # a requeue would show as PENDING now
    info = job(job_id)
    log = slurm_log(tmp_path, job_id)
    assert info["JobState"] == "CANCELLED" and info["Restarts"] == "0", (info["JobState"], log[-3000:])
    reached = max(losses(tmp_path / "a"))
    assert reached < STEPS and "SIGTERM received" in log, log[-3000:]
    assert list_checkpoints(tmp_path / "a" / "checkpoints") == [reached], log[-3000:]

    job_id = sbatch(tmp_path, "a", STEPS)
    info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=300)
    assert info["JobState"] == "COMPLETED", slurm_log(tmp_path, job_id)[-3000:]
    assert f"resumed from {tmp_path / 'a' / 'checkpoints' / f'step-{reached}'}" in slurm_log(tmp_path, job_id)
    assert losses(tmp_path / "a") == reference[0]


@pytest.mark.extended
def test_an_exit_file_left_by_an_earlier_job_of_the_same_id_is_not_taken_for_this_jobs(tmp_path, reference):
    """A job scancel'ed while its script is killed can leave its launcher's exit file behind; a later job of the same
    id (a controller whose job ids started again, another cluster sharing /tmp: seen when both local clusters
    reached job 3) must not read it as its own launcher's code (the watchdog ended srun at once and the job
    requeued at step 0)."""
    out = subprocess.run(["sbatch", "--parsable", "--hold", "--wrap", "true"], capture_output=True, text=True,
                         env=ENV, check=True)
    held = int(out.stdout.strip().split(";")[0])
    subprocess.run(["scancel", str(held)], check=True)
    conf = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, check=True).stdout
    cluster = next(ln.split("=", 1)[1].strip() for ln in conf.splitlines() if ln.startswith("ClusterName"))
    stale = Path(os.environ.get("TMPDIR", "/tmp")) / f"outlier_titan-{cluster}-job{held + 1}-restart0.exit.node0"
    stale.write_text("75\n")
    os.utime(stale, (time.time() - 600, time.time() - 600))
    try:
        job_id = sbatch(tmp_path, "a", STEPS)
        assert job_id == str(held + 1), "another job was submitted meanwhile; the stale file named another id"
        info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=300)
    finally:
        stale.unlink(missing_ok=True)
    log = slurm_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", log[-3000:]
    assert "ending srun" not in log and f"{STEPS} of {STEPS} steps done" in log, log[-3000:]
    assert losses(tmp_path / "a") == reference[0]


@pytest.mark.extended
def test_a_stray_sigterm_to_the_job_step_requeues_and_never_completes_early(tmp_path, reference):
    """A SIGTERM that reaches the job step but not the batch script (as Slurm's retried signal for a
    dead node's step does after a requeue) makes the ranks save and exit 75; multinode.slurm did not ask for
    that stop, so it requeues instead of ending COMPLETED with steps missing; the run then finishes exactly."""
    job_id = sbatch(tmp_path, "a", STEPS)
    metrics = tmp_path / "a" / "metrics.jsonl"
    t0 = time.monotonic()
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 5):
        assert time.monotonic() - t0 < 300, slurm_log(tmp_path, job_id)[-3000:]
        time.sleep(0.05)
    subprocess.run(["scancel", "--signal=TERM", f"{job_id}.0"], check=True)
    info = wait_job(job_id, ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"), timeout=300)
    log = slurm_log(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, (info["JobState"], log[-3000:])
    assert "SIGTERM received" in log and "on a signal this script did not send: requeueing" in log, log[-3000:]
    assert f"ranks exited with 0 (srun: 0); {STEPS} of {STEPS} steps done" in log, log[-3000:]
    assert losses(tmp_path / "a") == reference[0]


@pytest.mark.extended
def test_sweep_job_array_equals_run_local(tmp_path):
    """``sweep.py run --slurm`` submits a real job array (one task per point); the failing point is recorded as
    failed without stopping the others, and ``collect`` gives the table of ``run --local``."""
    from tests.test_sweep import THREE, assert_same_values, read_csv, write
    from tests.test_sweep import cli as sweep

    path = write(tmp_path, THREE)
    for mode in ("local", "slurm"):
        assert sweep("plan", str(path), "--out", mode, cwd=tmp_path).returncode == 0
    assert sweep("run", "local", "--local", cwd=tmp_path).returncode == 1  # one point fails
    proc = sweep("run", "slurm", "--slurm", "--gpus-per-node", "0", "--cpus-per-task", "1", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    script = (tmp_path / "slurm" / "slurm" / "sweep.sbatch").read_text()
    assert "#SBATCH --array=0,1,2\n" in script
    job_id = proc.stdout.split("Submitted batch job")[1].split()[0]
    t0 = time.monotonic()
    while subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip():
        assert time.monotonic() - t0 < 300, f"job array {job_id} still queued or running after 300 s"
        time.sleep(1)
    status = sweep("status", "slurm", cwd=tmp_path).stdout.splitlines()
    assert [line.split()[1] for line in status[1:4]] == ["done", "done", "failed"], status
    assert "error: data.source" in status[3] and status[4] == "2 done, 1 failed"
    for mode in ("local", "slurm"):
        assert sweep("collect", mode, cwd=tmp_path).returncode == 0
    local, slurm = (read_csv(tmp_path / mode / "results.csv") for mode in ("local", "slurm"))
    assert [list(r) for r in slurm] == [list(r) for r in local]
    assert_same_values(slurm, local)


def test_a_job_that_can_never_run_is_reported_at_once(tmp_path):
    """More CPUs per task than any node has leaves a Slurm job PENDING forever (reason
    PartitionConfig); the sweep engine reports it with one line and exit 2 within seconds, and cancels it."""
    from tests.test_sweep import THREE, write
    from tests.test_sweep import cli as sweep

    cpus = os.cpu_count() + 1
    assert sweep("plan", str(write(tmp_path, THREE)), "--out", "big", cwd=tmp_path).returncode == 0
    t0 = time.monotonic()
    proc = sweep("run", "big", "--slurm", "--gpus-per-node", "0", "--cpus-per-task", str(cpus), cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert time.monotonic() - t0 < 30
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: Slurm job ") and "can never start" in line and "PartitionConfig" in line, line
    job_id = line.split()[3]
    assert not subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True).stdout.strip()

