"""The training-remedy registry: a remedy is one entry with its ``[remedies]`` options, a validation and the hooks
the trainer runs while it is on. The trainer names no remedy: it asks :func:`build_remedies` for the active ones
and calls, for each micro-batch, their loss terms after the forward, and after every optimizer step (next to the
model spec's ``post_step``) their after-step hooks; the scalars they report are logged with the step's.

An entry (:class:`Remedy`):

* ``options``: a dataclass of its ``[remedies]`` keys (prefixed with its name, declared with ``opt``);
* ``enabled(cfg)``: whether the config turns it on (e.g. ``remedies.qk_clip_tau > 0``);
* ``validate(cfg)``: one-line ``ConfigError`` for bad values, checked with the config (on or off);
* ``build(model, job_config, ctx) -> RemedyHooks``: the set-up on the built, parallelised model (forward hooks,
  state), returning the object whose hooks the trainer calls (:class:`RemedyHooks`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from outlier_titan.config.job_config import add_option_group
from outlier_titan.errors import ConfigError
from outlier_titan.options import OptionGroup


@dataclass(frozen=True)
class RemedyContext:
    """What a remedy's set-up may need besides the model and the config."""

    dp_group: Any
    """The data-parallel process group (None at one rank): a quantity of the global batch reduces over it."""
    tp_group: Any
    """The tensor-parallel process group (None without TP): the heads (and a sequence-parallel stream) are split
    over it."""
    tokens_per_step: int
    """Target tokens of one optimizer step over all ranks (the cross entropy's divisor)."""


class RemedyHooks:
    """The hooks of an active remedy; each does nothing unless overridden."""

    def loss_term(self) -> torch.Tensor | None:
        """After a micro-batch's forward: the term added to its loss (this rank's share of the step's term, like
        the loss itself: summed over micro-batches and data-parallel ranks it is the step's), or None."""
        return None

    def after_step(self) -> None:
        """After ``optimizer.step()`` (and the spec's ``post_step``); only on steps whose update was applied."""

    def scalars(self) -> dict[str, float]:
        """What to log at a logging step (the same on every rank), e.g. ``remedies/qk_clip_heads``."""
        return {}

    def close(self) -> None:
        """Removes what the set-up installed (hooks)."""


@dataclass(frozen=True)
class Remedy:
    name: str
    help: str
    enabled: Callable[[Any], bool]
    """``[remedies]`` config -> whether it is on."""
    build: Callable[[Any, Any, RemedyContext], RemedyHooks]
    """``(model, job config, context) -> hooks``, once the model is built, parallelised and initialised."""
    options: type | None = None
    validate: Callable[[Any], None] | None = None
    """``[remedies]`` config -> None, raising a one-line ``ConfigError``."""
    check: Callable[[Any, Any], None] | None = None
    """``(model, job config) -> None`` on the built model when the remedy is on: a one-line ``ConfigError`` for a
    model it cannot act on."""


_REGISTRY: dict[str, Remedy] = {}


def register_remedy(name: str, help: str, enabled: Callable, build: Callable, *, options: type | None = None,
                    validate: Callable | None = None, check: Callable | None = None) -> Remedy:
    """Adds a training remedy; its options join ``[remedies]`` (``--help`` lists them under its name)."""
    if name in _REGISTRY:
        raise ConfigError(f"remedy {name!r} is already registered; pick another name")
    if options is not None:
        add_option_group(OptionGroup("remedies", "remedy", name, options))
    entry = Remedy(name, help, enabled, build, options, validate, check)
    _REGISTRY[name] = entry
    return entry


def remedies() -> list[Remedy]:
    """Every registered remedy, in registration order."""
    return list(_REGISTRY.values())


def validate_remedies(cfg) -> None:
    """Every remedy's validation of the ``[remedies]`` config (on or off)."""
    for r in remedies():
        if r.validate is not None:
            r.validate(cfg)


def active(cfg) -> list[Remedy]:
    """The remedies the ``[remedies]`` config turns on."""
    return [r for r in remedies() if r.enabled(cfg)]


class Remedies:
    """The active remedies of a run: the trainer calls these four, whatever is registered."""

    def __init__(self, model, job_config, ctx: RemedyContext):
        self.hooks: dict[str, RemedyHooks] = {}
        for r in active(job_config.remedies):
            if r.check is not None:
                r.check(model, job_config)
            self.hooks[r.name] = r.build(model, job_config, ctx)

    def loss_term(self) -> torch.Tensor | None:
        terms = [t for h in self.hooks.values() if (t := h.loss_term()) is not None]
        return sum(terms[1:], terms[0]) if terms else None

    def after_step(self) -> None:
        for h in self.hooks.values():
            h.after_step()

    def scalars(self) -> dict[str, float]:
        return {k: v for h in self.hooks.values() for k, v in h.scalars().items()}

    def close(self) -> None:
        for h in self.hooks.values():
            h.close()
