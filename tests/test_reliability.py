"""Damaged, mismatched or unwritable checkpoints and run folders, divergence and careless reuse: each
case ends in one clear line and a known exit code, and never changes an existing checkpoint or run record."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from outlier_titan.checkpoint.manager import list_checkpoints
from outlier_titan.checkpoint.run_folder import STALE_SECONDS, RunFolder
from outlier_titan.data.tokenizer import EMBEDDED_BPE
from outlier_titan.errors import RunFolderError
from tests.launch import REPO, TINY, train

STEPS = ["--checkpoint.enable", "true", "--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "3",
         "--lr_scheduler.total_steps", "8"]


def snapshot(folder: Path) -> dict[str, str]:
    """relative path -> sha256 of every file under ``folder``."""
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def error_lines(run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A 4-step run on a small local text corpus and a copy of the shipped BPE, checkpoints at steps 2 and 4."""
    root = tmp_path_factory.mktemp("base")
    corpus = root / "corpus.txt"
    corpus.write_text("".join((Path(shutil.__file__).parent / name).read_text() for name in
                              ("shutil.py", "textwrap.py", "argparse.py")))
    tok = root / "tok.tiktoken"
    shutil.copy(EMBEDDED_BPE, tok)
    args = [*TINY, *STEPS, "--data.source", str(corpus), "--data.tokenizer", str(tok),
            "--data.cache_dir", str(root / "cache")]
    run = train(root, *args, "--training.steps", "4", name="run").check()
    assert sorted(p.name for p in (run.run_dir / "checkpoints").iterdir()) == ["step-2", "step-4"]
    return root, args


@pytest.fixture
def copy(base, tmp_path):
    """A private copy of the base run folder (as ``tmp_path/run``), its tokenizer and the override list."""
    root, args = base
    shutil.copytree(root / "run", tmp_path / "run")
    tok = tmp_path / "tok.tiktoken"
    shutil.copy(root / "tok.tiktoken", tok)
    args = [str(tok) if a == str(root / "tok.tiktoken") else a for a in args]
    return tmp_path / "run", args


def assert_refused(run, fragments: list[str], code: int = 2) -> None:
    lines = error_lines(run)
    assert run.returncode == code, (run.returncode, run.stderr[-3000:])
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


