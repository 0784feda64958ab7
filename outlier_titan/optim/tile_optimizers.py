"""Factories of the tile optimizers for the builder's registry: ``optimizer.name = orthoadam | soap``.

Signature ``(param_groups, cfg, seed) -> Optimizer``; each group carries ``names`` (FQNs), which seed the
OrthoAdam bases. The paper ablations are plain config: Adam with beta1 = 0 (``optimizer.beta1 = 0``, i.e.
RMSProp in the rotated basis) and a larger eps (``optimizer.eps``).
"""

from __future__ import annotations

from outlier_titan.config.job_config import Optimizer as OptimizerConfig
from outlier_titan.optim.orthoadam import STRUCTURED, OrthoAdam
from outlier_titan.optim.soap import SOAP
from outlier_titan.optim.bases import resolve_representation
from outlier_titan.optim.tile_engine import EngineOptions


def engine_options(cfg: OptimizerConfig) -> EngineOptions:
    """Engine options from the config. The registry's optimizers are stepped by the trainer, which skips
    non-finite steps itself (one reduced grad norm), so the engine's own flag all-reduce is not repeated."""
    return EngineOptions(tile_size=cfg.tile_size, shard_tile_size=cfg.shard_tile_size,
                         max_shards=cfg.max_shards, tile_size_overrides=tuple(cfg.tile_size_overrides),
                         tile_alignment=cfg.tile_alignment, vocab_axis=cfg.vocab_axis, one_d=cfg.one_d,
                         max_precond_dim=cfg.max_precond_dim, nonfinite_guard=False)


def build_orthoadam(groups: list[dict], cfg: OptimizerConfig, seed: int) -> OrthoAdam:
    return OrthoAdam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                     seed=seed, basis=cfg.basis, options=engine_options(cfg))


def build_soap(groups: list[dict], cfg: OptimizerConfig, seed: int) -> SOAP:
    return SOAP(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay,
                precondition_frequency=cfg.precondition_frequency, shampoo_beta=cfg.shampoo_beta,
                stagger=cfg.refresh_stagger, factor_dtype=cfg.soap_factor_dtype, options=engine_options(cfg))


def check_tile_plans(groups: list[dict], cfg: OptimizerConfig) -> None:
    """The tile engine's per-parameter checks (tile alignment with the shards, dimensionality) on the sharded
    parameters' layout alone: run on the meta model, they fail in seconds instead of after materialising it."""
    if cfg.name not in ("orthoadam", "soap"):
        return
    from outlier_titan.optim.tile_engine import plan_param

    cls = SOAP if cfg.name == "soap" else OrthoAdam
    pow2 = cfg.name == "orthoadam" and resolve_representation(cfg.basis)[0] in STRUCTURED
    options = engine_options(cfg)
    for group in groups:
        for p, fqn in zip(group["params"], group["names"]):
            plan_param(fqn, p, options, cls.group_other_axis, pow2, cls.stacked_state)


def describe_tile_grid(model, cfg: OptimizerConfig) -> list[str]:
    """One line per parameter class (layer indices folded to ``*``): the tile edge along each axis and whether it is
    the whole axis, as the engine plans it for ``cfg`` on one rank. Reports state it for every OrthoAdam/SOAP run."""
    import re

    from outlier_titan.optim.builder import build_param_groups
    from outlier_titan.optim.tile_engine import plan_param

    cls = SOAP if cfg.name == "soap" else OrthoAdam
    pow2 = cfg.name == "orthoadam" and resolve_representation(cfg.basis)[0] in STRUCTURED
    options = engine_options(cfg)
    seen: dict[str, str] = {}
    for group in build_param_groups(model, cfg):
        for p, fqn in zip(group["params"], group["names"]):
            plan = plan_param(fqn, p, options, cls.group_other_axis, pow2, cls.stacked_state)
            axes = [f"{a.tile} ({'whole' if a.tile == a.size else f'{a.n_tiles} tiles'})" if a.rotate else
                    f"{a.size} unrotated" for a in plan.axes[:len(p.shape) or 1]]
            seen.setdefault(re.sub(r"\.\d+\.", ".*.", fqn), f"{list(p.shape)}: " + " × ".join(axes))
    return [f"`{k}` {v}" for k, v in seen.items()]
