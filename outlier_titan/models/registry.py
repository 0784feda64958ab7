"""Building a model from the config: the spec's args from its flavor and the ``model.*`` overrides, the model on the
meta device, and parameter / FLOP counts. The spec entries themselves are in :mod:`outlier_titan.models.spec`.

Every model built from a spec exposes ``tok_embeddings``, ``layers`` (an ``nn.ModuleDict`` of blocks, each
mapping the residual stream to the residual stream), ``norm`` (final norm or ``nn.Identity``), ``output``
(the LM head, or None when tied), ``init_weights(initializer)`` and ``forward(tokens) -> logits``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch.nn as nn

from outlier_titan.config.job_config import section_class
from outlier_titan.errors import ConfigError
from outlier_titan.models.attention_variants import KIND as VARIANT_KIND, check_options_used
from outlier_titan.models.spec import ModelSpec, all_specs, get_spec

if TYPE_CHECKING:
    from outlier_titan.config.job_config import Model as ModelConfig


def model_args(model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> tuple[ModelSpec, Any]:
    """The spec and its args: flavor values, then every non-None ``model.*`` override the spec supports."""
    spec = get_spec(model_cfg.name)
    values = dict(spec.flavor(model_cfg.flavor))
    arg_names = {f.name for f in dataclasses.fields(spec.args_cls)}
    # a variant registered after the spec's args class was made (a plug-in) has no field there: set on the args
    late = {f.name: f.metadata["default"] for f in dataclasses.fields(model_cfg)
            if f.metadata.get("kind") == VARIANT_KIND and f.name not in arg_names and "attention" in arg_names}
    for f in dataclasses.fields(model_cfg):
        if f.name in ("name", "flavor"):
            continue
        v = getattr(model_cfg, f.name)
        if v is None:
            continue
        if f.name in late:
            late[f.name] = v
            continue
        if f.name not in arg_names:
            owners = _specs_with_option(f.name)
            where = f"it is an option of {', '.join(repr(o) for o in owners)}; " if owners else ""
            raise ConfigError(f"model.{f.name} is not an option of model spec '{spec.name}'; {where}remove it or "
                              f"choose that spec (options of '{spec.name}': "
                              f"{', '.join(sorted(arg_names & _model_keys()))})")
        values[f.name] = v
    if model_cfg.vocab_size is None and "vocab_size" in arg_names:
        values["vocab_size"] = pad_vocab(vocab_size)
    if model_cfg.max_seq_len is None and "max_seq_len" in arg_names:
        values["max_seq_len"] = seq_len
    args = spec.args_cls(**values)
    for name, v in late.items():
        setattr(args, name, v)
    if "vocab_size" in arg_names and args.vocab_size < vocab_size:
        raise ConfigError(f"model.vocab_size = {args.vocab_size} is smaller than the tokenizer's {vocab_size}")
    if "max_seq_len" in arg_names and args.max_seq_len < seq_len:
        raise ConfigError(f"training.seq_len = {seq_len} exceeds model.max_seq_len = {args.max_seq_len}")
    validate = getattr(args, "validate", None)
    if validate is not None:
        validate()
    if "attention" in arg_names:
        check_options_used(model_cfg, args)
    return spec, args


def build_meta_model(model_cfg: ModelConfig, vocab_size: int, seq_len: int) -> tuple[ModelSpec, Any, nn.Module]:
    """The spec, its args and the model built on the meta device (nothing allocated)."""
    import torch

    spec, args = model_args(model_cfg, vocab_size, seq_len)
    with torch.device("meta"):
        model = spec.build(args)
    return spec, args, model


def _specs_with_option(name: str) -> list[str]:
    """The specs whose args have the option ``name``."""
    return sorted(s.name for s in all_specs() if name in {f.name for f in dataclasses.fields(s.args_cls)})


def _model_keys() -> set[str]:
    return {f.name for f in dataclasses.fields(section_class("model"))} - {"name", "flavor"}


def pad_vocab(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def count_params(model: nn.Module, exclude_embeddings: bool = False) -> int:
    """Parameter count (tied weights once); optionally without token/position embedding tables."""
    seen, total = set(), 0
    for mod_name, module in model.named_modules():
        for p in module.parameters(recurse=False):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if exclude_embeddings and isinstance(module, nn.Embedding):
                continue
            total += p.numel()
    return total


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    """Training FLOPs per token: 6 x matmul params (head included, embedding lookups excluded) plus the
    causal attention term 6 x layers x dim x seq_len (QK^T and PV, forward and backward, half masked)."""
    n_layers, dim = len(model.layers), model.tok_embeddings.weight.shape[1]
    matmul_params = count_params(model, exclude_embeddings=True)
    head = getattr(model, "output", None)
    if head is None:  # tied head: the embedding matrix is used as a matmul once
        matmul_params += model.tok_embeddings.weight.numel()
    return 6.0 * matmul_params + 6.0 * n_layers * dim * seq_len
