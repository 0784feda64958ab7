"""torchrun that lets the ranks save on preemption: ``python -m outlier_titan.launch [torchrun options] train.py ...``.

Plain torchrun handles SIGTERM itself: it raises ``SignalException`` (exit 1) and SIGKILLs the ranks after its
shutdown timeout, whether or not they finished saving. This wrapper runs torchrun's own launcher in-process with
SIGTERM/SIGUSR1/SIGUSR2 taken out of ``--signals-to-handle`` and forwards those signals to the ranks, which
finish their step, checkpoint and exit 0 (``outlier_titan.preempt``); torchrun then exits 0 too. It also:

- exports its pid, so a rank whose launcher died (kill -9) stops without writing anything;
- prints the one-line ``error:`` of whichever rank hit a user error, last on the console, and exits 2.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

# Handlers first: importing torch.distributed.run takes seconds, and a signal in that window must not kill us.
_pending: list[int] = []


def _on_signal(signum, _frame) -> None:
    _pending.append(signum)


def _children() -> list[int]:
    pids = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            pass
    return pids


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler installed for ``signum`` (its SigCgt mask in /proc)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def _forward_forever(interval: float = 0.1) -> None:
    """Delivers each received signal once to every rank, as soon as that rank has installed its handler (a rank
    still importing torch would otherwise die of it); ranks started later get pending signals too."""
    import time

    delivered: list[set[int]] = []
    while True:
        while len(delivered) < len(_pending):
            delivered.append(set())
        for signum, done in zip(list(_pending), delivered):
            for pid in _children():
                if pid not in done and _catches(pid, signum):
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        pass
                    done.add(pid)
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    from outlier_titan.preempt import ERROR_DIR_ENV, FORWARDED, LAUNCHER_PID_ENV

    argv = list(sys.argv[1:] if argv is None else argv)
    for name in FORWARDED:
        signal.signal(getattr(signal, name), _on_signal)
    if any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv):
        print("error: outlier_titan.launch sets --signals-to-handle itself (it forwards SIGTERM/SIGUSR1/SIGUSR2 "
              "to the ranks); remove that option", file=sys.stderr, flush=True)
        return 2
    import tempfile

    error_dir = tempfile.mkdtemp(prefix="outlier_titan-errors-")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ[ERROR_DIR_ENV] = error_dir
    threading.Thread(target=_forward_forever, daemon=True).start()

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(["--signals-to-handle", "SIGINT,SIGHUP,SIGQUIT", *argv])
    try:
        run(args)
        code = 0
    except ChildFailedError as e:
        code = 1
        lines = _user_errors(error_dir)
        if lines:
            print("\n".join(lines), file=sys.stderr, flush=True)
            code = 2
        else:
            print(e.format_msg(), file=sys.stderr, flush=True)
    finally:
        import shutil

        shutil.rmtree(error_dir, ignore_errors=True)
    return code


def _user_errors(folder: str) -> list[str]:
    """The distinct user-error lines the ranks left in ``folder``, in rank order."""
    lines: list[str] = []
    names = sorted(os.listdir(folder), key=lambda n: int(n.split("-")[1].split(".")[0]))
    for name in names:
        with open(os.path.join(folder, name)) as f:
            line = f.read().strip()
        if line and line not in lines:
            lines.append(line)
    return lines


if __name__ == "__main__":
    sys.exit(main())
