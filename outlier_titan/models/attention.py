"""Attention variants: softmax and the published attention-sink remedies, one option (``model.attention``).

Every variant maps causal logits ``s_ij = scale * q_i . k_j`` (j <= i; ``scale = 1/sqrt(d_h)``) to weights
``A_ij`` and returns ``sum_j A_ij v_j``. Rows need not sum to 1; the weights the probe sees are these ``A_ij``
(the ones that multiply the values), unnormalised for ``sigmoid``, ``relu`` and ``softpick``.

========================  =========================================================================  ==========
variant                   weights / output                                                           backend
========================  =========================================================================  ==========
``softmax``               ``softmax_j(s_ij)``                                                        fused SDPA
``softmax1``              ``exp(s_ij) / (1 + sum_j exp(s_ij))`` (Kaul et al. 2024, arXiv 2410.17174;   fused SDPA
                          a zero key and zero value prepended, exact)
``sink_logit``            ``exp(s_ij) / (exp(c_h) + sum_j exp(s_ij))``, ``c_h`` a learned logit per     fused SDPA
                          head with no value (gpt-oss 2025; softmax-1 is ``c_h = 0`` fixed): an extra
                          zero key / zero value whose score is set by an additive float mask, exact
``gated_head``            ``Y_i,h * sigmoid(x_i . w_h)``, one learned scalar gate per head and token    fused SDPA
                          on the softmax output ``Y`` before ``wo`` (Qiu et al. 2025, arXiv 2505.06708,
                          position G1; ``x`` the block's normalised attention input)
``gated_elementwise``     ``Y_i,h,c * sigmoid(x_i . w_h,c)``, one gate per head and channel             fused SDPA
``softpick``              ``relu(exp(s_ij) - 1) / (sum_j |exp(s_ij) - 1| + eps)`` (Zuhri et al. 2025,   explicit
                          arXiv 2504.20966), computed with ``m = max(max_j s_ij, 0)`` as
                          ``relu(e^(s-m) - e^-m) / (sum |e^(s-m) - e^-m| + eps e^-m)`` (exact rewrite)
``sigmoid``               ``sigmoid(s_ij + b)``, ``b = -log(T)`` by default (Ramapuram et al. 2024,    explicit
                          arXiv 2409.04431; T the sequence length of the forward)
``relu``                  ``relu(s_ij) / L_i``; ``L_i = i + 1`` keys seen (``prefix``), ``T``           explicit
                          (``seq_len``) or 1 (``none``) (Guo et al. 2024, arXiv 2410.13835)
``clipped_softmax``       ``clip((zeta - gamma) softmax_j(s_ij) + gamma, 0, 1)`` on visible keys        explicit
                          (Bondarenko et al. 2023, arXiv 2306.12929)
========================  =========================================================================  ==========

"explicit" means the [B, H, T, T] weights are materialised in float32 (float64 for float64 inputs); the
fused variants fall back to the same explicit formula only when the outlier probe asks for the weights.
Logit soft-capping (``op``'s ``logit_softcap``) is applied to ``s`` before any variant; a sink logit is not
capped.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from outlier_titan.models.attention_variants import (AttentionChoice, AttentionError, layer_variants,
                                                     option_groups, used_variants, validate_options, variants)
from outlier_titan.options import owner_defaults

# derived from the registry (outlier_titan.models.attention_variants), where a variant is added
VARIANTS = tuple(v.name for v in variants())
FUSED = tuple(v.name for v in variants() if v.fused)
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
    validate_options(args)


def block_options(args, layer_id: int) -> AttentionOptions:
    """Block ``layer_id``'s options: ``attention_layers`` (cycled over the blocks) overrides ``attention``."""
    per_layer = layer_variants(args.attention_layers)
    variant = per_layer[layer_id % len(per_layer)] if per_layer else args.attention
    return AttentionOptions(variant=variant, sink_init=args.attention_sink_init,
                            softpick_eps=args.attention_softpick_eps, sigmoid_bias=args.attention_sigmoid_bias,
                            relu_norm=args.attention_relu_norm, clip_zeta=args.attention_clip_zeta,
                            clip_gamma=args.attention_clip_gamma)


