"""``softmax``: ``A_ij = softmax_j(s_ij)``; on SDPA as it is."""

from __future__ import annotations

from outlier_titan.models.attention_variants.registry import AttentionVariant, VariantForms, register_variant


def _forms() -> VariantForms:
    import torch

    from outlier_titan.models.attention_sdpa import causal_sdpa

    def weights(s, visible, first, t, opts, state):
        return torch.softmax(s, dim=-1)

    def sdpa(q, k, v, scale, opts, state):
        return causal_sdpa(q, k, v, scale)

    return VariantForms(weights=weights, sdpa=sdpa)


register_variant(AttentionVariant("softmax", "softmax", _forms))
