"""The metric registry: each probe metric is registered once, with everything the rest of the stack needs to know.

An entry (:class:`Metric`) holds the names it logs (``outliers/layer_<i>/<name>``, ``outliers/<name>`` = the mean
over blocks, and for residual metrics ``outliers/head_input/<name>``), which probe input it reads, its per-layer
**sums** (float64 tensors whose element-wise sum over disjoint token sets gives the sums of the union, so that data-
and tensor-parallel ranks reduce by one all-reduce) and its **finalisation** from the reduced sums, the probe mode it
needs, its direction, its human label, and where it is shown (console headline, evaluation report, a sweep's
results table, ``scripts/analyze.py``'s default panels). The probe, the trainer's console line, the evaluator, the
sweep's results and ``scripts/analyze.py`` read it.

The built-ins register in :mod:`outlier_titan.observe.outliers` and :mod:`outlier_titan.observe.sinks`; code
outside the package calls :func:`register_metric` at import (``job.plugins``; docs/extending.md). The
evaluator's whole-model measures, which run their own forward passes instead of the probe's hooks (Park et al.
2025's excess kurtosis, :mod:`outlier_titan.observe.osp_kurtosis`), register with :func:`register_evaluation`.
"""

from __future__ import annotations

import statistics

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Callable, NamedTuple

import torch

from outlier_titan.errors import UserError

F64 = torch.float64
TINY = torch.finfo(F64).tiny
ACROSS_LAYERS = {"mean": lambda v: sum(v) / len(v), "max": max, "median": statistics.median}
"""How ``outliers/<name>`` combines the blocks' values (a metric's ``across_layers``)."""
READS = ("residual", "attention", "heads", "gradient", "attention_input_gradient", "logits", "down_proj", "casts",
         "cast_gradient")
STREAMS = ("residual", "gradient", "attention_input_gradient")  # [B, T, D] inputs read by the cheap probe
CHEAP = STREAMS + ("casts", "cast_gradient")  # inputs the cheap probe reads (the casts: observe/lowprec.py)
GRADIENTS = ("gradient", "attention_input_gradient", "cast_gradient")  # exist only with ``observe.gradients``
MODES = ("cheap", "full")
SHOWN = ("report", "collect", "plot", "profile")


class ResidualInput:
    """One block's residual stream ``x`` [B, T, D] (or the pre-head input), with float64 views computed once per
    hook and shared by the metrics that read them."""

    def __init__(self, x: torch.Tensor):
        if x.dim() != 3:
            raise ValueError(f"residual stream must be [B, T, D], got shape {tuple(x.shape)}")
        self.x = x

    @cached_property
    def x64(self) -> torch.Tensor:
        return self.x.to(F64)

    @cached_property
    def sq(self) -> torch.Tensor:
        return self.x64.square()

    @cached_property
    def norms2(self) -> torch.Tensor:
        """Squared token norms [B, T]."""
        return self.sq.sum(-1)

    @cached_property
    def tok_max(self) -> torch.Tensor:
        """max_d |x| per token [B, T], float64."""
        return self.x.abs().amax(-1).to(F64)

    def count(self, n: float) -> torch.Tensor:
        """A float64 scalar on x's device by a fill kernel, not a host-to-device copy (hooks never sync the host)."""
        return self.x64.new_full((), float(n))


class AttentionInput:
    """One Attention's weights ``probs`` [B, H, T, T] (``sink``: from softmax-1, whose rows keep < 1)."""

    def __init__(self, probs: torch.Tensor, sink: bool = False):
        if probs.dim() != 4:
            raise ValueError(f"attention probabilities must be [B, H, T, T], got shape {tuple(probs.shape)}")
        self.probs, self.sink = probs, sink

    @cached_property
    def p(self) -> torch.Tensor:
        """At least float32 (float64 weights stay float64)."""
        return self.probs if self.probs.dtype == F64 else self.probs.float()

    @cached_property
    def p0(self) -> torch.Tensor:
        """The weight on key 0 [B, H, T], float64."""
        return self.p[..., 0].to(F64)

    @cached_property
    def row(self) -> torch.Tensor:
        """Row masses [B, H, T], float64."""
        return self.p.sum(-1, dtype=F64)


