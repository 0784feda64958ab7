"""Megatron-style tensor parallelism with sequence parallelism, via ``parallelize_module``.

Residual stream between blocks: local tensors sharded on the sequence dim (Shard(1)).
  norms (attention_norm, ffn_norm, final norm)  SequenceParallel (params Replicate, grads reduced by DTensor)
  attention / feed_forward inputs               all-gather sequence -> Replicate
  wq, wk, wv, w1, w3                            ColwiseParallel   (weight Shard(0): local heads / hidden)
  wo, w2                                        RowwiseParallel   (weight Shard(1)), reduce-scatter -> Shard(1)
  feed_forward.smooth_scale (Smooth-SwiGLU)     MaxOverShards: its per-token max all-reduced over the TP ranks
  q_norm, k_norm (per head)                     Replicate params over the local-head dim (Shard(1) of q/k)
  a variant's modules (attention.<name>)       by their declared placement (PLACEMENTS): colwise ->
                                                ColwiseParallel, heads -> ShardedParams
  tok_embeddings                                vocab-parallel (RowwiseParallel, weight Shard(0))
  output (untied)                               ColwiseParallel: vocab-sharded logits (loss parallel) or gathered
With learned positions the embedding output is kept Replicate (positions are added to the full sequence) and
block 0 takes its sequence shard locally (no communication).

A spec gives its plan as data (``outlier_titan.models.spec.TPPlan``): :func:`apply_tp_plan` applies the plan
above, then the spec's extra entries, each a module FQN pattern and a placement name (:data:`PLACEMENTS`), for
specs with extra parameters beside the linears (op, angpt, ngpt):
  sequence_local                 SequenceParallel with local outputs (norms outside the standard positions)
  ReplicatedParamsOnShards(dim)  gains / LERP steps / residual scales applied to sequence-sharded (dim 1) or
                                 head-sharded activations: params Replicate, inputs viewed as Shard(dim),
                                 outputs local; their gradients are all-reduced by DTensor
  ShardedParams                  per-head / per-hidden-unit vectors: params Shard(0) with the heads, used
                                 locally (``local(p)``); no communication
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from outlier_titan.errors import ConfigError
from outlier_titan.models.attention_variants import get_variant
from outlier_titan.models.spec import TPPlan


def check_divisible(tp: int, **sizes: int) -> None:
    for name, n in sizes.items():
        if n % tp:
            raise ConfigError(f"parallelism.tp = {tp} does not divide {name} = {n}; choose a tp that divides it")


def _gather_output(module: nn.Module, inputs, output):
    return output.full_tensor() if isinstance(output, DTensor) else output


def tp_block_plan(block: nn.Module, *, norms: bool = True) -> dict:
    """The per-block plan for blocks built from ``layers.Attention`` and ``layers.MLP``.

    ``norms=False`` for blocks without pre-norms (OP): the sub-layer inputs are then prepared from the
    sequence-sharded residual stream directly.
    """
    plan = {
        "attention": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
        "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if getattr(block.feed_forward, "w3", None) is not None:
        plan["feed_forward.w3"] = ColwiseParallel()
    if getattr(block.feed_forward, "smooth_scale", None) is not None:
        plan["feed_forward.smooth_scale"] = MaxOverShards()
    variant = getattr(block.attention, "variant", None)
    for p in get_variant(variant).params if variant is not None else ():
        plan[f"attention.{p.name}"] = PLACEMENTS[p.placement]()
    if getattr(block.attention, "q_norm", None) is not None:
        # q, k are [B, H_local, T, d_h]: the head dim (1) is the sharded one.
        plan["attention.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["attention.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    if norms:
        for name in ("attention_norm", "ffn_norm"):
            if _has_params_or_module(block, name):
                plan[name] = SequenceParallel()
    return plan


def _has_params_or_module(block: nn.Module, name: str) -> bool:
    m = getattr(block, name, None)
    return m is not None and not isinstance(m, nn.Identity)


def apply_standard_tp(model: nn.Module, tp_mesh: DeviceMesh, args, *, block_norms: bool = True,
                      loss_parallel: bool = False) -> None:
    """TP + sequence parallel for a model with tok_embeddings / layers / norm / output.

    ``loss_parallel``: the head's logits stay vocab-sharded (a DTensor Shard(-1)); the trainer then computes the
    cross entropy under ``torch.distributed.tensor.parallel.loss_parallel`` without gathering [B, T, V].
    Only for models whose forward returns ``output(...)`` unchanged.
    """
    tp = tp_mesh.size()
    check_divisible(tp, n_heads=args.n_heads, n_kv_heads=getattr(args, "n_kv_heads", args.n_heads),
                    vocab_size=args.vocab_size)
    learned_pos = getattr(model, "pos_embeddings", None) is not None
    root = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(),
                                              output_layouts=Replicate() if learned_pos else Shard(1))}
    final_norm = getattr(model, "norm", None)
    has_final_norm = final_norm is not None and not isinstance(final_norm, nn.Identity)
    if has_final_norm:
        root["norm"] = SequenceParallel()
    if getattr(model, "output", None) is not None:
        root["output"] = (ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
                          if loss_parallel else ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()))
    parallelize_module(model, tp_mesh, root)
    for i, block in enumerate(model.layers.values()):
        plan = tp_block_plan(block, norms=block_norms)
        parallelize_module(block, tp_mesh, plan)
        if i == 0 and learned_pos:
            # Full sequence in, local sequence shard out: a local chunk, no communication.
            parallelize_module(block, tp_mesh, PrepareModuleInput(input_layouts=(Replicate(),),
                                                                  desired_input_layouts=(Shard(1),),
                                                                  use_local_output=True))
    if getattr(model, "output", None) is None or not has_final_norm:
        model.register_forward_hook(_gather_output)


def apply_tp_plan(model: nn.Module, tp_mesh: DeviceMesh, args, plan: TPPlan) -> None:
    """A spec's plan: the standard one (:func:`apply_standard_tp`), then each of its extra entries on the modules
    whose FQN matches the entry's pattern."""
    why = plan.unsupported(args) if plan.unsupported is not None else None
    if why:
        raise ConfigError(why)
    apply_standard_tp(model, tp_mesh, args, block_norms=plan.block_norms, loss_parallel=plan.loss_parallel)
    modules = list(model.named_modules())
    for pattern, placement in plan.extra.items():
        for fqn, module in modules:
            if not fnmatchcase(fqn, pattern):
                continue
            if placement in _PARAM_PLACEMENTS and next(module.parameters(recurse=False), None) is None:
                continue
            parallelize_module(module, tp_mesh, PLACEMENTS[placement]())


