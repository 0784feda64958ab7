"""``attention``: per attention variant and length, forward + backward time, peak memory and the kernel that ran."""

from __future__ import annotations

import datetime
import statistics
import time

import torch

from outlier_titan.tools.benchmarks.shapes import cpu_name


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes of the tensors ``fn()`` allocates and holds at once (on a GPU the caching allocator's peak; on the
    CPU torch's MemTracker, which follows every tensor's storage from allocation to release)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


def attention_step(variant: str, impl: str, batch: int, heads: int, seq_len: int, head_dim: int, dtype, device):
    """A closure running one forward + backward of ``variant``'s causal attention on fixed random inputs."""
    from outlier_titan.models.attention import run_attention
    from outlier_titan.models.attention_variants import AttentionOptions

    g = torch.Generator(device).manual_seed(seq_len)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, generator=g, device=device, dtype=dtype)
               .requires_grad_() for _ in range(3))
    sink = torch.zeros(heads, device=device, requires_grad=True) if variant == "sink_logit" else None
    opts = AttentionOptions(variant=variant, impl=impl)

    def step():
        run_attention(q, k, v, opts, head_dim ** -0.5, state=sink).float().square().sum().backward()
    return step


def _attention_ops(step, device: torch.device) -> str:
    """The attention operators the profiler saw in one call of ``step`` (SDPA, FlexAttention or bmm)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
    names = {e.key for e in prof.key_averages()}
    fused = sorted(n for n in names
                   if ("aten::_scaled_dot_product" in n or "flex" in n.lower()) and "backward" not in n)
    return ", ".join(f"`{n.removeprefix('aten::')}`" for n in fused) or ("`bmm`" if "aten::bmm" in names else "-")


def run_attention_bench(args, command: str) -> list[dict]:
    """Per variant and sequence length: forward + backward time (median of interleaved reps), peak memory, the path
    and the operators the profiler saw, for each ``--impls`` entry; the ratio to softmax on the same path."""
    from outlier_titan.models.attention import attention_path
    from outlier_titan.models.attention_variants import variants as registered

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    variants = args.variants.split(",") if args.variants else [v.name for v in registered()]
    if "softmax" not in variants:
        variants.insert(0, "softmax")
    impls = args.impls.split(",")
    rows = []
    for t in [int(x) for x in args.seq_lens.split(",")]:
        cases = [(v, impl) for impl in impls for v in variants]
        steps = {c: attention_step(*c, args.batch, args.heads, t, args.head_dim, dtype, device) for c in cases}
        for step in steps.values():
            step()  # warm-up (and compilation on a GPU)
        times = {c: [] for c in cases}
        for rep in range(args.reps):
            for i in range(len(cases)):
                c = cases[(i + rep) % len(cases)]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                steps[c]()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[c].append(time.perf_counter() - t0)
        for v, impl in cases:
            med = statistics.median(times[(v, impl)])
            rows.append({"variant": v, "impl": impl, "seq_len": t, "s": med,
                         "ratio": med / statistics.median(times[("softmax", impl)]),
                         "path": attention_path(v, impl, device), "ops": _attention_ops(steps[(v, impl)], device),
                         "peak": peak_bytes(steps[(v, impl)], device)})
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    lines = [f"date {datetime.date.today()}  machine {machine}, {torch.get_num_threads()} thread(s), "
             f"torch {torch.__version__}", f"command: `{command}`",
             f"B {args.batch} x H {args.heads} x d_h {args.head_dim}, {args.dtype}, causal, forward + backward "
             f"(attention core only), median of {args.reps} interleaved reps", "",
             "| T | variant | model.attention_impl | path | operators seen | fwd+bwd | / softmax | peak memory |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['variant']} | {r['impl']} | {r['path']} | {r['ops']} | "
                     f"{r['s'] * 1e3:.1f} ms | {r['ratio']:.2f}x | {r['peak'] / 2**20:.1f} MiB |")
    print("\n".join(lines))
    return rows