class HeadsInput:
    """One Attention's per-head outputs ``out`` (after any gate, before ``wo``) and value states ``v``, both
    [B, H, T, d_h] (v repeated to the query heads under GQA)."""

    def __init__(self, out: torch.Tensor, v: torch.Tensor):
        self.out, self.v = out, v


class LogitsInput:
    """One Attention's MaxLogit per sequence and head ``m`` [B, H] (``models.attention.max_logits``: the largest
    causal ``scale * q_i . k_j``, before any soft-cap or variant)."""

    def __init__(self, m: torch.Tensor):
        if m.dim() != 2:
            raise ValueError(f"max logits must be [B, H], got shape {tuple(m.shape)}")
        self.m = m




class DownProjInput:
    """One block's MLP down projection (``feed_forward.w2``): its whole input ``x_in`` [B, T, F], output ``x_out``
    [B, T, D] and weight [D, F] (gathered under TP). ``global_max`` reduces a float64 vector element-wise with max
    over the data-parallel ranks (the probe's; identity on one shard): a metric of the spikes' coordinates needs
    the batch's maximum before it can read the weight there, which no sum gives."""

    def __init__(self, x_in: torch.Tensor, x_out: torch.Tensor, weight: torch.Tensor,
                 global_max: Callable[[torch.Tensor], torch.Tensor] | None = None):
        self.x_in, self.x_out, self.weight = x_in, x_out, weight
        self.global_max = global_max or (lambda t: t)

    def count(self, n: float) -> torch.Tensor:
        return self.x_in.new_full((), float(n), dtype=F64)


class CastInput:
    """One low-precision cast module's operands as its GEMMs cast them: ``recipe`` (a ``lowprec.recipes.Recipe``),
    ``group`` (``attn`` or ``mlp``), and the whole tensors (gathered under TP) of the forward input ``act``
    [B, T, in], the ``weight`` [out, in] and the output gradient ``grad`` [B, T, out] (the latter only in the
    probe's backward). ``weight_counted``: False on the ranks whose weight another rank already counts (the weight
    is the same on every data-parallel rank). ``shared``: a dict that modules reading the same ``act`` share (wq,
    wk and wv), where a metric may keep what it computed from ``act``."""

    def __init__(self, recipe, group: str, act: torch.Tensor | None = None, weight: torch.Tensor | None = None,
                 grad: torch.Tensor | None = None, weight_counted: bool = True, shared: dict | None = None):
        self.recipe, self.group, self.act, self.weight, self.grad = recipe, group, act, weight, grad
        self.weight_counted = weight_counted
        self.shared = {} if shared is None else shared


INPUTS = {"residual": ResidualInput, "attention": AttentionInput, "heads": HeadsInput, "logits": LogitsInput,
          "down_proj": DownProjInput,
          # the gradient of the loss w.r.t. the residual stream, and w.r.t. each block's pre-attention norm output
          "gradient": ResidualInput, "attention_input_gradient": ResidualInput,
          # each cast module's GEMM operands (forward) and output gradient (the probe's backward)
          "casts": CastInput, "cast_gradient": CastInput}


def is_max(key: str) -> bool:
    """A sum key starting with ``max_`` holds maxima: batches and ranks combine it by max, not by sum."""
    return key.startswith("max_")


def is_per_head(key: str) -> bool:
    """A sum key laid out over the heads (``head_*``, ``max_head_*``): TP ranks place it at their heads."""
    return key.startswith("head_") or key.startswith("max_head_")


class Headline(NamedTuple):
    """A part of the probe's console line: ``label`` then the layer means of ``names`` joined by ``/``."""

    label: str
    names: tuple[str, ...]
    rank: int = 0
    """Position in the line (ascending)."""


