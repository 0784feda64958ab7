"""Fault injection: 2-rank runs under ``python -m outlier_titan.launch`` are killed (SIGKILL, also mid-save) or
preempted (SIGTERM, SIGUSR1) at random points from a fixed seed, then resumed; the final losses must equal an
uninterrupted run's, and no complete checkpoint may ever be lost or become unreadable."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outlier_titan.checkpoint.manager import list_checkpoints
from outlier_titan.exit_codes import FAILURE, INTERRUPTED, STOPPED
from outlier_titan.observe.logger import read_metrics
from tests.launch import REPO, TINY

STEPS = 12
# Later overrides win: TINY with checkpoints every 3 steps, all of them kept.
ARGS = [*TINY, "--training.steps", str(STEPS), "--checkpoint.enable", "true", "--checkpoint.interval", "3",
        "--checkpoint.keep_latest_k", "0"]


def launch(tmp_path: Path, name: str, *extra: str) -> subprocess.Popen:
    """Starts a 2-rank run through the launcher, as ``scripts/run_train.sh`` does; output in ``<name>.log``."""
    cmd = [sys.executable, "-m", "outlier_titan.launch", "--standalone", "--nproc_per_node=2",
           str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"),
           "--job.dump_folder", str(tmp_path), "--job.name", name, *ARGS, *extra]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    log = open(tmp_path / f"{name}.log", "a")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    return proc.wait(timeout=timeout)


def wait_for(cond, timeout: float = 120.0, what: str = "") -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)


def losses(run_dir: Path) -> dict[int, float]:
    return {s: r["loss"] for s, r in read_metrics(run_dir / "metrics.jsonl").items() if "loss" in r}


def logged_steps(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.is_file() else 0


def saving(run_dir: Path) -> bool:
    folder = run_dir / "checkpoints"
    return folder.is_dir() and any(p.name.startswith(".tmp-") for p in folder.iterdir())


def ranks_of(launcher_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def gone(pids: list[int]) -> bool:
    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().split(") ")[-1][0] != "Z"
        except OSError:
            return False
    return not any(alive(p) for p in pids)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("ref")
    assert finish(launch(tmp, "ref")) == 0, (tmp / "ref.log").read_text()[-3000:]
    ref = losses(tmp / "ref")
    assert sorted(ref) == list(range(1, STEPS + 1))
    return ref


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", ["kill", *(pytest.param(c, marks=pytest.mark.extended)
                                           for c in ("kill_mid_save", "term", "usr1", "usr1_start_up"))])
def test_fault_then_resume_equals_uninterrupted(tmp_path, reference, case):
    rng = random.Random(f"faults-{case}")
    run = tmp_path / "run"
    proc = launch(tmp_path, "run")
    if case == "usr1_start_up":
        time.sleep(rng.uniform(0.5, 2.0))  # the ranks are still importing torch / building the model
    elif case == "kill_mid_save":
        wait_for(lambda: saving(run), what="a checkpoint being written")
    else:
        first = rng.randint(2, STEPS - 3)
        wait_for(lambda: logged_steps(run) >= first, what=f"step {first}")
    before = list_checkpoints(run / "checkpoints")
    sig = {"kill": signal.SIGKILL, "kill_mid_save": signal.SIGKILL, "term": signal.SIGTERM}.get(case, signal.SIGUSR1)
    ranks = ranks_of(proc.pid)
    proc.send_signal(sig)
    code = finish(proc)
    log = (tmp_path / "run.log").read_text()
    after = list_checkpoints(run / "checkpoints")
    assert set(before) <= set(after), f"checkpoints lost: {before} -> {after}"
    if sig == signal.SIGKILL:
        # Launcher killed: its ranks die with it and write nothing more.
        assert code == -signal.SIGKILL
        wait_for(lambda: gone(ranks), timeout=5, what="the orphaned ranks to stop")
        written = (list_checkpoints(run / "checkpoints"), logged_steps(run))
        time.sleep(1.0)
        assert (list_checkpoints(run / "checkpoints"), logged_steps(run)) == written
        assert after == before, f"a checkpoint was committed after the launcher died: {before} -> {after}"
    else:
        assert code == STOPPED, log[-3000:]  # stopped on request, resumable
        assert "Traceback" not in log, log[-3000:]
        reached = max(losses(run), default=0)
        assert reached < STEPS, "the signal came too late to test anything"
        assert f"{sig.name} received" in log
        # The checkpoint of the step reached (none needed when stopped before the first step).
        assert (after[-1] if after else 0) == reached, (after, reached, log[-2000:])
    for step in after:
        assert (run / "checkpoints" / f"step-{step}" / ".metadata").is_file()

    assert finish(launch(tmp_path, "run")) == 0, (tmp_path / "run.log").read_text()[-3000:]
    resumed = losses(run)
    assert resumed == reference, {s: (resumed.get(s), reference[s]) for s in reference if resumed.get(s) != reference[s]}
    assert list_checkpoints(run / "checkpoints")[-1] == STEPS


def test_unknown_stop_signal_is_one_line(tmp_path):
    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"),
           "--job.dump_folder", str(tmp_path), "--checkpoint.stop_signals", "SIGTERM,SIGHUP"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("error: checkpoint.stop_signals: SIGHUP cannot be used; choose from SIGTERM, "
                                   "SIGUSR1, SIGUSR2 (comma-separated, '' for none)")
    assert not (tmp_path / "debug").exists()


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("filter_, override, start", [
    (["--local-ranks-filter", "3"], ["--data.source", "missing.txt"], "error: data.source:"),
    ([], ["--parallelism.tp", "3"], "error: parallelism: dp_replicate x tp = 3 does not divide"),
])
def test_user_error_of_any_rank_is_the_consoles_one_last_line(tmp_path, filter_, override, start):
    """A user error on any rank (4 ranks) is shown once, as the launcher's last line, exit 2: the ranks leave it
    to the launcher and torchrun's own "failed (exitcode: 2)" lines are not shown."""
    cmd = [sys.executable, "-m", "outlier_titan.launch", "--standalone", "--nproc_per_node=4", *filter_,
           str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"),
           "--job.dump_folder", str(tmp_path), *override]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(start), proc.stderr[-3000:]
    assert [line for line in lines if line.startswith("error:")] == [lines[-1]], proc.stderr[-3000:]
    assert "exitcode" not in proc.stderr and "Sending process" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.dist
