"""Running sweep points through the trainer (``python -m outlier_titan.train``, or ``outlier_titan.launch``
(torchrun) for several ranks or nodes).

One code path for ``run --local`` (many points, ``--parallel K`` at a time) and a Slurm array task (one point):
:func:`run_points`. Robustness rules:

- a point is finished when its run folder says so (final step logged, with validation/probe records and the
  final checkpoint when those are enabled), never because an exit code was 0; a trainer stopped by SIGTERM
  exits 75 (stopped, resumable) and is resumed from its checkpoint next time;
- children are started with ``Popen`` from the main thread, in their own session (Ctrl-C reaches only the
  sweep, which then stops them cleanly) and with ``PR_SET_PDEATHSIG = SIGTERM``, so a ``kill -9`` of the sweep
  makes the trainer checkpoint and exit instead of running on as an orphan; the recorded pid is the trainer's
  (the launcher's for several ranks);
- SIGTERM, SIGINT and SIGUSR1 to the sweep are passed to every running trainer as SIGTERM (the trainer's
  "checkpoint at the next step boundary and exit 75"; the launcher forwards it to its ranks), and no new point
  starts;
- a failing point does not stop the others: its status and the trainer's one-line ``error:`` message (or the
  last line of its log) are recorded in ``sweep_state.json``, with the code (commit) of every attempt;
- the CPU threads are shared out: unless ``OMP_NUM_THREADS`` is set, every trainer process gets
  ``cpus // (parallel * nproc)`` threads (at least 1), so parallel points do not oversubscribe the cores
  (two trainers of 2 threads each on 2 cores: 750-1,000 tokens/s each; of 1 thread: 2,850-2,900).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from outlier_titan.checkpoint.manager import list_checkpoints
from outlier_titan.config.manager import tomllib
from outlier_titan.errors import UserError
from outlier_titan.exit_codes import STOPPED
from outlier_titan.observe.logger import read_metrics
from outlier_titan.packaged import child_environment
from outlier_titan.data.sources import embedded_fingerprint
from outlier_titan.provenance import code_version, runtime_versions
from outlier_titan.study.plan import STATE, point_dir, read_state

LOG = "train.log"
PR_SET_PDEATHSIG = 1


# ------------------------------------------------------------------------------------------------ state

def write_state(folder: Path, state: dict[str, Any]) -> None:
    tmp = folder / f".{STATE}.tmp"
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, folder / STATE)


def point_config(entry: dict[str, Any]) -> dict[str, Any]:
    return tomllib.loads(entry["config"])


def run_is_complete(metrics: Path, entry: dict[str, Any]) -> bool:
    """True when a ``metrics.jsonl`` holds the whole run: the final step's loss, with its validation loss and
    probe metrics when those are enabled."""
    if not metrics.is_file():
        return False
    cfg = point_config(entry)
    rec = read_metrics(metrics).get(entry["steps"], {})
    if "loss" not in rec:
        return False
    if cfg.get("eval", {}).get("every", 0) and "val_loss" not in rec:
        return False
    if cfg.get("observe", {}).get("every", 0) and not any(k.startswith("outliers/") for k in rec):
        return False
    return True


def is_finished(folder: Path, entry: dict[str, Any]) -> bool:
    """True when the run folder holds the whole run (:func:`run_is_complete`) and its final checkpoint when
    checkpoints are enabled; a point adopted from another machine's report (``adopted_from`` in its state, see
    ``study.adopt.adopt_points``) has its logs and evaluation but no checkpoint."""
    if not run_is_complete(folder / "metrics.jsonl", entry):
        return False
    if (point_config(entry).get("checkpoint", {}).get("enable", False)
            and entry["steps"] not in list_checkpoints(folder / "checkpoints")
            and not read_state(folder).get("adopted_from")):
        return False
    return True


def _alive(pid: int) -> bool:
    """A live trainer process with this pid on this host (the command line guards against pid reuse)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    zombie = stat.rsplit(")", 1)[-1].split()[0] == "Z"
    return not zombie and (b"outlier_titan.train" in cmdline or b"train.py" in cmdline)


