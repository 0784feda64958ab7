"""``run --slurm``: an sbatch job-array script, one array task per unfinished point.

Each task runs ``scripts/sweep.py task SWEEP_DIR --index $SLURM_ARRAY_TASK_ID`` (the same code path as
``run --local``) on every node of its allocation; torchrun's c10d rendezvous is on the first node, as in
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

from outlier_titan.study.runner import REPO

DEFAULTS = {"nodes": 1, "gpus_per_node": 8, "cpus_per_task": 0, "time": "", "partition": "", "account": "",
            "signal_seconds": 120, "extra": []}


def slurm_script(sweep_dir: Path, indices: list[int], options: dict[str, Any], parallel: int = 0) -> str:
    """The sbatch script of a job array over ``indices`` (manifest order); ``parallel`` > 0 caps the number of
    simultaneously running tasks (``%K``)."""
    o = {**DEFAULTS, **{k: v for k, v in options.items() if v is not None}}
    sweep_dir = Path(sweep_dir).resolve()
    array = ",".join(map(str, indices)) + (f"%{parallel}" if parallel > 0 else "")
    lines = ["#!/usr/bin/env bash",
             f"# Sweep {sweep_dir}: one array task per unfinished point (written by scripts/sweep.py run --slurm).",
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
    task = (f"{shlex.quote(sys.executable)} {shlex.quote(str(REPO / 'scripts' / 'sweep.py'))} task "
            f"{shlex.quote(str(sweep_dir))} --index \"$SLURM_ARRAY_TASK_ID\" --nproc {nproc}")
    lines += ["set -uo pipefail",
              "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}",
              "export PYTHONFAULTHANDLER=1",
              "NNODES=${SLURM_NNODES:-1}",
              'if [ "$NNODES" -gt 1 ]; then',
              '  head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
              '  head_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk \'{print $1}\')',
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
    proc = subprocess.run(["sbatch", str(script)], capture_output=True, text=True)
    return proc.returncode, (proc.stdout + proc.stderr).strip()
