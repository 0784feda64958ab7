"""The optimizer registry: each optimizer is registered once, with everything the rest of the stack needs to know.

An entry holds (a) the factory, (b) the optimizer-state bytes per parameter element for the dry run (a number, or
a function of the ``[optimizer]`` config), (c) the ``optimizer.*`` keys whose change makes a checkpoint's optimizer
state unloadable, and (d) optional extra validation of the config. ``optimizer.name``'s choices and ``--help``, the
dry run's state bytes (``training/planning.py``) and the resume check (``checkpoint/manager.py``) all read it.

The built-ins register in ``optim/builder.py``; code outside the package calls :func:`register_optimizer` before
the trainer parses its config (see ``outlier_titan/optim/README.md``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

from typing import TYPE_CHECKING

from outlier_titan.config.job_config import add_option_group, section_class
from outlier_titan.errors import UserError
from outlier_titan.options import OPTIMIZER_NAMES, OptionGroup

if TYPE_CHECKING:
    from outlier_titan.config.job_config import Optimizer as OptimizerConfig

COMMON_LAYOUT_KEYS = ("no_decay",)
"""Keys that change every optimizer's state layout: the decay / no-decay parameter groups."""
COMMON_HYPERPARAMETERS = ("initial_lr", "betas", "eps", "weight_decay", "momentum", "alpha")
"""Param-group keys of torch's optimizers that the config owns: a resume restores them from this run's config
over the checkpoint's values (an optimizer adds its own with ``hyperparameters``)."""

StateBytes = float | Callable[["OptimizerConfig"], float]


@dataclass(frozen=True)
class OptimizerSpec:
    name: str
    factory: Callable[..., Any]
    """``(param_groups, cfg, seed) -> Optimizer``, or ``(model, cfg, seed)`` when ``takes_model``."""
    state_bytes: StateBytes | None
    """Optimizer-state bytes per parameter element (a number or a function of the optimizer config); None when
    ``plan_state`` counts them."""
    layout_keys: tuple[str, ...] = ()
    """``optimizer.*`` keys (besides ``name`` and ``no_decay``) whose change breaks a resume."""
    validate: Callable[[OptimizerConfig], None] | None = None
    takes_model: bool = False
    """The factory takes the model: it splits the parameters itself (Muon: hidden matrices vs the rest) or reads the
    model's parameter roles (the tile optimizers: ``models.roles.roles_of``)."""
    plan_state: Callable[[Any, OptimizerConfig], tuple[str, float]] | None = None
    """Dry run of an optimizer that counts its own state (Muon: its split): (summary line, this rank's state bytes)
    on the sharded meta model, in place of ``state_bytes`` x local elements."""
    hyperparameters: tuple[str, ...] = ()
    """Param-group keys (besides :data:`COMMON_HYPERPARAMETERS`) that the config owns: restored after a resume."""
    check_layout: Callable[[Any, OptimizerConfig], None] | None = None
    """Pre-flight check on the sharded meta model, before it is materialised: ``(model, cfg)``; raises a UserError
    (the tile engine: tiles vs shards)."""
    after_build: Callable[[Any, OptimizerConfig, bool], str | None] | None = None
    """``(optimizer, cfg, compile) -> a line for the log or None``, once the optimizer is built (Muon: its split;
    the tile engine: compiling its element-wise math when ``compile.enable``)."""

    def bytes_per_element(self, cfg: OptimizerConfig) -> float:
        return float(self.state_bytes(cfg) if callable(self.state_bytes) else self.state_bytes)

    def breaking_keys(self) -> tuple[str, ...]:
        return COMMON_LAYOUT_KEYS + self.layout_keys

    def config_owned(self) -> tuple[str, ...]:
        return COMMON_HYPERPARAMETERS + self.hyperparameters


_REGISTRY: dict[str, OptimizerSpec] = {}


def _fields() -> set[str]:
    """The ``[optimizer]`` keys now (registrations with options add some)."""
    return {f.name for f in dataclasses.fields(section_class("optimizer"))}


def register_optimizer(name: str, factory: Callable[..., Any], *, state_bytes: StateBytes | None = None,
                       layout_keys: tuple[str, ...] | list[str] = (), validate: Callable | None = None,
                       takes_model: bool = False, plan_state: Callable | None = None,
                       options: type | None = None, hyperparameters: tuple[str, ...] | list[str] = (),
                       check_layout: Callable | None = None, after_build: Callable | None = None,
                       replace: bool = False) -> OptimizerSpec:
    """Makes ``name`` usable as ``optimizer.name`` (config, ``--help``, dry run, resume check). The dry run needs
    ``state_bytes`` or ``plan_state``; ``layout_keys`` are fields of the ``[optimizer]`` section; ``options``: a
    dataclass of the optimizer's own options declared with ``outlier_titan.options.opt`` (names prefixed with the
    optimizer's name), composed into ``[optimizer]`` (TOML, ``--optimizer.KEY``, ``--help``) for configs made
    afterwards; ``hyperparameters``, ``check_layout``, ``after_build``: see :class:`OptimizerSpec`; ``replace``
    allows registering a name again."""
    if not name or not name.replace("_", "").isalnum():
        raise UserError(f"optimizer name {name!r} must be letters, digits and underscores")
    if name in _REGISTRY and not replace:
        raise UserError(f"optimizer {name!r} is already registered; pick another name or pass replace=True")
    if options is not None and not dataclasses.is_dataclass(options):
        raise UserError(f"optimizer {name!r}: options must be a dataclass whose fields are declared with "
                        f"outlier_titan.options.opt")
    own = {f.name for f in dataclasses.fields(options)} if options is not None else set()
    unknown = [k for k in layout_keys if k not in _fields() | own]
    if unknown:
        raise UserError(f"optimizer {name!r}: layout key(s) {', '.join(unknown)} are not [optimizer] options; "
                        f"use field names of outlier_titan.config.job_config.Optimizer")
    if (state_bytes is None) == (plan_state is None):
        raise UserError(f"optimizer {name!r}: pass one of state_bytes (bytes per parameter element) or plan_state")
    if not (state_bytes is None or callable(state_bytes)
            or (isinstance(state_bytes, (int, float)) and state_bytes >= 0)):
        raise UserError(f"optimizer {name!r}: state_bytes must be a number >= 0 or a function of the config")
    if options is not None:
        add_option_group(OptionGroup("optimizer", "optimizer", name, options))
    spec = OptimizerSpec(name, factory, state_bytes, tuple(layout_keys), validate, takes_model, plan_state,
                         tuple(hyperparameters), check_layout, after_build)
    _REGISTRY[name] = spec
    if name not in OPTIMIZER_NAMES:
        OPTIMIZER_NAMES.add(name)
    return spec


def get_optimizer(name: str) -> OptimizerSpec:
    """The registered entry; an unknown name is a one-line error listing the registered ones."""
    if name not in _REGISTRY:
        raise UserError(f"optimizer.name = {name!r} is not registered; choose one of: {', '.join(_REGISTRY)} "
                        "(or register it with outlier_titan.optim.registry.register_optimizer)")
    return _REGISTRY[name]


def optimizer_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)
