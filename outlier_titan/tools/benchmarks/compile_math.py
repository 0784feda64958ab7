"""``compile-math``: the optimizers' element-wise math eager against compiled, and whole OrthoAdam steps."""

from __future__ import annotations

import datetime
import statistics
import time

import torch

from outlier_titan.optim.orthoadam import OrthoAdam
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.tools.benchmarks.shapes import gpt2_124m_shapes, one_gpt2_layer, params_with_grads


def run_compile_math(args, command: str) -> dict:
    """Eager vs compiled (``compile.enable``) element-wise math of the tile optimizers: the shared
    ``adam_directions`` alone on GPT-2 small's rotated matrices (or one layer's) with SOAP's and OrthoAdam's
    coefficients; whether the compiled kernel gives the same bits when its input is cut as a shard boundary would
    cut it; and whole OrthoAdam steps, eager and compiled stepped alternately (ABBA pairs)."""
    from outlier_titan.optim.tiles.adam import adam_directions, compiled_adam_directions

    dim = 768
    shapes = ([(dim, dim)] * 48 + [(4 * dim, dim)] * 12 + [(dim, 4 * dim)] * 12 + [(1024, dim)]
              if args.scale == "gpt2" else [s for _, s in one_gpt2_layer()])
    gen = torch.Generator().manual_seed(0)
    ms, vs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    gs = [torch.randn(s, generator=gen) for s in shapes]
    rows = {"soap": [(0.1, 0.95, 0.05, 1.0, 1e-8, 1.0)] * len(shapes),
            "orthoadam": [(0.1, 0.95, 0.05, 0.3, 1e-8, -1.0)] * len(shapes)}
    compiled = compiled_adam_directions()
    t0 = time.perf_counter()
    for r in rows.values():
        compiled(ms, vs, gs, r)
    compile_s = time.perf_counter() - t0
    m1, v1 = [m.clone() for m in ms], [v.clone() for v in vs]
    m2, v2 = [m.clone() for m in ms], [v.clone() for v in vs]
    err = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
              for x, y in zip(adam_directions(m1, v1, gs, rows["soap"]), compiled(m2, v2, gs, rows["soap"])))
    fns = {f"{k} {mode}": (f, r) for k, r in rows.items() for mode, f in (("eager", adam_directions),
                                                                         ("compiled", compiled))}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.reps):
        for k, (f, r) in fns.items():
            t0 = time.perf_counter()
            f(ms, vs, gs, r)
            times[k].append(time.perf_counter() - t0)
    n = sum(m.numel() for m in ms)
    print(f"{command}\ndate {datetime.date.today()}, {args.scale}: {n / 1e6:.1f}M elements, "
          f"{torch.get_num_threads()} thread(s); compile time {compile_s:.1f} s; compiled vs eager max relative "
          f"difference {err:.1e}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:20s} {v * 1e3:8.1f} ms")

    # The shipped kernel on one long tensor and on two pieces of it, cut where a shard boundary could fall: an
    # element-wise kernel must give the same bits whatever the cut (each piece shape compiles once).
    size = 768 * 3072 + 37
    m, v, g = ([t] for t in (torch.randn(size, generator=gen).abs() * 1e-3 for _ in range(3)))
    one = [rows["soap"][0]]
    with torch._dynamo.config.patch(recompile_limit=32):
        whole = compiled([m[0].clone()], [v[0].clone()], g, one)[0]
        for cut in (768 * 1536, 768 * 1536 + 5, 1000003, 13):
            pieces = [compiled([m[0][s].clone()], [v[0][s].clone()], [g[0][s]], one)[0]
                      for s in (slice(0, cut), slice(cut, size))]
            differ = (~torch.eq(torch.cat(pieces), whole)).sum().item()
            print(f"  cut at {cut}: {differ} elements differ from the whole call")
    eager = adam_directions([m[0].clone()], [v[0].clone()], g, one)[0]
    print(f"  compiled vs eager: {(~torch.eq(eager, whole)).sum().item()} of {size} elements differ")
    if args.step_pairs:
        med.update(_orthoadam_step_pairs(args))
    return med


def _orthoadam_step_pairs(args) -> dict:
    """Whole OrthoAdam steps (hadamard, tile 256) eager and with ``compile_math()``, on the same parameters and
    gradients, stepped alternately in ABBA order; medians and the median of the pairwise ratios."""
    torch._dynamo.reset()  # a fresh compile cache, as a training process has (the cut check above filled it)
    params = params_with_grads(gpt2_124m_shapes() if args.scale == "gpt2" else one_gpt2_layer())
    names = list(params)
    opts = EngineOptions(tile_size=256, shard_tile_size=256)
    make = lambda: OrthoAdam([{"params": [params[n] for n in names], "names": names, "weight_decay": 0.1}],  # noqa: E731
                             lr=1e-4, options=opts)
    eager, comp = make(), make()
    comp.compile_math()
    eager.step()
    comp.step()  # compiles
    t = {"eager": [], "compiled": []}
    for i in range(args.step_pairs):
        order = (("eager", eager), ("compiled", comp)) if i % 2 == 0 else (("compiled", comp), ("eager", eager))
        for k, opt in order:
            t0 = time.perf_counter()
            opt.step()
            t[k].append(time.perf_counter() - t0)
    med = {f"orthoadam step {k}": statistics.median(v) for k, v in t.items()}
    pair = statistics.median(c / e for c, e in zip(t["compiled"], t["eager"]))
    print(f"  OrthoAdam step ({len(t['eager'])} ABBA pairs): eager {med['orthoadam step eager'] * 1e3:.1f} ms, "
          f"compiled {med['orthoadam step compiled'] * 1e3:.1f} ms; compiled / eager, median of pairs {pair:.3f}x")
    return med

