"""The Outlier Protected (OP) block of He et al. 2024 (He et al., "Understanding and Minimising Outlier Features in
Transformer Training"), and the paper's baseline blocks as options of the same spec.

``block = "op"`` (default)::

    x = embed_scale * E[tokens] (+ learned positions)        # embed_scale: mean square 1 at init
    for each block:                                          # no pre-norms, no norm on the residual path
        x = x + beta_A * Wo Attn(QKNorm(Wq x), QKNorm(Wk x), Wv x)
        x = x + beta_M * W2 phi(W1 (alpha * x))              # alpha optional
    logits = head(x)                                         # no final norm (``final_norm = true`` keeps one)

Baselines (``block``): ``pre_ln`` / ``pre_rms`` / ``pre_srms`` (Pre-Norm with LayerNorm, RMSNorm, and SRMSNorm
= RMSNorm without trainable gain), x = x + beta * f(Norm(x)); ``post_ln``, x = LN(x + beta * f(x)). The
other options apply to every variant, so run the plain baselines with ``residual_scale_mode = "none"``,
``qk_norm = false`` and (Pre-Norm) ``final_norm = true``; a Pre-Norm block with beta is the paper's "Pre-LN
with downscaled residuals" (App. C).

Options and the readings chosen where the paper is ambiguous:

* ``residual_scale_mode``: beta as a ``fixed`` scalar (CodeParrot, the authors' code: 0.2, not trained), a
  trainable ``scalar`` (Languini, OPT: init 0.2), a trainable LayerScale ``vector`` (FineWeb: 0.1 / 0.05), or
  ``none``; ``residual_scale`` is the value / init. The same beta on both branches.
* Entropy regulation: ``qk_norm`` (per-head RMSNorm over d_h with a trainable gain of size d_h shared by the
  heads, eps ``norm_eps``, the authors' code), or ``logit_softcap`` c > 0: c * tanh(s / c) on the scaled logits
  (the tanh alternative of App. E.2; c = 30 in the authors' code). With a soft-cap the attention runs the
  explicit (non-fused) path. The OPT runs' LayerNorm QK-norm is not offered.
* ``attention`` (and the ``attention_*`` options): the attention variants of :mod:`outlier_titan.models.attention`;
  the gated ones only for the Pre-Norm baselines (the OP block has no normalised input for the gate).
* ``mlp_alpha``: a scalar on the MLP input (equivalently the pre-activation without bias). ``analytic`` is the
  Brock et al. style reading: alpha_l = 1 / predicted std of the pre-activation at init, from the variance
  recursion of the residual stream (embedding mean square, plus beta^2 times each branch's predicted output
  variance; attention is treated as passing its value variance through, i.e. no averaging reduction, an
  upper bound). ``trainable`` starts there. ``none`` (default; ReLU is homogeneous).
* ``embed_scale``: a constant forward multiplier on the token embeddings (Gemma-style; the paper's "x50"),
  default 1 / ``init_std`` so that the mean square of the embedding is 1 at init. Learned positions, if any,
  are added unscaled.
* ``input_norm``: the authors' code keeps a LayerNorm on block 0's attention input (skip path raw); the paper
  does not, so it is off by default.
* Init: every matrix N(0, ``init_std``^2) (truncated at 3 std), no depth scaling (as the authors' code).

Flavors: ``debug``; ``codeparrot_130m`` (6 x 768, 12 heads, ReLU, learned positions, untied, beta 0.2
fixed); ``languini_100m`` / ``320m`` / ``1.2b`` (12 x 768, 24 x 1024, 24 x 2048; RoPE, GeLU with analytic
alpha, tied, trainable scalar beta 0.2 / 0.15 / 0.15, an O(1/sqrt(depth)) choice: the paper's values are
lost); ``fineweb_1.2b`` / ``fineweb_7b`` (24 x 2048 / 32 x 4096, head dim 128 at 7B, GeLU, RoPE, LayerScale
0.1 / 0.05, untied); ``opt_125m`` (12 x 768, ReLU, learned positions, biases, tied, trainable beta 0.2).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Shard

from outlier_titan.errors import ConfigError
from outlier_titan.models.attention import (AttentionArgs, input_reading_variants, resolve_variant,
                                            validate_attention_args)
from outlier_titan.models.attention_variants import block_options
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import MLP, Attention, LayerNorm, RotaryEmbedding, build_norm, init_norms
from outlier_titan.models.op import OP_BLOCKS, OPOptions
from outlier_titan.models.pre_ln.model import build_rope, rope_dims
from outlier_titan.models.roles import DEFAULT_ROLES
from outlier_titan.models.smooth_swiglu import check_smooth_swiglu
from outlier_titan.models.value_path import value_path_steps

_BLOCK_NORM = {"pre_ln": "layernorm", "pre_rms": "rmsnorm", "pre_srms": "rmsnorm_nogain", "post_ln": "layernorm"}


@dataclass
class OPArgs(AttentionArgs, OPOptions):
    """The op spec's args: its own options (``block``, ``residual_scale``, ...: ``models/op/__init__.py``), the
    attention options, and the architecture below."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None  # default 4 * dim
    vocab_size: int = 4096
    max_seq_len: int = 1024
    softmax: str = "softmax"
    pos_encoding: str = "learned"
    rope_fraction: float = 1.0
    rope_theta: float = 10000.0
    bias: bool = False
    qk_norm: bool = True
    mlp: str = "relu"
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.dim
        if self.embed_scale is None:
            self.embed_scale = 1.0 / self.init_std
        resolve_variant(self)

    def validate(self) -> None:
        if self.block not in OP_BLOCKS:
            raise ConfigError(f"model.block = {self.block!r}: choose one of {', '.join(OP_BLOCKS)}")
        if self.dim % self.n_heads:
            raise ConfigError(f"model: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.pos_encoding == "rope":
            rope_dims(self.dim // self.n_heads, self.rope_fraction)
        if self.logit_softcap < 0:
            raise ConfigError(f"model.logit_softcap must be >= 0, got {self.logit_softcap}")
        if self.residual_scale_mode not in ("none", "fixed", "scalar", "vector"):
            raise ConfigError(f"model.residual_scale_mode = {self.residual_scale_mode!r} is not a mode")
        if self.mlp_alpha not in ("none", "analytic", "trainable"):
            raise ConfigError(f"model.mlp_alpha = {self.mlp_alpha!r} is not a mode")
        pre_norm = self.block in ("pre_ln", "pre_rms", "pre_srms")
        check_smooth_swiglu(self)
        validate_attention_args(self, "op", () if pre_norm else input_reading_variants(),
                                f"block {self.block!r} has no normalised attention input for the variant's "
                                f"input projections")

    @property
    def beta(self) -> float:
        return 1.0 if self.residual_scale_mode == "none" else self.residual_scale


class Scale(nn.Module):
    """Multiplies its input by a constant (``fixed``), a trainable scalar (``scalar``) or a trainable
    per-channel vector (``vector``, LayerScale). Trainable values are initialised to ``value``."""

    def __init__(self, mode: str, value: float, dim: int):
        super().__init__()
        self.mode, self.value = mode, value
        if mode == "fixed":
            self.register_parameter("weight", None)
        elif mode in ("scalar", "vector"):
            self.weight = nn.Parameter(torch.empty(1 if mode == "scalar" else dim))
        else:
            raise ValueError(f"unknown scale mode {mode!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.value if self.weight is None else x * self.weight

    def init_weights(self, init: Initializer) -> None:
        init.constant(self.weight, self.value)


class OPAttention(Attention):
    """layers.Attention (QK-RMSNorm before RoPE, any ``model.attention`` variant) with an optional tanh logit
    soft-cap c * tanh(s / c), s = q k^T / sqrt(d_h) (explicit path; softmax-1 exact: sink logit 0 after the
    cap; a learned sink logit is not capped)."""

    def __init__(self, args: OPArgs, rope: RotaryEmbedding | None, layer_id: int = 0):
        opts = block_options(args, layer_id)
        super().__init__(args.dim, args.n_heads, args.n_kv_heads, args.bias, opts.variant, qk_norm=args.qk_norm,
                         rope=rope, norm_eps=args.norm_eps, opts=opts, **value_path_steps(args))
        self.softcap = args.logit_softcap

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        return self.project_out(self.attend(x, q, k, v, softcap=self.softcap))


@functools.lru_cache(maxsize=None)
def activation_second_moment(kind: str) -> float:
    """E[phi(z)^2] for z ~ N(0, 1) (SwiGLU: E[silu(z)^2] E[z'^2]), by quadrature on a fine grid (on the CPU
    even while a model is built under ``torch.device("meta")``)."""
    z = torch.linspace(-12.0, 12.0, 200001, dtype=torch.float64, device="cpu")
    pdf = torch.exp(-0.5 * z * z) / math.sqrt(2 * math.pi)
    phi = {"relu": F.relu(z), "gelu": F.gelu(z, approximate="tanh"), "swiglu": F.silu(z)}[kind]
    return float(torch.trapezoid(phi * phi * pdf, z))


def analytic_alphas(args: OPArgs) -> list[float]:
    """Per block: 1 / predicted std of the MLP pre-activation W1 x at init (see the module docstring)."""
    s2 = args.init_std ** 2
    var = (args.embed_scale * args.init_std) ** 2 + (s2 if args.pos_encoding == "learned" else 0.0)
    beta2 = args.beta ** 2
    c_phi = activation_second_moment(args.mlp)
    pre, post = args.block in ("pre_ln", "pre_rms", "pre_srms"), args.block == "post_ln"
    alphas = []
    for i in range(args.n_layers):
        attn_in = 1.0 if pre or (args.block == "op" and args.input_norm and i == 0) else var
        var = 1.0 if post else var + beta2 * attn_in * (args.dim * s2) ** 2
        mlp_in = 1.0 if pre else var
        alphas.append(1.0 / math.sqrt(mlp_in * args.dim * s2))
        var = 1.0 if post else var + beta2 * args.ffn_hidden * c_phi * s2
    return alphas


class OPBlock(nn.Module):
    def __init__(self, args: OPArgs, layer_id: int, rope: RotaryEmbedding | None, alpha: float):
        super().__init__()
        self.post = args.block == "post_ln"
        if args.block in _BLOCK_NORM:
            kind = _BLOCK_NORM[args.block]
            self.attention_norm = build_norm(kind, args.dim, args.norm_eps, args.bias)
            self.ffn_norm = build_norm(kind, args.dim, args.norm_eps, args.bias)
        else:
            self.attention_norm = (LayerNorm(args.dim, eps=args.norm_eps, bias=args.bias)
                                   if args.input_norm and layer_id == 0 else None)
            self.ffn_norm = None
        self.attention = OPAttention(args, rope, layer_id)
        self.feed_forward = MLP(args.dim, args.ffn_hidden, args.mlp, args.bias, smooth=args.smooth_swiglu)
        mode = args.residual_scale_mode
        self.attn_scale = None if mode == "none" else Scale(mode, args.residual_scale, args.dim)
        self.mlp_scale = None if mode == "none" else Scale(mode, args.residual_scale, args.dim)
        self.mlp_input_scale = (None if args.mlp_alpha == "none"
                                else Scale("fixed" if args.mlp_alpha == "analytic" else "scalar", alpha, args.dim))

    @property
    def pre_attention_norm(self) -> nn.Module | None:
        """The norm whose output the attention reads (the Pre-Norm blocks); None for OP's own block, whose
        attention reads the residual stream (the optional input LayerNorm of block 0 is not a per-block pre-norm:
        that block has none either), and for Post-LN, whose norm follows the attention."""
        return None if self.post or self.ffn_norm is None else self.attention_norm

    @staticmethod
    def _maybe(m: nn.Module | None, x: torch.Tensor) -> torch.Tensor:
        return x if m is None else m(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.post:
            x = self.attention_norm(x + self._maybe(self.attn_scale, self.attention(x)))
            mlp_out = self.feed_forward(self._maybe(self.mlp_input_scale, x))
            return self.ffn_norm(x + self._maybe(self.mlp_scale, mlp_out))
        x = x + self._maybe(self.attn_scale, self.attention(self._maybe(self.attention_norm, x)))
        mlp_in = self._maybe(self.mlp_input_scale, self._maybe(self.ffn_norm, x))
        return x + self._maybe(self.mlp_scale, self.feed_forward(mlp_in))


class OPTransformer(nn.Module):
    param_roles = DEFAULT_ROLES  # the names of the parameters' roles (models/roles.py)

    def __init__(self, args: OPArgs):
        super().__init__()
        self.args = args
        self.embed_scale = args.embed_scale
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim) if args.pos_encoding == "learned" else None
        self.rope = (build_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta, args.rope_fraction)
                     if args.pos_encoding == "rope" else None)
        alphas = analytic_alphas(args) if args.mlp_alpha != "none" else [1.0] * args.n_layers
        self.layers = nn.ModuleDict({str(i): OPBlock(args, i, self.rope, alphas[i]) for i in range(args.n_layers)})
        self.norm = (LayerNorm(args.dim, eps=args.norm_eps, bias=args.bias) if args.final_norm else nn.Identity())
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens) * self.embed_scale
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers.values():
            x = block(x)
        x = self.norm(x)
        if self.output is not None:
            return self.output(x)
        w = self.tok_embeddings.weight
        if isinstance(w, DTensor) and not isinstance(x, DTensor):
            # Tied head under TP without a final norm: x is the local sequence shard of the residual stream.
            x = DTensor.from_local(x, w.device_mesh, [Shard(1)], run_check=False)
        return x @ w.t()

    @torch.no_grad()
    def init_weights(self, init: Initializer) -> None:
        std = self.args.init_std
        init.normal(self.tok_embeddings.weight, std)
        if self.pos_embeddings is not None:
            init.normal(self.pos_embeddings.weight, std)
        for block in self.layers.values():
            att, ff = block.attention, block.feed_forward
            for lin in (att.wq, att.wk, att.wv, att.wo, *att.input_readers(), ff.w1, ff.w3, ff.w2):
                init.linear(lin, std)
            att.init_variant(init)
            for m in (block.attn_scale, block.mlp_scale, block.mlp_input_scale):
                if m is not None:
                    m.init_weights(init)
        init.linear(self.output, std)
        init_norms(self)
