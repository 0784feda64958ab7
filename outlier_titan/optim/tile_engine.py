"""The tile engine: Adam in a tile-local Kronecker basis, on the local shards of (DTensor) parameters.

For a tile G_T of a 2-D weight with bases B0 (rows) and B1 (columns):
    Ĝ = B0ᵀ G_T B1,   m̂ ← β1 m̂ + (1-β1) Ĝ,   v̂ ← β2 v̂ + (1-β2) Ĝ²,   U_T = B0 (m̂ / (√v̂ + ε)) B1ᵀ,
with decoupled weight decay in the original basis. OrthoAdam's bases are fixed and regenerated from a
seed; SOAP's are eigenbases of per-tile factors. This module holds what both share:

* **The global tile grid.** Tiles sit on a grid in each parameter's *global* index space, so the tile
  holding element (i, j) does not depend on the mesh. Each rank works only on the tiles inside its shard:
  no communication, and the same numbers at any world size.
* **Local extents from DTensor's own shard arithmetic.** For every mesh coordinate the global indices of
  the local rows/columns are obtained by applying each placement's own ``_split_tensor`` (the code
  ``distribute_tensor`` runs) to an index vector, in mesh-dim order. This handles ``_StridedShard``
  (FSDP over TP), whose local shards are not contiguous in global index space.
* **The alignment check** at construction: every local run of indices must start and end on tile edges
  (the last tile of an axis may be ragged). ``strict`` raises, naming the parameter, its placements and a
  tile size that would work; ``adapt`` picks that tile and records it in the checkpointed tile spec.
* **State beside the shards**: m̂ and v̂ are DTensors with the parameter's mesh, placements and global
  shape (a tile's rotated coordinates occupy the tile's own index region); per-tile SOAP state is a global
  stacked tensor ``[T0, T1, t, t]`` sharded along the tile axes like the parameter. All state is created at
  construction, so every rank has the same keys, and DCP reshards it between aligned layouts.
* **One collective**: an all-reduced "some gradient is non-finite" flag; such a step is skipped on every
  rank and counted in ``optimizer.skipped_steps``.
* **Specs saved and verified on load**: the per-parameter tile spec is a small state tensor, the basis or
  SOAP spec a string in the param group; a mismatch raises ``CheckpointError``.

**Whole axes or tiles.** ``tile_size = 0`` (the default) makes every axis one tile: one basis per parameter axis,
as the papers run OrthoAdam (a fixed orthogonal matrix per parameter) and SOAP (Kronecker factors over whole axes up
to ``max_precond_dim``). A whole axis that a layout shards cannot be rotated without communication, so it fails the
alignment check with a message naming tiles that fit; ``tile_size > 0`` is the shard-local tile variant (no
communication, the same numbers at every layout whose shards fall on tile edges).

Axis rules: 1-D parameters run plain (unrotated) Adam unless ``one_d = "rotate"``; the vocabulary axis of
``tok_embeddings.weight`` / ``output.weight`` is rotated like the others unless ``vocab_axis = "identity"``; an
axis longer than ``max_precond_dim`` is not rotated.
"""

from __future__ import annotations

import abc

import fnmatch
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

from outlier_titan.errors import CheckpointError, UserError

VOCAB_PARAMS = ("tok_embeddings.weight", "output.weight")
"""FQN suffixes of parameters whose axis 0 is the vocabulary."""

ALIGNMENTS = ("strict", "adapt")


class TileAlignmentError(UserError):
    """A shard boundary that does not fall on the tile grid (``optimizer.tile_alignment = "strict"``)."""