@dataclass(frozen=True)
class Metric:
    key: str
    """Registry name (not logged)."""
    names: tuple[str, ...]
    """What it logs, after ``outliers/``, ``outliers/layer_<i>/`` or ``outliers/head_input/``."""
    reads: str
    """The probe input: ``residual`` (:class:`ResidualInput`: every block's output and the pre-head input),
    ``attention`` (:class:`AttentionInput`), ``heads`` (:class:`HeadsInput`), ``logits`` (:class:`LogitsInput`),
    ``down_proj`` (:class:`DownProjInput`), ``gradient`` (a :class:`ResidualInput` of the loss gradient w.r.t. the
    same tensors as ``residual``) or ``attention_input_gradient`` (the loss gradient w.r.t. each block's
    pre-attention norm output, what wq / wk / wv read; blocks without a pre-attention norm have none); the gradients
    only with ``observe.gradients``, which costs a backward; ``casts`` (:class:`CastInput`: every low-precision
    cast module's input and weight) or ``cast_gradient`` (its output gradient, with ``observe.gradients``)."""
    sums: Callable[[Any], dict[str, torch.Tensor]]
    """Input -> float64 sums of one layer. A ``head_*`` key is an [H] vector over this rank's heads; the probe lays
    it out at the global head positions under tensor parallelism. A ``max_*`` key (``max_head_*`` per head) is a
    maximum, combined by max over batches and ranks. Anything else adds up over ranks as it is."""
    finalize: Callable[[dict[str, torch.Tensor]], dict[str, float]]
    """Reduced (host, float64) sums -> ``{name: value}``; a name without data is left out."""
    label: str
    """Human label (console, docs)."""
    lower_is_better: bool | None = True
    """Direction for plots and reports (None: neither)."""
    mode: str = "cheap"
    """The probe mode it needs: ``cheap`` runs in both modes, ``full`` only in full mode (attention inputs)."""
    when: Callable[[Any], bool] | None = None
    """Extra condition on the ``[observe]`` config (None: always)."""
    shown: dict[str, tuple[tuple[str, int], ...]] = field(default_factory=dict)
    """Which names appear where: ``report`` (the evaluation's markdown), ``collect`` (a sweep's final_/peak_
    columns), ``plot`` and ``profile`` (``scripts/analyze.py``'s default panels and per-layer profiles); each name
    with a rank (the order there is by rank, then registration)."""
    headline: tuple[Headline, ...] = ()
    legacy: dict[str, str] = field(default_factory=dict)
    """Old logged name -> the name its definition has now (runs that logged only the old name)."""
    across_layers: str = "mean"
    """``outliers/<name>`` over the blocks: their ``mean`` (the papers' "averaged across layers"), ``max``
    (MaxLogit: the model's largest) or ``median`` (Chen et al. 2026's R_GS)."""
    averaged: tuple[str, ...] | None = None
    """The names logged as ``outliers/<name>``, the mean over blocks (None: all; a channel index has no mean)."""
    pool: Callable[[dict, dict], dict] | None = None
    """Two batches' sums -> the sums of both (None: added); for sums that are maxima with what sits at them."""
    partial: bool = False
    """Some blocks may lack it (e.g. the low-precision casts where the last blocks stay in BF16): ``outliers/<name>``
    is then over the blocks that have it; otherwise only a name every block has is combined."""

    def __call__(self, *tensors, **kw) -> dict[str, float]:
        """The direct form on one shard: finalise the sums of ``tensors`` (host float64)."""
        return self.finalize(host(self.sums(INPUTS[self.reads](*tensors, **kw))))


@dataclass(frozen=True)
class Evaluation:
    """A whole-model measure that the evaluator runs on its probe sequences besides the probe (not reducible sums:
    its own forward passes, so not a probe metric)."""

    key: str
    """The report's key (``report[key]``, a dict) and the headline value's key in it (``report[key][key]``)."""
    measure: Callable[[Any, list[torch.Tensor]], dict[str, float]]
    """``(model, token batches) -> {key: headline value, ...}``."""
    note: str
    """The evaluation markdown's sentence, with ``{value}`` for the headline value."""

    @property
    def column(self) -> str:
        """The sweep results' column of the headline value."""
        return f"eval_{self.key}"


_REGISTRY: dict[str, Metric] = {}
_EVALUATIONS: dict[str, Evaluation] = {}