@pytest.mark.slow
def test_rank_killed_during_save_is_a_failure_not_a_user_error(tmp_path):
    """A rank SIGKILLed while the checkpoint is written ends the launcher with the failure code (1),
    never the user-error code 2, and no ``error:`` line; the partial save is never committed."""
    run = tmp_path / "run"
    proc = launch(tmp_path, "run", "--checkpoint.interval", "1")
    wait_for(lambda: logged_steps(run) >= 2 and saving(run), what="a checkpoint being written after step 2")
    before = list_checkpoints(run / "checkpoints")
    os.kill(ranks_of(proc.pid)[-1], signal.SIGKILL)
    code = finish(proc, timeout=120)
    log = (tmp_path / "run.log").read_text()
    assert code == FAILURE, (code, log[-3000:])
    assert not [line for line in log.splitlines() if line.startswith("error:")], log[-3000:]
    assert "failure:" in log, log[-3000:]
    after = list_checkpoints(run / "checkpoints")
    assert set(before) <= set(after) and all((run / "checkpoints" / f"step-{s}" / ".metadata").is_file()
                                             for s in after)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_like_sigterm_and_a_second_aborts(tmp_path, presses):
    """Ctrl-C (SIGINT to the launcher) finishes the step, saves it and exits 75 without a traceback; a
    second Ctrl-C aborts at once with 130, one line, and commits nothing more."""
    run = tmp_path / "run"
    proc = launch(tmp_path, "run", "--checkpoint.interval", "100")
    if presses == 1:
        wait_for(lambda: logged_steps(run) >= 2, what="step 2")
        proc.send_signal(signal.SIGINT)
    else:  # both presses while the ranks still start up (a step here is faster than a person's double press)
        wait_for(lambda: len(ranks_of(proc.pid)) == 2, what="the ranks to start")
        proc.send_signal(signal.SIGINT)
        time.sleep(1.0)
        proc.send_signal(signal.SIGINT)
    code = finish(proc, timeout=120)
    log = (tmp_path / "run.log").read_text()
    assert "Traceback" not in log and "KeyboardInterrupt" not in log, log[-3000:]
    saved = list_checkpoints(run / "checkpoints")
    if presses == 1:
        assert code == STOPPED, (code, log[-3000:])
        assert "SIGINT received: stopped after step" in log, log[-3000:]
        assert saved == [max(losses(run))], (saved, log[-2000:])
    else:
        assert code == INTERRUPTED, (code, log[-3000:])
        assert log.strip().splitlines()[-1] == "aborted by a second Ctrl-C; the newest complete checkpoint is kept"
        assert saved == [] and logged_steps(run) == 0, (saved, log[-2000:])


