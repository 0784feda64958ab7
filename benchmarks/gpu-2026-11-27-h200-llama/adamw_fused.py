"""llama_1b (compile on, AC none, batch 4 x 2048 in one micro-batch): torch's AdamW as the trainer builds it
(foreach) against fused=True on the same FSDP2 parameters and gradients, the optimizer step alone and the whole
step. Run from the repository root: PYTHONPATH=. python <this file> [--dry]."""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from outlier_titan import gpu_check
from outlier_titan.observe.logger import peak_flops

DRY = "--dry" in sys.argv
OUT = Path(os.environ.get("OUT", "/tmp/adamw_fused"))
OUT.mkdir(parents=True, exist_ok=True)
dev = torch.device("cpu" if DRY else "cuda")


def sync():
    if not DRY:
        torch.cuda.synchronize()


def timed(fn, n):
    t = []
    for _ in range(n):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        t.append(time.perf_counter() - t0)
    return t


item = dict(name="llama_1b", kind="train", model="pre_ln", compile=True, ac="none", flavor="llama_1b",
            seq_len=2048, batch=4, micro=4, vocab_size=128256)
if DRY:
    item.update(flavor="debug_llama", seq_len=32, vocab_size=None)
trainer = gpu_check._trainer(item, DRY, Path("/tmp/adamw_wd"))
for _ in range(3):
    trainer.train_step()
foreach = trainer.optimizer
# the same groups' hyperparameters, moments started afresh (the speed does not depend on their values)
fused = torch.optim.AdamW([{k: g[k] for k in ("params", "lr", "betas", "eps", "weight_decay")}
                           for g in foreach.param_groups], fused=True)
assert all(g["fused"] and not g["foreach"] for g in fused.param_groups)
assert all(g["foreach"] for g in foreach.param_groups)
res = {}
n = 2 if DRY else 8
for rep in range(2):  # interleaved
    for label, opt in (("foreach", foreach), ("fused", fused)):
        res.setdefault(label + " optimizer step", []).extend(timed(opt.step, n))
        trainer.optimizer = opt
        res.setdefault(label + " whole step", []).extend(timed(trainer.train_step, n))
trainer.optimizer = foreach
tokens = item["batch"] * item["seq_len"]
out = {k: statistics.median(v) for k, v in res.items()}
if not DRY:
    for label in ("foreach", "fused"):
        out[label + " MFU %"] = 100 * trainer.flops_per_token * tokens / out[label + " whole step"] / peak_flops(dev)
out["all"] = res
print(json.dumps({k: v for k, v in out.items() if k != "all"}, indent=0), flush=True)
(OUT / "adamw_fused.json").write_text(json.dumps(out, indent=1))