def register_metric(key: str, names, reads: str, sums: Callable, finalize: Callable, *, label: str,
                    lower_is_better: bool | None = True, mode: str | None = None, when: Callable | None = None,
                    shown: dict | None = None, headline=(), legacy: dict | None = None,
                    across_layers: str = "mean", averaged=None, pool: Callable | None = None,
                    partial: bool = False, replace: bool = False) -> Metric:
    """Adds a metric to the probe, the evaluator, sweep results and ``scripts/analyze.py`` (see :class:`Metric`);
    ``shown`` maps a place to names or ``(name, rank)`` pairs; ``mode`` defaults to ``cheap`` for the residual
    stream and the casts and ``full`` otherwise."""
    names = (names,) if isinstance(names, str) else tuple(names)
    mode = mode or ("cheap" if reads in CHEAP else "full")
    if reads not in READS:
        raise UserError(f"metric {key!r}: reads must be one of {', '.join(READS)}, not {reads!r}")
    if mode not in MODES or (reads not in CHEAP and mode != "full"):
        raise UserError(f"metric {key!r}: mode must be 'full' for {reads} inputs (the cheap probe has none)"
                        if mode in MODES else f"metric {key!r}: mode must be one of {', '.join(MODES)}")
    shown = {k: tuple((n, 0) if isinstance(n, str) else tuple(n) for n in v) for k, v in (shown or {}).items()}
    unknown = [k for k in shown if k not in SHOWN] + [n for v in shown.values() for n, _ in v if n not in names] + \
        [n for h in headline for n in h.names if n not in names]
    if unknown:
        raise UserError(f"metric {key!r}: unknown place or name {unknown[0]!r} (places: {', '.join(SHOWN)})")
    if across_layers not in ACROSS_LAYERS:
        raise UserError(f"metric {key!r}: across_layers must be one of {', '.join(ACROSS_LAYERS)}, not "
                        f"{across_layers!r}")
    if key in _REGISTRY and not replace:
        raise UserError(f"metric {key!r} is already registered; pick another name or pass replace=True")
    taken = {n: m.key for m in _REGISTRY.values() if m.key != key for n in m.names}
    if any(n in taken for n in names):
        n = next(n for n in names if n in taken)
        raise UserError(f"metric {key!r}: the name {n!r} is already logged by metric {taken[n]!r}")
    m = Metric(key, names, reads, sums, finalize, label, lower_is_better, mode, when, shown, tuple(headline),
               dict(legacy or {}), across_layers, None if averaged is None else tuple(averaged), pool, partial)
    _REGISTRY[key] = m
    return m


def unregister_metric(key: str) -> None:
    """Removes a registered metric (tests)."""
    _REGISTRY.pop(key, None)


def register_evaluation(key: str, measure: Callable, note: str, *, replace: bool = False) -> Evaluation:
    """Adds a whole-model measure to ``scripts/evaluate.py``'s report and a sweep's results
    (:class:`Evaluation`)."""
    if key in _EVALUATIONS and not replace:
        raise UserError(f"evaluation {key!r} is already registered; pick another name or pass replace=True")
    _EVALUATIONS[key] = Evaluation(key, measure, note)
    return _EVALUATIONS[key]


def evaluations() -> list[Evaluation]:
    """Every whole-model measure of the evaluator, in registration order."""
    return list(_EVALUATIONS.values())


def registered() -> list[Metric]:
    """Every metric in registration order (the built-ins first: ``outlier_titan.components`` imports them before any
    plug-in), the order of each layer's keys in metrics.jsonl."""
    return list(_REGISTRY.values())


def get_metric(key: str) -> Metric:
    return _REGISTRY[key]


def active(cfg, reads: str) -> list[Metric]:
    """The metrics a probe with ``[observe]`` config ``cfg`` computes from ``reads`` (gradient ones only with
    ``observe.gradients``)."""
    if reads in GRADIENTS and not getattr(cfg, "gradients", False):
        return []
    return [m for m in registered() if m.reads == reads and (m.mode == "cheap" or cfg.mode == "full")
            and (m.when is None or m.when(cfg))]


def shown(place: str) -> tuple[str, ...]:
    """The names shown at ``place`` (one of :data:`SHOWN`), by rank, then in registration order."""
    return tuple(n for n, _ in sorted((s for m in registered() for s in m.shown.get(place, ())), key=lambda s: s[1]))


def legacy_names() -> dict[str, str]:
    """Old logged name -> the name its definition has now, over all metrics."""
    return {old: new for m in registered() for old, new in m.legacy.items()}


