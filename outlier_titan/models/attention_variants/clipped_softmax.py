"""``clipped_softmax``: ``A_ij = clip((zeta - gamma) softmax_j(s_ij) + gamma, 0, 1)`` on visible keys (Bondarenko
et al. 2023, arXiv 2306.12929). On FlexAttention a first pass for softmax's ``lse0``, then
``f = log clip((zeta - gamma) e^(s - lse0) + gamma, 0, 1)``: ``out * exp(lse)``."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.attention_variants.registry import (AttentionError, AttentionVariant, VariantForms,
                                                              register_variant)
from outlier_titan.options import opt


@dataclass
class ClippedSoftmaxOptions:
    attention_clip_zeta: float = opt(1.0, "clipped_softmax: stretch zeta >= 1.")
    attention_clip_gamma: float = opt(-0.03, "clipped_softmax: stretch gamma <= 0.")


def _check(args) -> None:
    if not args.attention_clip_zeta >= 1 or not args.attention_clip_gamma <= 0:
        raise AttentionError(f"model.attention_clip_zeta = {args.attention_clip_zeta} / attention_clip_gamma = "
                             f"{args.attention_clip_gamma}: clipped softmax needs zeta >= 1 and gamma <= 0")


def _forms() -> VariantForms:
    import torch

    from outlier_titan.models.attention_flex import capped, causal_flex, log_positive, score_mod

    def weights(s, visible, first, t, opts, state):
        o = opts.options
        p = (o.attention_clip_zeta - o.attention_clip_gamma) * torch.softmax(s, dim=-1) + o.attention_clip_gamma
        return p.clamp(0.0, 1.0).masked_fill(~visible, 0.0)

    def flex(q, k, v, scale, softcap, opts, state):
        _, lse0 = causal_flex(q, k, v, score_mod(None, softcap), scale)
        zeta, gamma = opts.options.attention_clip_zeta, opts.options.attention_clip_gamma

        def clipped(score, b, h, q_idx, kv_idx):  # captures this forward's lse0 (its gradient flows through it)
            w = (zeta - gamma) * torch.exp(capped(score, softcap) - lse0[b, h, q_idx]) + gamma
            return log_positive(torch.clamp(w, max=1.0))

        out, lse = causal_flex(q, k, v, clipped, scale)
        return out, lse, torch.exp(lse)

    return VariantForms(weights=weights, flex=flex)


register_variant(AttentionVariant("clipped_softmax", "stretched and clipped softmax", _forms,
                                  options=ClippedSoftmaxOptions, validate=_check))
