"""``softmax1``: ``A_ij = exp(s_ij) / (1 + sum_j exp(s_ij))`` (Kaul et al. 2024, arXiv 2410.17174): a sink of
logit 0 and value 0. On SDPA exact as a zero key and zero value prepended (T + 1 positions, causal); on FlexAttention
softmax's output times ``sigmoid(lse)``."""

from __future__ import annotations

from outlier_titan.models.attention_variants.registry import AttentionVariant, VariantForms, register_variant


def sink_weights(s, c):
    """``exp(s_ij) / (exp(c) + sum_j exp(s_ij))`` for a sink logit ``c`` (a number tensor or [1, H, 1, 1]), with the
    sink in the running max."""
    import torch

    m = torch.maximum(s.amax(-1, keepdim=True), c)
    e = torch.exp(s - m)
    return e / (torch.exp(c - m) + e.sum(-1, keepdim=True))


def _forms() -> VariantForms:
    import torch
    import torch.nn.functional as F

    from outlier_titan.models.attention_flex import causal_flex, score_mod

    def weights(s, visible, first, t, opts, state):
        return sink_weights(s, torch.zeros((), dtype=s.dtype, device=s.device))

    def sdpa(q, k, v, scale, opts, state):
        pad = (0, 0, 1, 0)
        out = F.scaled_dot_product_attention(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), is_causal=True,
                                             scale=scale)
        return out[:, :, 1:]

    def flex(q, k, v, scale, softcap, opts, state):
        out, lse = causal_flex(q, k, v, score_mod(None, softcap), scale)
        return out, lse, torch.sigmoid(lse)

    return VariantForms(weights=weights, sdpa=sdpa, flex=flex)


register_variant(AttentionVariant("softmax1", "exact zero sink (softmax-1)", _forms, with_sink=True))
