"""anGPT, the approximately normalised GPT (Franke et al. 2025, arXiv 2505.22014), following our reading of
the paper (docs/papers/franke2025.md); the authors' code (automl/anGPT) was not available.

    h = W_e[tokens]                                         # rows of W_e in the unit ball (unit at init)
    for each block (no pre-norms):
        q, k, v = (Wq h, Wk h, Wv h) * nu_qkv               # nu_qkv = sqrt(d / d_h)
        q, k = RoPE(q), RoPE(k)                             # on rope_fraction (0.5) of each head
        q, k = norm(q), norm(k)                             # exact L2 per head over d_h
        A = softmax(g * q k^T)                              # g: learnable temperature, one per head
        h_a = norm(Wo (A v) * nu_p)                         # nu_p = sqrt(d_h / d); exact post-norm
        h = (h + a_A * (h_a - h)) * nu(a_A)                 # LERP, per-dimension alpha
        u, z = W3 h * nu_uz, W1 h * nu_uz                   # nu_uz = sqrt(d / 4d) = 1/2 (d_f = ffn_hidden)
        h_m = norm(W2 (u * SiLU(z) * nu_acf) * nu_d)        # nu_acf = 3.74, nu_d = sqrt(d_f / d) = 2
        h = (h + a_M * (h_m - h)) * nu(a_M)
    logits = s_z * (W_h h)                                  # untied head, no final norm

Norm-bounded weights: every matrix (W_e, Wq, Wk, Wv, Wo, W1, W3, W2, W_h) has each vector along its input
dimension (torch dim 1 of a Linear weight; the d_model axis of the embedding) in the unit ball. Weights are
initialised with exactly unit rows (N(0, 1) rows normalised), and after every optimizer step ``post_step``
projects w <- w / max(1, ||w||). Where dim 1 is sharded (Wo and W2 are row-parallel under TP and FSDP-sharded
on dim 1) the squared norms are all-reduced over the sharding mesh dims before the projection.

Choices where the paper is ambiguous (spec section 12), each an option where cheap:

* nu(alpha) (Q1): the corrected (1 - 2a + 2a^2)^(-1/2), which keeps the residual norm at 1 (``lerp_form =
  "corrected"``); the paper's printed 1 - 2a + 2a^2 is ``lerp_form = "printed"``. Evaluated per dimension
  (Q2; ``lerp_factor = "mean"`` for one factor from the mean over dims). Not detached (Q19).
* alpha sign (Q3): used as is; ``alpha_abs = true`` takes |alpha| as nGPT's code does.
* s_init / s_scale (Q4): alpha and s_z are stored with init ``param_scale`` = 0.01 (Table F.2) and used as
  param * s_init / param_scale with s_init = ``alpha_init`` = 0.05 and ``logit_scale_init`` = 1.0 (nGPT's
  effective inits; the paper gives none).
* g (Q5): one learnable temperature per head per layer, stored directly, init ``attn_scale_init`` = sqrt(d_h)
  (nGPT's constant, and GPT+'s effective temperature at init). Per head rather than per layer so that it
  shards with the heads under TP.
* nu_acf = 3.74 as printed (Q6; cancelled by the post-norm anyway, like nu_qkv on q/k/v, nu_p, nu_d, and
  nu_uz on u: only nu_uz on z, nu(alpha), g, alpha and s_z change the function, spec section 2.5).
* The bound is a projection after each step (Q10), on each vector along the input dimension (Q9).
* RoPE on the first half of each head, base 10000, before the QK norm (Q18; L2 norms commute with it).
* No attention-matrix sqrt(r) rescaling (Appendix D, Q23; it would be cancelled by the post-norm).

Train configs: Adam (no weight decay), no warm-up, cosine to 1% of peak, beta2 0.99 below 100M.

Flavors: the six Table F.1 sizes (``32m`` ... ``1b``; vocab 50,304, d_h 64, d_f = 4d, untied): parameter
counts core + V + 2 d L (+ one g per head and layer, too small to show), e.g. 0.5B: 505,775,616 vs the printed
505.78M; and ``debug``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from outlier_titan.errors import ConfigError
from outlier_titan.models.angpt import ANGPTOptions
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import Attention, RotaryEmbedding, attention, init_norms
from outlier_titan.models.ngpt.model import (
    NGPT,
    HeadScale,
    Lerp,
    NGPTBlock,
    init_scales,
    init_unit,
    l2norm,
    normalized_matrices,
    project_,
    validate_normalized_args,
)
from outlier_titan.models.roles import DEFAULT_ROLES

NU_ACF = 3.74  # SiLU-GLU activation factor, the paper's Monte-Carlo value


@dataclass
class ANGPTArgs(ANGPTOptions):
    """The angpt spec's args: its own options (``lerp_form``, ``alpha_init``, ...: ``models/angpt/__init__.py``) and the
    architecture below."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int | None = None  # d_f, default 4 * dim (per SwiGLU branch)
    vocab_size: int = 4096
    max_seq_len: int = 1024
    softmax: str = "softmax"
    pos_encoding: str = "rope"
    rope_fraction: float = 0.5
    rope_theta: float = 10000.0
    nu_acf: float = NU_ACF

    def __post_init__(self):
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.dim
        if self.param_scale is None:
            self.param_scale = 0.01
        if self.attn_scale_init is None:
            self.attn_scale_init = math.sqrt(self.dim // self.n_heads)

    def validate(self) -> None:
        validate_normalized_args(self, "angpt")
        if self.lerp_form not in ("corrected", "printed"):
            raise ConfigError(f"model.lerp_form = {self.lerp_form!r}: choose corrected or printed")


class ANGPTAttention(Attention):
    """(Wq, Wk, Wv) h * nu_qkv, RoPE, exact per-head L2 QK norm, per-head temperature g, Wo (.) * nu_p."""

    logits_bilinear_in_wq_wk = False  # q, k are L2-normalised: rescaling W_q / W_k leaves the logits

    def __init__(self, args: ANGPTArgs, rope: RotaryEmbedding | None):
        super().__init__(args.dim, args.n_heads, args.n_heads, bias=False, variant=args.softmax, rope=rope)
        self.nu_qkv = math.sqrt(args.dim / self.head_dim)
        self.nu_p = math.sqrt(self.head_dim / args.dim)
        self.temperature = HeadScale(args.n_heads, 1, mult=1.0, stored_init=args.attn_scale_init)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        q, k, v = q * self.nu_qkv, k * self.nu_qkv, v * self.nu_qkv
        q, k = self.temperature(l2norm(q)), l2norm(k)
        return self.project_out(attention(q, k, v, self.variant, scale=1.0, prob_hook=self.prob_hook,
                                          logit_hook=self.logit_hook)) * self.nu_p


class ANGPTMLP(nn.Module):
    """u = W3 h * nu_uz, z = W1 h * nu_uz (gate), W2 (u * SiLU(z) * nu_acf) * nu_d."""

    def __init__(self, args: ANGPTArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w3 = nn.Linear(args.dim, args.ffn_hidden, bias=False)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)
        self.nu_uz = math.sqrt(args.dim / args.ffn_hidden)
        self.nu_d = math.sqrt(args.ffn_hidden / args.dim)
        self.nu_acf = args.nu_acf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, z = self.w3(x) * self.nu_uz, self.w1(x) * self.nu_uz
        return self.w2(u * F.silu(z) * self.nu_acf) * self.nu_d


class ANGPTBlock(NGPTBlock):
    """nGPT's block forward with anGPT's sub-layers and its ν(α) LERP (no exact normalisation)."""

    def __init__(self, args: ANGPTArgs, rope: RotaryEmbedding | None):
        nn.Module.__init__(self)
        lerp = dict(dim=args.dim, alpha_init=args.alpha_init, stored_init=args.param_scale,
                    abs_alpha=args.alpha_abs, form=args.lerp_form, factor=args.lerp_factor)
        self.attention = ANGPTAttention(args, rope)
        self.attn_lerp = Lerp(**lerp)
        self.feed_forward = ANGPTMLP(args)
        self.mlp_lerp = Lerp(**lerp)


class ANGPT(NGPT):
    param_roles = DEFAULT_ROLES  # the names of the parameters' roles (models/roles.py)

    block_cls = ANGPTBlock

    @torch.no_grad()
    def init_weights(self, init: Initializer) -> None:
        """Every matrix with exactly unit vectors along its input dim; scaling vectors at s_scale; g at its
        init."""
        for _, p, dim in normalized_matrices(self, residual_axis=False):
            init_unit(init, p, dim)
        init_scales(self, init)
        init_norms(self)


def angpt_post_step(model: nn.Module) -> None:
    """Projects every matrix's input-dim vectors into the unit ball (cross-shard norms where sharded)."""
    for _, p, dim in normalized_matrices(model, residual_axis=False):
        project_(p, dim, bound=True)
