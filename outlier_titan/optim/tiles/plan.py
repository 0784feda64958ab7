"""The per-parameter tile plan: the global tile grid of one parameter and this rank's part of it.

Tiles sit on a grid in each parameter's *global* index space, so the tile holding element (i, j) does not
depend on the mesh. ``plan_param`` decides which axes rotate and their tile edges (``options``), checks that
every shard of the layout starts and ends on tile edges (the last tile of an axis may be ragged; a basis
with ``needs_pow2`` also wants power-of-two tiles), and lists the local tiles as segments of equal-size tiles
that the kernels batch over. ``strict`` alignment raises, naming the parameter, its placements and a tile
size that would work; ``adapt`` picks that tile and records it in the checkpointed tile spec.

Axis rules: 1-D parameters run plain (unrotated) Adam unless ``one_d = "rotate"`` (``"auto"`` is resolved to the
optimizer's published choice before planning, ``TileAdamBase.plan``); the vocabulary axis of
the model's vocab-axis parameters (``options.roles``; ``tok_embeddings.weight`` / ``output.weight`` in the built-in
specs) is rotated like the others unless ``vocab_axis = "identity"``; an axis longer than ``max_precond_dim`` is
not rotated. A whole axis (``tile_size = 0``) that a layout shards cannot be rotated without communication, so it
fails the check with a message naming tiles that fit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor import DTensor

from outlier_titan.errors import UserError
from outlier_titan.linalg import is_power_of_two
from outlier_titan.optim.bases import Basis
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.optim.tiles.shards import local_indices, shard_boundaries
from outlier_titan.tensors import local



class TileAlignmentError(UserError):
    """A shard boundary that does not fall on the tile grid (``optimizer.tile_alignment = "strict"``)."""


def tile_ok(size: int, tile: int, boundaries: list[int], pow2: bool) -> bool:
    """Whether every boundary is on the tile grid (and, for ``pow2``, the tile and the ragged last tile are powers
    of two)."""
    if any(b % tile for b in boundaries):
        return False
    if pow2:
        ragged = size % tile
        if not is_power_of_two(tile) or (ragged and not is_power_of_two(ragged)):
            return False
    return True


def best_tile(size: int, tile: int, boundaries: list[int], pow2: bool, minimum: int) -> int | None:
    """The largest tile <= ``tile`` that works, or None when none >= ``minimum`` does."""
    for t in range(min(tile, size), minimum - 1, -1):
        if tile_ok(size, t, boundaries, pow2):
            return t
    return None


@dataclass
class Segment:
    """A run of equal-size local tiles along one axis: local offset, tile count, tile edge, first local
    tile position (the index into the local stacked state)."""

    start: int
    count: int
    size: int
    pos: int


@dataclass
class AxisPlan:
    size: int          # global extent
    tile: int          # tile edge (1: elementwise along this axis)
    rotate: bool       # whether a basis acts along this axis
    requested: int     # configured tile edge before adaptation
    adapted: bool
    compute: int = 1   # edge of the compute blocks: the tile, or for an unrotated axis beside a rotated one
    #                    a batching block (0: the whole local extent)
    local_tiles: list[int] = field(default_factory=list)  # global tile ids, in local order
    extent: int = 0    # local extent
    segments: list[Segment] = field(default_factory=list)

    @property
    def n_tiles(self) -> int:
        return math.ceil(self.size / self.tile) if self.size else 0


@dataclass
class ParamPlan:
    fqn: str
    shape: tuple[int, ...]            # the parameter's global shape
    axes: tuple[AxisPlan, AxisPlan]   # of its 2-D view (1-D: [n, 1]; 0-D: [1, 1])
    mesh: object | None
    placements: tuple | None

    @property
    def rotated(self) -> bool:
        return self.axes[0].rotate or self.axes[1].rotate

    def spec_tensor(self) -> torch.Tensor:
        """Saved in the state as ``tile_spec`` and compared on load."""
        a, b = self.axes
        return torch.tensor([a.size, b.size, a.tile, b.tile, int(a.rotate), int(b.rotate),
                             int(a.adapted), int(b.adapted)], dtype=torch.int64)

    def regions(self):
        """Rectangles of equal-size tiles: (row Segment, column Segment)."""
        return [(r, c) for r in self.axes[0].segments for c in self.axes[1].segments]

    def view2d(self, local: torch.Tensor) -> torch.Tensor:
        return local.reshape(self.axes[0].extent, self.axes[1].extent)


def describe_spec(spec: torch.Tensor) -> str:
    n0, n1, t0, t1, r0, r1, a0, a1 = (int(x) for x in spec.tolist())
    mode = lambda t, r, a: f"{t}{'' if r else '(unrotated)'}{'(adapted)' if a else ''}"  # noqa: E731
    return f"shape [{n0}, {n1}] tiles [{mode(t0, r0, a0)}, {mode(t1, r1, a1)}]"


def as_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The 2-D view the engine uses: [n] -> [n, 1], [] -> [1, 1]."""
    if len(shape) == 0:
        return (1, 1)
    if len(shape) == 1:
        return (shape[0], 1)
    return (shape[0], shape[1])


