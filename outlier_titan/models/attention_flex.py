"""The attention variants on FlexAttention: a score modification of the causal logits ``s`` (after the soft-cap)
plus the log-sum-exp ``lse`` the kernel returns, exact (the weights of :mod:`outlier_titan.models.attention`).

FlexAttention with the modification ``f`` returns ``out_i = sum_j e^f(s_ij) v_j / sum_j e^f(s_ij)`` and
``lse_i = log sum_j e^f(s_ij)``; a variant whose weights are ``w(s)`` uses ``f = log w`` and ``out * exp(lse)``,
and a normaliser that is itself a sum takes a second pass for its own ``lse``:

====================  ==========================================================  ====================================
variant               score modification ``f``                                    output
====================  ==========================================================  ====================================
softmax, the gates    none                                                        ``out``
softmax1              none                                                        ``out * sigmoid(lse)``
sink_logit            none                                                        ``out * sigmoid(lse - c_h)``
sigmoid               ``log sigmoid(s + b)``                                      ``out * exp(lse)``
relu                  ``log relu(s)``                                             ``out * exp(lse) / L_i``
softpick              ``log relu(e^s - 1)``; second pass ``log |e^s - 1|``        ``out * exp(lse - lse2) /
                      (its ``lse2``)                                              (1 + eps exp(-lse2))``
clipped_softmax       first pass: softmax's ``lse0``; then                        ``out * exp(lse)``
                      ``log clip((zeta - gamma) e^(s - lse0) + gamma, 0, 1)``
====================  ==========================================================  ====================================

A row with no positive weight (relu, softpick) has ``lse = -inf`` and output 0. On a GPU the kernel is compiled
(fused, tiled: no [T, T] tensor) and differentiable through ``lse``; on the CPU this torch runs FlexAttention
eagerly and in forward only (no backward), so the CPU trains on the chunked path instead and the tests check these
identities in forward.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

NEG_INF = float("-inf")


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


@torch.compiler.disable
@functools.lru_cache(maxsize=8)
def _causal_mask(t: int, device: torch.device):
    return create_block_mask(_causal, None, None, t, t, device=device)


@functools.cache
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def causal_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, score_mod, scale: float):
    """(out, lse) of causal FlexAttention over [B, H, T, d_h]: the compiled kernel on a GPU, eager elsewhere."""
    run = _compiled_flex() if q.is_cuda else flex_attention
    out, aux = run(q, k, v, score_mod=score_mod, block_mask=_causal_mask(q.shape[-2], q.device), scale=scale,
                   return_aux=AuxRequest(lse=True))
    return out, aux.lse


def _log_positive(x: torch.Tensor) -> torch.Tensor:
    """``log x`` where ``x > 0``, ``-inf`` elsewhere (with finite gradients on both sides)."""
    return torch.where(x > 0, torch.log(torch.where(x > 0, x, 1.0)), NEG_INF)


def _log_abs_expm1(s: torch.Tensor) -> torch.Tensor:
    """``log |e^s - 1|`` without overflow: ``relu(s) + log(1 - e^-|s|)``; ``-inf`` at ``s = 0``."""
    safe = torch.where(s != 0, s, 1.0)
    return torch.where(s != 0, F.relu(safe) + torch.log(-torch.expm1(-safe.abs())), NEG_INF)


@functools.lru_cache(maxsize=64)
def _score_mod(kind: str, softcap: float = 0.0, bias: float = 0.0):
    """The score modification ``kind`` of the soft-capped logit, built once per setting (compiled FlexAttention then
    sees the same function every step): ``plain`` (None without a cap), ``log_sigmoid`` (``log sigmoid(s + bias)``),
    ``log_relu``, ``log_relu_expm1`` (``log relu(e^s - 1)``) or ``log_abs_expm1``."""
    if kind == "plain" and not softcap:
        return None
    f = {"plain": lambda s: s, "log_sigmoid": lambda s: F.logsigmoid(s + bias), "log_relu": _log_positive,
         "log_relu_expm1": lambda s: torch.where(s > 0, _log_abs_expm1(s), NEG_INF),
         "log_abs_expm1": _log_abs_expm1}[kind]
    if softcap:
        return lambda score, b, h, q_idx, kv_idx: f(softcap * torch.tanh(score / softcap))
    return lambda score, b, h, q_idx, kv_idx: f(score)


def flex_attention_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts, scale: float,
                           sink: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of ``opts.variant`` (an ``AttentionOptions``) over [B, H, T, d_h] (k, v with H heads) by
    the identities above; ``sink``: the per-head logits [H] of ``sink_logit``."""
    t = q.shape[-2]
    variant = opts.variant
    if variant == "sigmoid":
        bias = -math.log(t) if opts.sigmoid_bias is None else opts.sigmoid_bias
        out, lse = causal_flex(q, k, v, _score_mod("log_sigmoid", softcap, bias), scale)
        factor = torch.exp(lse)
    elif variant == "relu":
        out, lse = causal_flex(q, k, v, _score_mod("log_relu", softcap), scale)
        keys = {"prefix": torch.arange(1, t + 1, dtype=lse.dtype, device=lse.device), "seq_len": t, "none": 1}
        factor = torch.exp(lse) / keys[opts.relu_norm]
    elif variant == "softpick":
        out, lse = causal_flex(q, k, v, _score_mod("log_relu_expm1", softcap), scale)
        _, lse2 = causal_flex(q, k, v, _score_mod("log_abs_expm1", softcap), scale)
        factor = torch.exp(lse - lse2) / (1.0 + opts.softpick_eps * torch.exp(-lse2))
    elif variant == "clipped_softmax":
        _, lse0 = causal_flex(q, k, v, _score_mod("plain", softcap), scale)
        zeta, gamma = opts.clip_zeta, opts.clip_gamma

        def clipped(score, b, h, q_idx, kv_idx):  # captures this forward's lse0 (its gradient flows through it)
            s = softcap * torch.tanh(score / softcap) if softcap else score
            w = (zeta - gamma) * torch.exp(s - lse0[b, h, q_idx]) + gamma
            return _log_positive(torch.clamp(w, max=1.0))

        out, lse = causal_flex(q, k, v, clipped, scale)
        factor = torch.exp(lse)
    else:
        out, lse = causal_flex(q, k, v, _score_mod("plain", softcap), scale)
        if variant in ("softmax1", "sink_logit"):
            c = 0.0 if variant == "softmax1" else sink.to(lse.dtype).view(1, -1, 1)
            factor = torch.sigmoid(lse - c)
        else:
            return out
    factor = torch.where(torch.isneginf(lse), 0.0, factor)  # rows with no positive weight
    out = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, out.to(factor.dtype))
    return (out * factor.unsqueeze(-1)).to(q.dtype)