class SinkLogit(nn.Module):
    """One learned logit per (query) head, ``weight`` [H] laid out like the heads (TP: ``ShardedParams``).
    Its optimizer class is ``sink`` (see ``optimizer.no_decay``)."""

    param_class = "sink"

    def __init__(self, n_heads: int, init: float):
        super().__init__()
        self.init_value = init
        self.weight = nn.Parameter(torch.empty(n_heads))

    def logits(self) -> torch.Tensor:
        from outlier_titan.parallel.tensor_parallel import local
        return local(self.weight)

    def init_weights(self, init) -> None:
        init.constant(self.weight, self.init_value)


# ----------------------------------------------------------------------------------------------------------
# explicit weights


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def causal_logits(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float = 0.0) -> torch.Tensor:
    """``scale * q k^T`` [B, H, T, T] in the compute dtype, soft-capped if asked, -inf above the diagonal."""
    dt = _compute_dtype(q)
    t = q.shape[-2]
    s = (q.to(dt) @ k.to(dt).transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~mask, float("-inf"))


def attention_weights(q: torch.Tensor, k: torch.Tensor, opts: AttentionOptions, scale: float,
                      sink: torch.Tensor | None = None, softcap: float = 0.0) -> torch.Tensor:
    """The weights ``A`` [B, H, T, T] of ``opts.variant`` (zero above the diagonal); ``sink``: the per-head
    logits [H] of ``sink_logit``."""
    s = causal_logits(q, k, scale, softcap)
    t = s.shape[-1]
    visible = torch.ones(t, t, dtype=torch.bool, device=s.device).tril()
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
            return a / torch.arange(1, t + 1, dtype=s.dtype, device=s.device).view(-1, 1)
        if opts.relu_norm == "seq_len":
            return a / t
        return a
    if v == "clipped_softmax":
        p = (opts.clip_zeta - opts.clip_gamma) * torch.softmax(s, dim=-1) + opts.clip_gamma
        return p.clamp(0.0, 1.0).masked_fill(~visible, 0.0)
    raise ValueError(f"unknown attention variant {v!r}")


# ----------------------------------------------------------------------------------------------------------
# the attention call


def _sink_mask(sink: torch.Tensor, t: int, dtype: torch.dtype) -> torch.Tensor:
    """Additive float mask [1, H, T, T+1] (4-d: the fused kernels take no 3-d masks): column 0 (a zero key) scores the head's sink logit, columns 1.. are
    the causal keys (0 or -inf)."""
    causal = torch.zeros(t, t, dtype=dtype, device=sink.device).masked_fill(
        ~torch.ones(t, t, dtype=torch.bool, device=sink.device).tril(), float("-inf"))
    h = sink.shape[0]
    return torch.cat([sink.to(dtype).view(h, 1, 1).expand(h, t, 1), causal.expand(h, t, t)], dim=-1).unsqueeze(0)


def run_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions, scale: float,
                  sink: torch.Tensor | None = None, softcap: float = 0.0, prob_hook=None) -> torch.Tensor:
    """Causal attention of ``opts.variant`` over [B, H, T, d_h] (k, v already repeated to H heads). Fused SDPA
    for the variants in ``FUSED`` without a soft-cap or probe hook; the explicit weights otherwise."""
    if prob_hook is not None or softcap or opts.variant not in FUSED:
        p = attention_weights(q, k, opts, scale, sink=sink, softcap=softcap)
        if prob_hook is not None:
            prob_hook(p.detach())
        return (p @ v.to(p.dtype)).to(q.dtype)
    if opts.variant == "softmax1":
        pad = (0, 0, 1, 0)
        out = F.scaled_dot_product_attention(F.pad(q, pad), F.pad(k, pad), F.pad(v, pad), is_causal=True,
                                             scale=scale)
        return out[:, :, 1:]
    if opts.variant == "sink_logit":
        pad = (0, 0, 1, 0)
        mask = _sink_mask(sink, q.shape[-2], q.dtype)
        return F.scaled_dot_product_attention(q, F.pad(k, pad), F.pad(v, pad), attn_mask=mask, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def apply_gate(out: torch.Tensor, gate_logits: torch.Tensor, variant: str) -> torch.Tensor:
    """``out`` [B, H, T, d_h] times ``sigmoid(gate_logits)``, gate logits [B, T, H] (head) or [B, T, H*d_h]."""
    b, h, t, d = out.shape
    g = torch.sigmoid(gate_logits.float() if gate_logits.dtype in (torch.bfloat16, torch.float16) else gate_logits)
    if variant == "gated_head":
        g = g.view(b, t, h, 1)
    else:
        g = g.view(b, t, h, d)
    return out * g.transpose(1, 2).to(out.dtype)
