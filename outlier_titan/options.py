"""Config options declared by the component that owns them.

A component (an attention variant, a model spec, an optimizer) declares its options as a small dataclass whose
fields are made with :func:`opt` (default, one-line help, allowed values). The config section that holds them
(``[model]``, ``[optimizer]``) is composed from its common fields plus every owner's group
(:func:`compose_section`); each composed field's metadata names its owner (``owner``, ``kind``), which ``--help``
groups by and the validation reads. This module imports nothing of the package, so the config and the light
option modules of the components can both import it without a cycle.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import MISSING, dataclass, field, make_dataclass
from typing import Any


def opt(default: Any, help: str, choices: Any = None, names: Any = None) -> Any:
    """A config field with a help line, optional allowed values (``choices``) or registered names that a free-form
    value may also be (``names``, listed by ``--help``)."""
    meta = {"help": help, "choices": choices}
    if names is not None:
        meta["names"] = names
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class RegisteredChoices:
    """Allowed values that a registry fills (``optimizer.name``: ``outlier_titan.optim.registry``; ``model.attention``:
    ``outlier_titan.models.attention_variants``). Reads like a tuple; while empty (no registry imported) the config
    does not restrict the value, and the registry's lookup names the registered ones."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._help: dict[str, str] = {}

    def add(self, name: str, help: str | None = None) -> None:
        if name not in self._names:
            self._names.append(name)
        if help:
            self._help[name] = help

    def described(self) -> str:
        """``a (what a is), b, ...`` for ``--help``."""
        return ", ".join(f"{n} ({self._help[n]})" if n in self._help else n for n in self._names)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __repr__(self) -> str:
        return repr(tuple(self._names))


OPTIMIZER_NAMES = RegisteredChoices()
"""``optimizer.name``'s choices: ``outlier_titan.optim.registry.register_optimizer`` fills it."""
ATTENTION_NAMES = RegisteredChoices()
"""``model.attention``'s choices: the attention variants' registry (``outlier_titan.models.attention_variants``)."""
ATTENTION_IMPLS = ("auto", "fused", "chunked", "explicit")
"""How attention runs (``model.attention_impl``): auto = the fused kernels on a GPU, SDPA or the chunked path
elsewhere; fused = SDPA or FlexAttention (no backward on the CPU); chunked = query blocks recomputed in the
backward, any device; explicit = the [B, H, T, T] weights (the probe's reader and the tests' oracle)."""
NO_DECAY_CLASSES = RegisteredChoices()
"""The parameter classes ``optimizer.no_decay`` may list: every model's (below) and those components register (an
attention variant's learned sink logits: ``sink``)."""
for _name in ("norm", "bias", "embedding", "gain"):
    NO_DECAY_CLASSES.add(_name)
DATA_SOURCE_NAMES = RegisteredChoices()
"""The named sources ``data.source`` takes besides paths (``outlier_titan.data.sources.register_source`` fills it);
``--help`` lists them (``names`` of the field's metadata), the value is not restricted to them."""


@dataclass(frozen=True)
class OptionGroup:
    """The options one component owns in one config section."""

    section: str
    """The config section (``model``, ``optimizer``)."""
    kind: str
    """What owns them, in words (``attention variant``, ``model spec``, ``optimizer``)."""
    owner: str
    """The owner's registered name (``softpick``, ``op``, ``muon``)."""
    cls: type
    """A dataclass whose fields are declared with :func:`opt`; its defaults are the owner's defaults."""

    def label(self) -> str:
        return f"{self.kind} '{self.owner}'"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    raise TypeError(f"option {f.name} has no default; declare it with opt(default, help)")


def group_fields(group: OptionGroup, optional: bool) -> list[tuple[str, Any, dataclasses.Field]]:
    """The group's fields as ``make_dataclass`` entries whose metadata names the owner. ``optional``: the config
    field holds None ("the owner's default", kept in the metadata's ``default``) instead of the default itself."""
    hints = typing.get_type_hints(group.cls)
    out = []
    for f in dataclasses.fields(group.cls):
        default = _default(f)
        meta = {**f.metadata, "owner": group.owner, "kind": group.kind, "default": default,
                "defaults": {group.owner: default}}
        tp = hints[f.name]
        if optional:
            if type(None) not in typing.get_args(tp):
                tp = tp | None
            out.append((f.name, tp, field(default=None, metadata=meta)))
        elif isinstance(default, (list, dict)):
            out.append((f.name, tp, field(default_factory=lambda d=default: type(d)(d), metadata=meta)))
        else:
            out.append((f.name, tp, field(default=default, metadata=meta)))
    return out


def owner_defaults(groups: typing.Iterable[OptionGroup]) -> list[tuple[str, Any, dataclasses.Field]]:
    """The groups' fields with their owners' defaults, for a component's own args dataclass."""
    out = []
    for g in groups:
        hints = typing.get_type_hints(g.cls)
        for f in dataclasses.fields(g.cls):
            default = _default(f)
            if isinstance(default, (list, dict)):
                out.append((f.name, hints[f.name], field(default_factory=lambda d=default: type(d)(d))))
            else:
                out.append((f.name, hints[f.name], field(default=default)))
    return out


def compose_section(name: str, base: type, groups: typing.Iterable[OptionGroup], optional: bool,
                    module: str) -> type:
    """A dataclass ``name``: the fields of ``base`` (common to every owner), then each group's fields in order.
    A key declared by two owners must have the same type (and, unless ``optional``, the same default); its metadata
    then names both (``owner``: "a, b"; ``defaults``: each owner's)."""
    fields: dict[str, tuple[str, Any, dataclasses.Field]] = {}
    base_names = {f.name for f in dataclasses.fields(base)}
    for g in groups:
        for entry in group_fields(g, optional):
            key = entry[0]
            if key in base_names:
                raise TypeError(f"{g.label()} declares '{g.section}.{key}', a common option of [{g.section}]")
            if key in fields:
                old = fields[key]
                if old[1] != entry[1] or (not optional and old[2].metadata["default"] != entry[2].metadata["default"]):
                    raise TypeError(f"'{g.section}.{key}' is declared differently by {old[2].metadata['owner']} "
                                    f"and {g.label()}")
                meta = {**old[2].metadata, "owner": old[2].metadata["owner"] + ", " + g.owner,
                        "defaults": {**old[2].metadata["defaults"], g.owner: entry[2].metadata["default"]}}
                if old[2].default_factory is not MISSING:
                    fields[key] = (key, old[1], field(default_factory=old[2].default_factory, metadata=meta))
                else:
                    fields[key] = (key, old[1], field(default=old[2].default, metadata=meta))
            else:
                fields[key] = entry
    cls = make_dataclass(name, list(fields.values()), bases=(base,))
    cls.__module__, cls.__doc__ = module, base.__doc__
    return cls


def owned_by(f: dataclasses.Field) -> tuple[str, str] | None:
    """``(kind, owner)`` of a composed field, None for a common one."""
    if "owner" not in f.metadata:
        return None
    return f.metadata["kind"], f.metadata["owner"]
