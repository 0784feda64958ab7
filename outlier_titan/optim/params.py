"""Parameter roles: the class of each trainable parameter (embedding, norm, bias, gain, matrix, or a module's
own ``param_class``) and its FQN as the plain model names it. The optimizer builders group by these."""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn as nn

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


def clean_fqn(fqn: str) -> str:
    """Drops wrapper prefixes (activation checkpointing, compile) so FQNs match the plain model's."""
    for prefix in ("_checkpoint_wrapped_module.", "_orig_mod."):
        fqn = fqn.replace(prefix, "")
    return fqn


def trainable_params(model: nn.Module) -> Iterator[tuple[str, str, nn.Parameter]]:
    """``(fqn, class, parameter)`` of every trainable parameter once (tied weights at their first module), in
    module order; the FQN without wrapper prefixes."""
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for p_name, p in module.named_parameters(recurse=False):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            yield clean_fqn(f"{mod_name}.{p_name}" if mod_name else p_name), param_class(module, p_name, p), p
