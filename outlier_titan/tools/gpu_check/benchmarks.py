"""The benchmark kinds (``train``, ``optim``, ``probe``, ``attention``, ``sleep``): each runs one item in a worker
and returns its numbers."""

from __future__ import annotations

import math
import os
import statistics
import time
import traceback
from pathlib import Path

from outlier_titan.tools.gpu_check.plan import GpuCheckError, item_argv


def _device(dry: bool):
    import torch

    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GpuCheckError("no CUDA device is visible; run with --dry on a CPU machine")
    return torch.device("cuda", 0)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, n: int, device) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``, the device synchronised around each."""
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times



def _trainer(item: dict, dry: bool, workdir: Path):
    from outlier_titan.config.manager import parse_args
    from outlier_titan.trainer import Trainer

    return Trainer(parse_args(item_argv(item, dry, workdir)))



def _close(trainer) -> None:
    """``trainer.close()``; a failure there (after an out-of-memory error, say) is printed to the log and does not
    hide the item's own error or result."""
    try:
        trainer.close()
    except Exception:  # noqa: BLE001
        traceback.print_exc()


def _peak_memory_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def bench_train(item: dict, dry: bool, workdir: Path) -> dict:
    """Tokens/s, MFU and peak memory of whole training steps (loader, forward, backward, clip, optimizer)."""
    import torch

    from outlier_titan.observe.logger import peak_flops

    device = _device(dry)
    trainer = _trainer(item, dry, workdir)
    try:
        t0 = time.perf_counter()
        losses = [float(trainer.train_step()[0]) for _ in range(item["warmup"])]
        warmup_s = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step_losses = []
        times = _timed(lambda: step_losses.append(trainer.train_step()[0]), item["steps"], device)
        losses += [float(x) for x in step_losses]
        tokens = item["batch"] * item["seq_len"]
        step_s = statistics.median(times)
        tps = tokens / step_s
        peak = peak_flops(device)
        return {"params": trainer.n_params, "flops_per_token": trainer.flops_per_token, "tokens_per_step": tokens,
                "step_s": step_s, "tokens_per_s": tps,
                "mfu_pct": 100.0 * trainer.flops_per_token * tps / peak if peak else None,
                "peak_memory_gib": _peak_memory_gib(device), "warmup_s": warmup_s,
                "loss_first": losses[0], "loss_last": losses[-1],
                "finite": all(math.isfinite(x) for x in losses),
                "dtype": "float32 (CPU)" if dry else trainer.cfg.training.mixed_precision_param}
    finally:
        _close(trainer)


def bench_memory(item: dict, dry: bool, workdir: Path) -> dict:
    """One rank's peak memory over its first steps (model build, optimizer state, the steps) against what the
    dry-run planner (``--dry_run``) predicts for the same settings; the whole job on one device, or rank 0 of a
    multi-GPU layout on the fake process group (``parallelism.fake_world_size``: collectives do nothing, so its
    losses are not the real job's and are not reported)."""
    from outlier_titan.config.manager import parse_args
    from outlier_titan.trainer import Trainer
    from outlier_titan.training.planning import GiB, plan as dry_plan, rank_params

    device = _device(dry)
    cfg = parse_args(item_argv(item, dry, workdir))
    planned = dry_plan(cfg)  # its own fake process group, torn down before the trainer's
    trainer = Trainer(cfg)
    try:
        local = rank_params(trainer.model)
        losses = [trainer.train_step()[0] for _ in range(item["warmup"])]
        times = _timed(lambda: losses.append(trainer.train_step()[0]), item["steps"], device)
        peak = _peak_memory_gib(device)
        rows = {"params": planned.param_bytes, "grads": planned.grad_bytes, "optimizer": planned.optimizer_bytes,
                "activations": planned.activation_bytes, "all_gather": planned.gather_bytes}
        out = {"params": trainer.n_params, "world_size": trainer.world_size, "fake": bool(item["fake_world"]),
               "layout": f"dp_shard {item['dp_shard']} x tp {item.get('tp', 1)}", "local_params": local,
               "planned_local_params": planned.local_params, "planned_gib": planned.total_bytes / GiB,
               "planned_rows_gib": {k: v / GiB for k, v in rows.items()}, "peak_memory_gib": peak,
               "measured_over_planned": peak / (planned.total_bytes / GiB) if peak is not None else None,
               "step_s": statistics.median(times)}
        if not item["fake_world"]:
            out["finite"] = all(math.isfinite(float(x)) for x in losses)
        return out
    finally:
        _close(trainer)


def bench_optim(item: dict, dry: bool, workdir: Path) -> dict:
    """The whole training step and the optimizer step alone (on the last step's gradients), medians."""
    device = _device(dry)
    trainer = _trainer(item, dry, workdir)
    try:
        for _ in range(item["warmup"]):
            trainer.train_step()
        step = _timed(trainer.train_step, item["steps"], device)
        opt = _timed(trainer.optimizer.step, item["steps"], device)
        return {"params": trainer.n_params, "tokens_per_step": item["batch"] * item["seq_len"],
                "step_s": statistics.median(step), "optimizer_step_s": statistics.median(opt),
                "optimizer_share": statistics.median(opt) / statistics.median(step)}
    finally:
        _close(trainer)


