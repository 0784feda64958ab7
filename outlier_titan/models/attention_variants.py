"""The attention variants' registry: each variant's name, help phrase, facts the model code needs (fused SDPA path,
output gate, sink share) and the ``model.attention_*`` options it owns (defaults, help, validation).

``model.attention``'s and ``model.attention_layers``' choices, the variants' options in ``[model]`` and ``--help``
are derived from it, and an option of a variant that the run does not use is a one-line error naming its variant.
This module imports no torch; the math is in :mod:`outlier_titan.models.attention`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from outlier_titan.config.job_config import add_option_group
from outlier_titan.errors import ConfigError
from outlier_titan.options import ATTENTION_IMPLS, ATTENTION_NAMES, OptionGroup, opt

KIND = "attention variant"


class AttentionError(ConfigError):
    """A bad ``model.attention*`` option."""


@dataclass(frozen=True)
class AttentionVariant:
    name: str
    help: str
    """A phrase for ``--help`` (what the weights are)."""
    sdpa: bool
    """Exact on SDPA's fused kernels (flash / cuDNN / memory-efficient, or the CPU's flash kernel); the others run
    on FlexAttention on a GPU and on the chunked path elsewhere (``model.attention_impl``)."""
    gated: bool = False
    """A sigmoid output gate needs the block's normalised attention input."""
    with_sink: bool = False
    """Rows sum to < 1: the rest is the sink's share."""
    options: type | None = None
    """Dataclass of the ``model.attention_*`` options this variant owns, declared with ``opt``."""
    validate: Callable[[object], None] | None = None
    """Checks the options' values on a spec's args."""

    def group(self) -> OptionGroup | None:
        return None if self.options is None else OptionGroup("model", KIND, self.name, self.options)


_VARIANTS: dict[str, AttentionVariant] = {}


def register_variant(variant: AttentionVariant) -> AttentionVariant:
    if variant.name in _VARIANTS:
        raise ValueError(f"attention variant {variant.name!r} is already registered")
    _VARIANTS[variant.name] = variant
    ATTENTION_NAMES.add(variant.name, variant.help)
    if variant.options is not None:
        add_option_group(variant.group())
    return variant


def variants() -> tuple[AttentionVariant, ...]:
    return tuple(_VARIANTS.values())


def option_groups() -> list[OptionGroup]:
    return [g for g in (v.group() for v in _VARIANTS.values()) if g is not None]


def layer_variants(spec: str | None) -> list[str]:
    """``"a,b"`` -> ["a", "b"] (empty: none)."""
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


# ---------------------------------------------------------------------------------------------- the variants


@dataclass
class SinkLogitOptions:
    attention_sink_init: float = opt(0.0, "sink_logit: initial sink logit of every head (0: softmax-1 at init).")


@dataclass
class SoftpickOptions:
    attention_softpick_eps: float = opt(1e-6, "softpick: epsilon of the denominator.")


@dataclass
class SigmoidOptions:
    attention_sigmoid_bias: float | None = opt(None, "sigmoid: the logit bias b (None: -log(sequence length)).")


RELU_NORMS = ("prefix", "seq_len", "none")


@dataclass
class ReluOptions:
    attention_relu_norm: str = opt("prefix", "relu: divide the weights by the keys each query sees (prefix), the "
                                             "sequence length (seq_len) or nothing (none).", RELU_NORMS)


@dataclass
class ClippedSoftmaxOptions:
    attention_clip_zeta: float = opt(1.0, "clipped_softmax: stretch zeta >= 1.")
    attention_clip_gamma: float = opt(-0.03, "clipped_softmax: stretch gamma <= 0.")


def _check_softpick(args) -> None:
    if args.attention_softpick_eps < 0:
        raise AttentionError(f"model.attention_softpick_eps must be >= 0, got {args.attention_softpick_eps}")


def _check_relu(args) -> None:
    if args.attention_relu_norm not in RELU_NORMS:
        raise AttentionError(f"model.attention_relu_norm = {args.attention_relu_norm!r}: choose one of "
                             f"{', '.join(RELU_NORMS)}")


def _check_clip(args) -> None:
    if not args.attention_clip_zeta >= 1 or not args.attention_clip_gamma <= 0:
        raise AttentionError(f"model.attention_clip_zeta = {args.attention_clip_zeta} / attention_clip_gamma = "
                             f"{args.attention_clip_gamma}: clipped softmax needs zeta >= 1 and gamma <= 0")


for _v in (
    AttentionVariant("softmax", "softmax", sdpa=True),
    AttentionVariant("softmax1", "exact zero sink (softmax-1)", sdpa=True, with_sink=True),
    AttentionVariant("sink_logit", "learned per-head sink logit", sdpa=False, with_sink=True,
                     options=SinkLogitOptions),
    AttentionVariant("gated_head", "sigmoid output gate per head", sdpa=True, gated=True),
    AttentionVariant("gated_elementwise", "sigmoid output gate per channel", sdpa=True, gated=True),
    AttentionVariant("softpick", "rectified softmax", sdpa=False, options=SoftpickOptions,
                     validate=_check_softpick),
    AttentionVariant("sigmoid", "sigmoid of the biased logits", sdpa=False, options=SigmoidOptions),
    AttentionVariant("relu", "ReLU of the logits, normalised", sdpa=False, options=ReluOptions,
                     validate=_check_relu),
    AttentionVariant("clipped_softmax", "stretched and clipped softmax", sdpa=False,
                     options=ClippedSoftmaxOptions, validate=_check_clip),
):
    register_variant(_v)


@dataclass
class AttentionChoice:
    """The variant options common to every variant (the ``attention`` / ``attention_layers`` of a spec's args)."""

    attention: str | None = None  # default: ``softmax`` (the old key ``model.softmax`` is its alias)
    attention_layers: str = ""
    attention_impl: str = "auto"


def used_variants(args) -> list[str]:
    """The variants a spec's resolved args run: ``attention`` and every ``attention_layers`` entry."""
    return [args.attention] + layer_variants(args.attention_layers)


def check_options_used(model_cfg, args) -> None:
    """A ``model.attention_*`` option set (not None) in the config whose variant the run does not use is a one-line
    error naming its variant."""
    used = used_variants(args)
    for f in dataclasses.fields(model_cfg):
        if f.metadata.get("kind") != KIND or getattr(model_cfg, f.name) is None:
            continue
        owners = f.metadata["owner"].split(", ")
        if not set(owners) & set(used):
            runs = ", ".join(dict.fromkeys(used))
            raise AttentionError(f"model.{f.name} is an option of attention variant "
                                 f"{', '.join(repr(o) for o in owners)}, but this run uses {runs}; remove it or "
                                 f"set model.attention (or model.attention_layers) to that variant")


def validate_options(args) -> None:
    for v in _VARIANTS.values():
        if v.validate is not None:
            v.validate(args)
