"""``run --slurm``: an sbatch job-array script, one array task per unfinished point.

Each task runs ``python -m outlier_titan.tools.sweep task SWEEP_DIR --index $SLURM_ARRAY_TASK_ID`` (the same
code path as ``run --local``) on every node of its allocation; torchrun's c10d rendezvous is on the first node, as in
``scripts/multinode.slurm``. Preemption and time limits: ``--signal=B:USR1@<s>`` sends USR1 to the batch shell,
which forwards it to the task (the sweep stops the trainer: checkpoint at the next step, exit), waits, and
requeues this array task, which then resumes the point from its checkpoint.
"""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from outlier_titan.packaged import child_environment


DEFAULTS = {"nodes": 1, "gpus_per_node": 8, "cpus_per_task": 0, "time": "", "partition": "", "account": "",
            "signal_seconds": 120, "extra": []}


def slurm_script(sweep_dir: Path, indices: list[int], options: dict[str, Any], parallel: int = 0) -> str:
    """The sbatch script of a job array over ``indices`` (manifest order); ``parallel`` > 0 caps the number of
    simultaneously running tasks (``%K``)."""
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    sweep_dir = Path(sweep_dir).resolve()
    array = ",".join(map(str, indices)) + (f"%{parallel}" if parallel > 0 else "")
    lines = ["#!/usr/bin/env bash",
             f"# Sweep {sweep_dir}: one array task per unfinished point (written by sweep run --slurm).",
             f"#SBATCH --job-name=sweep-{sweep_dir.name}",
             f"#SBATCH --array={array}",
             f"#SBATCH --nodes={o['nodes']}",
             "#SBATCH --ntasks-per-node=1"]
    if o["gpus_per_node"] > 0:
        lines.append(f"#SBATCH --gpus-per-node={o['gpus_per_node']}")
    if o["cpus_per_task"] > 0:
        lines.append(f"#SBATCH --cpus-per-task={o['cpus_per_task']}")
    for key in ("time", "partition", "account"):
        if o[key]:
            lines.append(f"#SBATCH --{key}={o[key]}")
    lines += [f"#SBATCH --signal=B:USR1@{o['signal_seconds']}",
              "#SBATCH --requeue",
              "#SBATCH --open-mode=append",
              f"#SBATCH --output={sweep_dir}/slurm/%A_%a.out"]
    lines += [f"#SBATCH {x}" for x in o["extra"]]
    nproc = max(1, o["gpus_per_node"])
    task = (f"{shlex.quote(sys.executable)} -m outlier_titan.tools.sweep task "
            f"{shlex.quote(str(sweep_dir))} --index \"$SLURM_ARRAY_TASK_ID\" --nproc {nproc}")
    lines += ["set -uo pipefail",
              "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
              "export PYTHONFAULTHANDLER=1",
              "NNODES=${SLURM_NNODES:-1}",
              'if [ "$NNODES" -gt 1 ]; then',
              '  head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              # the address Slurm uses for the node, else its first address from `hostname -I` (never loopback)
              '  head_ip=$(scontrol show node "$head_node" | grep -o "NodeAddr=[^ ]*" | cut -d= -f2)',
              '  if ! [[ "$head_ip" =~ ^[0-9]+\\.[0-9]+\\.[0-9]+\\.[0-9]+$ ]] || [[ "$head_ip" == 127.* ]]; then',
              '    head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname -I | awk \'{print $1}\')',
              '  fi',
              f'  srun --kill-on-bad-exit=1 {task} --nnodes "$NNODES" --rdzv-endpoint "$head_ip:29500" '
              '--rdzv-id "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}" &',
              "else",
              f"  {task} &",
              "fi",
              "child=$!",
              "requeue() {",
              '  echo "USR1: stopping point $SLURM_ARRAY_TASK_ID at its next step, then requeueing"',
              '  kill -USR1 "$child" 2>/dev/null',
              '  wait "$child"',
              '  scontrol requeue "${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}"',
              "  exit 0",
              "}",
              "trap requeue USR1",
              'wait "$child"',
              "rc=$?",
              # a USR1 arriving while `wait` runs interrupts it; the trap then takes over and exits
              'exit "$rc"',
              ""]
    return "\n".join(lines)


def submit(script: Path) -> tuple[int, str]:
    """``sbatch SCRIPT`` when sbatch is on PATH: (exit code, output); (-1, '') when it is not."""
    if shutil.which("sbatch") is None:
        return -1, ""
    # sbatch passes the submitting environment on (--export=ALL): the tasks run this very package
    proc = subprocess.run(["sbatch", str(script)], capture_output=True, text=True, env=child_environment())
    return proc.returncode, (proc.stdout + proc.stderr).strip()


# Pending reasons that no amount of waiting clears: the request exceeds what the partition's nodes have.
NEVER_RUNS = {"PartitionConfig": "asks for more CPUs, memory or GPUs per node than any node of the partition has",
              "PartitionNodeLimit": "asks for more nodes than the partition has",
              "PartitionTimeLimit": "asks for more time than the partition allows",
              "BadConstraints": "has constraints no node satisfies"}


def never_runs(job_id: str, wait_s: float = 5.0) -> str | None:
    """A one-line reason why submitted job ``job_id`` can never start (Slurm leaves such a job PENDING forever),
    or None. Checks its pending reason for up to ``wait_s`` seconds (Slurm sets these at submission or at the
    first scheduling pass); cancels the job when it can never run."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        try:
            out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], capture_output=True, text=True)
        except OSError:  # no squeue here (a submit-only host, a stand-in sbatch): nothing to check
            return None
        fields = out.stdout.split()
        state, reason = (fields + ["", ""])[:2]
        if state != "PENDING" or reason in NEVER_RUNS or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if reason not in NEVER_RUNS:
        return None
    subprocess.run(["scancel", job_id], capture_output=True)
    return (f"Slurm job {job_id} can never start: it {NEVER_RUNS[reason]} (pending reason {reason}; see "
            "sinfo -o '%n %c %m %G'); cancelled it: ask for less (--cpus-per-task, --nodes, --gpus-per-node, --time)")