def point_status(sweep_dir: Path, entry: dict[str, Any]) -> dict[str, Any]:
    """status (done / running / failed / pending), last step and loss, error line, attempts, wall time."""
    folder = point_dir(sweep_dir, entry["name"])
    state = read_state(folder)
    metrics = folder / "metrics.jsonl"
    records = read_metrics(metrics) if metrics.is_file() else {}
    losses = [(s, r["loss"]) for s, r in sorted(records.items()) if isinstance(r.get("loss"), (int, float))]
    out = {"name": entry["name"], "last_step": losses[-1][0] if losses else 0,
           "last_loss": losses[-1][1] if losses else None, "error": state.get("error", ""),
           "attempts": state.get("attempts", 0), "wall_s": state.get("wall_s", 0.0)}
    if is_finished(folder, entry):
        out["status"] = "done"
    elif state.get("status") == "running" and (state.get("host") != socket.gethostname()
                                               or _alive(state.get("pid", -1))):
        out["status"] = "running"
    elif state.get("status") == "failed":
        out["status"] = "failed"
    else:
        out["status"] = "pending"
    return out


# ------------------------------------------------------------------------------------------------ launch

def _child_setup(parent: int) -> None:  # pragma: no cover - runs in the forked child
    """Own session, and SIGTERM when the sweep dies (checked after prctl: it may already have died)."""
    os.setsid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(143)


def trainer_command(sweep_dir: Path, entry: dict[str, Any], nproc: int = 1, nnodes: int = 1,
                    rdzv_endpoint: str | None = None, rdzv_id: str | None = None) -> list[str]:
    """``python -m outlier_titan.train`` on the point's config (torchrun for several ranks; c10d rendezvous for
    several nodes)."""
    folder = point_dir(sweep_dir, entry["name"]).resolve()
    args = ["-m", "outlier_titan.train", "--config", str(folder / "config.toml"),
            "--job.dump_folder", str(folder.parent.resolve()), "--job.name", entry["name"]]
    if nproc == 1 and nnodes == 1:
        return [sys.executable, *args]
    # outlier_titan.launch, not plain torchrun: torchrun dies of SIGTERM and kills its ranks before they save.
    launch = [sys.executable, "-m", "outlier_titan.launch", f"--nproc_per_node={nproc}"]
    if nnodes > 1:
        launch += [f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={rdzv_endpoint}",
                   f"--rdzv_id={rdzv_id or 'sweep'}"]
    else:
        launch += ["--standalone"]
    return [*launch, *args]