def bench_probe(item: dict, dry: bool, workdir: Path) -> dict:
    """Training steps and probe runs interleaved; the throughput drop at observe.every = N is
    probe time / (N x step time). The first probe (hooks installed, with compile: the recompile of the blocks
    for the explicit attention path) is timed apart."""
    device = _device(dry)
    trainer = _trainer(item, dry, workdir)
    try:
        trainer._build_probe()
        trainer.train_step()
        first = _timed(lambda: trainer.probe.run(trainer.probe_tokens), 1, device)[0]
        after = _timed(trainer.train_step, 1, device)[0]  # the training graph again after the probe's
        steps, probes = [], []
        per = max(1, item["steps"] // item["probes"])
        for _ in range(item["probes"]):
            steps += _timed(trainer.train_step, per, device)
            probes += _timed(lambda: trainer.probe.run(trainer.probe_tokens), 1, device)
        step_s, probe_s = statistics.median(steps), statistics.median(probes)
        return {"params": trainer.n_params, "step_s": step_s, "probe_s": probe_s, "first_probe_s": first,
                "every": item["every"], "overhead_pct": 100.0 * probe_s / (item["every"] * step_s),
                "first_step_after_probe_s": after}
    finally:
        _close(trainer)


def _attention_module(item: dict, device):
    """Block 0's attention module of the item's flavor with the variant set, materialised on ``device``."""
    import torch

    from outlier_titan.config.job_config import Model
    from outlier_titan.models.layers import Attention, init_norms
    from outlier_titan.models.registry import build_meta_model

    cfg = Model(name="pre_ln", flavor=item["flavor"])
    setattr(cfg, item["key"], item["variant"])
    _, args, model = build_meta_model(cfg, 4096, item["seq_len"])
    attn = next(m for m in next(iter(model.layers.values())).modules() if isinstance(m, Attention))
    attn.to_empty(device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    init_norms(attn)
    return attn, args.dim


SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
            "_scaled_dot_product_flash_attention_for_cpu", "_efficient_attention_forward", "_flash_attention_forward")


def profiled(fn, device, top: int = 4) -> tuple[list[str], list[tuple[str, float]]]:
    """One profiled call of ``fn()``: the aten SDPA kernels (flash / efficient / cudnn / math) that ran, and the
    ``top`` entries by self time with their share of it (on a GPU the device's kernels; on the CPU the profiled
    ops, autograd nodes included): where the time of a variant goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        fn()
        _sync(device)
    names = {e.name.removeprefix("aten::") for e in prof.events()}
    sdpa = sorted(n for n in names if n in SDPA_OPS)
    if cuda:  # the kernels themselves (the CPU op that launched one may carry its time too: not counted twice)
        times = [(e.key, e.self_device_time_total) for e in prof.key_averages()
                 if e.device_type == DeviceType.CUDA and e.self_device_time_total > 0]
    else:
        times = [(e.key, e.self_cpu_time_total) for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(t for _, t in times) or 1.0
    return sdpa, [(name, t / total) for name, t in sorted(times, key=lambda kv: -kv[1])[:top]]


def bench_attention(item: dict, dry: bool, workdir: Path) -> dict:
    """Forward + backward of one attention module (projections included) in bf16 on the fused path."""
    import torch

    from outlier_titan.models.attention import attention_path

    device = _device(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    attn, dim = _attention_module(item, device)
    for p in attn.parameters():  # parameters in the compute dtype; RoPE tables stay float32, as under FSDP
        p.data = p.data.to(dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(item["batch"], item["seq_len"], dim, generator=gen)).to(device, dtype).requires_grad_()
    up = torch.randn(x.shape, generator=gen).to(device, dtype)

    def fwd_bwd():
        attn(x).backward(up)

    fwd_bwd()
    kernels, top = profiled(fwd_bwd, device)
    times = _timed(fwd_bwd, item["steps"], device)
    t = statistics.median(times)
    heads = dim // attn.head_dim
    # causal QK^T and PV: 2 matmuls x 2 FLOP x B H T^2 d_h / 2, backward twice the forward (+ recompute: 2.5x)
    core = 2 * 2 * item["batch"] * heads * item["seq_len"] ** 2 * attn.head_dim / 2 * 3.5
    return {"fwd_bwd_s": t, "tokens_per_s": item["batch"] * item["seq_len"] / t, "sdpa_kernels": kernels,
            "path": attention_path(attn.opts.variant, attn.opts.impl, device) + (": " + ", ".join(kernels)
                                                                                   if kernels else ""),
            "top_kernels": [[name, share] for name, share in top], "attention_core_tflops": core / t / 1e12,
            "dtype": str(dtype).removeprefix("torch."),
            "shape": f"B {item['batch']} x T {item['seq_len']} x D {dim}, {heads} heads of {attn.head_dim}"}


def bench_sleep(item: dict, dry: bool, workdir: Path) -> dict:
    """The runner's own check (tests): sleeps ``seconds``; ``fail`` raises instead; ``exit`` kills the worker."""
    if item.get("exit") is not None:
        os._exit(item["exit"])
    if item.get("fail"):
        raise GpuCheckError(item["fail"])
    time.sleep(item["seconds"])
    return {"slept_s": item["seconds"]}


KINDS = {"train": bench_train, "optim": bench_optim, "probe": bench_probe, "attention": bench_attention,
         "memory": bench_memory, "sleep": bench_sleep}

