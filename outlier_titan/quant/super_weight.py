"""Zeroing super weights (Yu et al. 2024, arXiv 2411.07191) as evaluation schemes, and the paper's controls.

Each scheme edits the model before the perplexity pass (``Scheme.edit``; the weights are restored afterwards) and
quantises nothing, so its Δppl in the evaluation report is the cost of the edit:

* ``superweight_zero``: the super weights that :func:`outlier_titan.observe.super_weights.detect` finds on the
  first calibration batch (the paper's one forward pass on any input) set to zero (the paper's "Prune SW").
* ``superweight_random``: as many weights of the down projections, drawn at random (seeded), the super weights
  excepted: is the harm of one weight more than that of any weight?
* ``superweight_topk``: as many of the largest-magnitude down-projection weights other than the super weights
  (the paper's contrast of the super weight with the other large outliers, "Prune Non-SW"; it prunes the
  thousands of largest weights, we prune as many as there are super weights so that the two Δppl compare weight
  for weight).

A model without a super weight zeroes nothing under all three (the report's ``edit`` entry lists what was zeroed).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from outlier_titan.observe.super_weights import SPIKE_THRESHOLD, detect, down_projections, zero
from outlier_titan.quant.ptq import Scheme, register_scheme

Coordinate = tuple[str, int, int]


def _super(model: nn.Module, batches: list[torch.Tensor]) -> list[Coordinate]:
    return [(s.layer, s.row, s.col) for s in detect(model, batches[0], SPIKE_THRESHOLD)]


def _flat_candidates(model: nn.Module, exclude: list[Coordinate]) -> tuple[list[tuple[str, int]], torch.Tensor]:
    """The down projections' weights as one flat vector of |w| (the super weights set to -1: never chosen), and
    each projection's (layer, offset) in it."""
    parts, offsets, at = [], [], 0
    for name, lin in down_projections(model).items():
        w = lin.weight.detach().abs().to(torch.float64).clone()
        for layer, row, col in exclude:
            if layer == name:
                w[row, col] = -1.0
        offsets.append((name, at))
        parts.append(w.reshape(-1))
        at += w.numel()
    return offsets, torch.cat(parts)


def _coordinates(model: nn.Module, offsets: list[tuple[str, int]], flat_index: torch.Tensor) -> list[Coordinate]:
    projections = down_projections(model)
    out = []
    for i in flat_index.tolist():
        name, at = max((o for o in offsets if o[1] <= i), key=lambda o: o[1])
        cols = projections[name].weight.shape[1]
        out.append((name, (i - at) // cols, (i - at) % cols))
    return out


def _edit(kind: str):
    def edit(model: nn.Module, batches: list[torch.Tensor], seed: int) -> dict:
        supers = _super(model, batches)
        if kind == "zero" or not supers:
            chosen = supers
        else:
            offsets, mag = _flat_candidates(model, supers)
            if kind == "random":
                g = torch.Generator().manual_seed(seed)
                allowed = (mag >= 0).nonzero().reshape(-1)
                index = allowed[torch.randperm(allowed.numel(), generator=g)[:len(supers)]]
            else:
                index = torch.topk(mag, len(supers)).indices
            chosen = _coordinates(model, offsets, index)
        zero(model, chosen)
        return {"super_weights": [list(c) for c in supers], "zeroed": [list(c) for c in chosen]}
    return edit


for _name, _kind, _what in (
        ("superweight_zero", "zero", "the detected super weights zeroed (Yu et al. 2024)"),
        ("superweight_random", "random", "as many random down-projection weights zeroed (control)"),
        ("superweight_topk", "topk", "as many of the largest other down-projection weights zeroed (control)")):
    register_scheme(Scheme(_name, _what + ", nothing quantised", None, None, False, False, calibrate=True,
                           edit=_edit(_kind)))