def error_line(log: Path, offset: int) -> str:
    """The trainer's last ``error:`` line in this attempt's part of the log, else its last line."""
    try:
        with log.open("rb") as f:
            f.seek(offset)
            lines = [ln.strip() for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    for ln in reversed(lines):
        if ln.startswith("error:"):
            return ln
    return lines[-1] if lines else ""


def write_hparams(folder: Path, entry: dict[str, Any]) -> None:
    """The point's axes as TensorBoard hparams, in the run's ``tb/`` (next to the trainer's scalars, so the
    HParams dashboard links them to ``loss``/``val_loss``). Called once per point (marked in the state)."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in entry["axes"].items()}
    hp.update(params=entry["params"], tokens=entry["tokens"], flops=entry["flops"])
    metrics = {"loss": 0.0, "val_loss": 0.0}
    writer = SummaryWriter(log_dir=str(folder / "tb"))
    try:
        for summary in hparams(hp, metrics):
            writer.file_writer.add_summary(summary)
    finally:
        writer.close()


def wait_for_previous_trainers(sweep_dir: Path, entries: list[dict[str, Any]], timeout: float = 120.0) -> None:
    """Trainers of an earlier sweep on this host (killed with -9: they are saving their checkpoint) must exit
    before their points start again; one still alive after ``timeout`` is a user error."""
    deadline = time.time() + timeout
    for e in entries:
        state = read_state(point_dir(sweep_dir, e["name"]))
        pid = state.get("pid")
        if state.get("status") != "running" or state.get("host") != socket.gethostname() or not pid:
            continue
        while _alive(pid) and time.time() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            raise UserError(f"point {e['name']} is still being trained by pid {pid} (another sweep of "
                            f"{sweep_dir}?); stop it or wait for it, then run again")


def trainer_environment(parallel: int, nproc: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a point's trainer: ``environ`` (default ``os.environ``) with this package first on
    PYTHONPATH (``packaged.child_environment``), unbuffered output and,
    unless it sets ``OMP_NUM_THREADS``, this machine's CPUs shared out over ``parallel * nproc`` processes."""
    env = {**child_environment(environ), "PYTHONUNBUFFERED": "1"}
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // (parallel * nproc)))
    return env


class PointRun:
    """One attempt of one point: its child process and log."""

    def __init__(self, sweep_dir: Path, entry: dict[str, Any], command: list[str], primary: bool,
                 env: dict[str, str]):
        self.sweep_dir, self.entry, self.primary = sweep_dir, entry, primary
        self.folder = point_dir(sweep_dir, entry["name"])
        self.command = command
        self.env = env
        self.proc: subprocess.Popen | None = None
        # the embedded corpus is this interpreter's standard library: its fingerprint names the data (the
        # trainer runs under the same interpreter); other sources are named by their config
        source = point_config(entry).get("data", {}).get("source", "embedded")
        self.corpus = embedded_fingerprint() if primary and source == "embedded" else None

    def start(self) -> None:
        folder = self.folder
        folder.mkdir(parents=True, exist_ok=True)
        self.state = read_state(folder) if self.primary else {}
        if self.primary:
            cfg = point_config(self.entry)
            if cfg.get("metrics", {}).get("tensorboard", True) and not self.state.get("hparams_written"):
                write_hparams(folder, self.entry)
                self.state["hparams_written"] = True
        log = folder / LOG
        self.log_offset = log.stat().st_size if log.is_file() else 0
        if self.primary and self.state.get("status") == "running" and self.state.get("started") and log.is_file():
            # the last attempt's driver died before recording it (kill -9, a lost node): its wall time is counted
            # up to the attempt's last log write, and `wall_s_estimated` says how much of wall_s is such an estimate
            lost = max(0.0, log.stat().st_mtime - self.state["started"])
            self.state["wall_s"] = self.state.get("wall_s", 0.0) + lost
            self.state["wall_s_estimated"] = self.state.get("wall_s_estimated", 0.0) + lost
        self.t0 = time.time()
        with log.open("ab") as f:
            f.write(f"==== sweep attempt {self.state.get('attempts', 0) + 1} on {socket.gethostname()} at "
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')}: {' '.join(self.command)}\n".encode())
            f.flush()
            self.proc = subprocess.Popen(self.command, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=self.env, preexec_fn=lambda p=os.getpid(): _child_setup(p))
        if self.primary:
            # the code of every attempt (a resumed point may have run on two versions): the report states them
            codes, code = self.state.get("code", []), code_version()
            versions, now = self.state.get("versions", []), runtime_versions()
            self.state.update(status="running", pid=self.proc.pid, host=socket.gethostname(), started=self.t0,
                              attempts=self.state.get("attempts", 0) + 1, error="",
                              code=codes + [code] if code not in codes[-1:] else codes,
                              versions=versions + [now] if now not in versions[-1:] else versions)
            if self.corpus is not None and self.corpus not in self.state.get("corpus", [])[-1:]:
                self.state["corpus"] = self.state.get("corpus", []) + [self.corpus]
            write_state(folder, self.state)

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass

    def finish(self, stopping: bool) -> str:
        """Records the attempt's outcome from the run folder; returns the status."""
        rc = self.proc.returncode
        wall = time.time() - self.t0
        if is_finished(self.folder, self.entry):
            status, err = "done", ""
        elif rc in (0, STOPPED) or stopping:  # 75: stopped on request after saving (outlier_titan.exit_codes)
            status, err = "pending", "interrupted" + (f" (exit {rc})" if rc not in (0, STOPPED) else "")
        else:
            status, err = "failed", error_line(self.folder / LOG, self.log_offset) or f"exit code {rc}"
        if self.primary:
            self.state.update(status=status, returncode=rc, error=err, ended=time.time(),
                              wall_s=self.state.get("wall_s", 0.0) + wall)
            write_state(self.folder, self.state)
        self.error = err
        return status


class _Signals:
    """Turns SIGTERM/SIGINT/SIGUSR1 into 'stop': running trainers get SIGTERM, nothing new starts."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)

    def __init__(self, running: list[PointRun]):
        self.running, self.stop, self.old = running, False, {}

    def __enter__(self):
        for s in self.SIGNALS:
            self.old[s] = signal.signal(s, self._handle)
        return self

    def _handle(self, signum, _frame):
        self.stop = True
        print(f"sweep: {signal.Signals(signum).name} received; stopping the running points at their next "
              f"step (they resume on the next run)", file=sys.stderr, flush=True)
        for run in self.running:
            run.terminate()

    def __exit__(self, *exc):
        for s, h in self.old.items():
            signal.signal(s, h)


def point_bar(desc: str, total: int, initial: int = 0, enabled: bool = True):
    """The progress bar of a stage that works through points (the sweep's training, a suite's evaluation): a tick a
    point, on stderr; ``point_line`` writes each finished point's line (on stdout) above it."""
    from tqdm import tqdm

    tqdm.monitor_interval = 0  # no monitor thread: children are forked with a preexec_fn
    return tqdm(total=total, initial=initial, desc=desc, unit="point", disable=not enabled, file=sys.stderr,
                dynamic_ncols=True)


def point_line(bar, status: str, name: str, detail: str = "") -> None:
    """One finished point's line above ``bar``: ``<status> <point>[: detail]``, the status padded to one width."""
    bar.write(f"{status:<7} {name}" + (f": {detail}" if detail else ""))


def run_points(sweep_dir: str | Path, manifest: dict[str, Any], indices: list[int] | None = None,
               parallel: int = 1, nproc: int = 1, nnodes: int = 1, rdzv_endpoint: str | None = None,
               rdzv_id: str | None = None, primary: bool = True, progress: bool = True) -> dict[str, str]:
    """Runs the unfinished points among ``indices`` (default: all), ``parallel`` at a time; returns
    name -> status (done / failed / pending) of the points it looked at."""
    sweep_dir = Path(sweep_dir).resolve()
    entries = [manifest["points"][i] for i in (indices if indices is not None else range(len(manifest["points"])))]
    result: dict[str, str] = {}
    todo = []
    for e in entries:
        if is_finished(point_dir(sweep_dir, e["name"]), e):
            result[e["name"]] = "done"
        else:
            todo.append(e)
    if primary:
        wait_for_previous_trainers(sweep_dir, todo)
    skipped = len(entries) - len(todo)
    bar = point_bar("sweep", len(entries), initial=skipped, enabled=progress)
    env = trainer_environment(parallel, nproc)
    if todo and "OMP_NUM_THREADS" not in os.environ:
        bar.write(f"each trainer process uses {env['OMP_NUM_THREADS']} CPU threads ({parallel} point(s) x {nproc} "
                  f"rank(s) at a time; set OMP_NUM_THREADS to choose)")
    running: list[PointRun] = []
    failed = 0
    with _Signals(running) as sig:
        while (todo and not sig.stop) or running:
            while todo and len(running) < parallel and not sig.stop:
                entry = todo.pop(0)
                run = PointRun(sweep_dir, entry, trainer_command(sweep_dir, entry, nproc, nnodes, rdzv_endpoint,
                                                                 rdzv_id), primary, env)
                run.start()
                running.append(run)
                bar.set_postfix_str(f"running {', '.join(r.entry['name'] for r in running)}")
            time.sleep(0.1)
            for run in [r for r in running if r.poll() is not None]:
                running.remove(run)
                status = run.finish(sig.stop)
                result[run.entry["name"]] = status
                failed += status == "failed"
                if status != "pending":
                    bar.update(1)
                point_line(bar, status, run.entry["name"], run.error)
                bar.set_postfix_str(f"failed {failed}" if failed else "")
    bar.close()
    for e in todo:
        result.setdefault(e["name"], "pending")
    return result
