"""Super weights and super activations (Yu et al. 2024, "The Super Weight in Large Language Models", arXiv
2411.07191): detection, and the probe metric that tracks them through training.

The paper's rule (its Sec. 3.1, and the authors' ``analyze.check_module_hidden_states`` /
``plot_down_proj_input_output``, github.com/mengxiayu/LLMSuperWeight): run one forward pass, take in every
block's MLP down projection (``mlp.down_proj``; our ``feed_forward.w2``) the element of largest magnitude of its
input ``x`` [B, T, F] and of its output ``y`` [B, T, D] (the authors' top-1 of ``|tensor|``, reported as the
signed value); a layer whose input and output spikes both exceed |50| (the authors' ``spike_threshold=50``)
holds a super weight at ``W[row, col]`` with row = the output spike's channel and col = the input spike's channel.

Choices where the paper or the code leave one open:

* **Both spikes.** The authors print input and output spikes separately and pair them by eye; we call a layer a
  super-weight layer only when both exceed the threshold (the super activation is the output spike that the
  input spike times the super weight produces).
* **One per layer.** The rule's top-1 pass gives at most one super weight per layer (the authors' list has two
  in one layer for Llama-13B, found by means their code does not show); zeroing it and repeating the pass does not
  find a second one, since the input spike, made upstream, stays where it was. We keep the one pass.
* **Ties.** Among the elements of largest magnitude we take the smallest channel (and the largest signed value at
  it), a rule independent of how the batch is split over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn

from outlier_titan.models.smooth_swiglu import recording_scales
from outlier_titan.observe.metrics import F64, register_metric

SPIKE_THRESHOLD = 50.0
"""|activation| above which a down projection's input or output has a spike: the authors' ``spike_threshold=50``
(``plot_down_proj_input_output``; the same 50 in ``plot_max_activation_ablation``)."""


@dataclass(frozen=True)
class SuperWeight:
    """One detected super weight: block ``layer``, ``W[row, col]`` of its down projection, and the spikes."""

    layer: str
    row: int
    col: int
    weight: float
    act_in: float
    """The down projection's input spike (signed), at channel ``col``."""
    act_out: float
    """Its output spike (signed), the super activation, at channel ``row``."""


def down_projections(model: nn.Module) -> dict[str, nn.Linear]:
    """Every block's MLP down projection (``layers[i].feed_forward.w2``) by block name."""
    out = {}
    for name, block in model.layers.items():
        w2 = getattr(getattr(block, "feed_forward", None), "w2", None)
        if isinstance(w2, nn.Linear):
            out[name] = w2
    return out


