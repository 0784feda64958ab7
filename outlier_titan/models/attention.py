"""Attention variants: softmax and the published attention-sink remedies, one option (``model.attention``).

Every variant maps causal logits ``s_ij = scale * q_i . k_j`` (j <= i; ``scale = 1/sqrt(d_h)``) to weights
``A_ij`` and returns ``sum_j A_ij v_j``. Rows need not sum to 1; the weights the probe sees are these ``A_ij``
(the ones that multiply the values), unnormalised for ``sigmoid``, ``relu`` and ``softpick``.

========================  =========================================================================  ==========
variant                   weights / output                                                           SDPA
========================  =========================================================================  ==========
``softmax``               ``softmax_j(s_ij)``                                                        yes
``softmax1``              ``exp(s_ij) / (1 + sum_j exp(s_ij))`` (Kaul et al. 2024, arXiv 2410.17174;   yes
                          a zero key and zero value prepended, exact)
``sink_logit``            ``exp(s_ij) / (exp(c_h) + sum_j exp(s_ij))``, ``c_h`` a learned logit per     CPU only
                          head with no value (gpt-oss 2025; softmax-1 is ``c_h = 0`` fixed): softmax's
                          output times ``sigmoid(lse - c_h)``
``gated_head``            ``Y_i,h * sigmoid(x_i . w_h)``, one learned scalar gate per head and token    yes
                          on the softmax output ``Y`` before ``wo`` (Qiu et al. 2025, arXiv 2505.06708,
                          position G1; ``x`` the block's normalised attention input)
``gated_elementwise``     ``Y_i,h,c * sigmoid(x_i . w_h,c)``, one gate per head and channel             yes
``softpick``              ``relu(exp(s_ij) - 1) / (sum_j |exp(s_ij) - 1| + eps)`` (Zuhri et al. 2025,   no
                          arXiv 2504.20966), computed with ``m = max(max_j s_ij, 0)`` as
                          ``relu(e^(s-m) - e^-m) / (sum |e^(s-m) - e^-m| + eps e^-m)`` (exact rewrite)
``sigmoid``               ``sigmoid(s_ij + b)``, ``b = -log(T)`` by default (Ramapuram et al. 2024,    no
                          arXiv 2409.04431; T the sequence length of the forward)
``relu``                  ``relu(s_ij) / L_i``; ``L_i = i + 1`` keys seen (``prefix``), ``T``           no
                          (``seq_len``) or 1 (``none``) (Guo et al. 2024, arXiv 2410.13835)
``clipped_softmax``       ``clip((zeta - gamma) softmax_j(s_ij) + gamma, 0, 1)`` on visible keys        no
                          (Bondarenko et al. 2023, arXiv 2306.12929)
========================  =========================================================================  ==========

How a forward runs (``model.attention_impl``, :func:`attention_path`): the variants SDPA expresses exactly run on
SDPA (no soft-cap; :mod:`outlier_titan.models.attention_sdpa`); on a GPU the others run on FlexAttention, a score
modification plus the returned log-sum-exp (:mod:`outlier_titan.models.attention_flex`); elsewhere they run
*chunked*: query blocks of ``CHUNK_ROWS`` rows, each against its causal prefix of keys, recomputed in the
backward, so no [T, T] tensor is ever held. The
explicit [B, H, T, T] weights (float32; float64 for float64 inputs) are only computed for the outlier probe
(which reads them) and when asked for (``explicit``: the tests' oracle). Logit soft-capping (``op``'s
``logit_softcap``) is applied to ``s`` before any variant; a sink logit is not capped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from outlier_titan.models import attention_flex
from outlier_titan.models.attention_sdpa import sdpa_attention
from outlier_titan.models.attention_variants import (ATTENTION_IMPLS, AttentionChoice, AttentionError, layer_variants,
                                                     option_groups, used_variants, validate_options, variants)
from outlier_titan.options import owner_defaults
from outlier_titan.tensors import local

# derived from the registry (outlier_titan.models.attention_variants), where a variant is added
VARIANTS = tuple(v.name for v in variants())
SDPA = tuple(v.name for v in variants() if v.sdpa)
GATED = tuple(v.name for v in variants() if v.gated)
WITH_SINK = tuple(v.name for v in variants() if v.with_sink)  # rows sum to < 1: the rest is the sink's share

AttentionArgs = dataclasses.make_dataclass("AttentionArgs", owner_defaults(option_groups()), bases=(AttentionChoice,))
AttentionArgs.__module__ = __name__
AttentionArgs.__doc__ = """The attention options of a model spec's args (mixed into ``PreLNArgs`` / ``OPArgs``): the
variant (``attention``, ``attention_layers``) and every registered variant's options with the variant's defaults."""


@dataclass(frozen=True)
class AttentionOptions:
    """One block's attention variant and its options."""

    variant: str = "softmax"
    sink_init: float = 0.0
    softpick_eps: float = 1e-6
    sigmoid_bias: float | None = None
    relu_norm: str = "prefix"
    clip_zeta: float = 1.0
    clip_gamma: float = -0.03
    impl: str = "auto"


