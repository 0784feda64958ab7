"""Layers shared by the model specs: norms, RoPE, attention (any registered variant:
:mod:`outlier_titan.models.attention_variants`), MLPs.

Conventions every spec follows (the TP plans, FSDP placements, optimizer and probe rely on them):
linear weights are named ``wq, wk, wv, wo`` (attention; a variant's own modules carry the names its entry declares)
and ``w1, w2, w3`` (MLP; w2 is the output projection); ``wo`` and ``w2`` map back into the residual stream. Heads
are inferred from the local weight shapes at run time, so a tensor-parallel shard sees only its local heads.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from outlier_titan.models.attention import attention_weights, max_logits, run_attention
from outlier_titan.models.attention_variants import AttentionOptions, get_variant
from outlier_titan.models.smooth_swiglu import TokenScale, smoothed_down
from outlier_titan.models.value_path import HeadRMSNorm, VScale


class RMSNorm(nn.Module):
    """RMSNorm with a per-channel gain (``gain="vector"``), one shared scalar gain (``"scalar"``:
    Kaul et al. 2024's RMSNormSingle) or no gain (``"none"``: OP's Pre-SRMS)."""

    is_norm = True

    def __init__(self, dim: int, eps: float = 1e-6, gain: str = "vector"):
        super().__init__()
        self.eps, self.gain_kind = eps, gain
        if gain == "vector":
            self.weight = nn.Parameter(torch.empty(dim))
        elif gain == "scalar":
            self.weight = nn.Parameter(torch.empty(1))
        elif gain == "none":
            self.register_parameter("weight", None)
        else:
            raise ValueError(f"unknown RMSNorm gain {gain!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 upcast; float64 stays exact
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        y = y.type_as(x)
        return y if self.weight is None else y * self.weight

    def init_weights(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)


class LayerNorm(nn.LayerNorm):
    """LayerNorm with an ``init_weights`` like the other layers."""

    def init_weights(self) -> None:
        self.reset_parameters()


def build_norm(kind: str, dim: int, eps: float, bias: bool) -> nn.Module:
    """layernorm | rmsnorm | rmsnorm_single | rmsnorm_nogain | none."""
    if kind == "layernorm":
        return LayerNorm(dim, eps=eps, bias=bias)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps, "vector")
    if kind == "rmsnorm_single":
        return RMSNorm(dim, eps, "scalar")
    if kind == "rmsnorm_nogain":
        return RMSNorm(dim, eps, "none")
    if kind == "none":
        return nn.Identity()
    raise ValueError(f"unknown norm {kind!r}")


class RotaryEmbedding(nn.Module):
    """Standard RoPE, half-split pairing (i, i + d_h/2), tables as non-persistent buffers."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim // 2), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim // 2), persistent=False)

    def init_weights(self) -> None:
        inv = self.theta ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=self.cos.device)
                             / self.head_dim)
        ang = torch.outer(torch.arange(self.max_seq_len, dtype=torch.float64, device=self.cos.device), inv)
        self.cos.copy_(ang.cos())
        self.sin.copy_(ang.sin())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [B, H, T, d_h]."""
        t = x.shape[-2]
        cos, sin = self.cos[:t].to(x.dtype), self.sin[:t].to(x.dtype)
        a, b = x.chunk(2, dim=-1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)


def repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v with their (grouped-query) heads repeated to q's head count."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k, v


def explicit_attention_probs(q: torch.Tensor, k: torch.Tensor, variant: str, scale: float,
                             softcap: float = 0.0) -> torch.Tensor:
    """Causal attention weights [B, H, T, T] of a parameter-free ``variant``, computed explicitly (rows of a variant
    with a sink sum to < 1). ``softcap > 0`` caps the scaled logits as c * tanh(s / c) before masking."""
    return attention_weights(q, k, AttentionOptions(variant=variant), scale, softcap=softcap)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, variant: str, scale: float | None = None,
              prob_hook: Callable[[torch.Tensor], None] | None = None, opts: AttentionOptions | None = None,
              state=None, softcap: float = 0.0,
              logit_hook: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Causal attention of ``variant`` over [B, H, T, d_h] tensors (k, v may have fewer heads: GQA).

    With ``prob_hook`` the weights are computed explicitly (for the outlier probe) and passed to the hook; with
    ``logit_hook`` the per-sequence, per-head MaxLogit [B, H] (``attention.max_logits``, no gradient, chunked) is.
    ``opts``: the variant's options (default: its defaults); ``state``: the variant's state (e.g. its learned
    logits). The paths and backends: :mod:`outlier_titan.models.attention`.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = repeat_kv(q, k, v)
    if logit_hook is not None:
        _hand_max_logits(logit_hook, q, k, scale)
    opts = opts if opts is not None else AttentionOptions(variant=variant)
    return run_attention(q, k, v, opts, scale, state=state, softcap=softcap, prob_hook=prob_hook)


@torch.compiler.disable
def _hand_max_logits(hook: Callable[[torch.Tensor], None], q: torch.Tensor, k: torch.Tensor, scale: float) -> None:
    """Outside a compiled graph: the hook is the caller's Python (it keeps or reduces the values)."""
    hook(max_logits(q.detach(), k.detach(), scale))


