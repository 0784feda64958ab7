"""nGPT (Loshchilov et al. 2024), as the NVIDIA reference code (``NVIDIA/ngpt`` ``model.py``, ``use_nGPT=1``)
implements it; anGPT's second baseline. Also the shared pieces of the normalised specs (anGPT imports them):
row-norm projection on sharded weights, unit-row init, the s_init/s_scale scaled parameters, the LERP.

Forward (``norm(x) = x / ||x||_2`` over the last dim, per token)::

    h = E_in[tokens]                                    # rows of E_in unit norm; no norm, no positions
    for each block:
        q, k, v = Wq h, Wk h, Wv h                       # no pre-norm, no biases
        q, k = RoPE(q), RoPE(k)                          # before the QK norm, as the reference
        q = s_qk * norm(q);  k = s_qk * norm(k)          # per head over d_h; s_qk in R^d seen as (H, d_h)
        y = causal_attention(q, k, v, scale = sqrt(d_h)) # sqrt, not 1/sqrt
        h = norm(h + |a_A| * (norm(Wo y) - h))
        u, z = W3 h * (s_u sqrt(d)),  W1 h * (s_v sqrt(d))    # s_uv in R^{2 * 4d}: both halves scaled
        h = norm(h + |a_M| * (norm(W2 (u * SiLU(z))) - h))
    logits = s_z * (E_out h)                             # untied head, rows unit norm; no final norm

Scaling vectors are stored as p (init ``s_scale``) and used as p * s_init / s_scale (nGPT's effective-LR
trick): alpha s_init 0.05 (``alpha_init``), s_qk 1, s_z 1 (``logit_scale_init``), all with s_scale =
``param_scale`` (default 1/sqrt(d)); s_uv s_init = s_scale = 1. After init and after every optimizer step
(``post_step``) every matrix is renormalised to unit norm along the embedding (d) axis: rows of
E_in, E_out, Wq, Wk, Wv, W1, W3 (torch dim 1) and columns of Wo, W2 (torch dim 0).

Differences from the paper (arXiv 2410.01131) and from the reference code, documented here:

* RoPE: the reference's rotary function is not RoPE (it drops the cos term and mis-splits the table, NVIDIA/ngpt
  issue #10); we use standard RoPE (half-split pairing, ``rope_fraction`` of each head; 1.0 = the whole head as
  in the reference, anGPT's comparison runs use 0.5).
* alpha: the code uses |alpha| (``alpha_abs = true``, default); the paper writes signed alpha (``false``).
* s_uv: the code scales both MLP halves by s_uv * sqrt(d); the paper scales only the gate by s_z * sqrt(d). The
  sqrt(d) on u has no forward effect (the MLP output is normalised); the per-unit s_u vector does, and is kept.
* The reference's redundant norm(h) inside the LERP is skipped (h is already unit norm).
* The reference stores block matrices in bf16; here parameters are fp32 masters like every other spec.
* norm() has a 1e-12 floor on the norm (the reference divides by the plain norm).
* Weights are drawn N(0, 1) and normalised exactly at init (the reference draws N(0, 1/sqrt(d)), which the
  first renormalisation makes the same directions).

Sizes: ``0.5b`` is the reference's 24 x 1024 x 16-head model (vocab 50,304); ``32m`` ... ``1b`` are the
anGPT paper's Table F.1 shapes, whose nGPT parameter counts (core + V + 11 d L) they reproduce.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import _StridedShard

from outlier_titan.errors import ConfigError
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import Attention, RotaryEmbedding, attention, init_norms
from outlier_titan.models.ngpt import NGPTOptions
from outlier_titan.models.pre_ln.model import build_rope, rope_dims
from outlier_titan.models.roles import DEFAULT_ROLES
from outlier_titan.tensors import local

NORM_EPS = 1e-12


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / ||x||_2 over the last dim (floored at 1e-12); works on local tensors and DTensors."""
    return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(NORM_EPS)