@dataclass(frozen=True)
class EngineOptions:
    """Tile-engine settings shared by OrthoAdam and SOAP (see the ``optimizer`` config section)."""

    tile_size: int = 0  # 0: whole axes (the published methods)
    shard_tile_size: int = 0
    max_shards: int = 8
    tile_size_overrides: tuple[str, ...] = ()
    tile_alignment: str = "strict"
    vocab_axis: str = "tile"
    one_d: str = "adamw"
    max_precond_dim: int = 10000
    # The all-reduced non-finite flag (skip the step on every rank). Off when the caller already skips
    # non-finite steps before ``step()`` (the trainer does, from the globally reduced gradient norm).
    nonfinite_guard: bool = True

    def __post_init__(self) -> None:
        if self.tile_size < 0:
            raise UserError(f"optimizer.tile_size = {self.tile_size} must be >= 0 (0: whole axes)")
        if self.shard_tile_size < 0:
            raise UserError(f"optimizer.shard_tile_size = {self.shard_tile_size} must be >= 0 (0: automatic)")
        if self.max_shards < 1:
            raise UserError(f"optimizer.max_shards = {self.max_shards} must be >= 1")
        if self.tile_alignment not in ALIGNMENTS:
            raise UserError(f"optimizer.tile_alignment = {self.tile_alignment!r}; choose strict or adapt")
        if self.vocab_axis not in ("identity", "tile"):
            raise UserError(f"optimizer.vocab_axis = {self.vocab_axis!r}; choose identity or tile")
        if self.one_d not in ("adamw", "rotate"):
            raise UserError(f"optimizer.one_d = {self.one_d!r}; choose adamw or rotate")
        parse_overrides(self.tile_size_overrides)

    @property
    def whole_axes(self) -> bool:
        """Whether every axis is one tile (``tile_size = 0``, the published methods)."""
        return self.tile_size == 0

    def requested_tile(self, fqn: str, axis: int, extent: int, ndim: int = 2) -> int:
        """The configured tile edge of ``fqn`` along ``axis`` (global ``extent``): the last matching override
        wins; otherwise the whole axis (``tile_size = 0``), or ``tile_size`` on the residual axis and
        ``default_shard_tile`` on the axis FSDP / TP shard. Depends on the FQN and the global shape only, never
        on the layout."""
        if self.whole_axes:
            size = extent
        elif axis == _sharded_axis(fqn, ndim):
            size = self.default_shard_tile(extent)
        else:
            size = self.tile_size
        for pattern, ax, value in parse_overrides(self.tile_size_overrides):
            if (ax is None or ax == axis) and fnmatch.fnmatchcase(fqn, pattern):
                size = value
        return size

    def has_override(self, fqn: str) -> bool:
        """Whether some ``tile_size_overrides`` entry matches ``fqn``."""
        return any(fnmatch.fnmatchcase(fqn, pattern) for pattern, _, _ in parse_overrides(self.tile_size_overrides))

    def default_shard_tile(self, extent: int) -> int:
        """Tile edge along a sharded axis of global length ``extent``: ``shard_tile_size`` when set, else the
        largest power of two <= ``tile_size`` with ``max_shards`` x tile dividing ``extent`` (so every layout
        with up to ``max_shards`` power-of-two shards on that axis cuts it on tile edges); ``tile_size`` when
        no power of two does (e.g. an odd length; the strict check then speaks for sharded layouts)."""
        if self.shard_tile_size:
            return self.shard_tile_size
        t = 1
        while 2 * t <= self.tile_size and extent % (2 * t * self.max_shards) == 0:
            t *= 2
        return t if t >= 2 else self.tile_size


def _sharded_axis(fqn: str, ndim: int) -> int:
    """The axis FSDP and TP shard (``parallel.fsdp.shard_dim_for``; the residual axis stays whole)."""
    from outlier_titan.parallel.fsdp import shard_dim_for

    return shard_dim_for(fqn, torch.empty((1,) * ndim, device="meta"))


def parse_overrides(entries) -> list[tuple[str, int | None, int]]:
    """``"PATTERN=SIZE"`` or ``"PATTERN:AXIS=SIZE"`` (fnmatch on the FQN) -> (pattern, axis or None, size)."""
    out = []
    for entry in entries:
        lhs, sep, rhs = str(entry).rpartition("=")
        axis = None
        if ":" in lhs:
            lhs, _, ax = lhs.rpartition(":")
            if ax not in ("0", "1"):
                lhs = ""
            else:
                axis = int(ax)
        if not sep or not lhs or not rhs.strip().isdigit() or int(rhs) < 1:
            raise UserError(f"optimizer.tile_size_overrides entry {entry!r}: write PATTERN=SIZE or "
                            f"PATTERN:AXIS=SIZE (AXIS 0 or 1, SIZE >= 1), e.g. 'layers.*.feed_forward.w2.weight:1=128'")
        out.append((lhs.strip(), axis, int(rhs)))
    return out


# ----------------------------------------------------------------------------------------------------------
# Global index sets of local shards


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


