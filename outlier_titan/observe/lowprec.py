"""What the probe sees of low-precision training: for every cast module (one that carries ``lowprec_recipe``, the
``[low_precision]`` conversion's mark), the statistics of each tensor its GEMMs cast, in the format its recipe
casts it to, on the probe batch.

Tensor classes (``<cls>``): ``act`` (the forward input, cast along the in-features), ``weight`` (cast along the
in-features) and ``grad`` (the output gradient as the input-gradient GEMM casts it, along the out-features; only
with ``observe.gradients``, whose backward gives it). The weight-gradient GEMM's casts along the tokens (and a
recipe's random Hadamard transform there) are not measured, and a stochastically rounded gradient is measured at
round-to-nearest (its expected error, not one draw's). Module groups (``<group>``): ``attn`` (the cast modules
inside an Attention) and ``mlp`` (the rest of the block). Per block, group and class (``lp_<cls>_<group>_<q>``):

* ``amax``: the largest |x|; ``scale_min`` / ``scale_max``: the smallest and largest scale the cast chose;
* ``underflow``: the share of the nonzero elements that quantise to 0;
* ``saturation``: the share of the elements clamped at the format's largest value;
* ``snr_db``: the quantisation signal-to-noise ratio ``10 log10(sum x^2 / sum (x - q(x))^2)`` over the group's
  elements (inf when every element is exact);
* ``block_dr`` (block formats only): the largest ``max |x| / min nonzero |x|`` inside one scaling block.

A tensor-level scale (FP8 tensorwise, NVFP4's FP32 second level) of an activation or gradient is taken per probe
sequence, not over the probe batch: training takes it over a micro-batch, whose size depends on the layout and
the accumulation, and a per-sequence scale makes the value the same however the probe batch is split over the
data-parallel ranks (row and block scales are per token, the same either way). The sums come from
``lowprec.formats.cast_stats`` and reduce like every probe metric: counts and squares add up
over ranks, maxima by max (``scale_min`` as the maximum of its negation). Every tensor is whole before it is cast
(DTensors gathered, sequence- or feature-sharded TP shards all-gathered), since a row or tensor scale over a TP
shard would differ from one rank's; the gathered tensors count once (TP rank 0), the weight once over the
data-parallel ranks too, so every layout gives one rank's value.

``observe.lowprec_recipe`` names the recipe to measure with instead of the modules' own; in a BF16 run (no cast
modules) it measures every ``nn.Linear`` of the blocks as that recipe would cast it: FOG's question (Hernandez-Cano
et al. 2025, arXiv 2505.20524) of whether a model's activations would survive a format, asked of a BF16 run.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from outlier_titan.config.manager import check_lowprec_recipe
from outlier_titan.lowprec.formats import cast_stats
from outlier_titan.lowprec.recipes import RECIPES
from outlier_titan.models.layers import Attention
from outlier_titan.observe.metrics import CastInput, Headline, add_sums, register_metric
from outlier_titan.tensors import gathered

GROUPS = ("attn", "mlp")
CLASSES = {"act": "input", "weight": "weight", "grad": "grad_output"}
"""Tensor class -> the recipe's field that casts it."""
QUANTITIES = ("amax", "scale_min", "scale_max", "underflow", "saturation", "snr_db", "block_dr")
SHARES = ("underflow", "saturation")
ADDED = ("n", "nonzero", "underflow", "saturated", "sig_sq", "err_sq")  # cast_stats' sums
MAXED = ("amax", "scale_max", "scale_min", "block_dr")  # cast_stats' maxima (scale_min: a minimum, negated)
CASTS = "casts"  # the probe's stream key of a cast module's output: (CASTS, layer, module name)
OFF = "bf16"
_NAME = re.compile(r"^lp_(act|weight|grad)_(attn|mlp)_(.+)$")


def name(cls: str, group: str, quantity: str) -> str:
    return f"lp_{cls}_{group}_{quantity}"


def recipe_named(key: str):
    """The recipe ``observe.lowprec_recipe`` names; one-line ConfigError for an unknown one."""
    check_lowprec_recipe(key)
    return RECIPES[key]


def cast_modules(model: nn.Module, override: str = "") -> dict[str, list[tuple[str, nn.Module, str, object]]]:
    """``{layer: [(module name, module, group, recipe)]}`` of the modules the probe measures: those carrying
    ``lowprec_recipe`` (cast as ``override`` where it names a recipe), or, when none does and ``override`` names
    one, every ``nn.Linear`` of the blocks; nothing for ``override = "bf16"``."""
    if override == OFF:
        return {}
    forced = recipe_named(override) if override else None
    marked = any(getattr(m, "lowprec_recipe", None) is not None for m in model.modules())
    if not marked and forced is None:
        return {}
    out = {}
    for layer, block in model.layers.items():
        in_attention = {id(m) for a in block.modules() if isinstance(a, Attention) for m in a.modules()}
        picked = []
        for mod_name, m in block.named_modules():
            own = getattr(m, "lowprec_recipe", None)
            if own is not None or (not marked and isinstance(m, nn.Linear)):
                picked.append((mod_name, m, "attn" if id(m) in in_attention else "mlp", forced or own))
        if picked:
            out[layer] = picked
    return out


