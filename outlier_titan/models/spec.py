"""The model-spec contract: one :class:`ModelSpec` entry carries everything about a spec, and the layers above read it.

A spec (a built-in one is the package ``outlier_titan.models.<name>``; a plug-in is any module) registers one entry
at import with :func:`register_spec`. The entry names its model class and args dataclass, its own ``[model]``
options, its flavors, its tensor-parallel plan as data (:class:`TPPlan`, applied by
``outlier_titan.parallel.tensor_parallel``), its post-step hook, its Hugging Face adapter (by ``"module:attr"``;
``outlier_titan.hf.export`` resolves it) and whether QuaRot may rotate its residual stream (read by
``outlier_titan.quant.rotation``). Its parameters' roles are the model class's ``param_roles``
(``models/roles.py``).

This module imports no torch: a registration adds the spec's options to ``[model]``, and a built-in spec's package
declares its entry without importing its model (the model, args and hooks may be given as ``"module:attr"``
strings, imported on first use). The built-ins register when ``outlier_titan.components`` imports them.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

from outlier_titan.config.job_config import add_option_group
from outlier_titan.errors import ConfigError
from outlier_titan.options import OptionGroup

KIND = "model spec"

PLACEMENTS = ("colwise", "rowwise", "sequence", "sequence_local", "replicated_on_shards", "sharded_params")
"""The placement names a :class:`TPPlan` may use (``outlier_titan.parallel.tensor_parallel`` maps each to a
ParallelStyle)."""


NOT_DECLARED = "the spec's entry does not declare its residual stream rotatable"


@dataclass(frozen=True)
class TPPlan:
    """A spec's tensor-parallel plan, as data.

    Every plan starts from the standard Megatron + sequence-parallel plan of the common layout (``tok_embeddings``,
    ``layers`` of ``attention`` / ``feed_forward`` blocks, ``norm``, ``output``), then applies ``extra``: module FQN
    patterns (``fnmatch``, e.g. ``layers.*.attn_lerp``) mapped to a name of :data:`PLACEMENTS`.
    ``replicated_on_shards`` and ``sharded_params`` apply only to modules that hold parameters of their own.
    """

    block_norms: bool = True
    """The standard plan places the blocks' pre-norms (``attention_norm``, ``ffn_norm``) as sequence parallel."""
    loss_parallel: bool = False
    """The head's logits stay vocab-sharded (the forward returns ``output(...)`` unchanged)."""
    extra: dict[str, str] = field(default_factory=dict)
    """Module FQN pattern -> placement name, applied after the standard plan."""
    unsupported: Callable[[Any], str | None] | None = None
    """Why a model of these args has no TP plan (None: it has one)."""

    def __post_init__(self):
        bad = [p for p in self.extra.values() if p not in PLACEMENTS]
        if bad:
            raise ValueError(f"TPPlan: placement {bad[0]!r} is not one of {', '.join(PLACEMENTS)}")


def resolve(ref):
    """``ref`` itself, or the object a ``"module:attr"`` string names."""
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


class _Deferred:
    """A callable named by ``"module:attr"``, imported on its first call."""

    def __init__(self, ref: str):
        self.ref = ref

    def __call__(self, *args, **kwargs):
        return resolve(self.ref)(*args, **kwargs)


@dataclass
class ModelSpec:
    """One model spec (see the module docstring)."""

    name: str
    model: type | str
    """The model class, built as ``model(args)`` (or ``"module:Class"``)."""
    args: type | str
    """The args dataclass; it inherits ``options`` (or ``"module:Class"``)."""
    flavors: dict[str, dict[str, Any]]
    flavor_aliases: dict[str, str] = field(default_factory=dict)
    """Old flavor name -> its name now: still accepted, with a one-line deprecation note."""
    options: type | None = None
    """The spec's own ``[model]`` options: a dataclass of ``outlier_titan.options.opt`` fields."""
    tp_plan: TPPlan | None = None
    post_step: Callable[[Any], None] | str | None = None
    """Run on the model after every optimizer step (or ``"module:function"``)."""
    hf_adapter: str | None = None
    """``"module:function"``: args -> (adapter, "") or (None, why not); None: no Hugging Face export."""
    rotation: str | Callable[[Any], str | None] | None = NOT_DECLARED
    """QuaRot's residual rotation: None (exact for this spec), why not, or a function of the args giving either."""
    description: str = ""

    def __post_init__(self):
        if isinstance(self.post_step, str):
            self.post_step = _Deferred(self.post_step)

    @property
    def build(self) -> Callable[[Any], Any]:
        return resolve(self.model)

    @property
    def args_cls(self) -> type:
        return resolve(self.args)

    def model_path(self) -> str:
        if isinstance(self.model, str):
            return self.model
        return f"{self.model.__module__}:{self.model.__qualname__}"

    def flavor(self, name: str) -> dict[str, Any]:
        """The values of flavor ``name``; an old name (``flavor_aliases``) says its new one on stderr."""
        if name in self.flavor_aliases:
            new = self.flavor_aliases[name]
            print(f"note: model.flavor {name!r} of '{self.name}' is now {new!r}; the old name is deprecated",
                  file=sys.stderr)
            name = new
        if name not in self.flavors:
            raise ConfigError(f"model.flavor = {name!r} is not a flavor of '{self.name}'; "
                              f"available: {', '.join(self.flavors)}")
        return self.flavors[name]

    def rotation_refusal(self, args) -> str | None:
        """Why the residual stream of this spec's model with ``args`` cannot be rotated exactly (None: it can)."""
        return self.rotation(args) if callable(self.rotation) else self.rotation


_SPECS: dict[str, ModelSpec] = {}


def register_spec(spec: ModelSpec) -> ModelSpec:
    """Registers ``spec`` under its name (once); its options join ``[model]``."""
    if spec.name in _SPECS:
        raise ValueError(f"model spec {spec.name!r} is already registered")
    _SPECS[spec.name] = spec
    if spec.options is not None:
        add_option_group(OptionGroup("model", KIND, spec.name, spec.options))
    return spec


def get_spec(name: str) -> ModelSpec:
    if name not in _SPECS:
        raise ConfigError(f"model.name = {name!r} is not a model spec; available: {', '.join(sorted(_SPECS))}")
    return _SPECS[name]


def all_specs() -> list[ModelSpec]:
    """Every registered spec, in registration order."""
    return list(_SPECS.values())


def spec_of_model(model) -> ModelSpec | None:
    """The registered spec whose model class is ``type(model)`` or its nearest base class, or None."""
    by_path = {s.model_path(): s for s in _SPECS.values()}
    return next((by_path[p] for p in (f"{c.__module__}:{c.__qualname__}" for c in type(model).__mro__)
                 if p in by_path), None)
