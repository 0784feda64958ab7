"""DTensor-aware gradient norm and clipping."""

from __future__ import annotations

from collections import defaultdict

import torch
from torch.distributed.tensor import DTensor


@torch.no_grad()
def grad_norm(parameters) -> torch.Tensor:
    """Global L2 norm of all gradients, reduced over every mesh the gradients live on.

    Gradients on different meshes (e.g. TP-sharded matrices on a 2-D mesh, FSDP-only gains on a 1-D mesh)
    are normed per mesh, each reduced by DTensor (replicas are not double counted), then combined.
    """
    groups: dict[object, list[torch.Tensor]] = defaultdict(list)
    for p in parameters:
        if p.grad is not None:
            g = p.grad
            groups[g.device_mesh if isinstance(g, DTensor) else None].append(g)
    sq = []
    for grads in groups.values():
        n = torch.nn.utils.get_total_norm(grads, norm_type=2.0, foreach=True)
        if isinstance(n, DTensor):
            n = n.full_tensor()
        sq.append(n.float() ** 2)
    if not sq:
        return torch.zeros(())
    return torch.stack(sq).sum().sqrt()


@torch.no_grad()
def clip_grads(parameters, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales gradients so their global norm is at most ``max_norm`` (no-op below it)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g  # a view: scales the shard in place
        local.mul_(coef.to(local.device))
