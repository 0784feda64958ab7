"""Causal attention of any registered variant (:mod:`outlier_titan.models.attention_variants`, one module each).

Every variant maps causal logits ``s_ij = scale * q_i . k_j`` (j <= i; ``scale = 1/sqrt(d_h)``) to weights
``A_ij`` and returns ``sum_j A_ij v_j``. Rows need not sum to 1; the weights the probe sees are these ``A_ij`` (the
ones that multiply the values).

How a forward runs (``model.attention_impl``, :func:`attention_path`): a variant with an SDPA form runs on SDPA (no
soft-cap; :mod:`outlier_titan.models.attention_sdpa`); on a GPU the others run on FlexAttention, a score
modification plus the returned log-sum-exp (:mod:`outlier_titan.models.attention_flex`); elsewhere they run
*chunked*: query blocks of ``CHUNK_ROWS`` rows, each against its causal prefix of keys, recomputed in the
backward, so no [T, T] tensor is ever held. The explicit [B, H, T, T] weights (float32; float64 for float64
inputs) are only computed for the outlier probe (which reads them) and when asked for (``explicit``: the tests'
oracle). Logit soft-capping (``op``'s ``logit_softcap``) is applied to ``s`` before any variant; a variant's own
learned logits are not capped.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from outlier_titan.models import attention_flex
from outlier_titan.models.attention_variants.registry import (AttentionChoice, AttentionError,
                                                              AttentionOptions, get_variant, option_groups,
                                                              used_variants, validate_options, variants)
from outlier_titan.options import ATTENTION_IMPLS, owner_defaults
from outlier_titan.tensors import local

AttentionArgs = dataclasses.make_dataclass("AttentionArgs", owner_defaults(option_groups()), bases=(AttentionChoice,))
AttentionArgs.__module__ = __name__
AttentionArgs.__doc__ = """The attention options of a model spec's args (mixed into ``PreLNArgs`` / ``OPArgs``): the
variant (``attention``, ``attention_layers``) and every registered variant's options with the variant's defaults."""


def resolve_variant(args) -> None:
    """Reconciles ``attention`` and its old spelling ``softmax`` on a spec's args (after both are set)."""
    old, new = getattr(args, "softmax", None), args.attention
    if old is not None and new is not None and old != new and old != "softmax":
        raise AttentionError(f"model.softmax = {old!r} and model.attention = {new!r} disagree; set only "
                             f"model.attention (model.softmax is its old spelling)")
    args.attention = new if new is not None else (old or "softmax")


def validate_attention_args(args, spec: str, unsupported: tuple[str, ...] = (), why: str = "") -> None:
    """One-line errors for an unknown variant, one the spec does not support, or a bad option value."""
    names = tuple(v.name for v in variants())
    for v in used_variants(args):
        get_variant(v)
        if v in unsupported:
            raise AttentionError(f"model.attention = {v!r} is not supported by model spec '{spec}' ({why}); "
                                 f"choose one of {', '.join(x for x in names if x not in unsupported)}")
    if args.attention_impl not in ATTENTION_IMPLS:
        raise AttentionError(f"model.attention_impl = {args.attention_impl!r}: choose one of "
                             f"{', '.join(ATTENTION_IMPLS)}")
    validate_options(args)


def input_reading_variants() -> tuple[str, ...]:
    """The variants with a module that reads the block's normalised attention input."""
    return tuple(v.name for v in variants() if v.reads_input)


class HeadParam(nn.Module):
    """One learned value per (query) head, ``weight`` [H] laid out like the heads (TP placement
    ``sharded_params``), initialised to a constant."""

    def __init__(self, n_heads: int, init: float):
        super().__init__()
        self.init_value = init
        self.weight = nn.Parameter(torch.empty(n_heads))

    def logits(self) -> torch.Tensor:
        return local(self.weight)

    def init_weights(self, init) -> None:
        init.constant(self.weight, self.init_value)