class CastTaps:
    """The probe's hooks on the cast modules of one model: the forward's ``casts`` sums per block, and the output
    tensors kept for the backward's ``cast_gradient`` sums."""

    def __init__(self, model: nn.Module, override: str, forward: list, backward: list, tp_mesh,
                 weight_counted: bool):
        self.forward, self.backward = forward, backward
        self.modules = cast_modules(model, override) if forward or backward else {}
        self.tp_mesh, self.weight_counted = tp_mesh, weight_counted
        self.found = {(layer, n): (recipe, group, m.weight.shape[0])
                      for layer, mods in self.modules.items() for n, m, group, recipe in mods}

    def hooks(self, res: dict, rep: dict, streams: dict | None, seq_len: int) -> list:
        """Forward hooks that add each cast module's sums to ``res[layer]`` (and keep its output in ``streams``
        for the backward); ``rep["res"]``: the gathered tensors are the same on every TP rank."""
        seen: set = set()  # a module's first call only (an activation-checkpointing recompute calls it again)
        last: dict = {}  # the last input gathered, and its casts' statistics: wq, wk and wv read one tensor

        def hook(layer, mod_name):
            recipe, group, _ = self.found[(layer, mod_name)]

            def tap(module, inputs, output):
                if (layer, mod_name) in seen:
                    return
                seen.add((layer, mod_name))
                rep["res"] |= self.tp_mesh is not None
                if self.forward:
                    x, w = inputs[0], module.weight
                    if last.get("source") is not x:
                        shape = (*x.shape[:-2], seq_len, w.shape[1]) if x.dim() >= 3 else (*x.shape[:-1], w.shape[1])
                        last.clear()
                        last.update(source=x, act=gathered(x.detach(), shape, self.tp_mesh), shared={})
                    weight = gathered(w.detach(), tuple(w.shape), self.tp_mesh)
                    inp = CastInput(recipe, group, act=last["act"], weight=weight,
                                    weight_counted=self.weight_counted, shared=last["shared"])
                    _add(res, layer, {m.key: m.sums(inp) for m in self.forward})
                if streams is not None and self.backward:
                    streams[(CASTS, layer, mod_name)] = output
            return torch.compiler.disable(tap)

        return [m.register_forward_hook(hook(layer, n)) for layer, mods in self.modules.items() for n, m, _, _ in mods]

    def gradient(self, res: dict, key: tuple, g: torch.Tensor, seq_len: int) -> None:
        """Adds the ``cast_gradient`` sums of one module's output gradient ``g`` (its stream ``key``) to ``res``;
        the last position has no target in the probe batch (its gradient is 0) and is left out."""
        _, layer, mod_name = key
        recipe, group, out_features = self.found[(layer, mod_name)]
        g = gathered(g.detach(), (g.shape[0], seq_len, out_features), self.tp_mesh)[:, :-1]
        _add(res, layer, {m.key: m.sums(CastInput(recipe, group, grad=g)) for m in self.backward})


def _add(res: dict, layer: str, sums: dict) -> None:
    per_metric = res.setdefault(layer, {})
    for key, s in sums.items():
        per_metric[key] = add_sums(per_metric.get(key), s)


def _sums(cls: str):
    def sums(inp: CastInput) -> dict[str, torch.Tensor]:
        """One module's cast of ``cls`` as sums laid out for both groups (the other group's are empty), so that a
        block's modules add up per group."""
        x = getattr(inp, cls)
        cast = getattr(inp.recipe, CLASSES[cls])
        s = inp.shared.get((cls, cast))
        if s is None:
            s = _stats(x, cast, per_sequence=cls != "weight")
            if cls == "act":  # the next module reading this input with this cast reuses it
                inp.shared[(cls, cast)] = s
        keep = 0.0 if cls == "weight" and not inp.weight_counted else 1.0
        zero, low = s["n"].new_zeros(()), s["n"].new_full((), float("-inf"))
        out = {}
        for g in GROUPS:
            mine = g == inp.group
            out.update({f"{g}_{k}": s[k] * keep if mine else zero for k in ADDED})
            seen = {"amax": s["amax"], "scale_max": s["scale_max"], "scale_min": -s["scale_min"],
                    "block_dr": s["block_dr"] if cast.scaling == "block" else low}
            out.update({f"max_{g}_{k}": seen[k] if mine else low for k in MAXED})
        return out
    return sums