def direction(name: str) -> bool | None:
    """Whether lower values of a logged name are better (None: no direction, or not a registered name)."""
    return next((m.lower_is_better for m in registered() if name in m.names), None)


def label(name: str) -> str:
    """The human label of the metric that logs ``name`` (the name itself when none does)."""
    return next((m.label for m in registered() if name in m.names), name)


def headline(step: int, scalars: dict[str, float]) -> str:
    """The probe's headline metrics (layer means) as one console line."""
    parts = []
    for h in sorted((h for m in registered() for h in m.headline), key=lambda h: h.rank):
        values = [f"{scalars[f'outliers/{n}']:.3g}" for n in h.names if f"outliers/{n}" in scalars]
        if f"outliers/{h.names[0]}" in scalars:
            parts.append(f"{h.label} {'/'.join(values)}")
    return f"step {step:>6}  probe  " + "  ".join(parts) + f"  ({scalars['outliers/probe_seconds']:.2f}s)"


def host(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums as float64 host tensors (what :attr:`Metric.finalize` receives)."""
    return {k: v.to(F64).cpu() for k, v in s.items()}


def add_sums(acc: dict | None, new: dict) -> dict:
    """Element-wise sum of two statistics dicts, nested ones included (``acc`` may be None); ``max_*`` keys take
    the element-wise maximum."""
    if acc is None:
        return dict(new)
    if acc.keys() != new.keys():
        raise ValueError(f"statistics differ in keys: {sorted(acc)} vs {sorted(new)}")
    return {k: add_sums(acc[k], new[k]) if isinstance(new[k], dict) else
            torch.maximum(acc[k], new[k]) if is_max(k) else acc[k] + new[k] for k in acc}


def pool_layer(acc: dict | None, new: dict) -> dict:
    """``{metric key: sums}`` of one layer over two batches: each metric's ``pool``, else added (keys that are not
    registered metrics, the probe's picture sums, are added)."""
    if acc is None:
        return dict(new)
    if acc.keys() != new.keys():
        raise ValueError(f"statistics differ in keys: {sorted(acc)} vs {sorted(new)}")
    pools = {m.key: m.pool for m in registered() if m.pool is not None}
    return {k: pools[k](acc[k], new[k]) if k in pools else add_sums(acc[k], new[k]) for k in acc}


def layer_sums(reads: str, *tensors, metrics: list[Metric] | None = None, **kw) -> dict[str, dict[str, torch.Tensor]]:
    """``{metric key: sums}`` of one layer's input (``metrics``: those reading it; None: every registered one)."""
    inp = INPUTS[reads](*tensors, **kw)
    return {m.key: m.sums(inp) for m in (metrics if metrics is not None else registered()) if m.reads == reads}


def finalize_layer(sums: dict[str, dict[str, torch.Tensor]]) -> dict[str, float]:
    """``{name: value}`` of one layer from its reduced ``{metric key: sums}``, in registration order; keys that are
    not registered metrics (the probe's picture sums) are skipped."""
    out: dict[str, float] = {}
    for m in registered():
        if m.key in sums:
            out.update(m.finalize(host(sums[m.key])))
    return out


def measure(reads: str, *tensors, **kw) -> dict[str, float]:
    """Every registered metric reading ``reads`` on one shard (``measure("residual", x)``)."""
    return finalize_layer(layer_sums(reads, *tensors, **kw))


def layer_mean(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """Mean over layers of each metric present in every layer, or in any for a metric registered ``partial`` (its
    maximum or median for a metric registered with ``across_layers="max"`` / ``"median"``)."""
    if not per_layer:
        return {}
    keys = set(per_layer[0])
    for m in per_layer[1:]:
        keys &= set(m)
    keys |= {n for m in registered() if m.partial for n in m.names if any(n in layer for layer in per_layer)}
    keys -= {n for m in registered() if m.averaged is not None for n in m.names if n not in m.averaged}
    how = {n: m.across_layers for m in registered() for n in m.names}
    return {k: ACROSS_LAYERS[how.get(k, "mean")]([m[k] for m in per_layer if k in m]) for k in sorted(keys)}
