"""``sigmoid``: ``A_ij = sigmoid(s_ij + b)``, ``b = -log(T)`` by default (Ramapuram et al. 2024, arXiv 2409.04431;
T the sequence length of the forward). On FlexAttention ``f = log sigmoid(s + b)``: ``out * exp(lse)``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from outlier_titan.models.attention_variants.registry import AttentionVariant, VariantForms, register_variant
from outlier_titan.options import opt


@dataclass
class SigmoidOptions:
    attention_sigmoid_bias: float | None = opt(None, "sigmoid: the logit bias b (None: -log(sequence length)).")


def _bias(opts, t: int) -> float:
    b = opts.options.attention_sigmoid_bias
    return -math.log(t) if b is None else b


def _forms() -> VariantForms:
    import functools

    import torch
    import torch.nn.functional as F

    from outlier_titan.models.attention_flex import causal_flex, score_mod

    @functools.lru_cache(maxsize=64)
    def log_sigmoid(bias: float):  # one lasting function per bias (compiled FlexAttention reuses it)
        return lambda s: F.logsigmoid(s + bias)

    def weights(s, visible, first, t, opts, state):
        return torch.sigmoid(s + _bias(opts, t)).masked_fill(~visible, 0.0)

    def flex(q, k, v, scale, softcap, opts, state):
        out, lse = causal_flex(q, k, v, score_mod(log_sigmoid(_bias(opts, q.shape[-2])), softcap), scale)
        return out, lse, torch.exp(lse)

    return VariantForms(weights=weights, flex=flex)


register_variant(AttentionVariant("sigmoid", "sigmoid of the biased logits", _forms, options=SigmoidOptions))
