"""MaxLogit (Kimi Team 2025, Kimi K2, arXiv 2507.20534, section 2.1): per attention head, the largest pre-softmax
logit ``S_max^h = max_{X in batch} max_{j <= i} scale * q_i^h . k_j^h`` over the probe batch's causal pairs (before
any soft-cap; keys repeated to the query heads under GQA). The probe logs the layer's largest head,
``outliers/layer_<i>/max_logit``, and the model's largest over its layers, ``outliers/max_logit`` (a maximum, not a
mean over layers). Maxima combine by max over batches, data-parallel ranks and tensor-parallel ranks (each of
which holds some of the heads), so every layout gives the same value. QK-Clip
(``outlier_titan.remedies.qk_clip``) bounds it during training."""

from __future__ import annotations

from outlier_titan.observe.metrics import F64, register_metric


def _sums(lg):
    return {"max_head_logit": lg.m.amax(0).to(F64)}  # [H_local]: this rank's heads


def _finalize(s):
    m = s["max_head_logit"]
    return {"max_logit": float(m.max())} if m.numel() and bool((m > float("-inf")).all()) else {}


MAX_LOGIT = register_metric("max_logit", "max_logit", "logits", _sums, _finalize,
                            label="MaxLogit, the largest pre-softmax attention logit (Kimi Team 2025)",
                            shown={k: ("max_logit",) for k in ("report", "collect", "plot", "profile")},
                            across_layers="max")