@pytest.mark.parametrize("damage, fragments", [
    ("truncate", ["cannot load checkpoint", "step-4", "truncated or damaged shard", "mv ", "step-4.corrupt",
                  "to resume from step-2"]),
    ("garbage_metadata", ["step-4 is damaged: its .metadata is unreadable", "to resume from step-2"]),
])
def test_damaged_checkpoint_is_one_line_and_kept(copy, damage, fragments):
    run_dir, args = copy
    ckpt = run_dir / "checkpoints" / "step-4"
    if damage == "truncate":
        shard = ckpt / "__0_0.distcp"
        os.truncate(shard, shard.stat().st_size // 2)
    else:
        (ckpt / ".metadata").write_bytes(b"not a pickle at all")
    before = snapshot(run_dir)
    # Without the checksum check (which would set it aside, see the test below), the load itself refuses it.
    run = train(run_dir.parent, *args, "--training.steps", "6", "--checkpoint.verify", "false")
    assert_refused(run, fragments)
    assert snapshot(run_dir) == before


def flip(path: Path, offset: int, n: int = 4096) -> None:
    """Inverts ``n`` bytes of ``path`` from ``offset`` (size unchanged: only the checksum can tell)."""
    data = bytearray(path.read_bytes())
    data[offset:offset + n] = bytes(b ^ 0xFF for b in data[offset:offset + n])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damaged", [["step-4"], ["step-2", "step-4"]])
def test_flipped_bytes_in_a_shard_are_refused_and_set_aside(copy, damaged):
    """Bytes flipped inside a shard (same size, unpickles fine) are caught by the checksums saved with
    the checkpoint: one WARNING line per checkpoint, moved aside untouched, and the run resumes from the
    previous checkpoint (or from scratch when none is left)."""
    run_dir, args = copy
    ckpts = run_dir / "checkpoints"
    for name in damaged:
        shard = ckpts / name / "__0_0.distcp"
        flip(shard, shard.stat().st_size // 3)
    kept = {name: snapshot(ckpts / name) for name in damaged}
    run = train(run_dir.parent, *args, "--training.steps", "4").check()
    warnings = [line for line in run.stdout.splitlines() if line.startswith("WARNING: checkpoint")]
    resume = "step-2" if damaged == ["step-4"] else "scratch"
    assert warnings == [f"WARNING: checkpoint {ckpts / name} is damaged (__0_0.distcp does not match its checksum "
                        f"(damaged on disk)); moved it aside to {name}.corrupt and resuming from {resume}"
                        for name in damaged], run.stdout
    for name in damaged:
        assert snapshot(ckpts / f"{name}.corrupt") == kept[name]
    assert ("resumed from " + str(ckpts / "step-2") in run.stdout) == (resume == "step-2")
    assert [r["step"] for r in run.records if "loss" in r] == \
        ([1, 2, 3, 4, 3, 4] if resume == "step-2" else [1, 2, 3, 4, 1, 2, 3, 4])


def test_a_damaged_checkpoint_asked_for_by_step_is_one_line(copy):
    run_dir, args = copy
    shard = run_dir / "checkpoints" / "step-4" / "__0_0.distcp"
    flip(shard, 100)
    before = snapshot(run_dir)
    run = train(run_dir.parent, *args, "--training.steps", "6", "--checkpoint.load_step", "4")
    assert_refused(run, ["step-4 is damaged: __0_0.distcp does not match its checksum",
                         "--checkpoint.verify false"])
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("change, fragments", [
    (["--training.seq_len", "32"], ["training.seq_len 64 -> 32", "allow_config_change"]),
    (["--training.seq_len", "32", "--checkpoint.allow_config_change", "true"],
     ["holds model.pos_embeddings.weight with shape [64,", "this run builds [32,"]),
    (["--training.steps", "6", "--lr_scheduler.total_steps", "none"],
     ["training.steps 4 -> 6", "pin lr_scheduler.total_steps = 8"]),
    ("{swap}", ["tokenizer vocabulary", "other BPE ranks: token ids differ"]),
])
def test_breaking_change_on_resume_is_refused(copy, change, fragments):
    run_dir, args = copy
    if change == "{swap}":  # same size and path, two merges exchanged: another vocabulary
        tok = Path(args[args.index("--data.tokenizer") + 1])
        lines = tok.read_text().splitlines()
        (a_tok, a_rank), (b_tok, b_rank) = lines[300].split(), lines[301].split()
        lines[300], lines[301] = f"{a_tok} {b_rank}", f"{b_tok} {a_rank}"
        tok.write_text("\n".join(lines) + "\n")
        change = []
    before = snapshot(run_dir)
    run = train(run_dir.parent, *args, "--training.steps", "6", *change)
    assert_refused(run, fragments)
    assert snapshot(run_dir) == before  # config.toml included: check first, write after


def test_allowed_changes_are_reported_and_the_config_history_kept(copy):
    run_dir, args = copy
    old_config = (run_dir / "config.toml").read_text()
    run = train(run_dir.parent, *args, "--training.steps", "6", "--optimizer.lr", "1e-3").check()
    assert "resume changes training.steps: 4 -> 6" in run.stdout
    assert "resume changes optimizer.lr: 0.003 -> 0.001" in run.stdout
    assert (run_dir / "config.4.toml").read_text() == old_config
    # the new peak lr applies (the checkpoint's optimizer and schedule states carry the old one)
    from outlier_titan.config.job_config import LRScheduler
    from outlier_titan.optim.lr_schedule import lr_factor

    lr5 = [r["lr"] for r in run.records if r.get("step") == 5 and "lr" in r][-1]
    assert lr5 == pytest.approx(1e-3 * lr_factor(5, LRScheduler(warmup_steps=2), 8), rel=1e-9)
    assert 'steps = 6' in (run_dir / "config.toml").read_text()


def test_unreadable_newest_checkpoint_is_moved_aside_loudly(copy):
    run_dir, args = copy
    ckpts = run_dir / "checkpoints"
    (ckpts / "step-4" / ".metadata").unlink()
    kept = snapshot(ckpts / "step-4")
    # a dead process's lock is stale: taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (run_dir / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "time": 0}))
    run = train(run_dir.parent, *args, "--training.steps", "4").check()
    assert "took over the stale lock" in run.stdout
    assert f"WARNING: checkpoint {ckpts / 'step-4'} is unreadable (no .metadata); moved it aside to " \
           "step-4.corrupt and resuming from step-2" in run.stdout
    assert "resumed from" in run.stdout and "step-2" in run.stdout
    assert snapshot(ckpts / "step-4.corrupt") == kept
    assert (ckpts / "step-4" / ".metadata").is_file()  # step 4 re-run and saved anew
    assert not (run_dir / ".lock").exists()  # released at exit


@pytest.mark.dist
def test_live_lock_refuses_on_every_rank(copy):
    run_dir, args = copy
    nproc = 2
    (run_dir / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "time": 0}))
    before = snapshot(run_dir)
    run = train(run_dir.parent, *args, "--training.steps", "6", nproc=nproc)
    lines = error_lines(run)
    assert run.returncode != 0  # torchrun's own code once its ranks exit 2
    # every rank that got to print says the same line (torchrun may stop a rank before it prints)
    assert 1 <= len(lines) <= nproc and len(set(lines)) == 1, run.stderr[-3000:]
    assert f"is in use by pid {os.getpid()} on {socket.gethostname()}" in lines[0]
    assert snapshot(run_dir) == before


