"""The attention-sink metrics of the field, registered in :mod:`outlier_titan.observe.metrics` (their sums reduce
over ranks like every probe metric's).

Definitions (docs/attention.md; "weights" are the weights that multiply the values, unnormalised for sigmoid /
ReLU / softpick attention):

* **sink rate** ``Sink^eps`` (Gu et al. 2024, arXiv 2410.10781, as their code computes it): per sequence and
  head the mean weight on key 0 over the queries, ``alpha_{b,h}``; the share of (sequence, head) pairs with
  ``alpha_{b,h} > eps``, eps = 0.3 (``SINK_EPS``). Per layer, and over all heads of all layers as the mean over
  layers (every layer has the same sequences and heads), which is Gu et al.'s mean over (sequence, layer, head).
  ``sink_rate_pooled`` is the form this project logged before 2026-11-28: the weight averaged over all sequences
  first, thresholded once per head (equal to Gu et al.'s on one sequence, not on several).
* **massive activations** (Sun et al. 2024, arXiv 2402.17762): per sequence, ``max |x|`` over its tokens and
  channels divided by the median ``|x|`` (``massive_ratio``) and the number of entries above 100 x that
  median (``massive_count``, ``MASSIVE_FACTOR``); means over sequences.
* **residual peak** (Guo et al. 2024, arXiv 2410.13835): per sequence ``||x_0|| / mean_{j>0} ||x_j||`` of the
  residual stream; **value drain**: per sequence and head ``||v_0|| / mean_{j>0} ||v_j||`` of the value
  states; means.
* **t0/early** (Chen, Lin, Yao 2026, arXiv 2603.17771, their rebuttal's summary of massive activations):
  ``massive_t0_early`` = the token-0 norm of the block output ``x_out`` over the mean norm of the early
  positions 1 .. 15, each position's norm first averaged over the sequences (the paper's token-wise statistics
  are "averaged over evaluation batches"); per layer and the mean over layers (the rebuttal gives the mean and
  the max over layers).
* **dormant heads** (after Guo et al.): a head is dormant when its mean output norm on the non-first tokens
  (after any gate, before ``wo``) is below ``DORMANT_TAU`` = 0.1 times the mean of that quantity over the
  layer's heads; ``dormant_head_share`` is the share of such heads.
"""

from __future__ import annotations

import torch

from outlier_titan.observe.metrics import F64, TINY, register_metric

SINK_EPS = 0.3  # Gu et al. 2024's threshold of the sink rate
T0_EARLY = 15  # Chen, Lin, Yao 2026's early positions 1 .. 15 of t0/early
MASSIVE_FACTOR = 100.0  # Sun et al. 2024: "massive" = more than this times the median magnitude
DORMANT_TAU = 0.1  # a head is dormant below this share of its layer's mean head-output norm


def first_norm_ratio(norms: torch.Tensor) -> torch.Tensor:
    """Norms [..., T] -> ``||x_0|| / mean_{j>0} ||x_j||`` per leading index (residual peak, value drain)."""
    return norms[..., 0] / norms[..., 1:].mean(-1).clamp_min(TINY)


