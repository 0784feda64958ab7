"""The attention variants on FlexAttention: a score modification of the causal logits ``s`` (after the soft-cap)
plus the log-sum-exp ``lse`` the kernel returns, exact (the weights of :mod:`outlier_titan.models.attention`).

FlexAttention with the modification ``f`` returns ``out_i = sum_j e^f(s_ij) v_j / sum_j e^f(s_ij)`` and
``lse_i = log sum_j e^f(s_ij)``; a variant whose weights are ``w(s)`` uses ``f = log w`` and ``out * exp(lse)``,
and a normaliser that is itself a sum takes a second pass for its own ``lse``. Each variant's module holds its
``f`` and output factor (its ``flex`` form); this module holds the kernel call and the pieces they share.

A row with no positive weight has ``lse = -inf`` and output 0. On a GPU the kernel is compiled (fused, tiled: no
[T, T] tensor) and differentiable through ``lse``; on the CPU this torch runs FlexAttention eagerly and in forward
only (no backward), so the CPU trains on the chunked path instead and the tests check these identities in forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from outlier_titan.models.attention_variants.registry import get_variant

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


def log_positive(x: torch.Tensor) -> torch.Tensor:
    """``log x`` where ``x > 0``, ``-inf`` elsewhere (with finite gradients on both sides)."""
    return torch.where(x > 0, torch.log(torch.where(x > 0, x, 1.0)), NEG_INF)


def log_abs_expm1(s: torch.Tensor) -> torch.Tensor:
    """``log |e^s - 1|`` without overflow: ``relu(s) + log(1 - e^-|s|)``; ``-inf`` at ``s = 0``."""
    safe = torch.where(s != 0, s, 1.0)
    return torch.where(s != 0, F.relu(safe) + torch.log(-torch.expm1(-safe.abs())), NEG_INF)


def capped(score: torch.Tensor, softcap: float) -> torch.Tensor:
    """The soft-capped logit ``c tanh(s / c)`` (``s`` itself without a cap)."""
    return softcap * torch.tanh(score / softcap) if softcap else score


def _identity(s):
    return s


@functools.lru_cache(maxsize=64)
def score_mod(f=None, softcap: float = 0.0):
    """The score modification ``f(capped logit)``, built once per (``f``, cap) so that compiled FlexAttention sees
    the same function every step (``f`` must be a lasting object); None (plain logits) without ``f`` or cap."""
    if f is None and not softcap:
        return None
    f = f or _identity
    return lambda score, b, h, q_idx, kv_idx: f(capped(score, softcap))


def flex_attention_variant(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts, scale: float, state=None,
                           softcap: float = 0.0) -> torch.Tensor:
    """Causal attention of ``opts.variant`` (an ``AttentionOptions``) over [B, H, T, d_h] (k, v with H heads) by
    its ``flex`` form; ``state``: the variant's state (e.g. its learned logits)."""
    form = get_variant(opts.variant).torch_forms().flex
    if form is None:
        return causal_flex(q, k, v, score_mod(None, softcap), scale)[0]
    result = form(q, k, v, scale, softcap, opts, state)
    if torch.is_tensor(result):
        return result
    out, lse, factor = result
    factor = torch.where(torch.isneginf(lse), 0.0, factor)  # rows with no positive weight
    out = torch.where(torch.isneginf(lse).unsqueeze(-1), 0.0, out.to(factor.dtype))
    return (out * factor.unsqueeze(-1)).to(q.dtype)
