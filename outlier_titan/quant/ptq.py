"""Post-training fake quantisation of a model's linear layers, scheme by scheme.

Every ``nn.Linear`` is a target (wq, wk, wv, wo, w1, w2, w3 and an untied head ``output``); embeddings,
norms, softmax and the QK^T / PV matmuls stay in full precision. ``w8a8_static`` also quantises the residual
stream where He et al. 2024's recipe (Bondarenko et al.'s) does and every model of this stack exposes it: the
embedding sum (the input of block 0) and the residual sum after each block (its output). Its other
quantisers (the residual sum after attention inside a block, norm outputs other than linear inputs,
attention scores and probabilities) are not applied. Weights are replaced by their fake-quantised
values; activation quantisers are forward (pre-)hooks. :func:`quantized` applies a scheme for the duration of
a ``with`` block and restores the exact original weights afterwards.

Schemes (the registry ``SCHEMES``, filled by :func:`register_scheme`; ``outlier-titan-evaluate --schemes``, its
default, its ``--help`` and the evaluation report read it, so a new scheme is one ``Scheme`` and one registration):

========================  ==================================  ==============================  ==============
name                      weights                              linear inputs                   linear outputs
========================  ==================================  ==============================  ==============
int8_fine                 absmax int8, per output channel      absmax int8, per feature         -
                                                               channel, dynamic (Kaul et al. 2024)
int8_fine_token           absmax int8, per output channel      absmax int8, per token, dynamic  -
int8_moderate             absmax int8, per tensor              absmax int8, per tensor, dyn.    -
int8_coarse               absmax int8, per tensor              absmax int8, per tensor, dyn.    same as inputs
int4_zeropoint            zeropoint int4, per output channel   -                                -
w8a8_static (He et al. 2024)    int8 symmetric, per tensor, MSE      uint8 asymmetric, per tensor,    same as inputs
                          clip                                 static calibrated ranges         (+ residual)
========================  ==================================  ==============================  ==============

Today's 4-bit schemes (QuaRot's conventions, Ashkboos et al. 2024, arXiv 2404.00456; head in full precision;
embeddings, norms, queries, softmax and the QK^T / PV matmuls in full precision):

=========================  ===========================================  ============================  ===============
name                       weights                                      linear inputs                 K and V (cache)
=========================  ===========================================  ============================  ===============
w8a8_dynamic               int8 symmetric absmax, per output channel    int8 symmetric absmax,        -
                                                                        per token, dynamic
w4a16_rtn                  int4 symmetric absmax, per output channel    -                             -
w4a4kv4_rtn                int4 symmetric absmax, per output channel    int4 symmetric absmax,        int4 asymmetric
                                                                        per token, dynamic            per head, token
w4a16_gptq, w4a4kv4_gptq   GPTQ on the int4 per-channel grid            as the _rtn scheme            as _rtn
``<scheme>_hadamard``      the same after a QuaRot rotation (quant/rotation.py): norms folded, residual stream
                           rotated by a seeded randomised Hadamard, online Hadamards on the wo and w2 inputs and on
                           K and V per head
=========================  ===========================================  ============================  ===============

A scheme may also edit the model instead of (or before) quantising it (``Scheme.edit``, restored afterwards):
``superweight_zero`` and its two controls zero super weights (Yu et al. 2024; :mod:`outlier_titan.quant.super_weight`).

GPTQ schemes calibrate on the report's calibration batches (one run per calibration seed); rotated schemes draw the
random signs from the same seed, so both report a spread over seeds.

Kaul et al. 2024 leaves the LM head unstated: its schemes quantise an untied head (a linear layer) and leave a tied
head (the embedding matrix) in full precision. He et al. 2024 keeps the head in full precision. The applied choice
is reported by :func:`quantized`. Kaul et al. 2024's "per-channel activations" is read as per feature channel
(its spec §6.2); ``int8_fine_token`` is the per-token (LLM.int8 "vector-wise") reading.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator

import torch
import torch.nn as nn

from outlier_titan.errors import UserError
from outlier_titan.models.layers import Attention
from outlier_titan.quant import quantizers as qz
from outlier_titan.quant.gptq import gptq_model
from outlier_titan.quant.rotation import kv_rotations, rotate


@dataclass(frozen=True)
class Scheme:
    name: str
    description: str
    weight: Callable[[torch.Tensor], torch.Tensor] | None
    act: str | None  # None | "channel" | "token" | "tensor" | "static"
    quantize_output: bool  # also quantise the linear's output activation (same kind as ``act``)
    head: bool  # quantise an untied LM head
    calibrate: bool = False
    quantize_residual: bool = False  # static only: the residual stream at block boundaries (He et al. 2024)
    # --- 4-bit schemes ---
    act_bits: int = 8  # dynamic activation quantisers: symmetric absmax at this width
    kv_bits: int | None = None  # K and V after RoPE: asymmetric per head, token and group of kv_group channels
    kv_group: int | None = None  # None: the whole head dim
    rotate: bool = False  # QuaRot rotation first (quant/rotation.py)
    gptq_bits: int | None = None  # GPTQ weights on the symmetric per-channel grid (quant/gptq.py)
    # --- model edits (quant/super_weight.py) ---
    edit: Callable[[nn.Module, list[torch.Tensor], int], dict] | None = None
    """(model, calibration batches, seed) -> a description; changes weights in place before the quantisers (the
    originals are restored after the ``with`` block)."""

    @property
    def seeded(self) -> bool:
        """Whether runs differ by seed (calibration batches or random rotation signs)."""
        return self.calibrate or self.rotate


def _w_int8_channel(w: torch.Tensor) -> torch.Tensor:
    return qz.absmax_quantize(w, 8, reduce_dims=(1,))


def _w_int8_tensor(w: torch.Tensor) -> torch.Tensor:
    return qz.absmax_quantize(w, 8, reduce_dims=None)


def _w_int4_zeropoint(w: torch.Tensor) -> torch.Tensor:
    return qz.zeropoint_quantize(w, 4, reduce_dims=(1,))


def _w_int4_channel(w: torch.Tensor) -> torch.Tensor:
    return qz.absmax_quantize(w, 4, reduce_dims=(1,))


def _w_int8_mse(w: torch.Tensor) -> torch.Tensor:
    return qz.symmetric_quantize(w, qz.mse_symmetric_clip(w, 8), 8)


SCHEMES: dict[str, Scheme] = {}
"""The registered schemes by name, in registration order (the report's order)."""


def register_scheme(scheme: Scheme) -> Scheme:
    """Makes ``scheme`` usable by name (``--schemes``, :func:`quantized`, the evaluation report)."""
    if not scheme.name or not scheme.name.replace("_", "").isalnum():
        raise UserError(f"quantisation scheme name {scheme.name!r} must be letters, digits and underscores")
    if scheme.name in SCHEMES:
        raise UserError(f"quantisation scheme {scheme.name!r} is already registered; pick another name")
    SCHEMES[scheme.name] = scheme
    return scheme


def get_scheme(name: str) -> Scheme:
    """The registered scheme; an unknown name is a one-line error listing the registered ones."""
    if name not in SCHEMES:
        raise UserError(f"quantisation scheme {name!r} is not registered; available: {', '.join(SCHEMES)}")
    return SCHEMES[name]


def check_schemes(names: Iterable[str], what: str = "quantisation scheme") -> list[str]:
    """``names`` as a list; one line naming every unknown one and the registered ones otherwise."""
    names = list(names)
    bad = [n for n in names if n not in SCHEMES]
    if bad:
        raise UserError(f"{what}: unknown {', '.join(bad)}; available: {', '.join(SCHEMES)}")
    return names


def scheme_help() -> str:
    """One line per registered scheme: its name and description (``--schemes``' help)."""
    return "; ".join(f"{s.name}: {s.description}" for s in SCHEMES.values())


for _s in (
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
    Scheme("w8a8_dynamic", "W8A8 dynamic: W int8 sym. per output channel, X int8 sym. per token, head FP",
           _w_int8_channel, "token", False, False),
    Scheme("w4a16_rtn", "W4A16 RTN: W int4 sym. per output channel, head FP", _w_int4_channel, None, False, False),
    Scheme("w4a4kv4_rtn", "W4A4KV4 RTN: W int4 sym. per output channel, X int4 sym. per token, K/V int4 asym. "
                          "per head and token, head FP", _w_int4_channel, "token", False, False, act_bits=4,
           kv_bits=4),
    Scheme("w4a16_gptq", "W4A16 GPTQ: W int4 sym. per output channel by GPTQ, head FP", None, None, False, False,
           calibrate=True, gptq_bits=4),
    Scheme("w4a4kv4_gptq", "W4A4KV4 GPTQ: W as w4a16_gptq, X and K/V as w4a4kv4_rtn, head FP", None, "token", False,
           False, calibrate=True, act_bits=4, kv_bits=4, gptq_bits=4),
):
    register_scheme(_s)
# QuaRot-rotated variants of the 4-bit schemes and of w8a8_dynamic
for _n in ("w8a8_dynamic", "w4a16_rtn", "w4a4kv4_rtn", "w4a16_gptq", "w4a4kv4_gptq"):
    register_scheme(replace(SCHEMES[_n], name=f"{_n}_hadamard", rotate=True,
                            description=SCHEMES[_n].description + ", after a QuaRot rotation"))


def _dynamic_act(kind: str, bits: int = 8) -> Callable[[torch.Tensor], torch.Tensor]:
    if kind == "channel":
        return lambda x: qz.absmax_quantize(x, bits, reduce_dims=tuple(range(x.dim() - 1)))
    if kind == "token":
        return lambda x: qz.absmax_quantize(x, bits, reduce_dims=(-1,))
    if kind == "tensor":
        return lambda x: qz.absmax_quantize(x, bits, reduce_dims=None)
    raise ValueError(f"unknown activation granularity {kind!r}")


def kv_quantizer(bits: int, group: int | None, rotation: torch.Tensor | None = None
                 ) -> Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """(k, v) [B, H, T, d_h] -> their fake-quantised values: asymmetric per head, token and channel group; with
    ``rotation`` (orthonormal d_h x d_h) quantised in the rotated basis, ``Q(x R) R^T``."""
    def fq(x: torch.Tensor) -> torch.Tensor:
        if rotation is None:
            return qz.group_zeropoint_quantize(x, bits, group)
        r = rotation.to(x.device)
        xr = (x.double() @ r).to(x.dtype)
        return (qz.group_zeropoint_quantize(xr, bits, group).double() @ r.t()).to(x.dtype)
    return lambda k, v: (fq(k), fq(v))


def linear_targets(model: nn.Module, include_head: bool) -> dict[str, nn.Linear]:
    """The linear layers a scheme quantises: every ``nn.Linear``, the top-level ``output`` head only if asked. The
    embedding projections (``model.embed_proj``: ``embed_proj``, ``head_proj``) are not: export folds them into the
    embedding and the head, so the deployed model has no such layers (the embedding stays in full precision as the
    folded one would; the head is quantised only if asked)."""
    head = getattr(model, "output", None)
    projs = [p for p in (getattr(model, "embed_proj", None), getattr(model, "head_proj", None)) if p is not None]
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and (include_head or m is not head) and all(m is not p for p in projs)}


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
              weight_cache: dict[str, torch.Tensor] | None = None, seed: int = 0) -> Iterator[dict]:
    """Applies a scheme inside the ``with`` block; yields a description of what was quantised, whose ``model``
    entry is the module to evaluate: ``model`` itself, or for rotated schemes a rotated copy (``model`` is
    left untouched).

    Static and GPTQ schemes calibrate on ``calib_batches`` (token tensors): static ones their activation ranges
    with the weights already quantised and the activations in full precision, GPTQ its Hessians. ``seed`` draws
    the random signs of a rotation. ``weight_cache`` (a dict, filled on first use) keeps the quantised weights of
    a deterministic weight quantiser so that repeated applications (calibration seeds) skip the weight
    quantisation, which for the MSE clip search is the expensive part.
    """
    s = get_scheme(scheme) if isinstance(scheme, str) else scheme
    if (s.act == "static" or s.gptq_bits or s.edit) and calib_batches is None:
        raise ValueError(f"scheme {s.name} needs calibration batches")
    work, rot_info = rotate(model, seed) if s.rotate else (model, None)
    head = getattr(model, "output", None)
    targets = linear_targets(work, include_head=s.head)
    head_state = ("fp (tied to the embedding)" if head is None and not s.rotate else
                  "quantised" if s.head else "fp")
    saved = {n: lin.weight.detach().clone() for n, lin in targets.items()} if work is model else {}
    stream = residual_stream_points(work) if s.act == "static" and s.quantize_residual else {}
    attentions = [m for m in work.modules() if isinstance(m, Attention)] if s.kv_bits else []
    handles = []
    edited = None
    try:
        with torch.no_grad():
            if s.edit is not None:
                edited = s.edit(work, list(calib_batches), seed)
            if s.gptq_bits:
                gptq_model(work, targets, calib_batches, s.gptq_bits)
            elif s.weight is not None:
                cache = weight_cache if not s.rotate else None
                for name, lin in targets.items():
                    if cache is not None and name in cache:
                        lin.weight.copy_(cache[name])
                        continue
                    wq = s.weight(lin.weight)
                    lin.weight.copy_(wq)
                    if cache is not None:
                        cache[name] = wq.detach().clone()
        if s.act == "static":
            ranges, stream_ranges = calibrate_ranges(work, targets, calib_batches, stream=stream)
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
            fq = _dynamic_act(s.act, s.act_bits)
            for lin in targets.values():
                handles.append(lin.register_forward_pre_hook(
                    lambda _m, args, f=fq: (f(args[0]),) + tuple(args[1:])))
                if s.quantize_output:
                    handles.append(lin.register_forward_hook(lambda _m, _a, out, f=fq: f(out)))
        kv_rot = kv_rotations(work, seed) if s.rotate and attentions else {}
        for att in attentions:
            att.kv_quant = kv_quantizer(s.kv_bits, s.kv_group, kv_rot.get(att))
        info = {"scheme": s.name, "description": s.description, "linear_layers": len(targets), "head": head_state,
                "residual_points": len(stream), "kv_cache": len(attentions), "model": work}
        if rot_info is not None:
            info["rotation"] = rot_info
        if edited is not None:
            info["edit"] = edited
        yield info
    finally:
        for h in handles:
            h.remove()
        for att in attentions:
            att.kv_quant = None
        with torch.no_grad():
            for n, lin in targets.items():
                if n in saved:
                    lin.weight.copy_(saved[n])
