"""The worker process: runs a chain of items in order, recording a start and a done event per item."""

from __future__ import annotations

import gc
import json
import os
import shutil
import tempfile
import time
import traceback
from pathlib import Path

from outlier_titan.tools.gpu_check.benchmarks import KINDS


def _cleanup() -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # set by the trainer's world-size-1 start-up: the next item takes a fresh port
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def dry_compile_backend() -> None:
    """In dry mode every torch.compile (the trainer's blocks and loss, the optimizers' math) defaults to the
    ``aot_eager`` backend: Dynamo and AOT autograd trace the graphs as on the GPU, without code generation."""
    import torch

    real = torch.compile

    def compile_aot_eager(model=None, **kwargs):
        kwargs.setdefault("backend", "aot_eager")
        return real(model, **kwargs) if model is not None else real(**kwargs)

    torch.compile = compile_aot_eager


def worker(items_file: Path, start: int, events: Path, dry: bool) -> int:
    """Runs items ``start..`` in order, appending a start and a done event per item to ``events``."""
    items = json.loads(items_file.read_text())
    if dry:
        dry_compile_backend()

    def emit(rec: dict) -> None:
        with events.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    for i in range(start, len(items)):
        item = items[i]
        emit({"index": i, "event": "start"})
        print(f"=== item {i}: {item['name']}", flush=True)
        t0 = time.perf_counter()
        workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        try:
            if item["kind"] != "sleep":  # the built-ins, for the items that build models (a sleep starts at once)
                import outlier_titan.components  # noqa: F401
            result, status = KINDS[item["kind"]](item, dry, workdir), "ok"
        except Exception as e:  # noqa: BLE001 - an item's failure is its row; the others still run
            traceback.print_exc()
            result, status = {"error": f"{type(e).__name__}: {e}"[:1500]}, "error"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if item["kind"] != "sleep":
                _cleanup()
        emit({"index": i, "event": "done", "status": status, "seconds": time.perf_counter() - t0, "result": result})
        print(f"=== item {i}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0

