"""Runs train.py as a user would (python, or torchrun with N gloo ranks) and reads back its metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# A small, fast variant of the debug run used by the distributed tests.
TINY = ["--training.steps", "20", "--training.seq_len", "64", "--training.global_batch_size", "8",
        "--metrics.log_every", "1", "--eval.every", "0", "--observe.every", "0", "--checkpoint.enable", "false",
        "--metrics.tensorboard", "false", "--lr_scheduler.warmup_steps", "2"]
LAYOUTS = {"one_rank": (1, []), "fsdp2": (2, []), "fsdp2_tp2": (4, ["--parallelism.tp", "2"])}
"""The layouts a distributed test trains on and compares: name -> (ranks, extra options)."""


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    run_dir: Path
    records: list = field(default_factory=list)

    @property
    def losses(self) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in self.records if "loss" in r}

    def check(self) -> "Run":
        assert self.returncode == 0, f"train.py failed ({self.returncode}):\n{self.stdout[-3000:]}\n{self.stderr[-6000:]}"
        return self


def train(tmp_path: Path, *overrides: str, nproc: int = 1, name: str = "run", config: str = "train_configs/debug.toml",
          timeout: int = 600, launcher: str = "torch.distributed.run") -> Run:
    """Runs one training job in ``tmp_path/<name>`` and returns its output and metrics.jsonl records (several
    ranks: under ``launcher``, plain torchrun or ``outlier_titan.launch``)."""
    args = ["--config", str(REPO / config), "--job.dump_folder", str(tmp_path), "--job.name", name, *overrides]
    if nproc == 1:
        cmd = [sys.executable, str(REPO / "train.py"), *args]
    else:
        cmd = [sys.executable, "-m", launcher, "--standalone", f"--nproc_per_node={nproc}",
               str(REPO / "train.py"), *args]
    tmp_path.mkdir(parents=True, exist_ok=True)
    # the repository first; what PYTHONPATH held stays after it (e.g. wheels that scripts/gpu_check.sh unpacked)
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp_path)
    run_dir = tmp_path / name
    records = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return Run(proc.returncode, proc.stdout, proc.stderr, run_dir, records)


def assert_losses_close(a: dict[int, float], b: dict[int, float], rtol: float) -> None:
    assert a.keys() == b.keys() and a, (sorted(a), sorted(b))
    for step in a:
        assert abs(a[step] - b[step]) <= rtol * abs(b[step]), f"step {step}: {a[step]!r} vs {b[step]!r}"


@contextmanager
def gloo_group(rank: int, world: int, port: int):
    """One rank of a test's own gloo process group (one torch thread), destroyed on the way out: the body of an
    ``mp.spawn`` / ``mp.start_processes`` worker."""
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def end_worker() -> None:
    """The last call of a :func:`launch_workers` script: every rank done, the process groups destroyed, then out as
    the trainer leaves (:func:`outlier_titan.train.leave`; without it a rank failed now and then at exit, -6)."""
    import torch.distributed as dist

    from outlier_titan.train import leave

    dist.barrier()
    dist.destroy_process_group()
    leave(0)


def launch_workers(worker: Path, args: list[str], world: int, timeout: int = 300) -> None:
    """Runs ``python worker *args`` as ``world`` gloo ranks (RANK, WORLD_SIZE, MASTER_ADDR / MASTER_PORT set, one
    thread each, the repository importable) and asserts that every rank exited 0, with the tails of their output;
    a rank still running after ``timeout`` seconds is killed. Each script ends with :func:`end_worker`."""
    from outlier_titan.parallel.dims import free_port

    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        procs.append(subprocess.Popen([sys.executable, str(worker), *args], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    bad = [(i, p.returncode) for i, p in enumerate(procs) if p.returncode != 0]
    assert not bad, f"{worker.name} {' '.join(args)}: ranks failed {bad}:\n" + "\n".join(log[-3000:] for log in logs)
