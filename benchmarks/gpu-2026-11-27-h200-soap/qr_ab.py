"""SOAP's optimizer step with the batched Householder QR (householder_q.py, beside this file) vs torch's batched QR,
interleaved in one process (gpu_check part 3's SOAP item). Run from the repository root:
PYTHONPATH=.:benchmarks/gpu-2026-11-27-h200-soap python benchmarks/gpu-2026-11-27-h200-soap/qr_ab.py
The measured run (qr_ab.json) used the trial code, which called the QR through a hook and put both sides' tiles in
one call; here torch.linalg.qr itself is swapped, so each side is one call (SOAP's refresh as committed)."""
import json, os, statistics, time
from pathlib import Path
import torch
from outlier_titan import gpu_check
import types
from householder_q import householder_q

dev = torch.device("cuda")
def timed(fn, n):
    t = []
    for _ in range(n):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); t.append(time.perf_counter() - t0)
    return t
res = {}
for k, s in ((290, 256), (472, 128), (20, 256)):
    a = torch.randn(k, s, s, dtype=torch.float64, device=dev)
    res[f"householder_q k={k} s={s} ms"] = statistics.median(timed(lambda: householder_q(a), 5)) * 1e3
    res[f"torch.linalg.qr k={k} s={s} ms"] = statistics.median(timed(lambda: torch.linalg.qr(a), 5)) * 1e3
    res[f"max |dQ| k={k} s={s}"] = (householder_q(a) - torch.linalg.qr(a).Q).abs().max().item()
print(json.dumps(res, indent=0), flush=True)
item = dict(name="soap", kind="optim", optimizer="soap", model="pre_ln", flavor="seed000_gpt2_130m", seq_len=256,
            batch=512, micro=128, steps=10, warmup=3, tile_size=256, vocab_size=50304)
trainer = gpu_check._trainer(item, False, Path("/tmp/wd"))
for _ in range(3):
    trainer.train_step()
ab = {}
torch_qr = torch.linalg.qr
arms = (("householder_q", lambda a, *args, **kw: types.SimpleNamespace(Q=householder_q(a))),
        ("torch.linalg.qr", torch_qr))
for rep in range(2):  # interleaved: householder, torch's, householder, torch's
    for label, fn in arms:
        torch.linalg.qr = fn  # what optim/soap.py's refresh_tiles calls
        ab.setdefault(label, []).extend(timed(trainer.optimizer.step, 10))
torch.linalg.qr = torch_qr
out = {k: {"median_ms": statistics.median(v) * 1e3, "all_ms": [round(x * 1e3, 1) for x in v]} for k, v in ab.items()}
print(json.dumps(out, indent=0), flush=True)
Path(os.environ["OUT"], "qr_ab.json").write_text(json.dumps({"micro": res, "opt_step": out}, indent=1))
