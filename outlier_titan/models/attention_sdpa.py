"""Attention on SDPA's fused kernels, the pieces variants' SDPA forms use: plain causal SDPA, and on the CPU
softmax's output rescaled by the log-sum-exp the CPU flash kernel returns, ``out * sigmoid(lse - c_h)`` for a
per-head logit ``c_h`` (a softmax with one extra logit and no value), forward and backward.

The rescaled backward adds the gradient that reaches the scores through ``lse``. With ``w = sigmoid(lse - c)`` and
the upstream gradient ``g``, ``d out = w g`` and ``d lse_i = w_i (1 - w_i) g_i . out_i``, and ``lse``'s gradient
on the scores is ``P_ij d lse_i``. The flash backward forms ``dS_ij = P_ij (dO_i . v_j - D_i)`` with
``D_i = dO_i . out_i``; one extra channel (zero in q, k and v, one in ``out``, ``-d lse_i`` in ``dO``) turns
``D_i`` into ``D_i - d lse_i``, so one call of the kernel's own backward returns every gradient.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax attention over [B, H, T, d_h] (k, v with H heads) on SDPA's kernels."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _with_channel(x: torch.Tensor, value) -> torch.Tensor:
    """``x`` [..., d] with one more channel holding ``value`` (a number or a [...] tensor)."""
    extra = value.unsqueeze(-1).to(x.dtype) if torch.is_tensor(value) else torch.full_like(x[..., :1], value)
    return torch.cat([x, extra], dim=-1)


class LseRescaledFlash(torch.autograd.Function):
    """``softmax attention * sigmoid(lse - c_h)`` on the CPU's flash kernel, forward and backward (see above);
    ``apply(q, k, v, c, scale)`` with ``c`` [H]."""

    @staticmethod
    def forward(ctx, q, k, v, c, scale):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)[:2]
        dt = torch.promote_types(q.dtype, torch.float32)
        w = torch.sigmoid(lse.to(dt) - c.to(dt).view(1, -1, 1))
        ctx.save_for_backward(q, k, v, out, lse, w)
        ctx.scale, ctx.c_dtype = scale, c.dtype
        return (out.to(dt) * w.unsqueeze(-1)).to(q.dtype)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse, w = ctx.saved_tensors
        g = grad.to(w.dtype)
        d_lse = w * (1 - w) * (g * out.to(w.dtype)).sum(-1)
        grad_out = _with_channel((g * w.unsqueeze(-1)).to(q.dtype), -d_lse)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, _with_channel(q, 0.0), _with_channel(k, 0.0), _with_channel(v, 0.0), _with_channel(out, 1.0),
            lse, 0.0, True, scale=ctx.scale)
        d_c = -d_lse.sum(dim=(0, 2)).to(ctx.c_dtype)
        return dq[..., :-1], dk[..., :-1], dv[..., :-1], d_c, None
