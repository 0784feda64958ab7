"""The ``[model]`` options owned by model specs: each spec declares its own dataclass beside its entry
(:attr:`outlier_titan.models.spec.ModelSpec.options`); the config composes them into ``[model]`` (each field's
metadata naming its spec), ``--help`` lists them under their spec, and ``models/registry.py`` rejects an option of
another spec in one line naming the spec(s) that have it. This module imports no torch: the config imports it.
Options every spec reads (``dim``, ``n_layers``, ...) stay in the config's common ``[model]`` fields.

A spec outside the package registers its entry before the config module is imported (the ``[model]`` section is
composed once, at that import).
"""

from __future__ import annotations

from outlier_titan.models.spec import all_specs
from outlier_titan.options import OptionGroup

KIND = "model spec"


def option_groups() -> list[OptionGroup]:
    """One group per spec with options: the built-in specs first, in their order, then the plug-ins."""
    return [OptionGroup("model", KIND, s.name, s.options) for s in all_specs() if s.options is not None]
