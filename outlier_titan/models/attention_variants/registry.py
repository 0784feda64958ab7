"""The attention variants' registry. Each variant is one entry, registered at import by its own module (the built-in
ones are the modules of this package, which imports them; a plug-in registers its own): its name, help phrase, the
``model.attention_*`` options it owns (defaults, help, validation), the modules it adds to the attention block (TP
placement, optimizer class, whether they read the block's normalised input) and, built lazily on first use, its
torch forms (:class:`VariantForms`: the explicit weights, the SDPA and FlexAttention forms, its modules, its output
step).

``model.attention``'s and ``model.attention_layers``' choices, the variants' options in ``[model]`` and ``--help``
are derived from it, and an option of a variant that the run does not use is a one-line error naming its variant.
This package imports no torch at import: a variant's torch code runs in its ``forms``. A registration adds the
variant's options to ``[model]``, its name to ``model.attention``'s choices and its parameter classes to
``optimizer.no_decay``'s.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Callable

from outlier_titan.config.job_config import add_option_group
from outlier_titan.errors import ConfigError
from outlier_titan.models.spec import PLACEMENTS
from outlier_titan.options import ATTENTION_NAMES, NO_DECAY_CLASSES, OptionGroup

KIND = "attention variant"


class AttentionError(ConfigError):
    """A bad ``model.attention*`` option."""


@dataclass(frozen=True)
class VariantParam:
    """A module a variant adds to the attention block, as attribute ``name``."""

    name: str
    placement: str
    """Its TP placement, a name of ``models.spec.PLACEMENTS`` (``colwise``: a linear map whose outputs are per local
    head, sharded like ``wq``; ``sharded_params``: parameters with the heads on dim 0, sharded with them)."""
    param_class: str | None = None
    """Its parameters' optimizer class (``optimizer.no_decay`` may list it); None: by the module's type."""
    reads_input: bool = False
    """A linear map of the block's normalised attention input: initialised like ``wq`` and, under QuaRot, rotated
    with it."""


@dataclass(frozen=True)
class VariantForms:
    """A variant's torch side. Every form sees ``opts`` (the block's :class:`AttentionOptions`) and ``state`` (what
    ``state`` returned for the block, e.g. its learned logits; None without)."""

    weights: Callable
    """``(s, visible, first, seq_len, opts, state) -> A``: the weights [B, H, T_q, T_k] of the causal logits ``s``
    (-inf where ``visible`` [T_q, T_k] is False) of the queries at ``first, ...`` in a sequence of ``seq_len``;
    zero where a key is not visible."""
    sdpa: Callable | None = None
    """``(q, k, v, scale, opts, state) -> out``: exact on SDPA's kernels (no soft-cap), or None."""
    sdpa_devices: tuple[str, ...] | None = None
    """The device types the SDPA form runs on (None: any)."""
    flex: Callable | None = None
    """``(q, k, v, scale, softcap, opts, state) -> out`` or ``(out, lse, factor)`` (the output is then
    ``out * factor``, zero where ``lse`` is -inf) on FlexAttention; None: softmax's plain FlexAttention output."""
    modules: Callable | None = None
    """``(dim, n_heads, head_dim, opts) -> {name: module}``, one per :attr:`AttentionVariant.params` entry; a module
    that does not read the input has ``init_weights(init)``."""
    state: Callable | None = None
    """``(attention block) -> state`` handed to every form (e.g. its local learned logits)."""
    output: Callable | None = None
    """``(attention block, out, x) -> out``: a step on the output [B, H, T, d_h] (``x``: the block's input)."""


@dataclass(frozen=True)
class AttentionVariant:
    name: str
    help: str
    """A phrase for ``--help`` (what the weights are)."""
    forms: Callable[[], VariantForms] = field(repr=False)
    """Builds the torch forms (imports torch; called once, on first use: :meth:`torch_forms`)."""
    options: type | None = None
    """Dataclass of the ``model.attention_*`` options this variant owns, declared with ``opt``."""
    validate: Callable[[object], None] | None = None
    """Checks the options' values on a spec's args."""
    params: tuple[VariantParam, ...] = ()
    """The modules it adds to the attention block, in creation order."""
    with_sink: bool = False
    """Rows sum to < 1: the rest is the sink's share (the probe reports it)."""

    def group(self) -> OptionGroup | None:
        return None if self.options is None else OptionGroup("model", KIND, self.name, self.options)

    def torch_forms(self) -> VariantForms:
        return _forms(self.name)

    @property
    def reads_input(self) -> tuple[str, ...]:
        """Its modules that read the block's normalised attention input."""
        return tuple(p.name for p in self.params if p.reads_input)


