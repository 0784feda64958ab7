"""Post-training fake quantisation of a model's linear layers, scheme by scheme.

Every ``nn.Linear`` is a target (wq, wk, wv, wo, w1, w2, w3 and an untied head ``output``); embeddings,
norms, softmax and the QK^T / PV matmuls stay in full precision. ``w8a8_static`` also quantises the residual
stream where seed 002's recipe (Bondarenko et al.'s) does and every model of this stack exposes it: the
embedding sum (the input of block 0) and the residual sum after each block (its output). Its other
quantisers (the residual sum after attention inside a block, norm outputs other than linear inputs,
attention scores and probabilities) are not applied. Weights are replaced by their fake-quantised
values; activation quantisers are forward (pre-)hooks. :func:`quantized` applies a scheme for the duration of
a ``with`` block and restores the exact original weights afterwards.

Schemes (``SCHEMES``):

========================  ==================================  ==============================  ==============
name                      weights                              linear inputs                   linear outputs
========================  ==================================  ==============================  ==============
int8_fine                 absmax int8, per output channel      absmax int8, per feature         -
                                                               channel, dynamic (seed 000)
int8_fine_token           absmax int8, per output channel      absmax int8, per token, dynamic  -
int8_moderate             absmax int8, per tensor              absmax int8, per tensor, dyn.    -
int8_coarse               absmax int8, per tensor              absmax int8, per tensor, dyn.    same as inputs
int4_zeropoint            zeropoint int4, per output channel   -                                -
w8a8_static (seed 002)    int8 symmetric, per tensor, MSE      uint8 asymmetric, per tensor,    same as inputs
                          clip                                 static calibrated ranges         (+ residual)
========================  ==================================  ==============================  ==============

Seed 000 leaves the LM head unstated: its schemes quantise an untied head (a linear layer) and leave a tied
head (the embedding matrix) in full precision. Seed 002 keeps the head in full precision. The applied choice
is reported by :func:`quantized`. Seed 000's "per-channel activations" is read as per feature channel
(its spec §6.2); ``int8_fine_token`` is the per-token (LLM.int8 "vector-wise") reading.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from outlier_titan.quant import quantizers as qz


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    weight: Callable[[torch.Tensor], torch.Tensor] | None
    act: str | None  # None | "channel" | "token" | "tensor" | "static"
    quantize_output: bool  # also quantise the linear's output activation (same kind as ``act``)
    head: bool  # quantise an untied LM head
    calibrate: bool = False
    quantize_residual: bool = False  # static only: the residual stream at block boundaries (seed 002)


def _w_int8_channel(w: torch.Tensor) -> torch.Tensor:
    return qz.absmax_quantize(w, 8, reduce_dims=(1,))


def _w_int8_tensor(w: torch.Tensor) -> torch.Tensor:
    return qz.absmax_quantize(w, 8, reduce_dims=None)


def _w_int4_zeropoint(w: torch.Tensor) -> torch.Tensor:
    return qz.zeropoint_quantize(w, 4, reduce_dims=(1,))


def _w_int8_mse(w: torch.Tensor) -> torch.Tensor:
    return qz.symmetric_quantize(w, qz.mse_symmetric_clip(w, 8), 8)


SCHEMES: dict[str, Scheme] = {s.name: s for s in (
    Scheme("int8_fine", "absmax int8: W per output channel, X per feature channel", _w_int8_channel,
           "channel", False, True),
    Scheme("int8_fine_token", "absmax int8: W per output channel, X per token", _w_int8_channel,
           "token", False, True),
    Scheme("int8_moderate", "absmax int8: W and X per tensor", _w_int8_tensor, "tensor", False, True),
    Scheme("int8_coarse", "absmax int8: W, X and Y per tensor", _w_int8_tensor, "tensor", True, True),
    Scheme("int4_zeropoint", "zeropoint int4: W per output channel, weights only", _w_int4_zeropoint,
           None, False, True),
    Scheme("w8a8_static", "W8A8 static: W int8 symmetric MSE per tensor, X and Y uint8 asymmetric "
                          "calibrated per tensor, residual stream at block boundaries too, head FP", _w_int8_mse,
           "static", True, False, calibrate=True, quantize_residual=True),
)}


def _dynamic_act(kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind == "channel":
        return lambda x: qz.absmax_quantize(x, 8, reduce_dims=tuple(range(x.dim() - 1)))
    if kind == "token":
        return lambda x: qz.absmax_quantize(x, 8, reduce_dims=(-1,))
    if kind == "tensor":
        return lambda x: qz.absmax_quantize(x, 8, reduce_dims=None)
    raise ValueError(f"unknown activation granularity {kind!r}")


def linear_targets(model: nn.Module, include_head: bool) -> dict[str, nn.Linear]:
    """The linear layers a scheme quantises: every ``nn.Linear``, the top-level ``output`` head only if asked."""
    head = getattr(model, "output", None)
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and (include_head or m is not head)}


def residual_stream_points(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Where the residual stream crosses block boundaries: ``embedding_sum`` (block 0's input) and
    ``residual_<i>`` (block i's output, the residual sum after its MLP); name -> (block, "input" | "output")."""
    blocks = list(getattr(model, "layers", {}).values())
    points = {"embedding_sum": (blocks[0], "input")} if blocks else {}
    points.update({f"residual_{i}": (b, "output") for i, b in enumerate(blocks)})
    return points


