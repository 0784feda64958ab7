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
            v_in, c_in = spike(inputs[0])
            v_out, c_out = spike(output)
            found[name] = {"in": float(v_in), "in_channel": float(c_in), "out": float(v_out),
                           "out_channel": float(c_out)}
        handles.append(lin.register_forward_hook(hook))
    try:
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
            found.append(SuperWeight(name, row, col, float(projections[name].weight.detach()[row, col]), s["in"], s["out"]))
    return found


# ----------------------------------------------------------------------------------------------------------
# The probe metric (reads the down projection: metrics.DownProjInput)


def _sums(d) -> dict[str, torch.Tensor]:
    """One layer's spikes and the weight at their crossing, the same on every rank (reduced with ``global_max``
    inside), with a count so that the probe's sum over ranks and batches finalises to their mean."""
    v_in, c_in = spike(d.x_in, d.global_max)
    v_out, c_out = spike(d.x_out, d.global_max)
    w = d.weight.detach().to(F64)
    rows = torch.arange(w.shape[0], device=w.device, dtype=F64)
    cols = torch.arange(w.shape[1], device=w.device, dtype=F64)
    value = w[rows == c_out][:, cols == c_in].sum()  # W[row, col] without a host sync
    flag = ((v_in.abs() > SPIKE_THRESHOLD) & (v_out.abs() > SPIKE_THRESHOLD)).to(F64)
    s = {"n": d.count(1), "in": v_in, "in_channel": c_in, "out": v_out, "out_channel": c_out, "weight": value,
         "flag": flag}
    s.update({f"{k}_sq": s[k].square() for k in ("in_channel", "out_channel")})
    return s


def _finalize(s: dict[str, torch.Tensor]) -> dict[str, float]:
    """The layer's values (means over the batches pooled; channels only when every batch agreed on them)."""
    n = float(s["n"])
    if n <= 0:
        return {}
    out = {"sa_in": float(s["in"]) / n, "sa_out": float(s["out"]) / n, "sw_value": float(s["weight"]) / n,
           "super_weight": float(s["flag"]) / n}
    for k, name in (("in_channel", "sa_in_channel"), ("out_channel", "sa_out_channel")):
        mean = float(s[k]) / n
        if abs(float(s[f"{k}_sq"]) / n - mean * mean) <= 1e-9 * max(1.0, mean * mean):
            out[name] = mean
    return out


SUPER_WEIGHTS = register_metric(
    "super_weight", ("super_weight", "sa_in", "sa_in_channel", "sa_out", "sa_out_channel", "sw_value"),
    "down_proj", _sums, _finalize,
    label="super weight (Yu et al. 2024): down-proj input/output spikes, their channels and W[out, in]",
    lower_is_better=None, averaged=("super_weight",),
    shown={"report": ("super_weight",), "collect": ("super_weight",)})


def zero(model: nn.Module, coordinates: Iterable[tuple[str, int, int]]) -> int:
    """Sets ``W[row, col]`` of block ``layer``'s down projection to zero for each ``(layer, row, col)``; the count."""
    projections = down_projections(model)
    n = 0
    with torch.no_grad():
        for layer, row, col in coordinates:
            projections[layer].weight[row, col] = 0.0
            n += 1
    return n