def tile_ok(size: int, tile: int, boundaries: list[int], pow2: bool) -> bool:
    """Whether every boundary is on the tile grid (and, for Hadamard bases, tile sizes are powers of two)."""
    if any(b % tile for b in boundaries):
        return False
    if pow2:
        ragged = size % tile
        if not _is_pow2(tile) or (ragged and not _is_pow2(ragged)):
            return False
    return True


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def best_tile(size: int, tile: int, boundaries: list[int], pow2: bool, minimum: int) -> int | None:
    """The largest tile <= ``tile`` that works, or None when none >= ``minimum`` does."""
    for t in range(min(tile, size), minimum - 1, -1):
        if tile_ok(size, t, boundaries, pow2):
            return t
    return None


# ----------------------------------------------------------------------------------------------------------
# Per-parameter plan


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


def _local_of(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def plan_param(fqn: str, p: torch.Tensor, opts: EngineOptions, group_other_axis: bool, pow2: bool,
               stacked_state: bool) -> ParamPlan:
    """Tile plan of one parameter: which axes rotate, tile edges, the alignment check and local segments.

    ``group_other_axis``: an unrotated axis still carries a tile grid (SOAP: the factor of the rotated axis
    accumulates over a tile of the other; its default tiles are square, see below). ``stacked_state``:
    per-tile state will be sharded along the tile axes, which is checked too.
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
    vocab = any(fqn == s or fqn.endswith("." + s) for s in VOCAB_PARAMS)

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
            want_pow2 = pow2 and rotate[axis]
            if not tile_ok(n, tile, bounds, want_pow2):
                minimum = 2 if rotate[axis] else 1
                better = best_tile(n, tile, bounds, want_pow2, minimum)
                if opts.tile_alignment == "adapt" and better is not None:
                    tile, adapted = better, True
                else:
                    raise TileAlignmentError(_misaligned_message(fqn, shape, placements, axis, n, tile, bounds,
                                                                 want_pow2, better))
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
    local_sizes = as_2d(tuple(_local_of(p).shape))
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


def _misaligned_message(fqn, shape, placements, axis, n, tile, bounds, pow2, better) -> str:
    what = []
    bad = [b for b in bounds if b % tile]
    if bad:
        what.append(f"shard boundaries at {bad[:6]}{'...' if len(bad) > 6 else ''} are not on the {tile}-grid")
    if pow2 and (not _is_pow2(tile) or (n % tile and not _is_pow2(n % tile))):
        what.append(f"Hadamard bases need power-of-two tiles (tile {tile}, ragged last tile {n % tile})")
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


# ----------------------------------------------------------------------------------------------------------
# State helpers


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


def local(t: torch.Tensor) -> torch.Tensor:
    return _local_of(t)


# ----------------------------------------------------------------------------------------------------------
# Rotation kernels


def to_tiles(x: torch.Tensor, rseg: Segment, cseg: Segment) -> torch.Tensor:
    """The region (rseg x cseg) of a local 2-D tensor as [a, b, s0, s1] tiles (a copy)."""
    region = x[rseg.start:rseg.start + rseg.count * rseg.size, cseg.start:cseg.start + cseg.count * cseg.size]
    return region.reshape(rseg.count, rseg.size, cseg.count, cseg.size).permute(0, 2, 1, 3).contiguous()


def from_tiles(dst: torch.Tensor, tiles: torch.Tensor, rseg: Segment, cseg: Segment) -> None:
    """Writes [a, b, s0, s1] tiles back into the region (rseg x cseg) of a local 2-D tensor."""
    region = dst[rseg.start:rseg.start + rseg.count * rseg.size, cseg.start:cseg.start + cseg.count * cseg.size]
    region.view(rseg.count, rseg.size, cseg.count, cseg.size).copy_(tiles.permute(0, 2, 1, 3))


def rotate_tiles(x4: torch.Tensor, q0: torch.Tensor | None, q1: torch.Tensor | None, transpose: bool) -> torch.Tensor:
    """Per-tile bases (SOAP): x4 [a, b, s0, s1], q0 [a, b, s0, s0], q1 [a, b, s1, s1].

    Forward: Q0ᵀ X Q1; back (``transpose=True``): Q0 X Q1ᵀ. None skips that side.
    """
    y = x4
    if q0 is not None:
        y = torch.matmul(q0 if transpose else q0.transpose(-1, -2), y)
    if q1 is not None:
        y = torch.matmul(y, q1.transpose(-1, -2) if transpose else q1)
    return y


# ----------------------------------------------------------------------------------------------------------
# Adam's element-wise math, shared by OrthoAdam and SOAP


def adam_directions(ms: list, vs: list, gs: list, rows: list[tuple]) -> list:
    """Updates the moments in place (m ← lerp(m, g, 1-β1), v ← β2 v + (1-β2) g²) and returns the directions
    m / ((√v / c2 + ε) · c1), as foreach ops over all tensors (the eager reference). ``rows``: per tensor
    ``(1-β1, β2, 1-β2, c2, ε, c1)``; passes whose coefficients are all 1 are skipped (they would be exact)."""
    col = lambda k: [r[k] for r in rows]  # noqa: E731
    torch._foreach_lerp_(ms, gs, col(0))
    torch._foreach_mul_(vs, col(1))
    torch._foreach_addcmul_(vs, gs, gs, col(2))
    denom = torch._foreach_sqrt(vs)
    if any(c != 1.0 for c in col(3)):
        torch._foreach_div_(denom, col(3))
    torch._foreach_add_(denom, col(4))
    if any(c != 1.0 for c in col(5)):
        torch._foreach_mul_(denom, col(5))
    return torch._foreach_div(ms, denom)


def _adam_directions_fusable(ms: list, vs: list, gs: list, coef: torch.Tensor) -> list:
    """``adam_directions`` written per tensor for ``torch.compile``, which fuses each tensor's update into one
    pass; ``coef`` is the rows as an [n, 6] tensor, so a new step count or learning rate does not recompile."""
    out = []
    for i, (m, v, g) in enumerate(zip(ms, vs, gs)):
        c = coef[i].to(m.dtype)
        m.lerp_(g, c[0])
        v.mul_(c[1]).add_(g * g * c[2])
        out.append(m / ((v.sqrt() / c[3] + c[4]) * c[5]))
    return out


def compiled_adam_directions():
    """``adam_directions`` compiled (static shapes): same signature, 4-5x faster on CPU (BENCHMARKS.md); equal to
    the eager reference up to rounding, and element-wise, so a shard's numbers do not depend on where the shard
    boundary falls. Not ``fullgraph``: the function has no graph break, and without it a process that outgrows
    dynamo's recompile limit (many optimizers of different shapes) runs the same math eagerly instead of failing."""
    fused = torch.compile(_adam_directions_fusable, dynamic=False)

    def directions(ms, vs, gs, rows):
        if not ms:
            return []
        coef = torch.tensor(rows, dtype=torch.float64)
        if ms[0].device.type != "cpu":  # a pinned, asynchronous copy: no host sync per step
            coef = coef.pin_memory().to(ms[0].device, non_blocking=True)
        return fused(ms, vs, gs, coef)

    return directions


# ----------------------------------------------------------------------------------------------------------
# The optimizer base


class TileAdamBase(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Shared machinery of the tile optimizers; subclasses provide the bases and the update.

    ``params``: param groups as ``build_param_groups`` makes them (each with ``names``, the FQNs).
    """

    spec_keys: tuple[str, ...] = ()
    group_other_axis = False
    stacked_state = False

    def __init__(self, params, defaults: dict, options: EngineOptions, pow2: bool = False,
                 flag_group=None) -> None:
        super().__init__(params, defaults)
        self.options = options
        self._flag_group = flag_group
        self._directions = adam_directions
        self.plans: dict[torch.Tensor, ParamPlan] = {}
        for group in self.param_groups:
            names = group.get("names")
            if names is None or len(names) != len(group["params"]):
                raise UserError("tile optimizers need the parameters' FQNs: give each param group 'names' "
                                "(build_param_groups does)")
            group.setdefault("skipped_steps", 0)
            for p, fqn in zip(group["params"], names):
                self.plans[p] = plan_param(fqn, p, options, self.group_other_axis, pow2, self.stacked_state)

    # -- subclass hooks ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def _init_state(self, p: torch.Tensor, plan: ParamPlan, group: dict) -> dict:
        """The per-parameter state (moments, and the basis provider's own) created at construction."""

    @abc.abstractmethod
    def _apply(self, work: list) -> None:
        """Rotates, updates the moments and applies the update for a batch of same-shape tiles."""

    def compile_math(self) -> None:
        """Runs Adam's element-wise math compiled (``compile.enable``); the eager foreach form stays the reference."""
        self._directions = compiled_adam_directions()

    # -- state ----------------------------------------------------------------------------------------
    def _materialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                plan = self.plans[p]
                st = self._init_state(p, plan, group)
                st["tile_spec"] = plan.spec_tensor()
                self.state[p] = st

    def _moments(self, p: torch.Tensor, plan: ParamPlan) -> dict:
        dt = state_dtype_for(p)
        lp = local(p)
        m = torch.zeros(lp.shape, dtype=dt, device=lp.device)
        return {"step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": as_global(m, plan, p.shape),
                "exp_avg_sq": as_global(torch.zeros_like(m), plan, p.shape)}

    # -- step -----------------------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank saw a non-finite gradient."""
        return int(self.param_groups[0]["skipped_steps"]) if self.param_groups else 0

    def _collect(self) -> list:
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if isinstance(g, DTensor):
                    if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                        raise RuntimeError(f"optimizer: gradient of {self.plans[p].fqn} has placements "
                                           f"{g.placements}, parameter {p.placements}; reduce it first")
                    g = g.to_local()
                work.append((group, p, self.plans[p], g))
        return work

    def _all_finite(self, work: list) -> bool:
        if not self.options.nonfinite_guard:
            return True
        grads = [g for _, _, _, g in work if g.numel()]
        device = work[0][3].device if work else torch.device("cpu")
        if grads:
            # A float64 sum is non-finite iff some element is (short of 1e308 overflow); a cheap reduction.
            sums = torch.stack([g.sum(dtype=torch.float64) for g in grads])
            bad = (~torch.isfinite(sums)).any().to(torch.float32)
        else:
            bad = torch.zeros((), dtype=torch.float32, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._flag_group) > 1:
            flag = bad.reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._flag_group)
            bad = flag[0]
        return not bool(bad.item())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._collect()
        if not self._all_finite(work):
            for group in self.param_groups:
                group["skipped_steps"] = int(group["skipped_steps"]) + 1
            return loss
        if work:
            self._apply(work)
        return loss

    # -- checkpoints ----------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        self._verify(state_dict)
        # torch casts loaded state to the parameter's dtype; keep each tensor in the dtype this optimizer
        # keeps it in (fp32 moments, fp64 SOAP factors) without a round trip through the parameter dtype.
        want = {}
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for p, pid in zip(group["params"], saved["params"]):
                for k, v in state_dict["state"].get(pid, {}).items():
                    cur = self.state.get(p, {}).get(k)
                    if torch.is_tensor(v) and torch.is_tensor(cur) and k != "step":
                        want[(p, k)] = (v, cur.dtype)
        super().load_state_dict(state_dict)
        for (p, k), (v, dtype) in want.items():
            st = self.state[p]
            st[k] = v.to(device=st[k].device, dtype=dtype)

    def _verify(self, state_dict: dict) -> None:
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise CheckpointError(f"optimizer checkpoint has {len(saved_groups)} param groups, this run "
                                  f"{len(self.param_groups)}")
        saved_state = state_dict.get("state", {})
        for cur, saved in zip(self.param_groups, saved_groups):
            for key in self.spec_keys:
                if key not in saved:
                    raise CheckpointError(f"optimizer checkpoint has no {key}: it was written by another "
                                          f"optimizer; resume with that optimizer.name")
                if str(saved[key]) != str(cur[key]):
                    raise CheckpointError(f"optimizer {key} differs: checkpoint '{saved[key]}', this run "
                                          f"'{cur[key]}'; resume with the checkpoint's optimizer settings")
            for pid, p in zip(saved["params"], cur["params"]):
                plan = self.plans[p]
                st = saved_state.get(pid, {})
                if "tile_spec" not in st:
                    raise CheckpointError(f"optimizer checkpoint has no tile spec for {plan.fqn}: it was written "
                                          f"by another optimizer")
                got = torch.as_tensor(_local_of(st["tile_spec"])).to(torch.float64).cpu()
                want = plan.spec_tensor().to(torch.float64)
                # Sizes, tiles and rotated axes must match; whether a tile was adapted is informational.
                if got.shape != want.shape or not torch.equal(got[:6], want[:6]):
                    raise CheckpointError(f"optimizer tile spec of {plan.fqn} differs: checkpoint "
                                          f"{describe_spec(got)}, this run {describe_spec(want)}; use the "
                                          f"checkpoint's tile sizes (optimizer.tile_size / overrides)")


def pow2_required(representation: str) -> bool:
    return representation == "hadamard"