def advised_step(line: str) -> int:
    """The step a divergence line says to resume from."""
    m = re.search(r"--checkpoint.load_step (\d+)", line)
    assert m, line
    return int(m.group(1))


def chance_loss(run_dir: Path) -> float:
    """The loss of uniform guessing, ln vocab, from a checkpoint's meta.json."""
    meta = next((run_dir / "checkpoints").glob("step-*/meta.json"))
    return math.log(json.loads(meta.read_text())["vocab_size"])


def assert_no_ruined_checkpoint(run, chance: float) -> None:
    """Every checkpoint on disk was followed by a step whose loss beat uniform guessing (ln vocab)."""
    for step in list_checkpoints(run.run_dir / "checkpoints"):
        if step + 1 in run.losses:
            assert run.losses[step + 1] < chance, (step, run.losses)


def follow_advice(run, tmp_path: Path, args: list[str], chance: float) -> None:
    """The divergence line's advice, followed (its checkpoint, a lower lr), resumes and trains below chance."""
    step = advised_step(error_lines(run)[0])
    again = train(tmp_path, *args, "--checkpoint.load_step", str(step), "--optimizer.lr", "3e-3").check()
    assert f"resumed from {run.run_dir / 'checkpoints' / f'step-{step}'}" in again.stdout
    after = {s: v for s, v in again.losses.items() if s > step}
    assert after and all(v < chance for v in after.values()), after


