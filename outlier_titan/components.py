"""The built-in components, registered by importing this module: model specs and their options, attention variants,
optimizers, data sources, outlier metrics and PTQ schemes. Every entry point imports it (and ``job.plugins``,
:func:`load`) before it reads a config; the config composes whatever is registered (docs/extending.md).

The import order is the order of the options in ``[model]`` and ``[optimizer]`` (``--help``): the specs' options,
then the attention variants'; the tile engine's, then OrthoAdam's and SOAP's, then Muon's."""

from __future__ import annotations

from outlier_titan.models import pre_ln, op, ngpt, angpt  # noqa: F401  (first: the specs' [model] options)
from outlier_titan.models import attention_variants  # noqa: F401
from outlier_titan.optim.tiles import settings as _tile_settings  # noqa: F401  (before Muon's [optimizer] options)
from outlier_titan.optim import muon_settings  # noqa: F401
from outlier_titan.optim import builder as _optimizers  # noqa: F401
from outlier_titan.data import sources as _data_sources  # noqa: F401
from outlier_titan.observe import outliers as _metrics  # noqa: F401
from outlier_titan.quant import ptq as _ptq_schemes  # noqa: F401
from outlier_titan.plugins import load_plugins


def load(plugins=()) -> list:
    """Imports the plug-ins (``job.plugins``: module names or ``.py`` paths) after the built-ins; returns them."""
    return load_plugins(plugins)
