"""``softpick``: ``A_ij = relu(exp(s_ij) - 1) / (sum_j |exp(s_ij) - 1| + eps)`` (Zuhri et al. 2025, arXiv
2504.20966), computed with ``m = max(max_j s_ij, 0)`` as ``relu(e^(s-m) - e^-m) / (sum |e^(s-m) - e^-m| + eps e^-m)``
(an exact rewrite). On FlexAttention ``f = log relu(e^s - 1)`` and a second pass ``log |e^s - 1|`` for the
normaliser's ``lse2``: ``out * exp(lse - lse2) / (1 + eps exp(-lse2))``."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.attention_variants.registry import (AttentionError, AttentionVariant, VariantForms,
                                                              register_variant)
from outlier_titan.options import opt


@dataclass
class SoftpickOptions:
    attention_softpick_eps: float = opt(1e-6, "softpick: epsilon of the denominator.")


def _check(args) -> None:
    if args.attention_softpick_eps < 0:
        raise AttentionError(f"model.attention_softpick_eps must be >= 0, got {args.attention_softpick_eps}")


def _forms() -> VariantForms:
    import torch
    import torch.nn.functional as F

    from outlier_titan.models.attention_flex import NEG_INF, causal_flex, log_abs_expm1, score_mod

    def log_relu_expm1(s):
        return torch.where(s > 0, log_abs_expm1(s), NEG_INF)

    def weights(s, visible, first, t, opts, state):
        m = s.amax(-1, keepdim=True).clamp_min(0.0)
        a = (torch.exp(s - m) - torch.exp(-m)).masked_fill(~visible, 0.0)
        return F.relu(a) / (a.abs().sum(-1, keepdim=True) + opts.options.attention_softpick_eps * torch.exp(-m))

    def flex(q, k, v, scale, softcap, opts, state):
        out, lse = causal_flex(q, k, v, score_mod(log_relu_expm1, softcap), scale)
        _, lse2 = causal_flex(q, k, v, score_mod(log_abs_expm1, softcap), scale)
        return out, lse, torch.exp(lse - lse2) / (1.0 + opts.options.attention_softpick_eps * torch.exp(-lse2))

    return VariantForms(weights=weights, flex=flex)


register_variant(AttentionVariant("softpick", "rectified softmax", _forms, options=SoftpickOptions, validate=_check))