def resolve_variant(args) -> None:
    """Reconciles ``attention`` and its old spelling ``softmax`` on a spec's args (after both are set);
    afterwards ``softmax`` names the first variant in use other than softmax, if any."""
    old, new = getattr(args, "softmax", None), args.attention
    if old is not None and new is not None and old != new and old != "softmax":
        raise AttentionError(f"model.softmax = {old!r} and model.attention = {new!r} disagree; set only "
                             f"model.attention (model.softmax is its old spelling)")
    args.attention = new if new is not None else (old or "softmax")
    # ``softmax`` stays "softmax" only when every block runs plain softmax (the HF export checks it)
    used = [args.attention] + layer_variants(args.attention_layers)
    args.softmax = next((v for v in used if v != "softmax"), "softmax")


def validate_attention_args(args, spec: str, unsupported: tuple[str, ...] = (), why: str = "") -> None:
    """One-line errors for an unknown variant, one the spec does not support, or a bad option value."""
    names = used_variants(args)
    for v in names:
        if v not in VARIANTS:
            raise AttentionError(f"model.attention = {v!r} is not a variant; choose one of {', '.join(VARIANTS)}")
        if v in unsupported:
            raise AttentionError(f"model.attention = {v!r} is not supported by model spec '{spec}' ({why}); "
                                 f"choose one of {', '.join(x for x in VARIANTS if x not in unsupported)}")
    if args.attention_impl not in ATTENTION_IMPLS:
        raise AttentionError(f"model.attention_impl = {args.attention_impl!r}: choose one of "
                             f"{', '.join(ATTENTION_IMPLS)}")
    validate_options(args)


def block_options(args, layer_id: int) -> AttentionOptions:
    """Block ``layer_id``'s options: ``attention_layers`` (cycled over the blocks) overrides ``attention``."""
    per_layer = layer_variants(args.attention_layers)
    variant = per_layer[layer_id % len(per_layer)] if per_layer else args.attention
    return AttentionOptions(variant=variant, sink_init=args.attention_sink_init,
                            softpick_eps=args.attention_softpick_eps, sigmoid_bias=args.attention_sigmoid_bias,
                            relu_norm=args.attention_relu_norm, clip_zeta=args.attention_clip_zeta,
                            clip_gamma=args.attention_clip_gamma, impl=args.attention_impl)


class SinkLogit(nn.Module):
    """One learned logit per (query) head, ``weight`` [H] laid out like the heads (TP: ``ShardedParams``).
    Its optimizer class is ``sink`` (see ``optimizer.no_decay``)."""

    param_class = "sink"

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
    s = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    return s.masked_fill(~_visible(q.shape[-2], k.shape[-2], first, s.device), float("-inf"))


def _visible(n_queries: int, n_keys: int, first: int, device) -> torch.Tensor:
    """[T_q, T_k] bool: key j is visible to the query at position ``first + i`` (j <= first + i)."""
    rows = torch.arange(first, first + n_queries, device=device).view(-1, 1)
    return torch.arange(n_keys, device=device) <= rows


def attention_weights(q: torch.Tensor, k: torch.Tensor, opts: AttentionOptions, scale: float,
                      sink: torch.Tensor | None = None, softcap: float = 0.0, first: int = 0,
                      seq_len: int | None = None) -> torch.Tensor:
    """The weights ``A`` [B, H, T_q, T_k] of ``opts.variant`` (zero where a key is not visible) for the queries at
    positions ``first, ...`` of a sequence of ``seq_len`` tokens (default: the queries are the whole sequence);
    ``sink``: the per-head logits [H] of ``sink_logit``."""
    s = causal_logits(q, k, scale, softcap, first)
    n_q, n_k = s.shape[-2:]
    t = first + n_q if seq_len is None else seq_len
    visible = _visible(n_q, n_k, first, s.device)
    v = opts.variant
    if v in ("softmax",) + GATED:
        return torch.softmax(s, dim=-1)
    if v in WITH_SINK:
        if v == "sink_logit":
            if sink is None:
                raise ValueError("sink_logit attention needs the sink logits")
            c = sink.to(s.dtype).view(1, -1, 1, 1)
        else:
            c = torch.zeros((), dtype=s.dtype, device=s.device)
        m = torch.maximum(s.amax(-1, keepdim=True), c)  # the sink takes part in the running max
        e = torch.exp(s - m)
        return e / (torch.exp(c - m) + e.sum(-1, keepdim=True))
    if v == "softpick":
        m = s.amax(-1, keepdim=True).clamp_min(0.0)
        a = (torch.exp(s - m) - torch.exp(-m)).masked_fill(~visible, 0.0)
        return F.relu(a) / (a.abs().sum(-1, keepdim=True) + opts.softpick_eps * torch.exp(-m))
    if v == "sigmoid":
        b = -math.log(t) if opts.sigmoid_bias is None else opts.sigmoid_bias
        return torch.sigmoid(s + b).masked_fill(~visible, 0.0)
    if v == "relu":
        a = F.relu(s.masked_fill(~visible, 0.0))
        if opts.relu_norm == "prefix":
            return a / torch.arange(first + 1, first + n_q + 1, dtype=s.dtype, device=s.device).view(-1, 1)
        if opts.relu_norm == "seq_len":
            return a / t
        return a
    if v == "clipped_softmax":
        p = (opts.clip_zeta - opts.clip_gamma) * torch.softmax(s, dim=-1) + opts.clip_gamma
        return p.clamp(0.0, 1.0).masked_fill(~visible, 0.0)
    raise ValueError(f"unknown attention variant {v!r}")