def plan_param(fqn: str, p: torch.Tensor, opts: EngineOptions, group_other_axis: bool, basis: Basis | None,
               stacked_state: bool) -> ParamPlan:
    """Tile plan of one parameter: which axes rotate, tile edges, the alignment check and local segments.

    ``group_other_axis``: an unrotated axis still carries a tile grid (SOAP: the factor of the rotated axis
    accumulates over a tile of the other; its default tiles are square, see below). ``basis``: the fixed basis
    the rotated axes will carry (OrthoAdam), whose ``needs_pow2`` adds its tile rule; None when the bases have no
    such rule. ``stacked_state``: per-tile state will be sharded along the tile axes, which is checked too.
    """
    shape = tuple(p.shape)
    if len(shape) > 2:
        raise UserError(f"optimizer: {fqn} has {len(shape)} dims {list(shape)}; the tile optimizers handle "
                        f"1-D and 2-D parameters")
    sizes = as_2d(shape)
    is_dt = isinstance(p, DTensor)
    mesh = p.device_mesh if is_dt else None
    placements = tuple(p.placements) if is_dt else ()
    mesh_shape = tuple(mesh.shape) if is_dt else ()
    vocab = opts.roles.has_vocab_axis(fqn)

    rotate = []
    for axis, n in enumerate(sizes):
        r = n >= 2 and n <= opts.max_precond_dim
        if len(shape) < 2:
            r = r and axis == 0 and opts.one_d == "rotate"
        if vocab and axis == 0 and opts.vocab_axis == "identity":
            r = False
        rotate.append(r)

    grid = [rotate[a] or (group_other_axis and rotate[1 - a]) for a in (0, 1)]
    reqs = [opts.requested_tile(fqn, a, sizes[a], len(shape)) if grid[a] else 1 for a in (0, 1)]
    if group_other_axis and all(grid) and not opts.has_override(fqn) and not opts.whole_axes:
        # SOAP: square default tiles (the smaller requested edge on both axes). A t0 x t1 tile
        # with t0 < t1 gives R = Gᵀ G rank <= t0 on the first steps; the eigenvectors of its null space are
        # then set by rounding noise, which differs between layouts (gradient reduction order) and which
        # Adam's normalisation turns into visible update differences.
        reqs = [min(reqs)] * 2
    axes = []
    for axis, n in enumerate(sizes):
        needs_grid = grid[axis]
        requested = reqs[axis]
        tile = max(1, min(requested, n)) if needs_grid else 1
        adapted = False
        if tile > 1:
            bounds = shard_boundaries(n, axis, mesh_shape, placements) if is_dt else []
            pow2_basis = basis if basis is not None and basis.needs_pow2 and rotate[axis] else None
            if not tile_ok(n, tile, bounds, pow2_basis is not None):
                minimum = 2 if rotate[axis] else 1
                better = best_tile(n, tile, bounds, pow2_basis is not None, minimum)
                if opts.tile_alignment == "adapt" and better is not None:
                    tile, adapted = better, True
                else:
                    raise TileAlignmentError(_misaligned_message(fqn, shape, placements, axis, n, tile, bounds,
                                                                 pow2_basis, better))
        compute = tile
        if tile == 1 and not group_other_axis and rotate[1 - axis] and n > 1:
            # An unrotated axis beside a rotated one (OrthoAdam: vocabulary, long axes): its rows are batched
            # in blocks of the configured tile when every shard aligns with them, so each product has the same
            # shape at any layout (bitwise equal results); otherwise one block per shard.
            c = max(1, min(opts.requested_tile(fqn, axis, n, len(shape)), n))
            bounds = shard_boundaries(n, axis, mesh_shape, placements) if is_dt else []
            compute = c if tile_ok(n, c, bounds, False) else 0
        axes.append(AxisPlan(size=n, tile=tile, rotate=rotate[axis] and tile > 1, requested=requested,
                             adapted=adapted, compute=compute))

    plan = ParamPlan(fqn=fqn, shape=shape, axes=(axes[0], axes[1]), mesh=mesh, placements=placements or None)
    coord = mesh.get_coordinate() if is_dt else None
    if is_dt and coord is None:
        raise UserError(f"optimizer: this rank is not part of the mesh of {fqn}")
    local_sizes = as_2d(tuple(local(p).shape))
    for axis, ax in enumerate(plan.axes):
        idx = local_indices(ax.size, axis, mesh_shape, placements, coord) if is_dt else torch.arange(ax.size)
        if idx.numel() != local_sizes[axis]:
            raise UserError(f"optimizer: {fqn} local extent {local_sizes[axis]} along dim {axis} disagrees with "
                            f"its placements {placements} ({idx.numel()} expected)")
        ax.extent = idx.numel()
        if plan.rotated:
            _fill_segments(fqn, axis, ax, idx)
        if stacked_state and is_dt and ax.tile > 1:
            # The stacked [T0, T1, ...] state is sharded along its tile axes with the same placements: its
            # local tiles must be exactly the tiles of this shard, in the same order.
            tiles = local_indices(ax.n_tiles, axis, mesh_shape, placements, coord).tolist()
            if tiles != ax.local_tiles:
                raise TileAlignmentError(
                    f"optimizer: {fqn} (global shape {list(shape)}, placements {placements}): along dim {axis} "
                    f"the shard holds tiles {ax.local_tiles} of edge {ax.tile} but the tile-axis state shard "
                    f"would hold {tiles}; choose a tile edge that divides every shard's length "
                    f"(optimizer.tile_size / tile_size_overrides)")
    return plan