@pytest.mark.parametrize("lr", ["1e6", "50"])
def test_a_huge_lr_on_resume_keeps_no_ruined_checkpoint_and_the_advice_works(copy, lr):
    """lr 50 after good steps: the first update's gradient is finite, its weights' loss is ~10^5 (once saved,
    kept and recommended); lr 1e6: the gradients turn non-finite. Checkpoints every step from the resume on."""
    run_dir, args = copy
    args = [*args, "--training.steps", "8", "--checkpoint.interval", "1", "--training.max_skipped_steps", "2"]
    before, chance = snapshot(run_dir / "checkpoints"), chance_loss(run_dir)
    run = train(run_dir.parent, *args, "--optimizer.lr", lr)
    assert_refused(run, ["training diverged: steps", "training.max_skipped_steps = 2", "lower optimizer.lr",
                         "this run's newest checkpoint step-4 precedes the divergence", "--checkpoint.load_step 4"],
                   code=3)
    assert "step 5: checkpoint not saved: the weights its update produced are ruined" in run.stdout, run.stdout
    assert snapshot(run_dir / "checkpoints") == before
    follow_advice(run, run_dir.parent, args, chance)


def test_the_advice_names_this_runs_checkpoint_not_a_newer_abandoned_one(copy):
    """A step-12 left by another try is newer than anything of this run: the advice names step-4, which this
    run resumed from, and the advised run keeps its own newest checkpoints (step-12 is not counted among them)."""
    run_dir, args = copy
    shutil.copytree(run_dir / "checkpoints" / "step-4", run_dir / "checkpoints" / "step-12")
    args = [*args, "--training.steps", "8", "--checkpoint.interval", "1", "--training.max_skipped_steps", "2"]
    chance = chance_loss(run_dir)
    run = train(run_dir.parent, *args, "--checkpoint.load_step", "4", "--optimizer.lr", "50")
    assert_refused(run, ["this run's newest checkpoint step-4 precedes", "--checkpoint.load_step 4"], code=3)
    assert "step-12" not in run.stderr + run.stdout
    follow_advice(run, run_dir.parent, args, chance)
    assert list_checkpoints(run_dir / "checkpoints") == [6, 7, 8, 12]  # keep_latest_k 3 of this run, and step-12


def test_a_blow_up_over_several_steps_ends_at_a_checkpoint_that_precedes_it(tmp_path):
    """The lr ramps up to 0.15: the loss falls for three steps, then climbs (12.7, 14.0, 12.0 against 7.9 at
    best, uniform guessing 8.3) with finite gradients throughout; without the loss history this run finished
    with exit 0 and checkpoints of those weights."""
    args = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.keep_latest_k", "1",
            "--training.max_skipped_steps", "3", "--lr_scheduler.warmup_steps", "12", "--lr_scheduler.decay",
            "constant", "--training.steps", "10", "--lr_scheduler.total_steps", "20"]
    run = train(tmp_path, *args, "--optimizer.lr", "0.15")
    assert_refused(run, ["training diverged: steps", "at best recently", "--checkpoint.load_step"], code=3)
    chance = chance_loss(run.run_dir)
    assert_no_ruined_checkpoint(run, chance)
    follow_advice(run, tmp_path, args, chance)


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_diverging_first_update_leaves_no_checkpoint(tmp_path, nproc):
    """With lr 1e6 step 1's gradient is finite but its update ruins the weights (step 2's loss ~1e13): no
    checkpoint of them is kept and the line says to start afresh."""
    args = [*TINY, "--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "1",
            "--checkpoint.keep_latest_k", "0", "--optimizer.lr", "1e6", "--training.max_skipped_steps", "3"]
    run = train(tmp_path, *args, nproc=nproc, launcher="outlier_titan.launch")
    if nproc > 1:  # the ranks leave the line to the launcher: once, last (exit 3)
        assert run.stderr.strip().splitlines()[-1] == error_lines(run)[0], run.stderr[-3000:]
    assert_refused(run, ["training diverged: steps 2-4", "no checkpoint of this run precedes it: start afresh",
                         "--checkpoint.load_step 0", "lower optimizer.lr (now 1e+06)"], code=3)
    assert "step 1: checkpoint not saved: the weights its update produced are ruined" in run.stdout, run.stdout
    assert not (run.run_dir / "checkpoints").exists() or not any((run.run_dir / "checkpoints").iterdir())


