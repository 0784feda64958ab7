"""Where SOAP's optimizer step spends its time on the GPU (gpu_check part 3's SOAP item): QR / eigh / Cholesky
timings on float64 tile batches, sync-timed pieces of the step, and the torch profiler's table over 10 steps."""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from outlier_titan import gpu_check
from outlier_titan.optim import soap as soap_mod

OUT = Path(os.environ.get("OUT", "/tmp/out"))
DRY = not torch.cuda.is_available()
dev = torch.device("cpu" if DRY else "cuda")
res = {}


def sync():
    if not DRY:
        torch.cuda.synchronize(dev)


def timed(fn, n):
    t = []
    for _ in range(n):
        sync(); t0 = time.perf_counter(); fn(); sync(); t.append(time.perf_counter() - t0)
    return statistics.median(t), t


# ---- micro: QR / cholesky / eigh at tile 256, float64 --------------------------------------------------
micro = {}
for k in ((1, 2) if DRY else (1, 20, 200)):
    a = torch.randn(k, 256, 256, dtype=torch.float64, device=dev)
    p = a @ a.transpose(-1, -2)
    q0 = torch.linalg.qr(torch.randn(k, 256, 256, dtype=torch.float64, device=dev)).Q
    pq = p @ q0
    micro[f"qr_f64_k{k}"] = timed(lambda: torch.linalg.qr(pq), 5)[0]
    micro[f"geqrf_f64_k{k}"] = timed(lambda: torch.geqrf(pq), 5)[0]
    h, tau = torch.geqrf(pq)
    micro[f"orgqr_f64_k{k}"] = timed(lambda: torch.linalg.householder_product(h, tau), 5)[0]
    micro[f"qr_f32_k{k}"] = timed(lambda: torch.linalg.qr(pq.float()), 5)[0]
    micro[f"chol_f64_k{k}"] = timed(lambda: torch.linalg.cholesky_ex(pq.transpose(-1, -2) @ pq), 5)[0]
    micro[f"mm_f64_k{k}"] = timed(lambda: p @ q0, 5)[0]
    if k <= 20:
        micro[f"eigh_f64_k{k}"] = timed(lambda: torch.linalg.eigh(p), 3)[0]
print(json.dumps({k: round(v * 1e3, 3) for k, v in micro.items()}, indent=0), flush=True)
res["micro_ms"] = {k: v * 1e3 for k, v in micro.items()}

# ---- the gpu_check optim item with SOAP ----------------------------------------------------------------
item = dict(name="soap", kind="optim", optimizer="soap", model="pre_ln", flavor="seed000_gpt2_130m", seq_len=256,
            batch=512, micro=128, steps=10, warmup=3, tile_size=256, vocab_size=50304)
if DRY:
    item.update(flavor="debug", seq_len=32, batch=8, micro=4, tile_size=32)
    item.pop("vocab_size")
trainer = gpu_check._trainer(item, DRY, Path("/tmp/wd"))
for _ in range(3):
    trainer.train_step()
opt = trainer.optimizer
base = timed(opt.step, 10)
res["opt_step_ms"] = [x * 1e3 for x in base[1]]
print("opt step ms", [round(x * 1e3, 1) for x in base[1]], flush=True)

# breakdown: sync-timed wrappers
acc = {}


def wrap(mod, name):
    fn = getattr(mod, name)

    def w(*a, **kw):
        sync(); t0 = time.perf_counter()
        r = fn(*a, **kw)
        sync(); acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        acc[name + "_n"] = acc.get(name + "_n", 0) + 1
        return r
    setattr(mod, name, w)
    return fn


orig_refresh = wrap(soap_mod, "refresh_tiles")
orig_acc = wrap(soap_mod, "_accumulate")
orig_rot = wrap(soap_mod, "rotate_tiles")
orig_qr = torch.linalg.qr
qacc = {"t": 0.0, "n": 0, "shapes": {}}


def qr_w(x, *a, **kw):
    sync(); t0 = time.perf_counter(); r = orig_qr(x, *a, **kw); sync()
    qacc["t"] += time.perf_counter() - t0; qacc["n"] += 1
    qacc["shapes"][str(tuple(x.shape))] = qacc["shapes"].get(str(tuple(x.shape)), 0) + 1
    return r


torch.linalg.qr = qr_w
tot = timed(opt.step, 10)
torch.linalg.qr = orig_qr
soap_mod.refresh_tiles, soap_mod._accumulate, soap_mod.rotate_tiles = orig_refresh, orig_acc, orig_rot
res["breakdown_10_steps_s"] = {**acc, "qr": qacc["t"], "qr_n": qacc["n"], "qr_shapes": qacc["shapes"],
                               "total": sum(tot[1])}
print(json.dumps(res["breakdown_10_steps_s"], indent=0), flush=True)

# profiler over 10 steps
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU] + ([] if DRY else [ProfilerActivity.CUDA])) as prof:
    for _ in range(10):
        opt.step()
    sync()
t1 = prof.key_averages().table(sort_by="cpu_time_total" if DRY else "cuda_time_total", row_limit=25)
t2 = prof.key_averages().table(sort_by="cpu_time_total", row_limit=25)
print(t1, flush=True)
print(t2, flush=True)
(OUT / "prof_cuda.txt").write_text(t1)
(OUT / "prof_cpu.txt").write_text(t2)

(OUT / "soap_profile.json").write_text(json.dumps(res, indent=1))
print("done", flush=True)