def _stats(x: torch.Tensor, cast, per_sequence: bool) -> dict[str, torch.Tensor]:
    """cast_stats of ``x`` along its last axis; a tensor-level scale (FP8 tensorwise, NVFP4's FP32 one) of an
    activation or gradient per sequence, whatever the ranks' split (row and block scales are per token: the same
    for a batch and for its sequences)."""
    if per_sequence and (cast.scaling == "tensor" or cast.scale == "e4m3"):
        return _pooled([cast_stats(seq, cast, -1) for seq in x])
    return cast_stats(x, cast, -1)


def _pooled(stats: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """cast_stats of several tensors as one: sums added, maxima by max, ``scale_min`` by min."""
    out = {k: torch.stack([s[k] for s in stats]).sum() for k in ADDED}
    out.update({k: torch.stack([s[k] for s in stats]).amax() for k in MAXED if k != "scale_min"})
    out["scale_min"] = torch.stack([s["scale_min"] for s in stats]).amin()
    return out


def _finalize(cls: str):
    def finalize(s: dict[str, torch.Tensor]) -> dict[str, float]:
        out = {}
        for g in GROUPS:
            n, nonzero, err = float(s[f"{g}_n"]), float(s[f"{g}_nonzero"]), float(s[f"{g}_err_sq"])
            if n <= 0:
                continue
            sig = float(s[f"{g}_sig_sq"])
            out.update({name(cls, g, "amax"): float(s[f"max_{g}_amax"]),
                        name(cls, g, "scale_min"): -float(s[f"max_{g}_scale_min"]),
                        name(cls, g, "scale_max"): float(s[f"max_{g}_scale_max"]),
                        name(cls, g, "underflow"): float(s[f"{g}_underflow"]) / nonzero if nonzero > 0 else 0.0,
                        name(cls, g, "saturation"): float(s[f"{g}_saturated"]) / n,
                        name(cls, g, "snr_db"): 10 * math.log10(sig / err) if err > 0 else math.inf})
            if math.isfinite(dr := float(s[f"max_{g}_block_dr"])):
                out[name(cls, g, "block_dr")] = dr
        return out
    return finalize


def picture_rows(scalars: dict[str, float], prefix: str = "outliers") -> tuple[list[str], list[str], dict]:
    """``(layers, columns "<cls> <group>", {quantity: [layers x columns] values, NaN where absent})`` of the
    underflow share, saturation share and SNR from a probe's scalars (TensorBoard's ``outliers/lowprec``)."""
    values: dict[tuple[str, str], dict[str, float]] = {}
    for key, v in scalars.items():
        layer, _, metric = key.removeprefix(f"{prefix}/layer_").partition("/")
        m = _NAME.match(metric) if key.startswith(f"{prefix}/layer_") else None
        if m and m.group(3) in SHARES + ("snr_db",):
            values.setdefault((layer, f"{m.group(1)} {m.group(2)}"), {})[m.group(3)] = v
    layers = list(dict.fromkeys(layer for layer, _ in values))
    columns = [f"{c} {g}" for c in CLASSES for g in GROUPS if any((n, f"{c} {g}") in values for n in layers)]
    table = {q: [[values.get((n, c), {}).get(q, math.nan) for c in columns] for n in layers]
             for q in SHARES + ("snr_db",)}
    return layers, columns, table


for _rank, _cls in enumerate(CLASSES):
    _names = tuple(name(_cls, g, q) for g in GROUPS for q in QUANTITIES)
    _read = {"act": "activation (forward input)", "weight": "weight",
             "grad": "output gradient (observe.gradients)"}[_cls]
    register_metric(
        f"lowprec_{_cls}", _names, "cast_gradient" if _cls == "grad" else "casts", _sums(_cls), _finalize(_cls),
        label=f"low-precision cast of the {_read}: amax, scales, underflow / saturation shares, SNR dB, "
              "block dynamic range", lower_is_better=None, partial=True,  # blocks left in BF16 have none
        # a sweep's final_ / peak_ columns (not scripts/analyze.py's default panels: a BF16 run has none of these)
        shown={"collect": tuple(name(_cls, g, q) for g in GROUPS
                                for q in ("snr_db",) + (("underflow",) if _cls != "weight" else ()))},
        headline=(Headline(f"{_cls} SNR dB", (name(_cls, "attn", "snr_db"), name(_cls, "mlp", "snr_db")), 20 + _rank),
                  *([] if _cls == "weight" else  # the weights' cast hardly changes from probe to probe
                    [Headline(f"{_cls} underflow", (name(_cls, "attn", "underflow"), name(_cls, "mlp", "underflow")),
                              23 + _rank)])))
