"""``relu``: ``A_ij = relu(s_ij) / L_i``; ``L_i = i + 1`` keys seen (``prefix``), ``T`` (``seq_len``) or 1
(``none``) (Guo et al. 2024, arXiv 2410.13835). On FlexAttention ``f = log relu(s)``: ``out * exp(lse) / L_i``."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.attention_variants.registry import (AttentionError, AttentionVariant, VariantForms,
                                                              register_variant)
from outlier_titan.options import opt

RELU_NORMS = ("prefix", "seq_len", "none")


@dataclass
class ReluOptions:
    attention_relu_norm: str = opt("prefix", "relu: divide the weights by the keys each query sees (prefix), the "
                                             "sequence length (seq_len) or nothing (none).", RELU_NORMS)


def _check(args) -> None:
    if args.attention_relu_norm not in RELU_NORMS:
        raise AttentionError(f"model.attention_relu_norm = {args.attention_relu_norm!r}: choose one of "
                             f"{', '.join(RELU_NORMS)}")


def _forms() -> VariantForms:
    import torch
    import torch.nn.functional as F

    from outlier_titan.models.attention_flex import causal_flex, log_positive, score_mod

    def weights(s, visible, first, t, opts, state):
        a = F.relu(s.masked_fill(~visible, 0.0))
        norm = opts.options.attention_relu_norm
        if norm == "prefix":
            n_q = s.shape[-2]
            return a / torch.arange(first + 1, first + n_q + 1, dtype=s.dtype, device=s.device).view(-1, 1)
        if norm == "seq_len":
            return a / t
        return a

    def flex(q, k, v, scale, softcap, opts, state):
        t = q.shape[-2]
        out, lse = causal_flex(q, k, v, score_mod(log_positive, softcap), scale)
        keys = {"prefix": torch.arange(1, t + 1, dtype=lse.dtype, device=lse.device), "seq_len": t, "none": 1}
        return out, lse, torch.exp(lse) / keys[opts.options.attention_relu_norm]

    return VariantForms(weights=weights, flex=flex)


register_variant(AttentionVariant("relu", "ReLU of the logits, normalised", _forms, options=ReluOptions,
                                  validate=_check))