# ----------------------------------------------------------------------------------------------------------
# explicit weights


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def causal_logits(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float = 0.0,
                  first: int = 0) -> torch.Tensor:
    """``scale * q k^T`` [B, H, T_q, T_k] in the compute dtype, soft-capped if asked, -inf where a key is not
    visible; ``q`` holds the queries at positions ``first, first + 1, ...``, ``k`` the keys from position 0."""
    dt = _compute_dtype(q)
    s = attention_flex.capped((q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale, softcap)
    return s.masked_fill(~_visible(q.shape[-2], k.shape[-2], first, s.device), float("-inf"))


def _visible(n_queries: int, n_keys: int, first: int, device) -> torch.Tensor:
    """[T_q, T_k] bool: key j is visible to the query at position ``first + i`` (j <= first + i)."""
    rows = torch.arange(first, first + n_queries, device=device).view(-1, 1)
    return torch.arange(n_keys, device=device) <= rows


def attention_weights(q: torch.Tensor, k: torch.Tensor, opts: AttentionOptions, scale: float, state=None,
                      softcap: float = 0.0, first: int = 0, seq_len: int | None = None) -> torch.Tensor:
    """The weights ``A`` [B, H, T_q, T_k] of ``opts.variant`` (zero where a key is not visible) for the queries at
    positions ``first, ...`` of a sequence of ``seq_len`` tokens (default: the queries are the whole sequence);
    ``state``: the variant's state (e.g. its learned logits)."""
    s = causal_logits(q, k, scale, softcap, first)
    n_q, n_k = s.shape[-2:]
    t = first + n_q if seq_len is None else seq_len
    weights = get_variant(opts.variant).torch_forms().weights
    return weights(s, _visible(n_q, n_k, first, s.device), first, t, opts, state)


@torch.no_grad()
def max_logits(q: torch.Tensor, k: torch.Tensor, scale: float, rows: int | None = None) -> torch.Tensor:
    """MaxLogit per sequence and head [B, H]: ``max_{j <= i} scale * q_i . k_j`` over the causal pairs, before any
    soft-cap or variant (Kimi Team 2025, arXiv 2507.20534); ``k`` repeated to q's heads. One block of ``rows``
    (default ``CHUNK_ROWS``) queries at a time, so no [T, T] tensor is held; no gradient."""
    t, rows = q.shape[-2], rows or CHUNK_ROWS
    out = None
    for first in range(0, t, rows):
        last = min(t, first + rows)
        block = causal_logits(q[:, :, first:last], k[:, :, :last], scale, first=first).amax((-2, -1))
        out = block if out is None else torch.maximum(out, block)
    return out


# ----------------------------------------------------------------------------------------------------------
# the attention call

CHUNK_ROWS = 128
"""Queries per block of the chunked path: its transient logits are [B, H, CHUNK_ROWS, T], linear in T."""


def attention_path(variant: str, impl: str, device: torch.device, softcap: float = 0.0) -> str:
    """Where a training forward of ``variant`` runs: ``sdpa``, ``flex``, ``chunked`` or ``explicit``."""
    if impl in ("explicit", "chunked"):
        return impl
    forms = get_variant(variant).torch_forms()
    on_sdpa = forms.sdpa is not None and (forms.sdpa_devices is None or device.type in forms.sdpa_devices)
    if not softcap and on_sdpa:  # SDPA takes no soft-cap
        return "sdpa"
    return "flex" if impl == "fused" or device.type == "cuda" else "chunked"


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions, scale: float,
                       state=None, softcap: float = 0.0, first: int = 0, seq_len: int | None = None,
                       prob_hook=None) -> torch.Tensor:
    """``A v`` for the queries at positions ``first, ...`` with the explicit weights ``A`` (handed to
    ``prob_hook`` if given); ``k``, ``v``: the keys and values they see."""
    p = attention_weights(q, k, opts, scale, state=state, softcap=softcap, first=first, seq_len=seq_len)
    if prob_hook is not None:
        prob_hook(p.detach())
    return (p @ v.to(p.dtype)).to(q.dtype)


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions, scale: float,
                      state=None, softcap: float = 0.0, rows: int | None = None) -> torch.Tensor:
    """The explicit formula one block of ``rows`` (default ``CHUNK_ROWS``) queries at a time, each block against its
    causal prefix of keys and recomputed in the backward (only q, k, v and the output are kept): exact, memory
    linear in T."""
    t, rows = q.shape[-2], rows or CHUNK_ROWS
    keep = torch.is_grad_enabled()
    blocks = []
    for first in range(0, t, rows):
        last = min(t, first + rows)
        block = (q[:, :, first:last], k[:, :, :last], v[:, :, :last], opts, scale, state, softcap, first, t)
        blocks.append(checkpoint(explicit_attention, *block, use_reentrant=False, preserve_rng_state=False)
                      if keep else explicit_attention(*block))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions, scale: float,
                  state=None, softcap: float = 0.0, prob_hook=None) -> torch.Tensor:
    """Causal attention of ``opts.variant`` over [B, H, T, d_h] (k, v already repeated to H heads) on the path of
    :func:`attention_path`; with a probe hook, the explicit weights (handed to the hook)."""
    path = "explicit" if prob_hook is not None else attention_path(opts.variant, opts.impl, q.device, softcap)
    if path == "explicit":
        return explicit_attention(q, k, v, opts, scale, state=state, softcap=softcap, prob_hook=prob_hook)
    if path == "chunked":
        return chunked_attention(q, k, v, opts, scale, state=state, softcap=softcap)
    if path == "flex":
        if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise AttentionError(f"model.attention_impl = {opts.impl}: {opts.variant} runs on FlexAttention, which has "
                                 f"no backward on the CPU in this torch; use auto or chunked there")
        return attention_flex.flex_attention_variant(q, k, v, opts, scale, state=state, softcap=softcap)
    return get_variant(opts.variant).torch_forms().sdpa(q, k, v, scale, opts, state)
