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
from outlier_titan.optim.tile_optimizers import build_orthoadam, build_soap

NORM_TYPES = (nn.LayerNorm, nn.RMSNorm)


def param_class(module: nn.Module, param_name: str, param: torch.Tensor) -> str:
    """One of: embedding, norm, bias, gain, matrix, or the module's own ``param_class`` (``sink``: attention
    sink logits)."""
    own = getattr(module, "param_class", None)
    if isinstance(own, str):
        return own
    if isinstance(module, nn.Embedding):
        return "embedding"
    if isinstance(module, NORM_TYPES) or getattr(module, "is_norm", False):
        return "norm"
    if param_name == "bias":
        return "bias"
    if param.ndim < 2:
        return "gain"
    return "matrix"


def build_param_groups(model: nn.Module, cfg: OptimizerConfig) -> list[dict]:
    """Two groups, decay and no_decay, each with ``params`` and ``names`` (FQNs)."""
    decay, no_decay = {"params": [], "names": []}, {"params": [], "names": []}
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            fqn = f"{mod_name}.{p_name}" if mod_name else p_name
            group = no_decay if param_class(module, p_name, p) in cfg.no_decay else decay
            group["params"].append(p)
            group["names"].append(_clean_fqn(fqn))
    decay["weight_decay"] = cfg.weight_decay
    no_decay["weight_decay"] = 0.0
    return [g for g in (decay, no_decay) if g["params"]]


def _clean_fqn(fqn: str) -> str:
    """Drops wrapper prefixes (activation checkpointing, compile) so FQNs match the plain model's."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod."):
        fqn = fqn.replace(prefix, "")
    return fqn


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
