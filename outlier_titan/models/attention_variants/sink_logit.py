"""``sink_logit``: ``A_ij = exp(s_ij) / (exp(c_h) + sum_j exp(s_ij))``, ``c_h`` a learned logit per head with no
value (gpt-oss 2025; softmax-1 is ``c_h = 0`` fixed): softmax's output times ``sigmoid(lse - c_h)``. On SDPA on the
CPU only (its flash kernel returns ``lse``); the logits are module ``sink``, optimizer class ``sink``, sharded with
the heads under TP and never soft-capped."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.attention_variants.registry import (AttentionVariant, VariantForms, VariantParam,
                                                              register_variant)
from outlier_titan.options import opt


@dataclass
class SinkLogitOptions:
    attention_sink_init: float = opt(0.0, "sink_logit: initial sink logit of every head (0: softmax-1 at init).")


def _forms() -> VariantForms:
    import torch

    from outlier_titan.models.attention import HeadParam
    from outlier_titan.models.attention_flex import causal_flex, score_mod
    from outlier_titan.models.attention_sdpa import LseRescaledFlash
    from outlier_titan.models.attention_variants.softmax1 import sink_weights

    def weights(s, visible, first, t, opts, state):
        if state is None:
            raise ValueError("sink_logit attention needs the sink logits")
        return sink_weights(s, state.to(s.dtype).view(1, -1, 1, 1))

    def sdpa(q, k, v, scale, opts, state):
        return LseRescaledFlash.apply(q, k, v, state, scale)

    def flex(q, k, v, scale, softcap, opts, state):
        out, lse = causal_flex(q, k, v, score_mod(None, softcap), scale)
        return out, lse, torch.sigmoid(lse - state.to(lse.dtype).view(1, -1, 1))

    def modules(dim, n_heads, head_dim, opts):
        return {"sink": HeadParam(n_heads, opts.options.attention_sink_init)}

    return VariantForms(weights=weights, sdpa=sdpa, sdpa_devices=("cpu",), flex=flex, modules=modules,
                        state=lambda att: att.sink.logits())


register_variant(AttentionVariant("sink_logit", "learned per-head sink logit", _forms, options=SinkLogitOptions,
                                  params=(VariantParam("sink", "sharded_params", param_class="sink"),), with_sink=True))
