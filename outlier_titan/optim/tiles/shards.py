"""DTensor shard arithmetic: which global indices of a tensor dim each mesh coordinate holds.

For every mesh coordinate the global indices of the local rows / columns come from applying each placement's
own ``_split_tensor`` (the code ``distribute_tensor`` runs) to an index vector, in mesh-dim order. This handles
``_StridedShard`` (FSDP over TP), whose local shards are not contiguous in global index space.
"""

from __future__ import annotations

import itertools

import torch
from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

from outlier_titan.errors import UserError


def _shard_dims(placements, dim: int) -> list[int]:
    """Mesh dims whose placement shards tensor dim ``dim``."""
    return [i for i, pl in enumerate(placements) if isinstance(pl, (Shard, _StridedShard)) and pl.dim == dim]


def local_indices(size: int, dim: int, mesh_shape: tuple[int, ...], placements, coord) -> torch.Tensor:
    """Global indices, in local order, of tensor dim ``dim`` held at mesh coordinate ``coord``.

    Applies each placement's own split (as ``distribute_tensor`` does, mesh dim by mesh dim) to an index
    vector; ``_StridedShard`` shards come out as the (possibly non-contiguous) index sets they are.
    """
    idx = torch.arange(size)
    for mesh_dim, pl in enumerate(placements):
        if isinstance(pl, Partial):
            raise UserError(f"a Partial placement {pl} cannot be tiled; reduce the tensor first")
        if isinstance(pl, _StridedShard) and pl.dim == dim:
            pieces, _ = _StridedShard(0, split_factor=pl.split_factor)._split_tensor(
                idx, mesh_shape[mesh_dim], with_padding=False)
            idx = pieces[coord[mesh_dim]]
        elif isinstance(pl, Shard) and pl.dim == dim:
            pieces, _ = Shard(0)._split_tensor(idx, mesh_shape[mesh_dim], with_padding=False)
            idx = pieces[coord[mesh_dim]]
    return idx


def all_local_indices(size: int, dim: int, mesh_shape, placements) -> list[torch.Tensor]:
    """The local index set of every distinct shard of dim ``dim`` (over the mesh dims that shard it)."""
    sdims = _shard_dims(placements, dim)
    out = []
    for combo in itertools.product(*(range(mesh_shape[d]) for d in sdims)):
        coord = [0] * len(mesh_shape)
        for d, c in zip(sdims, combo):
            coord[d] = c
        out.append(local_indices(size, dim, mesh_shape, placements, coord))
    return out


def _runs(idx: torch.Tensor) -> list[tuple[int, int]]:
    """Maximal runs [start, end) of consecutive indices."""
    if idx.numel() == 0:
        return []
    vals = idx.tolist()
    runs, start, prev = [], vals[0], vals[0]
    for v in vals[1:]:
        if v != prev + 1:
            runs.append((start, prev + 1))
            start = v
        prev = v
    runs.append((start, prev + 1))
    return runs


def shard_boundaries(size: int, dim: int, mesh_shape, placements) -> list[int]:
    """Sorted interior shard boundaries along ``dim`` (0 and ``size`` excluded)."""
    bounds = set()
    for idx in all_local_indices(size, dim, mesh_shape, placements):
        for s, e in _runs(idx):
            bounds.update((s, e))
    bounds.discard(0)
    bounds.discard(size)
    return sorted(bounds)
