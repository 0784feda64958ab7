"""Optimizer builder: parameter groups by class (decay / no decay), the built-in optimizers' registrations, and
the optimizer named by the config, built from the registry (``optim/registry.py``).

Parameters are classified by their module and name, never by their order, so groups are the same at any
world size. Each group carries ``names`` (the parameters' FQNs), which FQN-seeded optimizers rely on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from outlier_titan.models.roles import roles_of
from outlier_titan.optim.muon import build_muon, plan_muon_state
from outlier_titan.optim.muon_settings import MuonOptions
from outlier_titan.optim.params import trainable_params
from outlier_titan.optim.registry import OptimizerSpec, get_optimizer, optimizer_names, register_optimizer
from outlier_titan.optim.tile_optimizers import TILE_LAYOUT_KEYS, build_orthoadam, build_soap, check_tile_plans
from outlier_titan.optim.tiles import settings as tile_settings

if TYPE_CHECKING:
    from outlier_titan.config.job_config import Optimizer as OptimizerConfig

__all__ = ["after_build", "build_optimizer", "build_param_groups", "check_optimizer_layout", "checked_optimizer",
           "config_owned_hyperparameters", "get_optimizer", "optimizer_names", "register_optimizer"]


def build_param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Two groups, decay and no_decay, each with ``params`` and ``names`` (FQNs)."""
    decay, no_decay = {"params": [], "names": []}, {"params": [], "names": []}
    for fqn, cls, p in trainable_params(model):
        group = no_decay if cls in cfg.no_decay else decay
        group["params"].append(p)
        group["names"].append(fqn)
    decay["weight_decay"] = cfg.weight_decay
    no_decay["weight_decay"] = 0.0
    return [g for g in (decay, no_decay) if g["params"]]


def _adam_kernels(groups, cfg) -> dict:
    """``fused=`` / ``foreach=`` of torch's Adam and AdamW from ``optimizer.implementation``. ``auto`` takes the
    fused kernel on a GPU (on an H200, llama_1b's AdamW step 34 -> 17 ms, BENCHMARKS.md) and foreach on the CPU,
    where the committed reports were trained (the two differ by float32 rounding)."""
    impl = cfg.implementation
    if impl == "auto":
        impl = "fused" if any(p.device.type == "cuda" for g in groups for p in g["params"]) else "foreach"
    return {"fused": True} if impl == "fused" else {"foreach": True}


def _adamw(groups, cfg, seed):
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                             **_adam_kernels(groups, cfg))


def _adam(groups, cfg, seed):
    # Adam with L2-coupled decay, as torch.optim.Adam defines weight_decay.
    return torch.optim.Adam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                            **_adam_kernels(groups, cfg))


def _sgd(groups, cfg, seed):
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1 if cfg.momentum else 0.0, foreach=True)


def _rmsprop(groups, cfg, seed):
    return torch.optim.RMSprop(groups, lr=cfg.lr, alpha=cfg.beta2, eps=cfg.eps, foreach=True)


def _soap_state_bytes(cfg: OptimizerConfig) -> float:
    # m, v (fp32) + per t x t tile the factors L, R and bases Q_L, Q_R, each t x t: one value of each per element
    # of a square tile (an upper bound: unrotated vocab axes carry no factor).
    factor_bytes = 8 if cfg.soap_factor_dtype == "float64" else 4
    return 8.0 + 2 * factor_bytes + 2 * 4


def _with_model_roles(build):
    """A ``takes_model`` factory for a tile optimizer: its decay / no-decay groups and the model's parameter roles
    (vocabulary axes, residual writers)."""
    def factory(model: nn.Module, cfg: OptimizerConfig, seed: int) -> torch.optim.Optimizer:
        return build(build_param_groups(model, cfg), cfg, seed, roles_of(model))
    return factory


def _check_tiles(model: nn.Module, cfg: OptimizerConfig) -> None:
    """The tile engine's per-parameter checks (tiles vs shards, the basis' power-of-two rule) on the sharded meta
    model: they fail in seconds instead of after materialising it."""
    check_tile_plans(build_param_groups(model, cfg), cfg, roles_of(model))


def _compile_tile_math(optimizer, cfg: OptimizerConfig, compile: bool) -> None:
    if compile:
        optimizer.compile_math()


def _describe_split(optimizer, cfg: OptimizerConfig, compile: bool) -> str:
    return optimizer.describe()


# The built-ins, registered in one place. State bytes are fp32 values per parameter element.
register_optimizer("adamw", _adamw, state_bytes=8)
register_optimizer("adam", _adam, state_bytes=8)
register_optimizer("sgd", _sgd, state_bytes=lambda cfg: 4.0 if cfg.momentum else 0.0)
register_optimizer("rmsprop", _rmsprop, state_bytes=4)
register_optimizer("orthoadam", _with_model_roles(build_orthoadam), takes_model=True, state_bytes=8,
                   layout_keys=(*TILE_LAYOUT_KEYS, "basis"), options=tile_settings.OrthoAdamOptions,
                   check_layout=_check_tiles, after_build=_compile_tile_math)
register_optimizer("soap", _with_model_roles(build_soap), takes_model=True, state_bytes=_soap_state_bytes,
                   layout_keys=(*TILE_LAYOUT_KEYS, "soap_factor_dtype"), options=tile_settings.SOAPOptions,
                   check_layout=_check_tiles, after_build=_compile_tile_math)
# Muon's state is a momentum buffer beside each shard whatever muon_layout, so no muon_* key changes its layout; the
# Muon / AdamW split follows the model and no_decay (common to every optimizer).
register_optimizer("muon", build_muon, takes_model=True, plan_state=plan_muon_state, options=MuonOptions,
                   hyperparameters=("nesterov", "ns_coefficients", "ns_steps", "adjust_lr_fn"),
                   after_build=_describe_split)


def checked_optimizer(cfg: OptimizerConfig) -> OptimizerSpec:
    """The configured optimizer's registration, after its own validation of the config (a ``UserError``)."""
    spec = get_optimizer(cfg.name)
    if spec.validate is not None:
        spec.validate(cfg)
    return spec


def check_optimizer_layout(model: nn.Module, cfg: OptimizerConfig) -> None:
    """The configured optimizer's pre-flight check on the (sharded, meta) model, if it has one."""
    spec = checked_optimizer(cfg)
    if spec.check_layout is not None:
        spec.check_layout(model, cfg)


def after_build(optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, compile: bool) -> str | None:
    """The configured optimizer's post-build hook (compiling, a line describing it for the log), if any."""
    spec = get_optimizer(cfg.name)
    return spec.after_build(optimizer, cfg, compile) if spec.after_build is not None else None


def config_owned_hyperparameters(cfg: OptimizerConfig) -> tuple[str, ...]:
    """The param-group keys a resume takes from this run's config rather than the checkpoint."""
    return get_optimizer(cfg.name).config_owned()


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, seed: int) -> torch.optim.Optimizer:
    """Builds the configured optimizer over the model's (possibly DTensor) parameters."""
    spec = checked_optimizer(cfg)
    if spec.takes_model:
        return spec.factory(model, cfg, seed)
    return spec.factory(build_param_groups(model, cfg), cfg, seed)
