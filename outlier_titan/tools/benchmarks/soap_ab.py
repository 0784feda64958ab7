"""``soap-ab``: another checkout's SOAP against this one's, with AdamW, in one process."""

from __future__ import annotations

import datetime
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from outlier_titan.tools.benchmarks.shapes import one_gpt2_layer, params_with_grads


def run_soap_ab(args, command: str) -> float:
    """AdamW, another checkout's SOAP and this checkout's SOAP step one GPT-2-small layer's six matrices (108
    tiles of 256) interleaved in one process; the other ``optim/soap.py`` runs on this checkout's tile engine."""
    import importlib.util

    from outlier_titan.optim import soap as this_soap
    from outlier_titan.optim.tiles.options import EngineOptions

    path = Path(args.before) / "outlier_titan" / "optim" / "soap.py"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist; pass the root of a checkout (e.g. a git worktree)")
    spec = importlib.util.spec_from_file_location("soap_before", str(path))
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    shapes = one_gpt2_layer()
    names = [n for n, _ in shapes]

    def params():
        return list(params_with_grads(shapes).values())

    o = EngineOptions(tile_size=256, shard_tile_size=256)
    opts = {"adamw": torch.optim.AdamW(params(), lr=1e-4, betas=(0.9, 0.95), foreach=True),
            "soap before": before.SOAP([{"params": params(), "names": names}], lr=1e-4, options=o),
            "soap after": this_soap.SOAP([{"params": params(), "names": names}], lr=1e-4, options=o)}
    for opt in opts.values():  # first basis (eigh) and warm-up, untimed
        opt.step()
        opt.step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in tqdm(range(args.steps), desc="soap-ab", unit="step"):
        for k, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[k].append(time.perf_counter() - t0)
    print(f"{command}\ndate {datetime.date.today()}, {torch.get_num_threads()} thread(s), {args.steps} steps each "
          "(means cover whole refresh cycles when steps is a multiple of f = 10)")
    adamw = statistics.median(times["adamw"])
    for k, v in times.items():
        print(f"  {k:12s} median {statistics.median(v) * 1e3:8.1f} ms  mean {statistics.fmean(v) * 1e3:8.1f} ms  "
              f"mean / AdamW median {statistics.fmean(v) / adamw:6.2f}x")
    ratio = statistics.fmean(times["soap after"]) / statistics.fmean(times["soap before"])
    print(f"after / before (means): {ratio:.3f}")
    return ratio

