"""Smooth-SwiGLU (``model.smooth_swiglu``, an option of the ``pre_ln`` and ``op`` specs with ``model.mlp = "swiglu"``).

Fishman, Chmiel, Banner, Soudry 2024, "Scaling FP8 training to trillion-token LLMs" (arXiv 2409.12517, ICLR 2025;
the authors' code github.com/Anonymous1252022/Megatron-DeepSpeed): late in long runs SwiGLU's two input
projections align, its product ``silu(w1 x) * (w3 x)`` grows quadratically in rare tokens, and those tokens set a
per-tensor FP8 scale that flushes every other token of the down projection's input. Smooth-SwiGLU divides the
linear branch by a scale before that input is quantised and multiplies the down projection's output by it again:

    s = max_j |(w3 x)_j|          per token, over the hidden units, not differentiated
    y = w2(silu(w1 x) * (w3 x) / s) * s          (w2's bias added after the product)

In exact arithmetic ``y`` is the plain SwiGLU MLP's output for any ``s`` (``w2`` is linear), so the option changes
nothing but rounding until ``w2``'s input is quantised: a low-precision training recipe with one scale per tensor
(``low_precision.recipe = "fp8_tensorwise"``; NVFP4 too, whose block scales sit under one scale per tensor) or a
PTQ scheme's per-tensor activation quantiser. Under ``fp8_rowwise`` and MX every token has scales of its own and
the option changes little (tests/test_smooth_swiglu.py measures each).

Our reading, where the paper and the code differ: the paper writes the factor per channel; the released code
(``ScaledSwiglu`` in ``experimental/fp8_linear.py``, with its 7B script's settings: not delayed, detached), which we
follow, computes one factor per token, the max of |linear branch| over the hidden units, and scales the down
projection's output before its bias. Where the code is silent we chose: the max runs over every tensor-parallel
shard of the hidden units (the code takes each rank's own max and rescales after the all-reduce, exact at TP 1
only), and a token whose linear branch is all zero keeps ``s = 1``.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn as nn

from outlier_titan.errors import ConfigError
from outlier_titan.options import opt
from outlier_titan.tensors import full, local


@dataclass
class SmoothSwiGLUOptions:
    """The option, mixed into the options of the specs built on :class:`~outlier_titan.models.layers.MLP`."""

    smooth_swiglu: bool = opt(False, "Smooth-SwiGLU (Fishman et al. 2024, arXiv 2409.12517): SwiGLU's linear branch "
                                     "divided per token by its max |value| over the hidden units before w2, w2's "
                                     "output multiplied back (the authors' code); exact in full precision, it "
                                     "changes what a per-tensor FP8 recipe or PTQ quantiser sees. Needs mlp = "
                                     "swiglu.")


def check_smooth_swiglu(args) -> None:
    """A one-line error where the option cannot apply."""
    if args.smooth_swiglu and args.mlp != "swiglu":
        raise ConfigError(f"model.smooth_swiglu rescales SwiGLU's linear branch, but model.mlp = {args.mlp!r}; "
                          f"set model.mlp = \"swiglu\" or model.smooth_swiglu = false")


class TokenScale(nn.Module):
    """Smooth-SwiGLU's ``s``: per token, the max |value| of the linear branch over its last (hidden-unit) dim, not
    differentiated. Under tensor parallelism the plan (``parallel/tensor_parallel.py`` ``MaxOverShards``) reduces
    it over the ranks' hidden units and sets ``sequence_shard``, the (rank, size) whose sequence chunk a
    sequence-sharded output holds."""

    sequence_shard: tuple[int, int] | None = None
    record = False  # on for one forward of a reader of w2's input and output (:func:`recording_scales`)
    last: torch.Tensor | None = None  # the scale of that forward, [B, T, 1], every token

    def forward(self, linear_branch: torch.Tensor) -> torch.Tensor:
        return linear_branch.detach().abs().amax(-1, keepdim=True)

    def rows_of(self, s: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``s`` [B, T, 1] for the tokens ``out`` holds: all of them, or a TP rank's sequence chunk."""
        if out.shape[1] == s.shape[1]:
            return s
        if self.sequence_shard is None:
            raise RuntimeError(f"Smooth-SwiGLU: w2's output holds {out.shape[1]} of {s.shape[1]} tokens, "
                               f"but no tensor-parallel plan set the sequence shard")
        rank, size = self.sequence_shard
        return s.chunk(size, dim=1)[rank]

    def plain(self, x_in: torch.Tensor, x_out: torch.Tensor, bias: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """w2's whole input [B, T, F] and output [B, T, D] of the recorded forward as the plain SwiGLU has them:
        the super-weight rule (Yu et al. 2024) reads the model's down projection, not its rescaled operands."""
        s = self.last
        if s is None:
            raise RuntimeError("Smooth-SwiGLU: no scale recorded; read w2 inside recording_scales(model)")
        return x_in * s, _times_scale(x_out, s, None if bias is None else full(bias).detach())


@contextmanager
def recording_scales(model: nn.Module):
    """Every Smooth-SwiGLU scale of ``model`` keeps its ``s`` for the forwards inside the block (a reader of w2's
    input and output undoes the rescaling with :meth:`TokenScale.plain`); nothing is kept afterwards."""
    scales = [m for m in model.modules() if isinstance(m, TokenScale)]
    for m in scales:
        m.record = True
    try:
        yield
    finally:
        for m in scales:
            m.record, m.last = False, None


def smoothed_down(w2: nn.Linear, gate: torch.Tensor, linear_branch: torch.Tensor, scale: TokenScale) -> torch.Tensor:
    """``w2(gate * linear_branch / s) * s`` (+ w2's bias after the product), ``s`` from ``scale``."""
    s = scale(linear_branch)
    s = torch.where(s > 0, s, 1.0)
    if scale.record:
        scale.last = s
    y = w2(gate * (linear_branch / s))
    return _times_scale(y, scale.rows_of(s, y), None if w2.bias is None else local(w2.bias))


def _times_scale(y: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """A linear layer's output ``y`` (its ``bias`` included) for an input ``s`` times larger: ``(y - b) s + b``."""
    return y * s if bias is None else (y - bias) * s + bias