@pytest.mark.dist
@pytest.mark.slow
def test_a_stop_signal_during_a_save_stops_right_after_it(tmp_path):
    """SIGTERM reaches both ranks while step N is being saved (they are paused while ``.tmp-step-N`` is seen, so
    the signal lands before the commit): the run stops with step N saved, exit 75, and trains no step after it
    (it used to train and save one more)."""
    run = tmp_path / "run"
    proc = launch(tmp_path, "run", "--checkpoint.interval", "1")
    while True:
        wait_for(lambda: saving(run), what="a checkpoint being written")
        ranks = ranks_of(proc.pid)
        for pid in ranks:
            os.kill(pid, signal.SIGSTOP)
        pending = [p.name for p in (run / "checkpoints").iterdir() if p.name.startswith(".tmp-step-")]
        if pending:
            break
        for pid in ranks:  # the save ended between the look and the pause: try the next one
            os.kill(pid, signal.SIGCONT)
    for pid in ranks:
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGCONT)
    step = int(pending[0].rsplit("-", 1)[1])
    code = finish(proc, timeout=120)
    log = (tmp_path / "run.log").read_text()
    assert code == STOPPED, (code, log[-3000:])
    assert f"SIGTERM received: stopped after step {step} (checkpoint saved)" in log, log[-3000:]
    assert max(losses(run)) == step and list_checkpoints(run / "checkpoints")[-1] == step, log[-3000:]


