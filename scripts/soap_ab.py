"""SOAP before / after in one process: AdamW, the SOAP of another checkout and this checkout's SOAP step the six
matrices of one GPT-2-small layer (108 tiles of 256), interleaved, so that load from other processes hits all
three alike. The other checkout's ``optim/soap.py`` is loaded on top of this checkout's tile engine.

    python scripts/soap_ab.py BEFORE_CHECKOUT [THREADS] [STEPS]
"""
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from outlier_titan.optim import soap as new  # noqa: E402
from outlier_titan.optim.tile_engine import EngineOptions  # noqa: E402

torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 1)
spec = importlib.util.spec_from_file_location("soap_before", str(Path(sys.argv[1]) / "outlier_titan/optim/soap.py"))
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
dim = 768
shapes = [(f"layers.0.attention.{w}.weight", (dim, dim)) for w in ("wq", "wk", "wv", "wo")] + \
         [("layers.0.feed_forward.w1.weight", (4 * dim, dim)), ("layers.0.feed_forward.w2.weight", (dim, 4 * dim))]
names = [n for n, _ in shapes]


def make():
    gen = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for _, s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    return ps


o = EngineOptions(tile_size=256, shard_tile_size=256)
opts = {"adamw": torch.optim.AdamW(make(), lr=1e-4, betas=(0.9, 0.95), foreach=True),
        "soap before": old.SOAP([{"params": make(), "names": names}], lr=1e-4, options=o),
        "soap after": new.SOAP([{"params": make(), "names": names}], lr=1e-4, options=o)}
for op in opts.values():
    op.step()
    op.step()
times = {k: [] for k in opts}
# 10 consecutive steps per SOAP = one full refresh cycle (f = 10)
for _ in range(int(sys.argv[3]) if len(sys.argv) > 3 else 10):
    for k, op in opts.items():
        t0 = time.perf_counter()
        op.step()
        times[k].append(time.perf_counter() - t0)
a = statistics.median(times["adamw"])
for k, v in times.items():
    print(f"{k:12s} median {statistics.median(v)*1e3:7.1f} ms mean {statistics.fmean(v)*1e3:7.1f} ms  "
          f"mean/AdamW median {statistics.fmean(v)/a:6.2f}x")
sb, sa = statistics.fmean(times["soap before"]), statistics.fmean(times["soap after"])
print(f"after / before (means over a refresh cycle): {sa/sb:.3f}")
