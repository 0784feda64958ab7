"""Two optional steps on an attention block's value path (``model.v_scale`` and ``model.head_norm``, options of the
``pre_ln`` and ``op`` specs).

**V-scale** (Chen, Lin, Yao 2026, "Attention Sinks Induce Gradient Sinks", arXiv 2603.17771, Sec. 5.1): every value
state, per value head and token, is scaled radially before the aggregation,

    v^ = phi(||v||^2) v,    phi(r) = r / (r + C),    C = d_model * d_head * sigma^2 * exp(theta_h),

with ``sigma`` the value projection's initial std (our ``init_std``; the paper's 0.02) and one learned
``theta_h`` per layer and value (KV) head, initialised to 0. Its Jacobian ``phi I + 2C/(r+C)^2 v v^T`` attenuates
the gradient of small-norm values (the sink token's) and passes that of large-norm ones. ``backward`` is the
authors' backward-only control (their NeurIPS 2026 rebuttal to reviewer 6L5L): the forward keeps ``v`` exactly and
the backward applies the same Jacobian with ``theta`` frozen at 0 (no parameter).

**Head-wise RMSNorm** (Li, Jiang, Sun, Hu 2026, "The Structural Origin of Attention Sink", arXiv 2605.06611, ICML
2026; the authors' code github.com/Siquan-Li/Head-wise-RMSNorm): each head's value-aggregation output
``o_h = sum_j A_hj v_j`` [d_head] is RMS-normalised on its own before ``W_O``, ``o_h / RMS(o_h) * gamma_h`` (eps 1e-6),
with a learned gain per head and channel that the authors initialise by calibration: ``gamma_h`` is, in every
channel, the standard deviation over ``d_head`` of the first token's output under a standard normal input, which
is ``W_V z`` for that head (the first token attends only to itself), ``z ~ N(0, I)``. ``nogain``: no gain.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from outlier_titan.options import NO_DECAY_CLASSES, opt
from outlier_titan.tensors import full, local

@dataclass
class ValuePathOptions:
    """The value-path options of the specs built on :class:`~outlier_titan.models.layers.Attention` (mixed into
    their options: ``PreLNOptions``, ``OPOptions``)."""

    v_scale: str = opt("off", "V-scale (Chen, Lin, Yao 2026, arXiv 2603.17771): every value state scaled by "
                              "phi(|v|^2) = |v|^2 / (|v|^2 + C), C = dim * head_dim * init_std^2 * exp(theta), one "
                              "learned theta per layer and KV head (init 0), as the paper's Sec. 5.1; 'backward': "
                              "the authors' backward-only control (forward unchanged, same Jacobian in the "
                              "backward, theta frozen at 0). theta is parameter class v_scale: the paper decays "
                              "only matrices, so list it in optimizer.no_decay to match it.",
                       ("off", "on", "backward"))
    head_norm: str = opt("off", "Head-wise RMSNorm (Li, Jiang, Sun, Hu 2026, arXiv 2605.06611): each head's "
                                "attention output RMS-normalised over head_dim (eps 1e-6) before wo (and before a "
                                "gated variant's gate); 'on': a learned gain per head and channel, initialised by "
                                "the authors' calibration (the std of W_V z per head, z ~ N(0, I)), parameter "
                                "class head_norm (decayed by default, as the authors' 2-D gain is); 'nogain': none.",
                         ("off", "on", "nogain"))


VALUE_PATH_TP = {"layers.*.attention.v_scale": "sharded_params", "layers.*.attention.head_norm": "sharded_params"}
"""TP placements: V-scale's theta [n_kv_heads] and the head norm's gain [n_heads * head_dim] are laid out like
wv's / wo's heads."""

for _class in ("v_scale", "head_norm"):
    NO_DECAY_CLASSES.add(_class)


def value_path_steps(args) -> dict[str, nn.Module | None]:
    """The ``v_scale`` / ``head_norm`` modules a block's :class:`Attention` takes for a spec's ``args`` (None when
    off)."""
    head_dim = args.dim // args.n_heads
    return {"v_scale": (VScale(args.n_kv_heads, v_scale_constant(args.dim, head_dim, args.init_std), args.v_scale)
                        if args.v_scale != "off" else None),
            "head_norm": (HeadRMSNorm(args.n_heads, head_dim, gain=args.head_norm == "on")
                          if args.head_norm != "off" else None)}


HEAD_NORM_EPS = 1e-6
"""The authors' HeadRMSNorm eps (their code's default; the model's other norms keep ``norm_eps``)."""


def v_scale_constant(dim: int, head_dim: int, init_std: float) -> float:
    """The paper's C at theta = 0: ``d_model * d_head * sigma^2``, the squared value norm at initialisation."""
    return dim * head_dim * init_std ** 2