# ------------------------------------------------------------------ norm projection on (sharded) weights


def _sharding_mesh_dims(p: torch.Tensor, dim: int) -> list[int]:
    """Mesh dims over which a DTensor is sharded along tensor dim ``dim`` (FSDP's _StridedShard included)."""
    if not isinstance(p, DTensor):
        return []
    return [i for i, pl in enumerate(p.placements)
            if (pl.is_shard() or isinstance(pl, _StridedShard)) and pl.dim % p.ndim == dim]


@torch.no_grad()
def vector_norms(p: torch.Tensor, dim: int) -> torch.Tensor:
    """L2 norms of the slices of ``p`` along ``dim`` (keepdim), on this rank's local shard: the squared sums
    are all-reduced over every mesh dim that shards ``dim`` (row-parallel TP, FSDP on that axis), so each
    rank gets the norms of the full vectors of its rows."""
    t = local(p)
    sq = t.float().pow(2).sum(dim, keepdim=True)
    for mesh_dim in _sharding_mesh_dims(p, dim):
        dist.all_reduce(sq, group=p.device_mesh.get_group(mesh_dim))
    return sq.sqrt()


@torch.no_grad()
def project_(p: torch.Tensor, dim: int, bound: bool) -> None:
    """In place: ``bound=False`` normalises every vector along ``dim`` to unit norm (nGPT); ``bound=True``
    projects it into the unit ball, w / max(1, ||w||) (anGPT)."""
    t = local(p)
    norms = vector_norms(p, dim)
    t.div_((norms.clamp_min(1.0) if bound else norms.clamp_min(NORM_EPS)).to(t.dtype))


def unit_tensor(shape: tuple[int, ...], dim: int, init: Initializer) -> torch.Tensor:
    """A full N(0, 1) tensor from the initializer's generator, normalised to unit norm along ``dim``
    (uniform directions on the sphere)."""
    full = torch.empty(shape, dtype=torch.float32, device=init.device).normal_(0.0, 1.0, generator=init.gen)
    return full / torch.linalg.vector_norm(full, dim=dim, keepdim=True)


def init_unit(init: Initializer, param: torch.Tensor, dim: int) -> None:
    init.value(param, unit_tensor(tuple(param.shape), dim, init))


# ------------------------------------------------------------------ scaled parameters and modules


class ScaledLinear(nn.Linear):
    """Linear without bias whose output units are multiplied by a learnable vector, stored as ``scale``
    (init ``s_scale``) and used as ``scale * mult`` (mult = s_init / s_scale, times any constant). Under
    column-parallel TP the vector is sharded with the weight's output dim."""

    def __init__(self, in_features: int, out_features: int, mult: float, stored_init: float):
        super().__init__(in_features, out_features, bias=False)
        self.scale = nn.Parameter(torch.empty(out_features))
        self.mult, self.stored_init = mult, stored_init

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight) * (self.scale * self.mult)


class HeadScale(nn.Module):
    """A learnable vector laid out head-major (``per_head`` values per head: 1 or d_h) that multiplies
    q / k of shape [B, H_local, T, d_h]; used as ``weight * mult``. Under TP it is ``Shard(0)`` like the heads
    (``tensor_parallel.ShardedParams``)."""

    def __init__(self, n_heads: int, per_head: int, mult: float, stored_init: float):
        super().__init__()
        self.per_head, self.mult, self.stored_init = per_head, mult, stored_init
        self.weight = nn.Parameter(torch.empty(n_heads * per_head))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = local(self.weight) * self.mult
        return x * w.view(-1, 1, self.per_head).to(x.dtype)