def plain_down_io(model: nn.Module, name: str, x_in: torch.Tensor, x_out: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``name``'s down-projection input and output as the plain SwiGLU has them: under Smooth-SwiGLU w2 reads
    the linear branch divided per token by a scale (``models/smooth_swiglu.py``; recorded by the forward inside
    ``recording_scales``), which the rule must not see; otherwise as they are."""
    mlp = model.layers[name].feed_forward
    scale = getattr(mlp, "smooth_scale", None)
    return (x_in, x_out) if scale is None else scale.plain(x_in, x_out, mlp.w2.bias)


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def spike(x: torch.Tensor, global_max: Callable[[torch.Tensor], torch.Tensor] = _identity
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed value, channel) of the element of largest |x| over all but the last dim of ``x`` [..., C], as
    float64 scalars; ties go to the smallest channel, then the largest value. ``global_max`` reduces a float64
    vector element-wise with max over the ranks that hold other parts of the batch (identity: one shard). No host
    sync."""
    a = x.detach().to(F64).reshape(-1, x.shape[-1])
    mag = a.abs()
    at_peak = mag == global_max(mag.amax().reshape(1))[0]  # [N, C]
    channels = torch.arange(a.shape[-1], device=a.device, dtype=F64)
    lowest = torch.where(at_peak.any(0), -channels, -float("inf")).amax()  # the smallest channel here: max of -c
    channel = -global_max(lowest.reshape(1))[0]
    value = global_max(torch.where(at_peak & (channels == channel), a, -float("inf")).amax().reshape(1))[0]
    return value, channel


@torch.no_grad()
def layer_spikes(model: nn.Module, tokens: torch.Tensor) -> dict[str, dict[str, float]]:
    """One forward pass; per block the down projection's input and output spikes (:func:`spike`) as
    ``{"in": v, "in_channel": c, "out": v, "out_channel": r}``."""
    found: dict[str, dict[str, float]] = {}
    handles = []
    for name, lin in down_projections(model).items():
        def hook(_m, inputs, output, name=name):
            x_in, x_out = plain_down_io(model, name, inputs[0], output)
            v_in, c_in = spike(x_in)
            v_out, c_out = spike(x_out)
            found[name] = {"in": float(v_in), "in_channel": float(c_in), "out": float(v_out),
                           "out_channel": float(c_out)}
        handles.append(lin.register_forward_hook(hook))
    try:
        with recording_scales(model):
            model(tokens)
    finally:
        for h in handles:
            h.remove()
    return found


def detect(model: nn.Module, tokens: torch.Tensor, threshold: float = SPIKE_THRESHOLD) -> list[SuperWeight]:
    """The super weights of ``model`` on ``tokens`` [B, T] by the paper's rule (module docstring): one forward
    pass; each layer whose down projection's input and output spikes both exceed ``threshold`` gives
    ``W[output spike's channel, input spike's channel]``."""
    projections = down_projections(model)
    found = []
    for name, s in layer_spikes(model, tokens).items():
        if abs(s["in"]) > threshold and abs(s["out"]) > threshold:
            row, col = int(s["out_channel"]), int(s["in_channel"])
            weight = float(projections[name].weight.detach()[row, col])
            found.append(SuperWeight(name, row, col, weight, s["in"], s["out"]))
    return found


# ----------------------------------------------------------------------------------------------------------
# The probe metric (reads the down projection: metrics.DownProjInput)


def _sums(d) -> dict[str, torch.Tensor]:
    """One layer's spikes (already the maxima over the data-parallel ranks: ``global_max`` inside) and the
    weight's row at the output spike's channel, the same on every rank; ``n`` counts the ranks, whose sum
    divides them out in :func:`_finalize`. Batches pool by :func:`_pool`, not by addition."""
    v_in, c_in = spike(d.x_in, d.global_max)
    v_out, c_out = spike(d.x_out, d.global_max)
    w = d.weight.detach().to(F64)
    rows = torch.arange(w.shape[0], device=w.device, dtype=F64)
    w_row = w[rows == c_out].sum(0)  # W[row, :] without a host sync
    return {"n": d.count(1), "in": v_in, "in_channel": c_in, "out": v_out, "out_channel": c_out, "w_row": w_row}


def _later_wins(a: dict, b: dict, side: str) -> torch.Tensor:
    """Whether batch ``b``'s spike on ``side`` beats ``a``'s: larger |value|, then smaller channel, then larger
    value (:func:`spike`'s order, so pooled batches give the spike of their union)."""
    va, vb, ca, cb = a[side], b[side], a[f"{side}_channel"], b[f"{side}_channel"]
    return (vb.abs() > va.abs()) | ((vb.abs() == va.abs()) & ((cb < ca) | ((cb == ca) & (vb > va))))


def _pool(a: dict, b: dict) -> dict:
    """Two batches' sums -> those of both: each side's spike from the batch that holds the larger one."""
    take_in, take_out = _later_wins(a, b, "in"), _later_wins(a, b, "out")
    out = {"n": a["n"]}
    out.update({k: torch.where(take_in, b[k], a[k]) for k in ("in", "in_channel")})
    out.update({k: torch.where(take_out, b[k], a[k]) for k in ("out", "out_channel", "w_row")})
    return out


def _finalize(s: dict[str, torch.Tensor]) -> dict[str, float]:
    """The layer's spikes, their channels, ``W[out channel, in channel]`` and the paper's flag."""
    n = float(s["n"])
    if n <= 0:
        return {}
    v_in, v_out = float(s["in"]) / n, float(s["out"]) / n
    c_in, c_out = round(float(s["in_channel"]) / n), round(float(s["out_channel"]) / n)
    return {"super_weight": float(abs(v_in) > SPIKE_THRESHOLD and abs(v_out) > SPIKE_THRESHOLD), "sa_in": v_in,
            "sa_in_channel": float(c_in), "sa_out": v_out, "sa_out_channel": float(c_out),
            "sw_value": float(s["w_row"][c_in]) / n}


SUPER_WEIGHTS = register_metric(
    "super_weight", ("super_weight", "sa_in", "sa_in_channel", "sa_out", "sa_out_channel", "sw_value"),
    "down_proj", _sums, _finalize,
    label="super weight (Yu et al. 2024): down-proj input/output spikes, their channels and W[out, in]",
    lower_is_better=None, averaged=("super_weight",), pool=_pool,
    shown={"report": ("super_weight",), "collect": ("super_weight",)})


def zero(model: nn.Module, coordinates: Iterable[tuple[str, int, int]]) -> None:
    """Sets ``W[row, col]`` of block ``layer``'s down projection to zero for each ``(layer, row, col)``."""
    projections = down_projections(model)
    with torch.no_grad():
        for layer, row, col in coordinates:
            projections[layer].weight[row, col] = 0.0
