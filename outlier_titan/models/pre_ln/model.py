"""Pre-LN transformer: GPT-2 style (LayerNorm, learned positions, GELU, biases, tied embeddings) and Llama style
(RMSNorm, RoPE, SwiGLU, no bias, GQA), chosen by options; plus Kaul et al. 2024's softmax-1 and single-scale RMSNorm
and anGPT's GPT+ (QK-norm).

    x = embed(tokens) [+ pos]
    for each block:  x = x + attn(norm1(x));  x = x + mlp(norm2(x))
    logits = head(norm_f(x))

Options (``model.*``): ``norm`` (layernorm | rmsnorm | rmsnorm_single = Kaul et al. 2024's RMSNormSingle, one scalar
gain | rmsnorm_nogain), ``attention`` (softmax | softmax1, exact | the sink remedies of
:mod:`outlier_titan.models.attention`, with its ``attention_*`` options; ``softmax`` is its old spelling),
``pos_encoding`` (learned | rope | none),
``rope_fraction`` (share of each head's dims that RoPE rotates; GPT+ uses 0.5), ``bias``, ``qk_norm``,
``mlp``, ``tie_embeddings``; on the value path (:mod:`outlier_titan.models.value_path`) ``v_scale`` (Chen, Lin, Yao
2026's V-scale) and ``head_norm`` (Li et al. 2026's head-wise RMSNorm); ``smooth_swiglu`` (Fishman et al. 2024,
:mod:`outlier_titan.models.smooth_swiglu`).

Kaul et al. 2024 flavors (``kaul2024_*``, formerly ``seed000_*``; the paper gives sizes only, no shapes): RMSNormSingle at every norm site
(pre-attention, pre-MLP, final), no biases in any linear layer, learned absolute positions, GELU, tied
embeddings for the GPT-2 family; parameter counts at the GPT-2 BPE vocabulary (50,304 padded) and 1024
positions:

    kaul2024_gpt2_60m     d=512,  L=11, H=8,  ffn 2048   60.9M  (closest GPT-2-shaped model to "~60M")
    kaul2024_gpt2_130m    d=768,  L=12, H=12, ffn 3072  124.4M  (GPT-2 small shape; Table 1 lists it as 137M)
    kaul2024_gpt2_350m    d=1024, L=24, H=16, ffn 4096  354.5M  (GPT-2 medium shape, as Table 1 suggests)
    kaul2024_gpt2_1.4b    d=1536, L=48, H=24, ffn 6144  1.44B   (GPT-2 XL depth at head dim 64; the XL shape
                                                               itself is 1.56B, which Table 1 calls 1.6B)
    kaul2024_llama2_130m  d=768,  L=12, H=12, SwiGLU 2048, RoPE, untied, RMSNormSingle eps 1e-6: the GaLore
                         ``llama_130m`` shape whose warm-up schedule the paper copies; 134M at Llama-2's
                         32,000 vocabulary, 162M at 50,304.

GPT+ flavors (``gptplus_*``, Franke et al. 2025's baseline, Table F.1 shapes): SwiGLU with 4*d hidden units per branch,
RoPE on half of each head (``rope_fraction`` 0.5), RMSNorm, per-head QK-RMSNorm with a learned gain of
size d_h, no bias, untied head. The paper's L2 QK-norm with a learned temperature g is realised as
QK-RMSNorm with scale 1/sqrt(d_h): the logits are sqrt(d_h) * g_q g_k * cos(q, k), so the effective
temperature starts at sqrt(d_h) and is learned through the gains (the 2*d_h*L gain parameters are what the
paper's GPT+ counts imply). Counts match Table F.1 (e.g. 0.5B: 505.73M).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from outlier_titan.errors import ConfigError
from outlier_titan.models.attention import AttentionArgs, resolve_variant, validate_attention_args
from outlier_titan.models.attention_variants import block_options
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import MLP, Attention, RotaryEmbedding, build_norm, init_norms
from outlier_titan.models.pre_ln import PreLNOptions
from outlier_titan.models.roles import DEFAULT_ROLES
from outlier_titan.models.smooth_swiglu import check_smooth_swiglu
from outlier_titan.models.value_path import value_path_steps


@dataclass
class PreLNArgs(AttentionArgs, PreLNOptions):
    """The pre_ln spec's args: its own options (``norm``, ``embed_proj``: ``models/pre_ln/__init__.py``), the attention
    options, and the architecture below."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None  # default: 4*dim (gelu/relu) or 8/3*dim rounded up to 64 (swiglu)
    vocab_size: int = 4096
    max_seq_len: int = 1024
    softmax: str = "softmax"
    pos_encoding: str = "learned"
    bias: bool = True
    qk_norm: bool = False
    mlp: str = "gelu"
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_fraction: float = 1.0
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.dim if self.mlp != "swiglu" else (8 * self.dim // 3 + 63) // 64 * 64
        resolve_variant(self)

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"model: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.pos_encoding == "rope":
            rope_dims(self.dim // self.n_heads, self.rope_fraction)
        validate_attention_args(self, "pre_ln")
        check_smooth_swiglu(self)


def rope_dims(head_dim: int, fraction: float) -> int:
    """Number of rotated dims per head: ``fraction * head_dim``, which must be a positive even integer."""
    n = fraction * head_dim
    if not 0 < fraction <= 1 or n != int(n) or int(n) % 2:
        raise ConfigError(f"model.rope_fraction = {fraction} of head dim {head_dim} must give a positive even "
                          f"number of rotated dims")
    return int(n)


class PartialRotaryEmbedding(RotaryEmbedding):
    """RoPE on the first ``rot_dims`` dims of each head (GPT-NeoX style partial rotary: frequencies
    theta^(-2i/rot_dims)); the other dims pass through. ``rot_dims == head_dim`` is plain RoPE."""

    def __init__(self, head_dim: int, rot_dims: int, max_seq_len: int, theta: float = 10000.0):
        super().__init__(rot_dims, max_seq_len, theta)
        self.full_head_dim = head_dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.head_dim == x.shape[-1]:
            return super().forward(x)
        rot, rest = x[..., :self.head_dim], x[..., self.head_dim:]
        return torch.cat([super().forward(rot), rest], dim=-1)


def build_rope(head_dim: int, max_seq_len: int, theta: float, fraction: float) -> RotaryEmbedding:
    """Full RoPE (fraction 1) or partial RoPE on the first ``fraction * head_dim`` dims."""
    rot = rope_dims(head_dim, fraction)
    if rot == head_dim:
        return RotaryEmbedding(head_dim, max_seq_len, theta)
    return PartialRotaryEmbedding(head_dim, rot, max_seq_len, theta)


class Block(nn.Module):
    def __init__(self, args: PreLNArgs, rope: RotaryEmbedding | None, layer_id: int = 0):
        super().__init__()
        self.attention_norm = build_norm(args.norm, args.dim, args.norm_eps, args.bias)
        opts = block_options(args, layer_id)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.bias, opts.variant,
                                   qk_norm=args.qk_norm, rope=rope, norm_eps=args.norm_eps, opts=opts,
                                   **value_path_steps(args))
        self.ffn_norm = build_norm(args.norm, args.dim, args.norm_eps, args.bias)
        self.feed_forward = MLP(args.dim, args.ffn_hidden, args.mlp, args.bias, smooth=args.smooth_swiglu)

    @property
    def pre_attention_norm(self) -> nn.Module:
        """The norm whose output the attention reads (the probe's gradient-sink input)."""
        return self.attention_norm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class PreLNTransformer(nn.Module):
    param_roles = DEFAULT_ROLES  # the names of the parameters' roles (models/roles.py)

    def __init__(self, args: PreLNArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # Outlier-Safe Pre-Training's projections (models/embed_proj.py): after the embedding, before the head
        self.embed_proj = nn.Linear(args.dim, args.dim, bias=False) if args.embed_proj else None
        self.head_proj = nn.Linear(args.dim, args.dim, bias=False) if args.embed_proj and args.embed_proj_head \
            else None
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim) if args.pos_encoding == "learned" else None
        # One rotary table shared by all blocks (a non-persistent buffer, not a parameter).
        self.rope = (build_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta, args.rope_fraction)
                     if args.pos_encoding == "rope" else None)
        self.layers = nn.ModuleDict({str(i): Block(args, self.rope, i) for i in range(args.n_layers)})
        self.norm = build_norm(args.norm, args.dim, args.norm_eps, args.bias)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers.values():
            x = block(x)
        x = self.norm(x)
        if self.head_proj is not None:
            x = self.head_proj(x)
        if self.output is None:
            return x @ self.tok_embeddings.weight.t()
        return self.output(x)

    @torch.no_grad()
    def init_weights(self, init: Initializer) -> None:
        """GPT-2 init: N(0, std) everywhere, residual output projections N(0, std / sqrt(2 L))."""
        a = self.args
        init.normal(self.tok_embeddings.weight, a.init_std)
        for proj in (self.embed_proj, self.head_proj):
            if proj is None:
                continue
            if a.embed_proj_init == "orthogonal":
                init.orthogonal(proj.weight)
            else:
                init.value(proj.weight, torch.eye(a.dim))
        if self.pos_embeddings is not None:
            init.normal(self.pos_embeddings.weight, a.init_std)
        for block in self.layers.values():
            att, ff = block.attention, block.feed_forward
            for lin in (att.wq, att.wk, att.wv, *att.input_readers(), ff.w1, ff.w3):
                init.linear(lin, a.init_std)
            att.init_variant(init)
            for lin in (att.wo, ff.w2):
                init.linear(lin, a.init_std / (2 * a.n_layers) ** 0.5)
        init.linear(self.output, a.init_std)
        init_norms(self)
