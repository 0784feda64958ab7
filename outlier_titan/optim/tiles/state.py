"""Optimizer state beside the shards.

m̂ and v̂ are DTensors with the parameter's mesh, placements and global shape (a tile's rotated coordinates
occupy the tile's own index region); per-tile state (SOAP's factors and bases) is a global stacked tensor
``[T0, T1, t, t]`` sharded along the tile axes like the parameter. All state is created at construction, so
every rank has the same keys, and DCP reshards it between aligned layouts. Local views of it are taken with
``outlier_titan.tensors.local``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from outlier_titan.optim.tiles.plan import ParamPlan


def contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def as_global(local: torch.Tensor, plan: ParamPlan, global_shape) -> torch.Tensor:
    """Wraps a local tensor as a DTensor with the parameter's mesh and placements (plain when unsharded)."""
    if plan.mesh is None:
        return local
    return DTensor.from_local(local, plan.mesh, plan.placements, run_check=False,
                              shape=torch.Size(global_shape), stride=contiguous_stride(global_shape))


def state_dtype_for(p: torch.Tensor) -> torch.dtype:
    """fp32 state, or fp64 for fp64 parameters (exact tests)."""
    return torch.float64 if p.dtype == torch.float64 else torch.float32
