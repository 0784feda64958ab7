"""The run folder ``<dump_folder>/<job.name>``: one run at a time (a lock file), the config record with its
history, and what must be writable before training starts.

Lock: ``<run>/.lock`` holds the host, pid and Slurm job id of rank 0 of the run that owns the folder. A lock
is *live* when its pid runs on this host, or, for a lock written on another host, when it was refreshed
(``heartbeat``) within :data:`STALE_SECONDS`. A dead holder's lock, and the lock of an earlier incarnation of
the same Slurm job (a requeue), is taken over with a note. Only rank 0 touches the folder; the other ranks
learn its verdict through :func:`on_rank0`.

Config history: ``config.toml`` always holds the config of the current (or last) start. When a resume
changes it, the previous record is kept as ``config.<step>.toml``, the config that produced steps up to
``<step>``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from outlier_titan import errors
from outlier_titan.errors import RunFolderError, UserError

LOCK_NAME = ".lock"
STALE_SECONDS = 600.0  # a lock from another host not refreshed for this long belongs to a dead run
HEARTBEAT_SECONDS = 60.0


def on_rank0(fn: Callable[[], Any], group=None) -> Any:
    """Runs ``fn`` on rank 0 only and returns its result on every rank; a UserError raised there is raised on
    every rank with the same message, so each rank prints (and exits with) the same line."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return fn()
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("ok", fn())
        except UserError as e:
            box[0] = ("error", type(e).__name__, str(e))
    dist.broadcast_object_list(box, src=0, group=group)
    if box[0][0] == "error":
        raise getattr(errors, box[0][1], UserError)(box[0][2])
    return box[0][1]


def check_writable(folder: Path, what: str) -> None:
    """Writes and removes a probe file in ``folder`` (or, if it does not exist yet, in its nearest existing
    ancestor, where it would be created), creating nothing else; RunFolderError if it cannot."""
    where = Path(folder).absolute()
    while not where.exists() and where != where.parent:
        where = where.parent
    probe = where / f".write-test-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(b"0")
        probe.unlink()
    except OSError as e:
        at = "" if where == Path(folder).absolute() else f" (at {where})"
        raise RunFolderError(f"{what} {folder} is not writable{at} ({e.strerror or e}); make it writable or set "
                             "job.dump_folder to a writable folder") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class RunFolder:
    """Rank 0's handle on the run folder: lock, config record, clean-up of a failed first start."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.lock = self.path / LOCK_NAME
        self.created = False  # this start created the folder (a failed start removes it again)
        self.token: dict | None = None
        self._beat = 0.0

    def _identity(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job": os.environ.get("SLURM_JOB_ID", ""),
                "time": time.time()}

    def _holder(self) -> dict | None:
        try:
            holder = json.loads(self.lock.read_text())
            return holder if isinstance(holder, dict) else None
        except (OSError, ValueError):
            return None

    def _is_live(self, holder: dict | None) -> bool:
        if holder is None:  # unreadable: a writer died mid-write
            return False
        me = self._identity()
        if holder.get("host") == me["host"]:
            pid = int(holder.get("pid", -1))
            return pid != me["pid"] and pid > 0 and _pid_alive(pid)
        if me["slurm_job"] and holder.get("slurm_job") == me["slurm_job"]:
            return False  # an earlier incarnation of this Slurm job (requeued)
        try:
            age = time.time() - self.lock.stat().st_mtime
        except OSError:
            return False
        return age < STALE_SECONDS

    def check_free(self) -> None:
        """RunFolderError if a live run holds the lock (read only; :meth:`acquire` takes it atomically later)."""
        holder = self._holder() if self.lock.exists() else None
        if holder is not None and self._is_live(holder):
            raise self._in_use(holder)

    def _in_use(self, holder: dict) -> RunFolderError:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("time", 0))))
        return RunFolderError(f"run folder {self.path} is in use by pid {holder.get('pid')} on {holder.get('host')} "
                              f"(since {since}); wait for that run to end or set another job.name (if that run is "
                              f"dead, delete {self.lock})")

    def acquire(self) -> str | None:
        """Creates the folder if needed and takes the lock; returns a note when a stale lock was taken over."""
        existed = self.path.is_dir()
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunFolderError(f"cannot create the run folder {self.path} ({e.strerror or e}); set "
                                 "job.dump_folder to a writable folder") from None
        self.created = not existed
        note = None
        me = self._identity()
        for _ in range(3):
            try:
                fd = os.open(self.lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if self._is_live(holder):
                    raise self._in_use(holder) from None
                who = f"pid {holder.get('pid')} on {holder.get('host')}" if holder else "an unreadable lock"
                note = f"run folder {self.path}: took over the stale lock of {who}"
                self.lock.unlink(missing_ok=True)
                continue
            except OSError as e:
                raise RunFolderError(f"run folder {self.path} is not writable ({e.strerror or e}); make it "
                                     "writable or set job.dump_folder to a writable folder") from None
            with os.fdopen(fd, "w") as f:
                json.dump(me, f)
            self.token = me
            self._beat = time.monotonic()
            return note
        raise RunFolderError(f"run folder {self.path}: another run keeps taking its lock; set another job.name")

    def heartbeat(self) -> None:
        """Refreshes the lock's mtime (at most every HEARTBEAT_SECONDS) so other hosts see the run alive."""
        if self.token is None or time.monotonic() - self._beat < HEARTBEAT_SECONDS:
            return
        self._beat = time.monotonic()
        try:
            os.utime(self.lock)
        except OSError:
            pass  # a vanished lock is taken over by the next start anyway

    def release(self) -> None:
        """Removes the lock if it is still ours."""
        if self.token is not None and self._holder() == self.token:
            self.lock.unlink(missing_ok=True)
        self.token = None

    def abandon(self) -> None:
        """After a failed start: removes the folder if this start created it, else only releases the lock."""
        if self.created and self.token is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            self.token = None
        else:
            self.release()

    def write_config(self, toml: str, step: int) -> str | None:
        """Writes ``config.toml``; a different previous record is kept as ``config.<step>.toml`` (returned)."""
        current = self.path / "config.toml"
        kept = None
        if current.is_file() and current.read_text() != toml:
            kept = self.path / f"config.{step}.toml"
            k = 1
            while kept.exists():
                kept, k = self.path / f"config.{step}.{k}.toml", k + 1
            os.replace(current, kept)
        tmp = self.path / ".config.toml.tmp"
        tmp.write_text(toml)
        os.replace(tmp, current)
        return kept.name if kept else None
