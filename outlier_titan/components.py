"""The built-in components, registered by importing this module: model specs and their options, attention variants,
optimizers, data sources, outlier metrics and PTQ schemes. Every entry point imports it before it reads a config
(the config then imports ``job.plugins``, yours); the config composes whatever is registered (docs/extending.md).

The import order is the order of the options in ``[model]`` and ``[optimizer]`` (``--help``) and of the metrics in
``metrics.jsonl``: the specs' options, then the attention variants'; the tile engine's, then OrthoAdam's and SOAP's,
then Muon's."""

from outlier_titan.models import pre_ln, op, ngpt, angpt  # noqa: F401
from outlier_titan.models import attention_variants  # noqa: F401
from outlier_titan.optim.tiles import settings  # noqa: F401
from outlier_titan.optim import muon_settings, builder  # noqa: F401
from outlier_titan.data import sources  # noqa: F401
from outlier_titan.observe import outliers, sinks, maxlogit, osp_kurtosis, gradients, super_weights  # noqa: F401
from outlier_titan.quant import ptq, super_weight  # noqa: F401
from outlier_titan import remedies  # noqa: F401