class Lerp(nn.Module):
    """The residual update h <- h + alpha * (x - h) with a learnable per-dimension alpha (stored init
    ``s_scale``, effective alpha = param * s_init / s_scale, optionally |alpha|), followed by

    * ``"norm"``: an exact norm(.) (nGPT);
    * ``"corrected"``: the factor nu(alpha) = (1 - 2 alpha + 2 alpha^2)^(-1/2) (anGPT, the spec's reading);
    * ``"printed"``: nu(alpha) = 1 - 2 alpha + 2 alpha^2 (anGPT as printed).

    ``factor = "mean"`` uses one nu from the mean of (1 - 2 alpha + 2 alpha^2) over dims instead of per dim.
    Under TP both inputs are sequence-sharded local tensors (``ReplicatedParamsOnShards``)."""

    def __init__(self, dim: int, alpha_init: float, stored_init: float, abs_alpha: bool, form: str,
                 factor: str = "elementwise"):
        super().__init__()
        if form not in ("norm", "corrected", "printed"):
            raise ValueError(f"unknown LERP form {form!r}")
        self.alpha = nn.Parameter(torch.empty(dim))
        self.mult, self.stored_init = alpha_init / stored_init, stored_init
        self.abs_alpha, self.form, self.factor = abs_alpha, form, factor

    def effective_alpha(self) -> torch.Tensor:
        a = self.alpha * self.mult
        return a.abs() if self.abs_alpha else a

    def forward(self, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a = self.effective_alpha()
        y = h + a * (x - h)
        if self.form == "norm":
            return l2norm(y)
        second_moment = 1.0 - 2.0 * a + 2.0 * a * a
        if self.factor == "mean":
            second_moment = second_moment.mean()
        nu = second_moment.rsqrt() if self.form == "corrected" else second_moment
        return y * nu


# ------------------------------------------------------------------ nGPT


@dataclass
class NGPTArgs(NGPTOptions):
    """The ngpt spec's args: its own options (``alpha_init``, ``param_scale``, ...: ``models/ngpt/__init__.py``) and
    the architecture below."""

    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    ffn_hidden: int | None = None  # default 4 * dim (per SwiGLU branch, as the reference)
    vocab_size: int = 4096
    max_seq_len: int = 1024
    softmax: str = "softmax"
    pos_encoding: str = "rope"
    rope_fraction: float = 1.0
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.dim
        if self.param_scale is None:
            self.param_scale = 1.0 / math.sqrt(self.dim)

    def validate(self) -> None:
        validate_normalized_args(self, "ngpt")


def validate_normalized_args(args, spec: str) -> None:
    """Checks shared by the nGPT and anGPT args."""
    if args.dim % args.n_heads:
        raise ConfigError(f"model: dim {args.dim} is not divisible by n_heads {args.n_heads}")
    if args.pos_encoding not in ("rope", "none"):
        raise ConfigError(f"model.pos_encoding = {args.pos_encoding!r}: {spec} supports rope or none")
    if args.pos_encoding == "rope":
        rope_dims(args.dim // args.n_heads, args.rope_fraction)
    if args.param_scale <= 0:
        raise ConfigError(f"model.param_scale must be > 0, got {args.param_scale}")


class NGPTAttention(Attention):
    """q, k, v projections (no bias), RoPE, per-head L2 norm times s_qk, attention with scale sqrt(d_h)."""

    logits_bilinear_in_wq_wk = False  # q, k are L2-normalised: rescaling W_q / W_k leaves the logits

    def __init__(self, args: NGPTArgs, rope: RotaryEmbedding | None):
        super().__init__(args.dim, args.n_heads, args.n_heads, bias=False, variant=args.softmax, rope=rope)
        self.sqk = HeadScale(args.n_heads, self.head_dim, mult=1.0 / args.param_scale, stored_init=args.param_scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x)
        q, k = self.sqk(l2norm(q)), self.sqk(l2norm(k))
        return self.project_out(attention(q, k, v, self.variant, scale=self.head_dim ** 0.5,
                                          prob_hook=self.prob_hook, logit_hook=self.logit_hook))


class NGPTMLP(nn.Module):
    """u = W3 h * s_u sqrt(d), z = W1 h * s_v sqrt(d) (gate), W2 (u * SiLU(z))."""

    def __init__(self, args: NGPTArgs):
        super().__init__()
        c = math.sqrt(args.dim)
        self.w1 = ScaledLinear(args.dim, args.ffn_hidden, mult=c, stored_init=1.0)
        self.w3 = ScaledLinear(args.dim, args.ffn_hidden, mult=c, stored_init=1.0)
        self.w2 = nn.Linear(args.ffn_hidden, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(self.w3(x) * F.silu(self.w1(x)))


class NGPTBlock(nn.Module):
    """h <- lerp(h, normalised attention(h)); h <- lerp(h, normalised mlp(h)). anGPT's block shares this
    forward and differs in its sub-layers and LERP factor."""

    def __init__(self, args: NGPTArgs, rope: RotaryEmbedding | None):
        super().__init__()
        self.attention = NGPTAttention(args, rope)
        self.attn_lerp = Lerp(args.dim, args.alpha_init, args.param_scale, args.alpha_abs, "norm")
        self.feed_forward = NGPTMLP(args)
        self.mlp_lerp = Lerp(args.dim, args.alpha_init, args.param_scale, args.alpha_abs, "norm")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.attn_lerp(h, l2norm(self.attention(h)))
        return self.mlp_lerp(h, l2norm(self.feed_forward(h)))


class NGPT(nn.Module):
    """Embedding -> normalised LERP blocks -> scaled head (no final norm). anGPT subclasses it."""

    param_roles = DEFAULT_ROLES  # the names of the parameters' roles (models/roles.py)

    block_cls = NGPTBlock

    def __init__(self, args: NGPTArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.rope = (build_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta, args.rope_fraction)
                     if args.pos_encoding == "rope" else None)
        self.layers = nn.ModuleDict({str(i): self.block_cls(args, self.rope) for i in range(args.n_layers)})
        self.norm = nn.Identity()
        self.output = ScaledLinear(args.dim, args.vocab_size, mult=args.logit_scale_init / args.param_scale,
                                   stored_init=args.param_scale)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for block in self.layers.values():
            h = block(h)
        return self.output(self.norm(h))

    @torch.no_grad()
    def init_weights(self, init: Initializer) -> None:
        """Unit-norm directions (normalised along d, the post-step axes) and the scaling vectors at s_scale."""
        for fqn, p, dim in normalized_matrices(self):
            init_unit(init, p, dim)
        init_scales(self, init)
        init_norms(self)


def init_scales(model: nn.Module, init: Initializer) -> None:
    """Sets every ScaledLinear / HeadScale / Lerp vector to its stored init value."""
    for m in model.modules():
        if isinstance(m, ScaledLinear):
            init.constant(m.scale, m.stored_init)
        elif isinstance(m, HeadScale):
            init.constant(m.weight, m.stored_init)
        elif isinstance(m, Lerp):
            init.constant(m.alpha, m.stored_init)


def normalized_matrices(model: nn.Module, residual_axis: bool = True):
    """(fqn, weight, dim) of every matrix of a normalised model, in module order. ``residual_axis=True``
    (nGPT): dim is the d_model axis (0 for ``wo`` / ``w2``, 1 otherwise); ``False`` (anGPT): always dim 1,
    the input dimension of a Linear and the d_model axis of an embedding."""
    out = []
    for name, m in model.named_modules():
        if isinstance(m, (nn.Linear, nn.Embedding)):
            leaf = name.split(".")[-1]
            dim = 0 if residual_axis and leaf in ("wo", "w2") else 1
            out.append((name, m.weight, dim))
    return out


def ngpt_post_step(model: nn.Module) -> None:
    """Renormalises every matrix to unit norm along d_model (works on FSDP / TP DTensor shards)."""
    for _, p, dim in normalized_matrices(model, residual_axis=True):
        project_(p, dim, bound=False)