@pytest.mark.dist
@pytest.mark.slow
def test_a_frozen_peer_fails_the_run_within_the_collective_timeout(tmp_path):
    """A rank that freezes (SIGSTOP: no TCP reset) makes its peer fail after
    ``parallelism.collective_timeout_s``, not gloo's default 30 minutes; the launcher exits with the failure code
    and a ``failure:`` line that names the setting."""
    run = tmp_path / "run"
    proc = launch(tmp_path, "run", "--training.steps", "100000", "--parallelism.collective_timeout_s", "5")
    wait_for(lambda: logged_steps(run) >= 3, what="step 3")
    frozen = ranks_of(proc.pid)[-1]
    os.kill(frozen, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        wait_for(lambda: "failure:" in (tmp_path / "run.log").read_text(), timeout=60, what="the peer's timeout")
        waited = time.monotonic() - t0
    finally:
        os.kill(frozen, signal.SIGCONT)  # lets torchrun's SIGTERM reach it (else it waits 30 s, then SIGKILLs)
    code = finish(proc, timeout=120)
    log = (tmp_path / "run.log").read_text()
    assert code == FAILURE, (code, log[-3000:])
    # the peer may already wait in the step's collective when the SIGSTOP lands (its 5 s began before t0: 4.9988 s
    # measured once under load), so the lower bound only rules out an immediate failure such as a TCP reset
    assert 2.5 <= waited < 30, waited
    assert "parallelism.collective_timeout_s = 5" in log, log[-3000:]


@pytest.mark.parametrize("codes, user, failure, aborted, want", [
    ({75}, [], [], False, (75, [])),
    ({2}, ["error: x"], [], False, (2, ["error: x"])),
    ({2, 75}, ["error: x"], [], False, (2, ["error: x"])),
    ({3, 2}, ["error: d"], [], False, (3, ["error: d"])),
    ({-9}, [], [], False, (1, ["failure: a rank was killed by SIGKILL; resume from the newest complete checkpoint"])),
    ({2, -9}, ["error: saving failed"], [], False,
     (1, ["failure: a rank was killed by SIGKILL; resume from the newest complete checkpoint"])),
    ({1}, [], ["failure: f"], False, (1, ["failure: f"])),
    ({1, 75}, [], [], False, (1, [])),
    ({130}, [], [], True, (130, ["aborted by a second Ctrl-C; the newest complete checkpoint is kept"])),
    ({75}, [], [], True, (75, [])),  # the second press came after every rank had saved and stopped
    # torchrun SIGTERMs a rank still in set-up after its peers' user error; the launcher was sent no signal
    ({2, -15}, ["error: x"], [], False, (2, ["error: x"])),
    ({-15}, [], [], False, (1, ["failure: a rank was killed by SIGTERM; resume from the newest complete checkpoint"])),
])
def test_launcher_exit_code_decision(codes, user, failure, aborted, want):
    """The exit contract's table: a rank that died unreported makes the job a failure (1), never a user error."""
    from outlier_titan.launch import decide

    assert decide(codes, user, failure, aborted) == want


def test_a_child_between_fork_and_exec_gets_no_signal_though_it_shows_the_launchers_handlers(tmp_path, monkeypatch):
    """The window that made the start-up USR1 case flaky under load: a forked child still has this process's
    handlers in its SigCgt until it execs, yet a signal sent then kills it (its handlers are reset to the defaults
    before exec, the signal pending). Only a child running its own program with its own handler is ready; a rank's
    ``ready-<pid>`` note counts whatever SigCgt shows."""
    from outlier_titan import launch
    from outlier_titan.preempt import ERROR_DIR_ENV

    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    previous = signal.signal(signal.SIGUSR1, lambda *_: None)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the launcher's copy, not exec'd yet
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])
        os.close(w)
        os.read(r, 1)
        os._exit(0)
    try:
        assert launch._catches(pid, signal.SIGUSR1)  # what the old check read: "ready"
        assert not launch._ready(pid, signal.SIGUSR1)
        (tmp_path / f"ready-{pid}").touch()
        assert launch._ready(pid, signal.SIGUSR1) and launch._ready(pid, signal.SIGINT)
    finally:
        os.close(w)
        os.waitpid(pid, 0)
        signal.signal(signal.SIGUSR1, previous)
    own = subprocess.Popen([sys.executable, "-c", "import signal, sys; signal.signal(signal.SIGUSR1, print); "
                            "print(flush=True); sys.stdin.read()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        own.stdout.readline()  # its handler is installed
        assert launch._ready(own.pid, signal.SIGUSR1) and not launch._ready(own.pid, signal.SIGINT)
    finally:
        own.communicate(b"")


def test_a_sigterm_death_counts_when_the_launcher_was_signalled():
    """With a SIGTERM sent to the launcher (forwarded to the ranks), a rank killed by it is a failure, not
    collateral of its peers' error."""
    from outlier_titan.launch import decide

    assert decide({2, -15}, ["error: x"], [], False, signalled=True)[0] == 1


def test_progress_reports_steps_done_and_total(tmp_path):
    """``python -m outlier_titan.progress`` (read by multinode.slurm): the newest complete checkpoint's step, or
    the last logged step without checkpoints; an incomplete checkpoint does not count."""
    ckpts = tmp_path / "run" / "checkpoints"
    for name in ("step-2", "step-4", "step-6"):
        (ckpts / name).mkdir(parents=True)
    for name in ("step-2", "step-4"):
        (ckpts / name / ".metadata").write_bytes(b"")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 5, "loss": 1.0}\n')
    base = [sys.executable, "-m", "outlier_titan.progress", "--config", str(REPO / "train_configs/debug.toml"),
            "--job.dump_folder", str(tmp_path), "--job.name", "run", "--training.steps", "8"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for extra, want in ((["--checkpoint.enable", "true"], "4 8"), (["--checkpoint.enable", "false"], "5 8")):
        out = subprocess.run([*base, *extra], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == want, (out.stdout, out.stderr)
    bad = subprocess.run([*base, "--training.nope", "1"], capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error:"), bad.stderr
