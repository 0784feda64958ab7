"""Factories of the tile optimizers for the builder's registry: ``optimizer.name = orthoadam | soap``.

Signature ``(param_groups, cfg, seed, roles) -> Optimizer`` (``roles``: the model's parameter roles, which the
builder passes from the model); each group carries ``names`` (FQNs), which seed the
OrthoAdam bases. The paper ablations are plain config: Adam with beta1 = 0 (``optimizer.beta1 = 0``, i.e.
RMSProp in the rotated basis) and a larger eps (``optimizer.eps``).

``tile_plans`` plans every parameter as the configured optimizer will at construction (its class' grid rules,
its basis' tile rule, the config's engine options); the meta-model pre-check and the reports' tile-grid
description both read it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Iterator

import torch

from outlier_titan.errors import UserError
from outlier_titan.models.roles import ParamRoles
from outlier_titan.optim.orthoadam import OrthoAdam
from outlier_titan.optim.soap import SOAP
from outlier_titan.optim.tiles.base import TileAdamBase
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.optim.tiles.plan import ParamPlan
from outlier_titan.optim.tiles.settings import TileOptions

if TYPE_CHECKING:
    from outlier_titan.config.job_config import Optimizer as OptimizerConfig

TILE_OPTIMIZERS: dict[str, type[TileAdamBase]] = {"orthoadam": OrthoAdam, "soap": SOAP}

TILE_LAYOUT_KEYS = tuple(f.name for f in dataclasses.fields(TileOptions))
"""The engine options (``optim/tiles/settings.py``), each of which changes a tile optimizer's state layout (its
registration's checkpoint layout keys)."""


def engine_options(cfg: OptimizerConfig, roles: ParamRoles) -> EngineOptions:
    """Engine options from the config and the model's parameter roles (``models.roles.roles_of``). The
    registry's optimizers are stepped by the trainer, which skips non-finite steps itself (one reduced grad
    norm), so the engine's own flag all-reduce is not repeated."""
    values = {k: getattr(cfg, k) for k in TILE_LAYOUT_KEYS}  # every key of the engine's group
    values["tile_size_overrides"] = tuple(values["tile_size_overrides"])
    return EngineOptions(**values, nonfinite_guard=False, roles=roles)


def build_orthoadam(groups: list[dict], cfg: OptimizerConfig, seed: int, roles: ParamRoles) -> OrthoAdam:
    return OrthoAdam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                     seed=seed, basis=cfg.basis, options=engine_options(cfg, roles))


def build_soap(groups: list[dict], cfg: OptimizerConfig, seed: int, roles: ParamRoles) -> SOAP:
    return SOAP(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                precondition_frequency=cfg.precondition_frequency, shampoo_beta=cfg.shampoo_beta,
                stagger=cfg.refresh_stagger, factor_dtype=cfg.soap_factor_dtype, options=engine_options(cfg, roles))


def tile_plans(groups: list[dict], cfg: OptimizerConfig,
               roles: ParamRoles) -> Iterator[tuple[torch.Tensor, str, ParamPlan]]:
    """(parameter, FQN, tile plan) of every parameter in ``groups`` (of a model with parameter roles ``roles``),
    planned as ``cfg``'s tile optimizer plans it at construction. Raises ``TileAlignmentError`` (a
    ``UserError``) at the first parameter that does not fit."""
    if cfg.name not in TILE_OPTIMIZERS:
        raise UserError(f"optimizer.name = {cfg.name!r} has no tile grid; choose one of: {', '.join(TILE_OPTIMIZERS)}")
    cls = TILE_OPTIMIZERS[cfg.name]
    basis = cls.tile_basis(cfg.basis)
    options = engine_options(cfg, roles)
    for group in groups:
        for p, fqn in zip(group["params"], group["names"]):
            yield p, fqn, cls.plan(fqn, p, options, basis)


def check_tile_plans(groups: list[dict], cfg: OptimizerConfig, roles: ParamRoles) -> None:
    """The tile engine's per-parameter checks (tile alignment with the shards, the basis' power-of-two rule,
    dimensionality) on the sharded parameters' layout alone: run on the meta model, they fail in seconds instead
    of after materialising it (the tile optimizers' ``check_layout``)."""
    for _ in tile_plans(groups, cfg, roles):
        pass


def describe_tile_grid(groups: list[dict], cfg: OptimizerConfig, roles: ParamRoles) -> list[str]:
    """One line per parameter class (layer indices folded to ``*``): the tile edge along each axis and whether it is
    the whole axis, as the engine plans it for ``cfg`` on one rank (``groups`` of the unsharded, e.g. meta, model).
    Reports state it for every OrthoAdam/SOAP run."""
    return describe_plans(tile_plans(groups, cfg, roles))


def describe_plans(plans) -> list[str]:
    """:func:`describe_tile_grid`'s lines for any ``(parameter, FQN, tile plan)`` items (block Muon's too)."""
    seen: dict[str, str] = {}
    for p, fqn, plan in plans:
        axes = [f"{a.tile} ({'whole' if a.tile == a.size else f'{a.n_tiles} tiles'})" if a.rotate else
                f"{a.size} unrotated" for a in plan.axes[:len(p.shape) or 1]]
        seen.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), f"{list(p.shape)}: " + " × ".join(axes))
    return [f"`{k}` {v}" for k, v in seen.items()]
