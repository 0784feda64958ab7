"""Training metrics: one console line, ``metrics.jsonl``, TensorBoard and (optionally) Weights & Biases, written by
rank 0.

Every ``metrics.jsonl`` record carries ``time`` (Unix wall-clock seconds) and ``elapsed`` (seconds since this
process's logger was created, i.e. since the start of this launch; a resumed run starts again from 0).

Also throughput, MFU (against a peak looked up by device name; omitted, with a warning, when the device is
unknown or a CPU) and peak memory.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from outlier_titan.observe.wandb_logger import WandbLogger

# Dense bf16 peak FLOP/s by device-name substring, most specific first.
PEAK_BF16_FLOPS = (
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("H20", 148e12),
    ("GH200", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("MI300X", 1307e12),
    ("MI325X", 1307e12),
    ("MI355X", 2500e12),
)


def peak_flops(device: torch.device) -> float | None:
    """Peak dense bf16 FLOP/s of the device, or None when unknown (MFU is then not reported)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, value in PEAK_BF16_FLOPS:
        if key in name:
            return value
    return None


def peak_memory_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    # ru_maxrss is KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class MetricsLogger:
    """Writes scalars (and images) for logged steps. Only rank 0 writes; other ranks no-op. ``wandb``: rank 0's
    open W&B run (``observe.wandb_logger.start_wandb``), or None."""

    def __init__(self, run_dir: Path, rank: int, tensorboard: bool, wandb: WandbLogger | None = None):
        self.enabled = rank == 0
        self.t0 = time.perf_counter()
        self.jsonl = None
        self.tb = None
        self.wandb = wandb
        if not self.enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = (run_dir / "metrics.jsonl").open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(log_dir=str(run_dir / "tb"))

    def log(self, step: int, scalars: dict[str, float], images: dict[str, np.ndarray] | None = None,
            console: str | None = None) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": round(time.time(), 3), "elapsed": round(time.perf_counter() - self.t0, 3),
                  **{k: _json_float(v) for k, v in scalars.items()}}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            for k, v in scalars.items():
                if v is not None and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            for k, img in (images or {}).items():
                self.tb.add_image(k, img, step, dataformats="HWC")
            self.tb.flush()
        if self.wandb is not None:
            self.wandb.log(step, scalars, images or {})
        if console:
            print(console, flush=True)

    def mark_resume(self, step: int) -> None:
        """Writes a resume marker: records of later steps written before it belong to an abandoned attempt
        (``read_metrics`` drops them)."""
        if not self.enabled:
            return
        self.jsonl.write(json.dumps({"event": "resume", "step": step, "time": time.time()}) + "\n")
        self.jsonl.flush()

    def close(self, exit_code: int = 0) -> None:
        """Closes the files and ends the W&B run (``exit_code`` non-zero: marked failed)."""
        if self.jsonl is not None:
            self.jsonl.close()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            self.wandb.close(exit_code)
        self.jsonl = self.tb = self.wandb = None


def read_metrics(path: Path) -> dict[int, dict]:
    """step -> merged record of a ``metrics.jsonl`` (later records of a step override earlier keys).

    A resume marker at step N discards what was read for steps after N: those steps were re-run after the
    restart, and only the last run of each step counts. Lines that are not JSON (a torn last line after a
    kill) are skipped with a warning.
    """
    steps: dict[int, dict] = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            print(f"warning: {path}:{n} is not JSON; skipped", file=sys.stderr)
            continue
        if "step" not in rec:
            continue
        step = int(rec["step"])
        if rec.get("event") == "resume":
            for s in [s for s in steps if s > step]:
                del steps[s]
            continue
        steps.setdefault(step, {}).update(rec)
    return steps


def _json_float(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class Throughput:
    """Tokens/s and MFU between two log points."""

    def __init__(self, flops_per_token: float, device: torch.device, world_size: int):
        self.flops_per_token = flops_per_token
        self.device = device
        self.world_size = world_size
        self.peak = peak_flops(device)
        if device.type == "cuda" and self.peak is None:
            print(f"warning: unknown peak FLOP/s for {torch.cuda.get_device_name(device)}; MFU is not reported",
                  file=sys.stderr)
        self.reset()

    def reset(self) -> None:
        self.t0 = time.perf_counter()
        self.tokens = 0

    def add(self, tokens: int) -> None:
        self.tokens += tokens

    def read(self) -> dict[str, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        dt = max(time.perf_counter() - self.t0, 1e-9)
        tps = self.tokens / dt
        out = {"tokens_per_second": tps, "tokens_per_second_per_device": tps / self.world_size}
        if self.peak is not None:
            out["mfu"] = 100.0 * self.flops_per_token * tps / self.world_size / self.peak
        self.reset()
        return out