def abs_median(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(|x|`` in float64, the median ``|x|`` of each sequence [B]) of a residual stream [B, T, D]."""
    a = x.to(F64).abs()
    return a, a.reshape(x.shape[0], -1).median(-1).values


def massive_mask(x: torch.Tensor, factor: float = MASSIVE_FACTOR
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sun et al. 2024's massive entries of a residual stream [B, T, D]: ``(|x| in float64, the median |x| per
    sequence [B], mask)``, the mask true where ``|x|`` exceeds ``factor`` x its sequence's median."""
    a, med = abs_median(x)
    return a, med, a > factor * med.view(-1, *([1] * (x.dim() - 1)))


def _sink_rate_sums(a):
    b, h, t, _ = a.probs.shape
    return {"head_mass_first": a.p0.sum((0, 2)), "head_n_rows": a.p0.new_full((h,), float(b * t)),
            "head_sink_seqs": (a.p0.mean(2) > SINK_EPS).to(F64).sum(0),  # sequences whose head sinks (Gu et al.)
            "head_n_seqs": a.p0.new_full((h,), float(b))}


def _sink_rate(s):
    out = {}
    if bool((s["head_n_rows"] > 0).all()):
        alpha = s["head_mass_first"] / s["head_n_rows"]
        out["sink_rate_pooled"] = float((alpha > SINK_EPS).to(F64).mean())
    if float(s["head_n_seqs"].sum()) > 0:
        out["sink_rate"] = float(s["head_sink_seqs"].sum() / s["head_n_seqs"].sum())
    return out


def _massive_sums(r):
    a, med = abs_median(r.x)
    a = a.reshape(a.shape[0], -1)
    med = med.clamp_min(TINY)
    return {"n_seq": r.count(a.shape[0]), "massive_ratio": (a.amax(-1) / med).sum(),
            "massive_count": (a > MASSIVE_FACTOR * med.unsqueeze(-1)).to(F64).sum()}


def _massive(s):
    n = float(s["n_seq"])
    return {"massive_ratio": float(s["massive_ratio"]) / n, "massive_count": float(s["massive_count"]) / n} \
        if n > 0 else {}


def _peak_sums(r):
    out = {"n_seq": r.count(r.x.shape[0])}
    if r.x.shape[1] > 1:
        out["peak"] = first_norm_ratio(r.norms2.sqrt()).sum()
    return out


def _peak(s):
    return {"residual_peak": float(s["peak"]) / float(s["n_seq"])} if "peak" in s and float(s["n_seq"]) > 0 else {}


def _t0_early_sums(r):
    norms = r.norms2.sqrt()  # [B, T]
    early = norms[:, 1:T0_EARLY + 1]
    return {"n_seq": r.count(norms.shape[0]), "t0": norms[:, 0].sum(), "n_early": r.count(early.numel()),
            "early": early.sum()}


def _t0_early(s):
    if float(s["n_seq"]) <= 0 or float(s["n_early"]) <= 0:
        return {}
    mean_early = float(s["early"]) / float(s["n_early"])
    return {"massive_t0_early": float(s["t0"]) / float(s["n_seq"]) / max(mean_early, TINY)}


def _drain_sums(hd):
    b, h, t, _ = hd.v.shape
    vn = hd.v.to(F64).norm(dim=-1)
    return {"n_head_seqs": vn.new_full((), float(b * h)), "n_rest": vn.new_full((), float(b * h * (t - 1))),
            "value_drain": first_norm_ratio(vn).sum() if t > 1 else vn.new_zeros(())}


def _drain(s):
    return {"value_drain": float(s["value_drain"]) / float(s["n_head_seqs"])} if float(s["n_rest"]) > 0 else {}


def _dormant_sums(hd):
    b, h, t, _ = hd.out.shape
    o = hd.out.to(F64).norm(dim=-1)  # [B, H, T]
    return {"head_n_rest": o.new_full((h,), float(b * (t - 1))), "head_out_rest": o[:, :, 1:].sum((0, 2))}


def _dormant(s):
    if not bool((s["head_n_rest"] > 0).all()):
        return {}
    r = s["head_out_rest"] / s["head_n_rest"]
    return {"dormant_head_share": float((r < DORMANT_TAU * r.mean()).to(F64).mean())}


_shown = ("report", "collect")
SINK_RATE = register_metric(
    "sink_rate", ("sink_rate", "sink_rate_pooled"), "attention", _sink_rate_sums, _sink_rate,
    label="sink rate (Gu et al. 2024)", shown={k: ("sink_rate", "sink_rate_pooled") for k in _shown},
    # until 2026-11-28 ``sink_rate`` was the pooled form, thresholded after averaging over sequences
    legacy={"sink_rate": "sink_rate_pooled"})
MASSIVE = register_metric("massive", ("massive_ratio", "massive_count"), "residual", _massive_sums, _massive,
                          label="massive activations (Sun et al. 2024)",
                          shown={k: ("massive_ratio", "massive_count") for k in _shown})
RESIDUAL_PEAK = register_metric("residual_peak", "residual_peak", "residual", _peak_sums, _peak,
                                label="residual peak (Guo et al. 2024)", shown={k: ("residual_peak",) for k in _shown})
T0_EARLY_METRIC = register_metric(
    "massive_t0_early", "massive_t0_early", "residual", _t0_early_sums, _t0_early,
    label="t0/early: token-0 norm of x_out over the mean of positions 1-15 (Chen, Lin, Yao 2026)",
    shown={k: ("massive_t0_early",) for k in _shown})
register_metric("value_drain", "value_drain", "heads", _drain_sums, _drain, label="value drain (Guo et al. 2024)",
                lower_is_better=None, shown={k: ("value_drain",) for k in _shown})
register_metric("dormant_heads", "dormant_head_share", "heads", _dormant_sums, _dormant,
                label="dormant-head share (after Guo et al. 2024)", shown={k: ("dormant_head_share",) for k in _shown})
