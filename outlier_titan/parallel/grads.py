"""DTensor-aware global norms (of gradients, of parameters) and gradient clipping."""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate


def _copies(t: DTensor) -> int:
    """How many ranks of the world hold each element of ``t``'s local shard: its mesh's replicated dimensions,
    times the copies of its mesh in the world (a 1-D FSDP mesh exists once per TP rank)."""
    mesh = t.device_mesh
    replicated = math.prod(mesh.size(i) for i, p in enumerate(t.placements) if p.is_replicate())
    return replicated * dist.get_world_size() // mesh.size()


@torch.no_grad()
def global_norm(tensors) -> torch.Tensor:
    """Global L2 norm (fp32) of ``tensors``, plain or DTensors on any meshes of the world.

    DTensors: each rank sums the squares of its local shards, weighted by 1 / the copies of each element in the
    world, and one all-reduce over the world adds them up (DTensor's own reduction would take one all-reduce
    per mesh dimension: two sequential ones under FSDP x TP). Plain tensors are this rank's alone."""
    groups: dict[int, list[torch.Tensor]] = defaultdict(list)
    plain: list[torch.Tensor] = []
    for t in tensors:
        if not isinstance(t, DTensor):
            plain.append(t)
            continue
        if any(p.is_partial() for p in t.placements):  # not met by FSDP2 / TP gradients; correct all the same
            t = t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])
        groups[_copies(t)].append(t.to_local())
    total = torch.zeros(())
    if groups:
        total = torch.stack([torch.nn.utils.get_total_norm(ts, norm_type=2.0, foreach=True).float() ** 2 / copies
                             for copies, ts in groups.items()]).sum()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(total)
    if plain:
        own = torch.nn.utils.get_total_norm(plain, norm_type=2.0, foreach=True).float() ** 2
        total = total.to(own.device) + own
    return total.sqrt()


def grad_norm(parameters) -> torch.Tensor:
    """Global L2 norm of all gradients (the same value on every rank)."""
    return global_norm(p.grad for p in parameters if p.grad is not None)


def param_norm(parameters) -> torch.Tensor:
    """Global L2 norm of the parameters (the same value on every rank)."""
    return global_norm(p.detach() for p in parameters)


@torch.no_grad()
def clip_grads(parameters, max_norm: float, total_norm: torch.Tensor) -> None:
    """Scales gradients so their global norm is at most ``max_norm`` (no-op below it)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for g in grads:
        local = g.to_local() if isinstance(g, DTensor) else g  # a view: scales the shard in place
        local.mul_(coef.to(local.device))
