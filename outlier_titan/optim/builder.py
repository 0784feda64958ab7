"""Optimizer builder: parameter groups by class (decay / no decay), then an optimizer from a registry.

Parameters are classified by their module and name, never by their order, so groups are the same at any
world size. Each group carries ``names`` (the parameters' FQNs), which FQN-seeded optimizers rely on.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from outlier_titan.config.job_config import Optimizer as OptimizerConfig
from outlier_titan.errors import UserError
from outlier_titan.optim.params import trainable_params
from outlier_titan.optim.tile_optimizers import build_orthoadam, build_soap

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




OptimizerFactory = Callable[[list[dict], OptimizerConfig, int], torch.optim.Optimizer]


def _adamw(groups, cfg, seed):
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def _adam(groups, cfg, seed):
    # Adam with L2-coupled decay, as torch.optim.Adam defines weight_decay.
    return torch.optim.Adam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=True)


def _sgd(groups, cfg, seed):
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.beta1 if cfg.momentum else 0.0, foreach=True)


def _rmsprop(groups, cfg, seed):
    return torch.optim.RMSprop(groups, lr=cfg.lr, alpha=cfg.beta2, eps=cfg.eps, foreach=True)


OPTIMIZERS: dict[str, OptimizerFactory] = {
    "adamw": _adamw,
    "adam": _adam,
    "sgd": _sgd,
    "rmsprop": _rmsprop,
    "orthoadam": build_orthoadam,
    "soap": build_soap,
}


ModelOptimizerFactory = Callable[[nn.Module, OptimizerConfig, int], torch.optim.Optimizer]


def _muon(model, cfg, seed):
    from outlier_titan.optim.muon import build_muon
    return build_muon(model, cfg, seed)


MODEL_OPTIMIZERS: dict[str, ModelOptimizerFactory] = {"muon": _muon}
"""Optimizers that split the model's parameters themselves (Muon: hidden matrices vs the rest)."""


def register_optimizer(name: str, factory: OptimizerFactory) -> None:
    """Adds an optimizer name usable as ``optimizer.name``."""
    OPTIMIZERS[name] = factory


def build_optimizer(model: nn.Module, cfg: OptimizerConfig, seed: int) -> torch.optim.Optimizer:
    """Builds the configured optimizer over the model's (possibly DTensor) parameters."""
    if cfg.name in MODEL_OPTIMIZERS:
        return MODEL_OPTIMIZERS[cfg.name](model, cfg, seed)
    if cfg.name not in OPTIMIZERS:
        raise UserError(f"optimizer.name = {cfg.name!r} is not available; choose one of: "
                        f"{', '.join([*OPTIMIZERS, *MODEL_OPTIMIZERS])}")
    return OPTIMIZERS[cfg.name](build_param_groups(model, cfg), cfg, seed)
