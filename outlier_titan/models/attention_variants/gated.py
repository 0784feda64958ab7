"""``gated_head`` / ``gated_elementwise``: softmax's output ``Y`` times ``sigmoid(x_i . w_h)``, one learned gate
per head and token (``_head``) or per head and channel (``_elementwise``), before ``wo`` (Qiu et al. 2025, arXiv
2505.06708, position G1; ``x`` the block's normalised attention input). The gate is module ``wg`` (a linear map of
``x``, no bias): it reads the normalised input, so it is column-sharded under TP and QuaRot rotates it with ``wq``."""

from __future__ import annotations

import dataclasses

from outlier_titan.models.attention_variants.registry import (AttentionVariant, VariantForms, VariantParam,
                                                              get_variant, register_variant)


def _gated(per_channel: bool):
    def forms() -> VariantForms:
        import torch
        import torch.nn as nn

        def modules(dim, n_heads, head_dim, opts):
            return {"wg": nn.Linear(dim, n_heads * (head_dim if per_channel else 1), bias=False)}

        def output(att, out, x):
            """``out`` [B, H, T, d_h] times ``sigmoid`` of the gate logits [B, T, H] or [B, T, H * d_h]."""
            b, h, t, d = out.shape
            logits = att.wg(x)
            g = torch.sigmoid(logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits)
            g = g.view(b, t, h, d if per_channel else 1)
            return out * g.transpose(1, 2).to(out.dtype)

        return dataclasses.replace(get_variant("softmax").torch_forms(), modules=modules, output=output)

    return forms


_GATE = (VariantParam("wg", "colwise", reads_input=True),)
register_variant(AttentionVariant("gated_head", "sigmoid output gate per head", _gated(False), params=_GATE))
register_variant(AttentionVariant("gated_elementwise", "sigmoid output gate per channel", _gated(True), params=_GATE))