def test_the_divergence_guard_changes_no_loss(tmp_path):
    """The guard's extra forward and backward before a save leaves gradients and RNG as they were: the same
    losses with a save every step as with none."""
    args = [*TINY, "--training.steps", "5", "--checkpoint.keep_latest_k", "0"]
    plain = train(tmp_path, *args, name="plain").check()
    saved = train(tmp_path, *args, "--checkpoint.enable", "true", "--checkpoint.interval", "1", name="saved").check()
    assert saved.losses == plain.losses and len(plain.losses) == 5


def test_failed_start_leaves_no_run_folder(base, tmp_path):
    _, args = base
    run = train(tmp_path, *args, "--model.vocab_size", "64", name="fresh")  # fails at the model build
    assert_refused(run, ["model.vocab_size = 64 is smaller than the tokenizer's"])
    assert not (tmp_path / "fresh").exists()


def _in_namespace(script: str) -> subprocess.CompletedProcess:
    """Runs ``script`` as root of a private mount namespace (so it can mount a tmpfs) or skips the test."""
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) for a private tmpfs")
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /mnt 2>/dev/null || "
                            "mount -t tmpfs -o size=1M tmpfs \"$(mktemp -d)\""], capture_output=True)
    if probe.returncode:
        pytest.skip("user namespaces with tmpfs mounts are not available here")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(["unshare", "-rm", "bash", "-c", script], capture_output=True, text=True, env=env,
                          timeout=600)


def _train_cmd(args: list[str], dump: Path, steps: int) -> str:
    import shlex

    return " ".join(shlex.quote(a) for a in [sys.executable, str(REPO / "train.py"), "--config",
                                             str(REPO / "train_configs/debug.toml"), *args, "--job.dump_folder",
                                             str(dump), "--job.name", "run", "--training.steps", str(steps)])


@pytest.mark.slow
def test_disk_full_during_save_keeps_previous_checkpoints(base, tmp_path):
    """A tmpfs runs out of inodes in the middle of writing step 4: one line, partial folder removed, step 2 kept."""
    _, args = base
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f"""set -u
mount -t tmpfs -o size=512M tmpfs {mnt}
{_train_cmd(args, mnt, 2)} > /dev/null 2>&1 || {{ echo FIRST_RUN_FAILED; exit 1; }}
sha256sum $(find {mnt}/run/checkpoints -type f | sort) > {tmp_path}/before.txt
used=$(df --output=iused {mnt} | tail -1)
mount -o remount,nr_inodes=$((used + 3)) {mnt}
{_train_cmd(args, mnt, 4)}
echo "RC=$?"
ls -A {mnt}/run/checkpoints
sha256sum -c --quiet {tmp_path}/before.txt && echo KEPT
"""
    proc = _in_namespace(script)
    out = proc.stdout
    assert "FIRST_RUN_FAILED" not in out, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "RC=2" in out and len(lines) == 1, proc.stderr[-3000:]
    assert f"no space left on device while saving step 4 to {mnt}/run/checkpoints/step-4 (needs ~" in lines[0]
    assert "removed the partial .tmp-step-4, previous checkpoints are kept" in lines[0]
    listing = out.split("RC=2", 1)[1].split()
    assert "step-2" in listing and not any(n.startswith(".tmp-step") for n in listing) and "KEPT" in out