def calibrate_ranges(model: nn.Module, targets: dict[str, nn.Linear], batches: Iterable[torch.Tensor],
                     momentum: float = 0.9, pct: float | None = 99.999,
                     stream: dict[str, tuple[nn.Module, str]] | None = None
                     ) -> tuple[dict[str, tuple[qz.RunningMinMax, qz.RunningMinMax]], dict[str, qz.RunningMinMax]]:
    """Runs ``model`` on the calibration batches; (input, output) running ranges per target linear, and the
    running range at each residual-stream point of ``stream`` (see :func:`residual_stream_points`)."""
    ranges = {n: (qz.RunningMinMax(momentum, pct), qz.RunningMinMax(momentum, pct)) for n in targets}
    stream_ranges = {n: qz.RunningMinMax(momentum, pct) for n in stream or {}}
    handles = []
    for name, lin in targets.items():
        def hook(_m, inputs, output, r=ranges[name]):
            r[0].update(inputs[0])
            r[1].update(output)
        handles.append(lin.register_forward_hook(hook))
    for name, (block, where) in (stream or {}).items():
        r = stream_ranges[name]
        handles.append(block.register_forward_pre_hook(lambda _m, args, r=r: r.update(args[0])) if where == "input"
                       else block.register_forward_hook(lambda _m, _a, out, r=r: r.update(out)))
    seen = 0
    try:
        with torch.no_grad():
            for tokens in batches:
                model(tokens)
                seen += 1
    finally:
        for h in handles:
            h.remove()
    if seen == 0:
        raise ValueError("static quantisation needs at least one calibration batch")
    return ranges, stream_ranges


@contextmanager
def quantized(model: nn.Module, scheme: str | Scheme, calib_batches: Iterable[torch.Tensor] | None = None,
              weight_cache: dict[str, torch.Tensor] | None = None) -> Iterator[dict]:
    """Applies a scheme to ``model`` inside the ``with`` block; yields a description of what was quantised.

    Static schemes calibrate their activation ranges on ``calib_batches`` (token tensors) with the weights
    already quantised and the activations in full precision. ``weight_cache`` (a dict, filled on first use)
    keeps the quantised weights of this scheme so that repeated applications (calibration seeds) skip the
    weight quantisation, which for the MSE clip search is the expensive part.
    """
    s = SCHEMES[scheme] if isinstance(scheme, str) else scheme
    head = getattr(model, "output", None)
    targets = linear_targets(model, include_head=s.head)
    head_state = ("fp (tied to the embedding)" if head is None else
                  "quantised" if s.head else "fp")
    saved = {n: lin.weight.detach().clone() for n, lin in targets.items()}
    stream = residual_stream_points(model) if s.act == "static" and s.quantize_residual else {}
    handles = []
    try:
        with torch.no_grad():
            if s.weight is not None:
                for name, lin in targets.items():
                    if weight_cache is not None and name in weight_cache:
                        lin.weight.copy_(weight_cache[name])
                        continue
                    wq = s.weight(lin.weight)
                    lin.weight.copy_(wq)
                    if weight_cache is not None:
                        weight_cache[name] = wq.detach().clone()
        if s.act == "static":
            if calib_batches is None:
                raise ValueError(f"scheme {s.name} needs calibration batches")
            ranges, stream_ranges = calibrate_ranges(model, targets, calib_batches, stream=stream)
            for name, lin in targets.items():
                p_in, p_out = ranges[name][0].params(8), ranges[name][1].params(8)
                handles.append(lin.register_forward_pre_hook(
                    lambda _m, args, p=p_in: (qz.asymmetric_quantize(args[0], *p, 8),) + tuple(args[1:])))
                if s.quantize_output:
                    handles.append(lin.register_forward_hook(
                        lambda _m, _a, out, p=p_out: qz.asymmetric_quantize(out, *p, 8)))
            for name, (block, where) in stream.items():
                p = stream_ranges[name].params(8)
                handles.append(block.register_forward_pre_hook(
                    lambda _m, args, p=p: (qz.asymmetric_quantize(args[0], *p, 8),) + tuple(args[1:]))
                    if where == "input" else
                    block.register_forward_hook(lambda _m, _a, out, p=p: qz.asymmetric_quantize(out, *p, 8)))
        elif s.act is not None:
            fq = _dynamic_act(s.act)
            for lin in targets.values():
                handles.append(lin.register_forward_pre_hook(
                    lambda _m, args, f=fq: (f(args[0]),) + tuple(args[1:])))
                if s.quantize_output:
                    handles.append(lin.register_forward_hook(lambda _m, _a, out, f=fq: f(out)))
        yield {"scheme": s.name, "description": s.description, "linear_layers": len(targets), "head": head_state,
               "residual_points": len(stream)}
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for n, lin in targets.items():
                lin.weight.copy_(saved[n])
