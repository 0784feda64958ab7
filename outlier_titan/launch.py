"""torchrun that lets the ranks save on preemption: ``python -m outlier_titan.launch [torchrun options] train.py ...``.

Plain torchrun handles SIGTERM itself: it raises ``SignalException`` (exit 1) and SIGKILLs the ranks after its
shutdown timeout, whether or not they finished saving. This wrapper runs torchrun's own launcher in-process with
SIGINT/SIGTERM/SIGUSR1/SIGUSR2 taken out of ``--signals-to-handle`` and forwards those signals to the ranks, which
finish their step, checkpoint and exit 75 ("stopped, resumable", ``outlier_titan.preempt``). It also:

- exports its pid, so a rank whose launcher died (kill -9) stops without writing anything;
- exits with the contract's code (``outlier_titan.exit_codes``, docs/launching.md): 0 finished, 75 stopped on
  request and resumable, 2 user error (the one-line ``error:`` of whichever rank hit it, last on the console),
  3 diverged, 1 failure (a rank died or was killed, a save failed not by the user: never 2), 130 after a second
  Ctrl-C; the ranks leave their ``error:`` / ``failure:`` line to it, so the console shows it once, last, without
  torchrun's own lines about the ranks' exits;
- on several hosts, points gloo at the network interface that routes to the rendezvous host (``GLOO_SOCKET_IFNAME``,
  unless set): gloo otherwise binds to the address its host name resolves to, which Debian's default hosts line
  (``127.0.1.1 <host>``) makes loopback, and the peers on other hosts then connect to their own loopback;
- writes that code to ``$OUTLIER_TITAN_EXIT_FILE.node<SLURM_NODEID>`` when the variable is set, so
  ``scripts/multinode.slurm`` can tell that its node's launcher has ended while ``srun`` still waits for a task on
  a node that died (see its watchdog).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import struct
import sys
import threading

from outlier_titan.errors import print_error
from outlier_titan.preempt import ERROR_DIR_ENV

EXIT_FILE_ENV = "OUTLIER_TITAN_EXIT_FILE"

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


def _execed(pid: int) -> bool:
    """Whether ``pid`` runs its own program yet. Between fork and exec a child is a copy of this launcher, with its
    handlers in SigCgt: a signal sent then stays pending (the child blocks signals while it resets the handlers to
    the defaults for exec) and kills the rank with the default action once unblocked."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as child, open("/proc/self/cmdline", "rb") as own:
            return child.read() != own.read()
    except OSError:
        return False


def _ready(pid: int, signum: int) -> bool:
    """Whether rank ``pid`` handles ``signum`` its own way now: its note that ``preempt.install_early`` ran (every
    forwarded signal and SIGINT are caught from then on), or, for a program that does not write one, its own handler
    for ``signum`` once it has left the launcher's image. SIGINT is caught by every Python from its start
    (KeyboardInterrupt), so for it only the note counts."""
    if os.path.exists(os.path.join(os.environ.get(ERROR_DIR_ENV, ""), f"ready-{pid}")):
        return True
    return signum != signal.SIGINT and _catches(pid, signum) and _execed(pid)


def _forward_forever(interval: float = 0.1) -> None:
    """Delivers each received signal once to every rank, as soon as that rank has installed its handler (a rank
    still importing torch would otherwise die of it); ranks started later get pending signals too."""
    import time

    delivered: list[set[int]] = []
    while True:
        while len(delivered) < len(_pending):
            delivered.append(set())
        sent: set[int] = set()  # one signal per rank and round: two at once would reach its handler as one
        for signum, done in zip(list(_pending), delivered):
            for pid in _children():
                if pid not in done and pid not in sent and _ready(pid, signum):
                    try:
                        os.kill(pid, signum)
                    except ProcessLookupError:
                        pass
                    done.add(pid)
                    sent.add(pid)
        time.sleep(interval)