def _radial_scale(v: torch.Tensor, c: torch.Tensor | float) -> torch.Tensor:
    """``phi(||v||^2) v`` over the last dim (computed in at least float32); ``c`` a number or [1, H, 1, 1]."""
    vf = v.to(torch.promote_types(v.dtype, torch.float32))
    r = vf.pow(2).sum(-1, keepdim=True)
    return (vf * (r / (r + c))).to(v.dtype)


class _BackwardOnly(torch.autograd.Function):
    """Identity forward; the backward applies V-scale's Jacobian (symmetric) to the incoming gradient."""

    @staticmethod
    def forward(ctx, v: torch.Tensor, c: float) -> torch.Tensor:
        ctx.save_for_backward(v)
        ctx.c = c
        return v.view_as(v)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """``J^T g = phi(r) g + 2C / (r + C)^2 (v . g) v`` (the paper's Proposition 3; J is symmetric)."""
        (v,) = ctx.saved_tensors
        dt = torch.promote_types(v.dtype, torch.float32)
        vf, gf, c = v.to(dt), grad.to(dt), ctx.c
        r = vf.pow(2).sum(-1, keepdim=True)
        radial = (2 * c / (r + c) ** 2) * (vf * gf).sum(-1, keepdim=True)
        return (r / (r + c) * gf + radial * vf).to(grad.dtype), None


class VScale(nn.Module):
    """V-scale on value states [B, H_kv_local, T, d_head]; ``mode`` ``on`` learns ``theta`` [H_kv] (laid out like
    the KV heads: TP placement ``sharded_params``), ``backward`` has no parameter."""

    param_class = "v_scale"

    def __init__(self, n_kv_heads: int, base: float, mode: str):
        super().__init__()
        if mode not in ("on", "backward"):
            raise ValueError(f"VScale mode {mode!r}")
        self.base, self.mode = base, mode
        self.theta = nn.Parameter(torch.empty(n_kv_heads)) if mode == "on" else None

    def forward(self, v: torch.Tensor) -> torch.Tensor:
        if self.theta is None:
            return _BackwardOnly.apply(v, self.base)
        dt = torch.promote_types(v.dtype, torch.float32)
        c = self.base * torch.exp(local(self.theta).to(dt)).view(1, -1, 1, 1)
        return _radial_scale(v, c)

    def init_weights(self, init) -> None:
        if self.theta is not None:
            init.constant(self.theta, 0.0)


class HeadRMSNorm(nn.Module):
    """RMSNorm of each head's attention output [B, H_local, T, d_head] over d_head; the gain ``weight`` is
    [H * d_head], head-major (TP placement ``sharded_params``; parameter class ``head_norm``), or None."""

    param_class = "head_norm"

    def __init__(self, n_heads: int, head_dim: int, gain: bool = True, eps: float = HEAD_NORM_EPS):
        super().__init__()
        self.n_heads, self.head_dim, self.eps = n_heads, head_dim, eps
        self.weight = nn.Parameter(torch.empty(n_heads * head_dim)) if gain else None

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        yf = y.to(torch.promote_types(y.dtype, torch.float32))
        out = (yf * torch.rsqrt(yf.pow(2).mean(-1, keepdim=True) + self.eps)).to(y.dtype)
        if self.weight is None:
            return out
        return out * local(self.weight).view(1, -1, 1, self.head_dim).to(y.dtype)

    def init_weights(self, init, wv: nn.Linear) -> None:
        """The authors' calibration from the (initialised) value projection ``wv`` and a draw of ``z``."""
        if self.weight is None:
            return
        z = torch.empty(wv.in_features, dtype=torch.float32, device=init.device).normal_(generator=init.gen)
        bias = full(wv.bias) if wv.bias is not None else None
        init.value(self.weight, calibrated_gain(full(wv.weight), bias, z, self.n_heads, self.head_dim))


def calibrated_gain(w_v: torch.Tensor, b_v: torch.Tensor | None, z: torch.Tensor, n_heads: int,
                    head_dim: int) -> torch.Tensor:
    """``gamma`` [n_heads * head_dim]: for each query head, in every channel, the population std over head_dim of its
    KV head's part of ``W_V z + b_V``."""
    v0 = w_v.detach().to(z) @ z + (b_v.detach().to(z) if b_v is not None else 0)
    std = v0.view(-1, head_dim).std(-1, unbiased=False)  # [n_kv_heads]
    return std.repeat_interleave(n_heads // std.numel()).view(-1, 1).expand(n_heads, head_dim).reshape(-1)
