"""The attention variants: the registry (:mod:`.registry`, no torch) and the built-in variants,
one module each, which register themselves when this package is imported. A variant outside the package is one
plug-in file that calls :func:`register_variant` (docs/extending.md)."""

from __future__ import annotations

from outlier_titan.models.attention_variants.registry import (  # noqa: F401
    KIND, AttentionError, VariantParam,
    VariantForms, AttentionVariant, register_variant, variants, get_variant, option_groups,
    layer_variants, AttentionChoice, AttentionOptions, block_variant, block_options, used_variants,
    uses_only, check_options_used, validate_options)

# the built-in variants, in the order --help lists them
from outlier_titan.models.attention_variants import (  # noqa: E402,F401
    softmax, softmax1, sink_logit, gated, softpick, sigmoid, relu, clipped_softmax)