_VARIANTS: dict[str, AttentionVariant] = {}


def register_variant(variant: AttentionVariant) -> AttentionVariant:
    if variant.name in _VARIANTS:
        raise ValueError(f"attention variant {variant.name!r} is already registered")
    for p in variant.params:
        if p.placement not in PLACEMENTS:
            raise ValueError(f"attention variant {variant.name!r}: placement {p.placement!r} of {p.name!r} is not "
                             f"one of {', '.join(PLACEMENTS)}")
    _VARIANTS[variant.name] = variant
    ATTENTION_NAMES.add(variant.name, variant.help)
    for p in variant.params:
        if p.param_class:
            NO_DECAY_CLASSES.add(p.param_class)
    if variant.options is not None:
        add_option_group(variant.group())
    return variant


def variants() -> tuple[AttentionVariant, ...]:
    return tuple(_VARIANTS.values())


def get_variant(name: str) -> AttentionVariant:
    try:
        return _VARIANTS[name]
    except KeyError:
        raise AttentionError(f"model.attention = {name!r} is not a variant; choose one of "
                             f"{', '.join(_VARIANTS)}") from None


@functools.cache
def _forms(name: str) -> VariantForms:
    return _VARIANTS[name].forms()


def option_groups() -> list[OptionGroup]:
    return [g for g in (v.group() for v in _VARIANTS.values()) if g is not None]


def layer_variants(spec: str | None) -> list[str]:
    """``"a,b"`` -> ["a", "b"] (empty: none)."""
    return [s.strip() for s in (spec or "").split(",") if s.strip()]


@dataclass
class AttentionChoice:
    """The variant options common to every variant (the ``attention`` / ``attention_layers`` of a spec's args)."""

    attention: str | None = None  # default: ``softmax`` (the old key ``model.softmax`` is its alias)
    attention_layers: str = ""
    attention_impl: str = "auto"


@dataclass(frozen=True)
class AttentionOptions:
    """One block's attention: its variant, ``model.attention_impl`` and the variant's own options (an instance of
    its options dataclass; default: the declared defaults, None for a variant without options)."""

    variant: str = "softmax"
    impl: str = "auto"
    options: object = None

    def __post_init__(self):
        cls = get_variant(self.variant).options
        if self.options is None and cls is not None:
            object.__setattr__(self, "options", cls())

    @classmethod
    def of(cls, variant: str, impl: str = "auto", **values) -> AttentionOptions:
        """``variant``'s options with ``values`` (its ``attention_*`` option names) over the defaults."""
        own = get_variant(variant).options
        return cls(variant, impl, own(**values) if own is not None else None)


def block_variant(args, layer_id: int) -> str:
    """Block ``layer_id``'s variant: ``attention_layers`` (cycled over the blocks) overrides ``attention``."""
    per_layer = layer_variants(args.attention_layers)
    return per_layer[layer_id % len(per_layer)] if per_layer else args.attention


def block_options(args, layer_id: int) -> AttentionOptions:
    """Block ``layer_id``'s :class:`AttentionOptions` from a spec's args."""
    name = block_variant(args, layer_id)
    own = get_variant(name).options
    values = None if own is None else own(**{f.name: getattr(args, f.name) for f in dataclasses.fields(own)})
    return AttentionOptions(name, args.attention_impl, values)


def used_variants(args) -> list[str]:
    """The variants a spec's resolved args run: ``attention`` and every ``attention_layers`` entry."""
    return [args.attention] + layer_variants(args.attention_layers)


def uses_only(args, *names: str) -> bool:
    """Every block of a spec's resolved args runs one of ``names``."""
    return set(used_variants(args)) <= set(names)


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