class ReplicatedParamsOnShards(ParallelStyle):
    """For a small module whose parameters (gains, LERP steps, residual scales) act on TP-local activations
    that are sharded on ``shard_dim`` (the sequence dim of the residual stream, or the head dim of q/k):
    its parameters become Replicate DTensors, every tensor input is viewed as a DTensor ``Shard(shard_dim)``
    (no communication), and outputs are turned back into local tensors. Parameter gradients come out
    ``Partial`` and are all-reduced by DTensor, as for SequenceParallel norms; unlike SequenceParallel,
    every positional tensor input is wrapped (modules with two inputs, e.g. a LERP)."""

    def __init__(self, shard_dim: int = 1):
        super().__init__()
        self.shard_dim = shard_dim

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        placements = (Shard(self.shard_dim),)

        def partition(name, mod, mesh):
            for p_name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(p_name, nn.Parameter(DTensor.from_local(p, mesh, [Replicate()], run_check=False),
                                                            requires_grad=p.requires_grad))

        def wrap_inputs(mod, inputs, mesh):
            return tuple(DTensor.from_local(x, mesh, placements, run_check=False)
                         if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

        def unwrap_outputs(mod, outputs, mesh):
            if isinstance(outputs, tuple):
                return tuple(o.to_local() if isinstance(o, DTensor) else o for o in outputs)
            return outputs.to_local() if isinstance(outputs, DTensor) else outputs

        return distribute_module(module, device_mesh, partition, wrap_inputs, unwrap_outputs)


class ShardedParams(ParallelStyle):
    """For per-head or per-hidden-unit vectors that a module applies to TP-local activations (local heads,
    local hidden units): the parameters become ``Shard(0)`` DTensors on the TP mesh (dim 0 must be laid out
    head-major / unit-major like the column-parallel weight it follows), and the module uses
    ``p.to_local()``. The activations are full-sequence there, so each rank's shard gets its complete
    gradient; no communication."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for p_name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(p_name, nn.Parameter(distribute_tensor(p, device_mesh, [Shard(0)]),
                                                           requires_grad=p.requires_grad))
        return module


class MaxOverShards(ParallelStyle):
    """For a parameter-free module that returns a per-token maximum over its TP-local hidden units (Smooth-SwiGLU's
    scale, ``models/smooth_swiglu.py``): its output is all-reduced (max) over the TP mesh, so every rank holds the
    maximum over all units, and the module learns its rank's sequence chunk (``sequence_shard``) for the outputs
    that come back sequence-sharded. The output is never differentiated."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.sequence_shard = (device_mesh.get_local_rank(), device_mesh.size())

        def reduce_max(mod, outputs, mesh):
            return funcol.all_reduce(outputs, "max", mesh)

        return distribute_module(module, device_mesh, output_fn=reduce_max)


PLACEMENTS = {
    "colwise": ColwiseParallel,
    "rowwise": lambda: RowwiseParallel(output_layouts=Shard(1)),
    "sequence": SequenceParallel,
    "sequence_local": lambda: SequenceParallel(use_local_output=True),
    "replicated_on_shards": lambda: ReplicatedParamsOnShards(1),
    "sharded_params": ShardedParams,
}
"""A plan's placement names (``outlier_titan.models.spec.PLACEMENTS``) -> the ParallelStyle each stands for."""
_PARAM_PLACEMENTS = ("replicated_on_shards", "sharded_params")