def _fill_segments(fqn: str, axis: int, ax: AxisPlan, idx: torch.Tensor) -> None:
    """Local tiles and segments of the compute grid (aligned with every shard, checked before)."""
    t = ax.compute
    if ax.extent == 0:
        return
    if t == 0:
        ax.segments = [Segment(start=0, count=1, size=ax.extent, pos=0)]
        return
    vals = idx.tolist()
    tiles = []
    pos = 0
    while pos < len(vals):
        g = vals[pos] // t
        edge = min(t, ax.size - g * t)
        if vals[pos] != g * t or vals[pos:pos + edge] != list(range(g * t, g * t + edge)):
            raise TileAlignmentError(f"optimizer: {fqn} dim {axis}: local indices do not cover whole tiles of "
                                     f"edge {t}")
        tiles.append(g)
        pos += edge
    ax.local_tiles = tiles
    start = 0
    for k, g in enumerate(tiles):
        edge = min(t, ax.size - g * t)
        seg = ax.segments[-1] if ax.segments else None
        if seg is not None and seg.size == edge and seg.start + seg.count * seg.size == start:
            seg.count += 1
        else:
            ax.segments.append(Segment(start=start, count=1, size=edge, pos=k))
        start += edge


def _misaligned_message(fqn, shape, placements, axis, n, tile, bounds, pow2_basis: Basis | None, better) -> str:
    """The one-line alignment error: what is off (shard boundaries, the basis' power-of-two rule) and the fix."""
    what = []
    bad = [b for b in bounds if b % tile]
    if bad:
        what.append(f"shard boundaries at {bad[:6]}{'...' if len(bad) > 6 else ''} are not on the {tile}-grid")
    if pow2_basis is not None and not tile_ok(n, tile, [], True):
        what.append(f"the {pow2_basis.name} basis needs power-of-two tiles (tile {tile}, ragged last tile "
                    f"{n % tile})")
    fix = (f"set optimizer.tile_size_overrides = ['{fqn}:{axis}={better}'] (or optimizer.tile_size = {better})"
           if better is not None else "no tile size >= 2 fits this layout: change the parallel layout or the basis")
    if tile == n and bad:
        what[0] = (f"the whole-axis rotation (optimizer.tile_size = 0, the published method) cannot stay local to "
                   f"shards that cut the axis at {bad[:6]}")
        fix = (f"on a sharded layout choose shard-local tiles, e.g. optimizer.tile_size = {better or 128} (a named "
               f"variant: see the tile-size study in docs), or train on one rank")
    return (f"optimizer: {fqn} (global shape {list(shape)}, placements {placements or '(not sharded)'}) dim {axis}: "
            f"{'; '.join(what)}; {fix}, or raise optimizer.max_shards to this axis' shard count, or "
            f"optimizer.tile_alignment = 'adapt'")

