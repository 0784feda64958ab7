"""Eager vs ``torch.compile`` of the optimizer step's element-wise math: SOAP's moment updates, sqrt(v) + eps and
division, and OrthoAdam's foreach chain, on the rotated matrices of GPT-2 small (``gpt2``) or one of its layers
(``layer``). Prints compile times, the largest relative difference and medians of 7 interleaved calls; then
whether the compiled kernel gives the same bits when its input is cut in two (as shards would cut it).

    python scripts/compile_optim_math.py [THREADS] [gpt2|layer]
"""
import statistics
import sys
import time

import torch

torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
scale = sys.argv[2] if len(sys.argv) > 2 else "gpt2"
dim = 768
if scale == "gpt2":
    shapes = [(dim, dim)] * 48 + [(4 * dim, dim)] * 12 + [(dim, 4 * dim)] * 12 + [(1024, dim)]
else:
    shapes = [(dim, dim)] * 4 + [(4 * dim, dim), (dim, 4 * dim)]
gen = torch.Generator().manual_seed(0)
ms = [torch.zeros(s) for s in shapes]
vs = [torch.zeros(s) for s in shapes]
gs = [torch.randn(s, generator=gen) for s in shapes]
n = sum(m.numel() for m in ms)


def soap_eager(ms, vs, gs, b1, b2, eps):
    for m, v, g in zip(ms, vs, gs):
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
    d = torch._foreach_sqrt(vs)
    torch._foreach_add_(d, eps)
    return torch._foreach_div(ms, d)


def ortho_eager(ms, vs, gs, b1, b2, eps, c2, c1):
    torch._foreach_lerp_(ms, gs, 1 - b1)
    torch._foreach_mul_(vs, b2)
    torch._foreach_addcmul_(vs, gs, gs, 1 - b2)
    d = torch._foreach_sqrt(vs)
    torch._foreach_div_(d, c2)
    torch._foreach_add_(d, eps)
    torch._foreach_mul_(d, c1)
    return torch._foreach_div(ms, d)


def soap_fused(ms, vs, gs, b1, b2, eps):
    out = []
    for m, v, g in zip(ms, vs, gs):
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        out.append(m / (v.sqrt() + eps))
    return out


def ortho_fused(ms, vs, gs, b1, b2, eps, c2, c1):
    out = []
    for m, v, g in zip(ms, vs, gs):
        m.lerp_(g, 1 - b1)
        v.mul_(b2).addcmul_(g, g, value=1 - b2)
        out.append(m / ((v.sqrt() / c2 + eps) * c1))
    return out

args_s = (0.9, 0.95, 1e-8)
args_o = (0.9, 0.95, 1e-8, 0.3, -1.0)
t0 = time.perf_counter()
soap_c = torch.compile(soap_fused, fullgraph=True)
soap_c(ms, vs, gs, *args_s)
tc_s = time.perf_counter() - t0
t0 = time.perf_counter()
ortho_c = torch.compile(ortho_fused, fullgraph=True)
ortho_c(ms, vs, gs, *args_o)
tc_o = time.perf_counter() - t0
# compiled against eager (fp32 rounding)
m1, v1 = [m.clone() for m in ms], [v.clone() for v in vs]
m2, v2 = [m.clone() for m in ms], [v.clone() for v in vs]
a = soap_eager(m1, v1, gs, *args_s)
b = soap_c(m2, v2, gs, *args_s)
err = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item() for x, y in zip(a, b))
fns = {"soap eager": lambda: soap_eager(ms, vs, gs, *args_s), "soap compiled": lambda: soap_c(ms, vs, gs, *args_s),
       "orthoadam eager": lambda: ortho_eager(ms, vs, gs, *args_o),
       "orthoadam compiled": lambda: ortho_c(ms, vs, gs, *args_o)}
times = {k: [] for k in fns}
for _ in range(7):
    for k, f in fns.items():
        t0 = time.perf_counter()
        f()
        times[k].append(time.perf_counter() - t0)
print(f"{scale}: {n/1e6:.1f}M elements, {torch.get_num_threads()} thread(s); compile time soap {tc_s:.1f} s, "
      f"orthoadam {tc_o:.1f} s; max rel diff {err:.1e}")
for k, v in times.items():
    print(f"  {k:20s} {statistics.median(v)*1e3:8.1f} ms")

# Does the compiled kernel depend on where the data is cut (as a shard boundary would cut it)?


def moments(m, v, g, b1, b2, eps):
    m = torch.lerp(m, g, 1 - b1)
    v = v * b2 + (1 - b2) * g * g
    return m / (v.sqrt() + eps)


dyn = torch.compile(moments, dynamic=True)
size = 768 * 3072 + 37
m, v, g = (torch.randn(size, generator=gen).abs() * 1e-3 for _ in range(3))
whole = dyn(m, v, g, *args_s)
for cut in (768 * 1536, 768 * 1536 + 5, 1000003, 13):
    pieces = [dyn(m[s].clone(), v[s].clone(), g[s].clone(), *args_s) for s in (slice(0, cut), slice(cut, size))]
    print(f"cut at {cut}: {(~torch.eq(torch.cat(pieces), whole)).sum().item()} elements differ from the whole call")
print(f"compiled vs eager: {(~torch.eq(moments(m, v, g, *args_s), whole)).sum().item()} of {size} elements differ")
