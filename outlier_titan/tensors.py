"""Tensor helpers every layer may use (models, optimizers, parallelism): the bottom of the import graph."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor


def local(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (differentiable), or the tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    """The full tensor of a DTensor (a collective over its mesh: every rank must call it), or the tensor itself."""
    return t.full_tensor() if isinstance(t, DTensor) else t
