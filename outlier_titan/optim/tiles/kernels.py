"""Rotation kernels: a region of equal-size tiles gathered as a [a, b, s0, s1] batch, rotated per tile, and
scattered back. Every product has the tile's shape whatever the layout, so a tile's numbers do not depend on
which shard holds it. (OrthoAdam's factored Hadamard / Kronecker bases have their own in-layout kernel,
``orthoadam.KronAxis``.)"""

from __future__ import annotations

import torch

from outlier_titan.optim.tiles.plan import Segment


def to_tiles(x: torch.Tensor, rseg: Segment, cseg: Segment) -> torch.Tensor:
    """The region (rseg x cseg) of a local 2-D tensor as [a, b, s0, s1] tiles (a copy)."""
    region = x[rseg.start:rseg.start + rseg.count * rseg.size, cseg.start:cseg.start + cseg.count * cseg.size]
    return region.reshape(rseg.count, rseg.size, cseg.count, cseg.size).permute(0, 2, 1, 3).contiguous()


def from_tiles(dst: torch.Tensor, tiles: torch.Tensor, rseg: Segment, cseg: Segment) -> None:
    """Writes [a, b, s0, s1] tiles back into the region (rseg x cseg) of a local 2-D tensor."""
    region = dst[rseg.start:rseg.start + rseg.count * rseg.size, cseg.start:cseg.start + cseg.count * cseg.size]
    region.view(rseg.count, rseg.size, cseg.count, cseg.size).copy_(tiles.permute(0, 2, 1, 3))


def rotate_tiles(x4: torch.Tensor, q0: torch.Tensor | None, q1: torch.Tensor | None, transpose: bool) -> torch.Tensor:
    """Per-tile bases: x4 [a, b, s0, s1], q0 [a, b, s0, s0] (or broadcastable), q1 [a, b, s1, s1].

    Forward: Q0ᵀ X Q1; back (``transpose=True``): Q0 X Q1ᵀ. None skips that side.
    """
    y = x4
    if q0 is not None:
        y = torch.matmul(q0 if transpose else q0.transpose(-1, -2), y)
    if q1 is not None:
        y = torch.matmul(y, q1.transpose(-1, -2) if transpose else q1)
    return y