# ----------------------------------------------------------------------------------------------------------
# the attention call

CHUNK_ROWS = 128
"""Queries per block of the chunked path: its transient logits are [B, H, CHUNK_ROWS, T], linear in T."""


def attention_path(variant: str, impl: str, device: torch.device, softcap: float = 0.0) -> str:
    """Where a training forward of ``variant`` runs: ``sdpa``, ``flex``, ``chunked`` or ``explicit``."""
    if impl in ("explicit", "chunked"):
        return impl
    # SDPA takes no soft-cap; the sink logit runs on it on the CPU (its flash kernel's lse, rescaled)
    if not softcap and (variant in SDPA or (variant == "sink_logit" and device.type == "cpu")):
        return "sdpa"
    return "flex" if impl == "fused" or device.type == "cuda" else "chunked"


def explicit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions, scale: float,
                       sink: torch.Tensor | None = None, softcap: float = 0.0, first: int = 0,
                       seq_len: int | None = None, prob_hook=None) -> torch.Tensor:
    """``A v`` for the queries at positions ``first, ...`` with the explicit weights ``A`` (handed to
    ``prob_hook`` if given); ``k``, ``v``: the keys and values they see."""
    p = attention_weights(q, k, opts, scale, sink=sink, softcap=softcap, first=first, seq_len=seq_len)
    if prob_hook is not None:
        prob_hook(p.detach())
    return (p @ v.to(p.dtype)).to(q.dtype)


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions, scale: float,
                      sink: torch.Tensor | None = None, softcap: float = 0.0, rows: int | None = None) -> torch.Tensor:
    """The explicit formula one block of ``rows`` (default ``CHUNK_ROWS``) queries at a time, each block against its
    causal prefix of keys and recomputed in the backward (only q, k, v and the output are kept): exact, memory
    linear in T."""
    t, rows = q.shape[-2], rows or CHUNK_ROWS
    keep = torch.is_grad_enabled()
    blocks = []
    for first in range(0, t, rows):
        last = min(t, first + rows)
        block = (q[:, :, first:last], k[:, :, :last], v[:, :, :last], opts, scale, sink, softcap, first, t)
        blocks.append(checkpoint(explicit_attention, *block, use_reentrant=False, preserve_rng_state=False)
                      if keep else explicit_attention(*block))
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, dim=2)


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions, scale: float,
                  sink: torch.Tensor | None = None, softcap: float = 0.0, prob_hook=None) -> torch.Tensor:
    """Causal attention of ``opts.variant`` over [B, H, T, d_h] (k, v already repeated to H heads) on the path of
    :func:`attention_path`; with a probe hook, the explicit weights (handed to the hook)."""
    path = "explicit" if prob_hook is not None else attention_path(opts.variant, opts.impl, q.device, softcap)
    if path == "explicit":
        return explicit_attention(q, k, v, opts, scale, sink=sink, softcap=softcap, prob_hook=prob_hook)
    if path == "chunked":
        return chunked_attention(q, k, v, opts, scale, sink=sink, softcap=softcap)
    if path == "flex":
        if q.device.type == "cpu" and torch.is_grad_enabled() and q.requires_grad:
            raise AttentionError(f"model.attention_impl = {opts.impl}: {opts.variant} runs on FlexAttention, which has "
                                 f"no backward on the CPU in this torch; use auto or chunked there")
        return attention_flex.flex_attention_variant(q, k, v, opts, scale, sink=sink, softcap=softcap)
    return sdpa_attention(q, k, v, opts.variant, scale, sink=sink)


def apply_gate(out: torch.Tensor, gate_logits: torch.Tensor, variant: str) -> torch.Tensor:
    """``out`` [B, H, T, d_h] times ``sigmoid(gate_logits)``, gate logits [B, T, H] (head) or [B, T, H*d_h]."""
    b, h, t, d = out.shape
    g = torch.sigmoid(gate_logits.float() if gate_logits.dtype in (torch.bfloat16, torch.float16) else gate_logits)
    if variant == "gated_head":
        g = g.view(b, t, h, 1)
    else:
        g = g.view(b, t, h, d)
    return out * g.transpose(1, 2).to(out.dtype)