def main(argv: list[str] | None = None) -> int:
    from outlier_titan.preempt import ERROR_DIR_ENV, FORWARDED, LAUNCHER_PID_ENV

    argv = list(sys.argv[1:] if argv is None else argv)
    for name in (*FORWARDED, "SIGINT"):
        signal.signal(getattr(signal, name), _on_signal)
    if any(a.split("=")[0] in ("--signals-to-handle", "--signals_to_handle") for a in argv):
        print("error: outlier_titan.launch sets --signals-to-handle itself (it forwards SIGINT/SIGTERM/SIGUSR1/"
              "SIGUSR2 to the ranks); remove that option", file=sys.stderr, flush=True)
        return 2
    import tempfile

    host = _rendezvous_host(argv)
    if host and "GLOO_SOCKET_IFNAME" not in os.environ and (ifname := gloo_interface(host)):
        os.environ["GLOO_SOCKET_IFNAME"] = ifname
    error_dir = tempfile.mkdtemp(prefix="outlier_titan-errors-")
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())
    os.environ[ERROR_DIR_ENV] = error_dir
    threading.Thread(target=_forward_forever, daemon=True).start()

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun's own lines about the ranks' ends ("failed (exitcode: N)", "Sending process ... SIGTERM") would
    # follow the contract's one line; a failure's details are printed below from the exception instead.
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    args = parse_args(["--signals-to-handle", "SIGHUP,SIGQUIT", *argv])
    try:
        run(args)
        code = 0
    except ChildFailedError as e:
        codes = {f.exitcode for f in e.failures.values()}
        code, lines = decide(codes, _reported(error_dir, "txt"), _reported(error_dir, "failure.txt"),
                             _pending.count(signal.SIGINT) >= 2, signalled=bool(_pending))
        if code == 1:
            print_error(e.format_msg())
        if lines:
            print_error("\n".join(lines))
    finally:
        import shutil

        shutil.rmtree(error_dir, ignore_errors=True)
    _write_exit_file(code)
    return code


def _rendezvous_host(argv: list[str]) -> str | None:
    """The rendezvous (or master) host of a multi-host torchrun command line; None for --standalone."""
    if "--standalone" in argv:
        return None
    for i, a in enumerate(argv):
        key, _, value = a.partition("=")
        if key.replace("_", "-") in ("--rdzv-endpoint", "--master-addr"):
            value = value or (argv[i + 1] if i + 1 < len(argv) else "")
            host = value.rsplit(":", 1)[0] if key.replace("_", "-") == "--rdzv-endpoint" else value
            return host.strip("[]") or None
    return None


def _ipv4_of(interface: str) -> str | None:
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:  # SIOCGIFADDR
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", interface.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def gloo_interface(host: str) -> str | None:
    """The name of the interface this host reaches ``host`` through (no packet is sent), if not loopback."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            local = s.getsockname()[0]
    except OSError:
        return None
    if local.startswith("127."):
        return None
    return next((name for _, name in socket.if_nameindex() if _ipv4_of(name) == local), None)


def _write_exit_file(code: int) -> None:
    base = os.environ.get(EXIT_FILE_ENV)
    if base:
        path = f"{base}.node{os.environ.get('SLURM_NODEID', '0')}"
        with open(path + ".tmp", "w") as f:
            f.write(f"{code}\n")
        os.replace(path + ".tmp", path)  # the watchdog never reads a half-written file


def decide(codes: set[int], user_lines: list[str], failure_lines: list[str], aborted: bool,
           signalled: bool = False) -> tuple[int, list[str]]:
    """The launcher's exit code and last console lines from the exit codes of the ranks that torchrun saw end
    first (negative: killed by that signal) and the lines the ranks reported. A rank that died unreported (a
    signal, a crash) makes the run a failure (1) even when its peers then hit an error of their own. Except a
    SIGTERM death while the launcher itself was sent no signal (``signalled`` false) beside other ranks' exits:
    that is torchrun stopping the ranks still running after a peer failed (a rank still in set-up, before its
    own handler), not a cause."""
    from outlier_titan import exit_codes as X

    if not signalled and len(codes) > 1:
        codes = codes - {-signal.SIGTERM}
    if aborted and X.INTERRUPTED in codes:
        return X.INTERRUPTED, ["aborted by a second Ctrl-C; the newest complete checkpoint is kept"]
    if codes == {X.STOPPED}:
        return X.STOPPED, []
    if codes <= {X.USER_ERROR, X.DIVERGED, X.STOPPED} and user_lines:
        return (X.DIVERGED if X.DIVERGED in codes else X.USER_ERROR), user_lines
    died = sorted(c for c in codes if c < 0)
    why = [f"failure: a rank was killed by {signal.Signals(-died[0]).name}; resume from the newest complete "
           "checkpoint"] if died and not failure_lines else []
    return X.FAILURE, failure_lines + why


def _reported(folder: str, suffix: str) -> list[str]:
    """The distinct lines the ranks left in ``folder`` as ``rank-<N>.<suffix>``, in rank order."""
    lines: list[str] = []
    names = [n for n in os.listdir(folder) if n.startswith("rank-") and n.split(".", 1)[1] == suffix]
    for name in sorted(names, key=lambda n: int(n.split("-")[1].split(".")[0])):
        with open(os.path.join(folder, name)) as f:
            line = f.read().strip()
        if line and line not in lines:
            lines.append(line)
    return lines


if __name__ == "__main__":
    sys.exit(main())
