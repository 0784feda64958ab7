"""A toy attention variant as one plug-in file: softmax at a learned per-head inverse temperature,
``A_ij = softmax_j(g_h s_ij)``, ``g_h`` initialised to ``1 / model.attention_toy_temperature``.

Load it with ``job.plugins = ["tests/plugins/toy_attention.py"]`` and select it with
``model.attention = "toy_temperature"``."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.attention_variants import (AttentionError, AttentionVariant, VariantForms, VariantParam,
                                                     register_variant)
from outlier_titan.options import opt


@dataclass
class ToyOptions:
    attention_toy_temperature: float = opt(2.0, "toy_temperature: initial temperature of every head.")


def _check(args) -> None:
    if not args.attention_toy_temperature > 0:
        raise AttentionError(f"model.attention_toy_temperature must be > 0, got {args.attention_toy_temperature}")


def _forms() -> VariantForms:
    import torch

    from outlier_titan.models.attention import HeadParam
    from outlier_titan.models.attention_flex import causal_flex

    def weights(s, visible, first, t, opts, state):
        scaled = s.masked_fill(~visible, 0.0) * state.to(s.dtype).view(1, -1, 1, 1)  # -inf * g: no gradient for g
        return torch.softmax(scaled.masked_fill(~visible, float("-inf")), -1)

    def flex(q, k, v, scale, softcap, opts, state):
        def mod(score, b, h, q_idx, kv_idx):
            return (softcap * torch.tanh(score / softcap) if softcap else score) * state[h]
        return causal_flex(q, k, v, mod, scale)[0]

    def modules(dim, n_heads, head_dim, opts):
        return {"toy_scale": HeadParam(n_heads, 1.0 / opts.options.attention_toy_temperature)}

    return VariantForms(weights=weights, flex=flex, modules=modules, state=lambda att: att.toy_scale.logits())


register_variant(AttentionVariant("toy_temperature", "softmax at a learned temperature (toy plug-in)", _forms,
                                  options=ToyOptions, validate=_check,
                                  params=(VariantParam("toy_scale", "sharded_params", param_class="gain"),)))
