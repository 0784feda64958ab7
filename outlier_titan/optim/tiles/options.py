"""Tile-engine options and the tile-size policy: which tile edge each axis of a parameter asks for.

The requested edge depends on the parameter's FQN and global shape only, never on the layout; whether the
layout's shards fall on that grid is checked later (``plan.plan_param``).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass

import torch

from outlier_titan.errors import UserError
from outlier_titan.models.roles import DEFAULT_ROLES, ParamRoles
from outlier_titan.optim.tiles.settings import TileOptions
from outlier_titan.models.roles import shard_dim_for

_DECLARED = {f.name: f for f in dataclasses.fields(TileOptions)}  # defaults and choices, declared once there


def _default(name: str):
    return _DECLARED[name].default


def _check_choice(name: str, value: str) -> None:
    choices = _DECLARED[name].metadata["choices"]
    if value not in choices:
        raise UserError(f"optimizer.{name} = {value!r}; choose {' or '.join(choices)}")


@dataclass(frozen=True)
class EngineOptions:
    """Tile-engine settings shared by OrthoAdam and SOAP (see the ``optimizer`` config section)."""

    tile_size: int = _default("tile_size")  # 0: whole axes (the published methods)
    shard_tile_size: int = _default("shard_tile_size")
    max_shards: int = _default("max_shards")
    tile_size_overrides: tuple[str, ...] = ()
    tile_alignment: str = _default("tile_alignment")
    vocab_axis: str = _default("vocab_axis")
    one_d: str = _default("one_d")
    max_precond_dim: int = _default("max_precond_dim")
    # The all-reduced non-finite flag (skip the step on every rank). Off when the caller already skips
    # non-finite steps before ``step()`` (the trainer does, from the globally reduced gradient norm).
    nonfinite_guard: bool = True
    # The model's parameter roles (``models.roles.roles_of``): its vocabulary-axis parameters and the residual
    # writers, whose sharded axis is the input one. Not a config key: the builder takes it from the model.
    roles: ParamRoles = DEFAULT_ROLES

    def __post_init__(self) -> None:
        if self.tile_size < 0:
            raise UserError(f"optimizer.tile_size = {self.tile_size} must be >= 0 (0: whole axes)")
        if self.shard_tile_size < 0:
            raise UserError(f"optimizer.shard_tile_size = {self.shard_tile_size} must be >= 0 (0: automatic)")
        if self.max_shards < 1:
            raise UserError(f"optimizer.max_shards = {self.max_shards} must be >= 1")
        for name in ("tile_alignment", "vocab_axis", "one_d"):
            _check_choice(name, getattr(self, name))
        parse_overrides(self.tile_size_overrides)

    def resolved(self, published_one_d: str) -> EngineOptions:
        """These options with ``one_d = "auto"`` resolved to the optimizer's published choice."""
        return dataclasses.replace(self, one_d=published_one_d) if self.one_d == "auto" else self

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
        elif axis == _sharded_axis(fqn, ndim, self.roles):
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


def _sharded_axis(fqn: str, ndim: int, roles: ParamRoles) -> int:
    """The axis FSDP and TP shard (``models.roles.shard_dim_for``; the residual axis stays whole)."""
    return shard_dim_for(fqn, torch.empty((1,) * ndim, device="meta"), roles)


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