class Attention(nn.Module):
    """Multi-head (grouped-query) causal self-attention with optional RoPE and per-head QK RMSNorm.

    ``variant`` names the attention variant (:mod:`outlier_titan.models.attention_variants`); ``opts`` carries its
    options. The modules the variant declares (e.g. a sink logit or a gate) are created after the projections, as
    attributes under their declared names. Optional value-path steps (:mod:`outlier_titan.models.value_path`):
    ``v_scale`` on the values, ``head_norm`` on each head's aggregated output (before the variant's output step
    and ``wo``); None when off.
    """

    logits_bilinear_in_wq_wk = True
    """The logits scale with the rows of ``wq`` and ``wk`` (false for a subclass that normalises q and k: QK-Clip
    then refuses the model)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, bias: bool, variant: str,
                 qk_norm: bool = False, rope: RotaryEmbedding | None = None, norm_eps: float = 1e-6,
                 opts: AttentionOptions | None = None, v_scale: VScale | None = None,
                 head_norm: HeadRMSNorm | None = None):
        super().__init__()
        self.head_dim = dim // n_heads
        self.opts = opts if opts is not None else AttentionOptions(variant=variant)
        self.variant = self.opts.variant
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, norm_eps) if qk_norm else None
        self.rope = rope
        self.v_scale, self.head_norm = v_scale, head_norm
        entry = get_variant(self.variant)
        self._forms = entry.torch_forms()
        if entry.params:
            built = self._forms.modules(dim, n_heads, self.head_dim, self.opts)
            for p in entry.params:
                if p.param_class is not None:
                    built[p.name].param_class = p.param_class
                setattr(self, p.name, built[p.name])
        self.prob_hook: Callable[[torch.Tensor], None] | None = None
        self.head_hook: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        # the probe's MaxLogit metric and QK-Clip: the per-sequence, per-head MaxLogit [B, H_local] of each forward
        self.logit_hook: Callable[[torch.Tensor], None] | None = None
        # post-training KV-cache fake quantisation (quant/ptq.py): (k, v) after RoPE -> (k^, v^)
        self.kv_quant: Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None

    def input_readers(self) -> list[nn.Module]:
        """The variant's modules that read the block's normalised input (initialised like ``wq``)."""
        return [getattr(self, name) for name in get_variant(self.variant).reads_input]

    def init_variant(self, init) -> None:
        """Initialises the variant's other modules and the value-path steps (their ``init_weights``)."""
        for p in get_variant(self.variant).params:
            if not p.reads_input:
                getattr(self, p.name).init_weights(init)
        if self.v_scale is not None:
            self.v_scale.init_weights(init)
        if self.head_norm is not None:  # calibrated from wv: init_weights has initialised wv before this
            self.head_norm.init_weights(init, self.wv)

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, T, D] -> q, k, v as [B, H_local, T, d_h], with QK-norm and RoPE applied."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        if self.v_scale is not None:  # before the KV cache's quantiser: v^ is what the cache holds
            v = self.v_scale(v)
        if self.kv_quant is not None:
            k, v = self.kv_quant(k, v)
        return q, k, v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """[B, H_local, T, d_h] attention output -> wo([B, T, H_local * d_h])."""
        b, _, t, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def attend(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
               softcap: float = 0.0) -> torch.Tensor:
        """The variant's attention output [B, H_local, T, d_h] (gate applied; ``x`` is the gate's input)."""
        state = self._forms.state(self) if self._forms.state is not None else None
        out = attention(q, k, v, self.variant, scale=scale, prob_hook=self.prob_hook, opts=self.opts, state=state,
                        softcap=softcap, logit_hook=self.logit_hook)
        if self.head_norm is not None:
            out = self.head_norm(out)
        if self._forms.output is not None:
            out = self._forms.output(self, out, x)
        if self.head_hook is not None:  # the probe: per-head outputs and value states
            self.head_hook(out.detach(), repeat_kv(q, k, v)[1].detach())
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        return self.project_out(self.attend(x, q, k, v))


class MLP(nn.Module):
    """gelu / relu: w2(act(w1 x)); swiglu: w2(silu(w1 x) * w3 x); ``smooth``: Smooth-SwiGLU's per-token rescaling
    around w2 (:mod:`outlier_titan.models.smooth_swiglu`)."""

    def __init__(self, dim: int, hidden: int, kind: str, bias: bool, smooth: bool = False):
        super().__init__()
        self.kind = kind
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias) if kind == "swiglu" else None
        self.smooth_scale = TokenScale() if smooth else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.w1(x)
        if self.kind == "swiglu":
            if self.smooth_scale is not None:
                return smoothed_down(self.w2, F.silu(h), self.w3(x), self.smooth_scale)
            h = F.silu(h) * self.w3(x)
        elif self.kind == "gelu":
            h = F.gelu(h, approximate="tanh")
        elif self.kind == "relu":
            h = F.relu(h)
        else:
            raise ValueError(f"unknown mlp {self.kind!r}")
        return self.w2(h)


def init_norms(module: nn.Module) -> None:
    """Calls init_weights on every norm / rotary table below ``module``."""
    for m in module.modules():
        if isinstance(m, (RMSNorm, LayerNorm, RotaryEmbedding)):
            m.init_weights()
