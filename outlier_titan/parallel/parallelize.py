"""Applies the parallel plan to a meta-device model, in torchtitan's order: TP -> AC -> compile -> FSDP2."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from outlier_titan.config.job_config import JobConfig
from outlier_titan.errors import ConfigError
from outlier_titan.lowprec.training import convert_model
from outlier_titan.parallel.dims import ParallelDims
from outlier_titan.parallel.fsdp import apply_fsdp
from outlier_titan.parallel.tensor_parallel import apply_tp_plan

# Ops whose outputs op-level selective AC keeps (everything else is recomputed in backward): the linear layers and
# the fused attention kernels. Not bmm: the chunked attention's [T_q, T] logits would pile up to T x T.
_SAVE_OPS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _op_policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in _SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def apply_activation_checkpointing(model: nn.Module, mode: str, every: int) -> None:
    """none | full (every block) | selective (every k-th block, or op-level when every == 0)."""
    if mode == "none":
        return
    for i, (name, block) in enumerate(list(model.layers.items())):
        if mode == "selective" and every > 0 and i % every != 0:
            continue
        if mode == "selective" and every == 0:
            wrapped = checkpoint_wrapper(block, context_fn=lambda: create_selective_checkpoint_contexts(_op_policy),
                                         preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        model.layers[name] = wrapped


def apply_compile(model: nn.Module) -> None:
    """Compiles each transformer block in place (identical blocks reuse one compiled graph)."""
    for block in model.layers.values():
        block.compile(fullgraph=False)


def parallelize(model: nn.Module, spec, args, cfg: JobConfig, dims: ParallelDims, mesh: DeviceMesh,
                device_type: str, log=None) -> list[str]:
    """Low-precision conversion -> TP (spec plan) -> activation checkpointing -> per-block compile -> FSDP2 / HSDP.
    Returns the names of the Linears ``[low_precision]`` converted (``log`` gets its lines)."""
    converted = convert_model(model, cfg.low_precision, device_type, tp=dims.tp, log=log)
    if dims.tp_enabled:
        if spec.tp_plan is None:
            raise ConfigError(f"parallelism.tp = {dims.tp} but model spec '{spec.name}' has no TP plan")
        apply_tp_plan(model, mesh["tp"], args, spec.tp_plan)
    apply_activation_checkpointing(model, cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_every)
    if cfg.compile.enable:
        apply_compile(model)
    on_gpu = device_type == "cuda"
    param_dtype = getattr(torch, cfg.training.mixed_precision_param) if on_gpu else torch.float32
    reduce_dtype = getattr(torch, cfg.training.mixed_precision_reduce) if on_gpu else torch.float32
    dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.dp_replicate > 1 else mesh["dp_shard"]
    # FSDP2 also at dp = 1: it then only applies the mixed-precision policy, so world size 1 trains in
    # bf16 on GPU exactly like N ranks (no silent fp32 single-GPU runs).
    apply_fsdp(model, dp_mesh, param_dtype, reduce_dtype)
    return converted
