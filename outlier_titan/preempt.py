"""Preemption on the rank side: stop signals and the launcher watch. Imports nothing heavy (no torch), so
``train.py`` can install the handlers before the seconds-long ``import torch``.

Convention: each signal named in ``checkpoint.stop_signals`` (default SIGTERM and SIGUSR1) makes every rank
finish the current step, save a checkpoint of the step reached and exit with ``exit_codes.STOPPED`` (75,
resumable). SIGTERM means stop (``scancel``); SIGUSR1 is Slurm's early warning, after which
``scripts/multinode.slurm`` requeues the job. Ctrl-C (SIGINT) always stops the same way; a second Ctrl-C aborts
at once (exit 130, one line, nothing more saved).
"""

from __future__ import annotations

import os
import signal
import sys

from outlier_titan.errors import UserError, print_error

# The signals the launcher (``outlier_titan.launch``) forwards to the ranks instead of handling them itself.
FORWARDED = ("SIGTERM", "SIGUSR1", "SIGUSR2")
LAUNCHER_PID_ENV = "OUTLIER_TITAN_LAUNCHER_PID"
ERROR_DIR_ENV = "OUTLIER_TITAN_ERROR_DIR"

_received: list[str] = []
_interrupts = [0]
_PR_SET_PDEATHSIG = 1


def _record(signum, _frame) -> None:
    _received.append(signal.Signals(signum).name)


def _on_interrupt(signum, _frame) -> None:
    """Ctrl-C: the first one stops like SIGTERM (finish the step, save, exit 75), a second one aborts."""
    _interrupts[0] += 1
    if _interrupts[0] == 1:
        _received.append("SIGINT")
        if os.environ.get("RANK", "0") == "0":
            os.write(2, b"Ctrl-C: stopping after this step and saving it; press Ctrl-C again to abort without "
                        b"saving\n")
        return
    if os.environ.get("RANK", "0") == "0":
        os.write(2, b"aborted by a second Ctrl-C; the newest complete checkpoint is kept\n")
    os._exit(130)


def install_early() -> None:
    """Catches every forwardable signal from the first line of ``train.py`` (a signal that arrives while torch
    imports is kept, not fatal) and ties this rank's life to its launcher's (see :func:`launcher_alive`)."""
    for name in FORWARDED:
        signal.signal(getattr(signal, name), _record)
    signal.signal(signal.SIGINT, _on_interrupt)
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and os.path.isdir(folder):  # tells the launcher that Ctrl-C may now be forwarded to this rank
        open(os.path.join(folder, f"ready-{os.getpid()}"), "w").close()
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if pid and sys.platform == "linux":
        import ctypes

        # The kernel kills this rank the moment its launcher dies (kill -9 included), even inside a blocking
        # store connect or collective; a launcher that died before this line is caught by launcher_alive().
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def parse_signals(text: str) -> list[str]:
    """``checkpoint.stop_signals`` ("SIGTERM,SIGUSR1", "" for none) as signal names; a bad name is a UserError."""
    names = [s.strip().upper() for s in text.split(",") if s.strip()]
    names = [n if n.startswith("SIG") else f"SIG{n}" for n in names]
    bad = [n for n in names if n not in FORWARDED]
    if bad:
        raise UserError(f"checkpoint.stop_signals: {', '.join(bad)} cannot be used; choose from "
                        f"{', '.join(FORWARDED)} (comma-separated, '' for none)")
    return names


def configure(text: str) -> None:
    """Keeps the stop handler for the configured signals only; the others get their default action back (and
    one that already arrived takes effect now, as it would have without the early handler)."""
    names = set(parse_signals(text))
    for name in FORWARDED:
        if name not in names:
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    for name in list(_received):
        if name not in names:
            os.kill(os.getpid(), getattr(signal, name))


def stop_requested() -> str | None:
    """The name of the first stop signal this rank received, or None."""
    return _received[0] if _received else None


def launcher_alive() -> bool:
    """False when this rank was started by ``outlier_titan.launch`` and that launcher is gone (then the rank
    must not write anything: nobody would restart it from a consistent state)."""
    pid = os.environ.get(LAUNCHER_PID_ENV)
    return not pid or os.getppid() == int(pid)


def report_user_error(message: str) -> None:
    """A user error's one line: left where the launcher prints it once, whichever rank hit it; printed here
    without a launcher."""
    _report(message, "txt")


def report_failure(message: str) -> None:
    """A failure's one line (not the user's: a peer died, a save failed): printed here at once (the launcher may
    wait half a minute for a frozen peer before it can say anything) and left for the launcher's summary."""
    print_error(message)
    _report(message, "failure.txt", echo=False)


def _report(message: str, suffix: str, echo: bool = True) -> None:
    folder = os.environ.get(ERROR_DIR_ENV)
    if folder and os.path.isdir(folder):
        with open(os.path.join(folder, f"rank-{os.environ.get('RANK', '0')}.{suffix}"), "w") as f:
            f.write(message + "\n")
    elif echo:
        print_error(message)
