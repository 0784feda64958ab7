"""Where llama_1b's compiled training step spends its time (gpu_check part 2's 'compile on, AC none' item), and
the step at a larger micro-batch. Run from the repository root: PYTHONPATH=. python <this file> [--dry]."""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from outlier_titan import gpu_check
from outlier_titan.observe.logger import peak_flops

DRY = "--dry" in sys.argv
OUT = Path(os.environ.get("OUT", "/tmp/llama_profile"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cpu" if DRY else "cuda")
res = {}


def timed(fn, n):
    t = []
    for _ in range(n):
        if not DRY:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if not DRY:
            torch.cuda.synchronize()
        t.append(time.perf_counter() - t0)
    return t


for micro in (2, 4):
    item = dict(name=f"llama_1b compile on AC none micro {micro}", kind="train", model="pre_ln", compile=True,
                ac="none", flavor="llama_1b", seq_len=2048, batch=4, micro=micro, vocab_size=128256)
    if DRY:
        item.update(flavor="debug_llama", seq_len=32, batch=4, micro=micro // 2, vocab_size=None)
    trainer = gpu_check._trainer(item, DRY, Path(f"/tmp/llama_wd_{micro}"))
    t0 = time.perf_counter()
    for _ in range(3):
        trainer.train_step()
    warm = time.perf_counter() - t0
    steps = timed(trainer.train_step, 2 if DRY else 8)
    opt = timed(trainer.optimizer.step, 2 if DRY else 5)
    tokens = item["batch"] * item["seq_len"]
    step = statistics.median(steps)
    peak = None if DRY else peak_flops(dev)
    r = {"warmup_s": warm, "step_s": step, "steps_s": steps, "optimizer_step_s": statistics.median(opt),
         "tokens_per_s": tokens / step,
         "mfu_pct": 100 * trainer.flops_per_token * tokens / step / peak if peak else None,
         "peak_memory_gib": None if DRY else torch.cuda.max_memory_allocated() / 2**30}
    print(micro, json.dumps(r), flush=True)
    if micro == 2:
        acts = [ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])
        with profile(activities=acts) as prof:
            for _ in range(3):
                trainer.train_step()
            if not DRY:
                torch.cuda.synchronize()
        ka = prof.key_averages()
        key = "cpu_time_total" if DRY else "self_cuda_time_total"
        table = ka.table(sort_by=key, row_limit=40, max_name_column_width=90)
        (OUT / "llama_prof_gpu.txt").write_text(table)
        (OUT / "llama_prof_cpu.txt").write_text(ka.table(sort_by="cpu_time_total", row_limit=40,
                                                         max_name_column_width=90))
        if not DRY:
            kernels = [e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA]
            total = sum(e.self_device_time_total for e in kernels) / 1e6
            buckets = {}
            for e in kernels:
                n = e.key.lower()
                b = ("gemm" if ("gemm" in n or "xmma" in n or "cutlass" in n or "nvjet" in n) else
                     "attention" if ("flash" in n or "fmha" in n or "attention" in n or "cudnn" in n) else
                     "nccl" if "nccl" in n else "triton" if "triton" in n else "other")
                buckets[b] = buckets.get(b, 0.0) + e.self_device_time_total / 1e6
            r["profile"] = {"wall_3_steps_s": sum(steps[:3]) if len(steps) >= 3 else None,
                            "kernel_time_3_steps_s": total, "by_kind_s": buckets}
            print(json.dumps(r["profile"]), flush=True)
        print(table, flush=True)
    res[f"micro_{micro}"] = r
    del trainer
    if not DRY:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
(OUT / "llama_profile.json").write_text(json.dumps(res, indent=1))
print("done", flush=True)