@pytest.mark.slow
def test_free_space_and_writability_are_checked_before_training(base, tmp_path):
    """A tmpfs smaller than one checkpoint: refused before the first step, in MiB; a read-only checkpoint folder:
    refused at start, before the model is built."""
    _, args = base
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = f"""set -u
mount -t tmpfs -o size=6M tmpfs {mnt}
{_train_cmd(args, mnt, 2)}
echo "RC1=$?"
ls -A {mnt}
echo "END1"
mkdir -p {mnt}/run/checkpoints
mount --bind {mnt}/run/checkpoints {mnt}/run/checkpoints && mount -o remount,bind,ro {mnt}/run/checkpoints
{_train_cmd(args, mnt, 2)}
echo "RC2=$?"
"""
    proc = _in_namespace(script)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "RC1=2" in proc.stdout and "RC2=2" in proc.stdout and len(lines) == 2, proc.stdout + proc.stderr[-3000:]
    assert "not enough space on device to save step 2" in lines[0] and " MiB free)" in lines[0], lines[0]
    assert proc.stdout.split("RC1=2", 1)[1].split("END1")[0].split() == []  # a failed start leaves no run folder
    assert "step      1" not in proc.stdout.split("RC1=2", 1)[0]  # refused before the first step
    assert f"checkpoint folder {mnt}/run/checkpoints is not writable (Read-only file system)" in lines[1]
    assert "step      1" not in proc.stdout.split("END1", 1)[1]  # refused before training


def _lock(folder: Path, **holder) -> RunFolder:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".lock").write_text(json.dumps({"pid": 1, "slurm_job": "", "time": 0, **holder}))
    return RunFolder(folder)


def test_lock_of_another_host_is_live_until_stale(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    run = _lock(tmp_path / "a", host="other-node")
    with pytest.raises(RunFolderError, match=r"is in use by pid 1 on other-node .*delete .*\.lock"):
        run.acquire()
    old = time.time() - STALE_SECONDS - 5
    os.utime(run.lock, (old, old))  # the holder stopped refreshing it: dead
    assert "took over the stale lock of pid 1 on other-node" in run.acquire()
    assert json.loads(run.lock.read_text())["pid"] == os.getpid()
    run.release()
    assert not run.lock.exists()


def test_lock_of_an_earlier_incarnation_of_the_slurm_job_is_taken_over(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    run = _lock(tmp_path / "b", host="other-node", slurm_job="4242")
    assert "took over" in run.acquire()  # a requeued job on another node
    run.release()


def test_config_history_keeps_each_changed_record(tmp_path):
    run = RunFolder(tmp_path / "c")
    run.acquire()
    assert run.write_config("a = 1\n", 0) is None
    assert run.write_config("a = 1\n", 10) is None  # unchanged: no history entry
    assert run.write_config("a = 2\n", 10) == "config.10.toml"
    assert run.write_config("a = 3\n", 10) == "config.10.1.toml"
    assert (run.path / "config.10.toml").read_text() == "a = 1\n"
    assert (run.path / "config.toml").read_text() == "a = 3\n"


def test_bad_data_source_on_the_1b_config_fails_before_the_model_is_built(tmp_path):
    """(Measured: ~58 s and a leftover run folder before the reorder, ~13 s, mostly imports, after.)"""
    # the embedded tokenizer: the config's named tiktoken encoding needs a download this machine may not allow
    run = train(tmp_path, "--data.source", str(tmp_path / "no_such_corpus"), "--training.device", "cpu",
                "--data.tokenizer", "embedded", config="train_configs/llama_1b_8gpu.toml", name="big")
    assert_refused(run, [f"data.source: path {tmp_path / 'no_such_corpus'} does not exist"])
    assert not run.run_dir.exists()


def test_the_loss_reference_does_not_climb_with_a_slow_blow_up():
    """Losses settle at 3.0 (one easy batch at 0.5 among them), then rise 5 % a step: each step alone passes,
    yet the reference stays at the settled level, so the rise is called diverged once it doubles it; an
    ordinary spike is not."""
    from outlier_titan.training.divergence import Health

    health = Health(vocab_size=50257)
    for loss in [4.0, 3.6, 3.3, 3.1, 0.5, *[3.0] * 20]:
        assert health.loss_problem(loss) is None
        health.add_loss(loss)
    assert health.loss_problem(4.5) is None  # a spike of +50 %
    loss, steps = 3.0, 0
    while health.loss_problem(loss) is None:
        health.add_loss(loss)
        loss, steps = loss * 1.05, steps + 1
    assert health.reference() == 3.0 and 6.0 < loss < 6.4 and steps == 15
