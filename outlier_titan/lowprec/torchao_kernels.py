"""The FP8 recipes on real FP8 kernels: torchao's ``Float8Linear`` (CUDA SM 8.9+), imported only here and only
when such a run starts (its import prints kernel-library and pytree notices on machines without them)."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import warnings

import torch.nn as nn

from outlier_titan.errors import ConfigError
from outlier_titan.lowprec.recipes import Recipe


def import_torchao_float8():
    """``torchao.float8`` with its import-time notices silenced; a one-line ConfigError when torchao is missing."""
    pytree = logging.getLogger("torch.utils._pytree")  # its Enum notices go through torch's log handler
    level = pytree.level
    pytree.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()), \
                contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            import torchao.float8 as float8
    except ImportError:
        raise ConfigError("low_precision: the FP8 kernels need torchao: pip install 'outlier_titan[lowprec]' "
                          "(or set low_precision.emulate = always)") from None
    finally:
        pytree.setLevel(level)
    return float8


def float8_config(recipe: Recipe, *, emulate: bool = False):
    """torchao's ``Float8LinearConfig`` of the recipe; tensorwise all-gathers the FSDP shards in FP8 as torchtitan
    does (``enable_fsdp_float8_all_gather``)."""
    float8 = import_torchao_float8()
    cfg = float8.Float8LinearConfig.from_recipe_name(recipe.torchao_float8)
    return dataclasses.replace(cfg, emulate=emulate,
                               enable_fsdp_float8_all_gather=recipe.torchao_float8 == "tensorwise")


def convert_float8(model: nn.Module, names: list[str], recipe: Recipe, *, emulate: bool = False) -> None:
    """Swaps the named Linears for torchao's ``Float8Linear`` (the same parameters)."""
    float8 = import_torchao_float8()
    chosen = set(names)
    float8.convert_to_float8_training(model, config=float8_config(recipe, emulate=emulate),
                                      module_filter_fn=lambda module, fqn: fqn in chosen)
