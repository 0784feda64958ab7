"""Tensor helpers every layer may use (models, optimizers, parallelism): the bottom of the import graph."""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Shard


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (differentiable), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective over its mesh: every rank must call it), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def gathered(t: torch.Tensor, shape: tuple[int, ...], tp_mesh) -> torch.Tensor:
    """The whole tensor of global ``shape``: a DTensor's full tensor, or, under tensor parallelism (``tp_mesh``), a
    plain local shard (smaller than ``shape`` in exactly one dim: that dim's Shard over ``tp_mesh``) all-gathered;
    a tensor of that shape, or any tensor without ``tp_mesh``, as it is. A collective where it gathers."""
    if isinstance(t, DTensor):
        return t.full_tensor()
    if tp_mesh is None or tuple(t.shape) == tuple(shape):
        return t
    dims = [d for d in range(t.dim()) if t.shape[d] != shape[d]]
    if len(dims) != 1:
        raise ValueError(f"a tensor of local shape {tuple(t.shape)} is no TP shard of {tuple(shape)}")
    stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
    return DTensor.from_local(t.contiguous(), tp_mesh, [Shard(dims[0])], run_check=False, shape=torch.Size(shape),
                              stride=stride).full_tensor()
