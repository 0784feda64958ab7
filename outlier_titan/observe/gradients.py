"""Gradient-side probe metrics: statistics of ``g = dL/dx``, the gradient of the probe batch's mean next-token cross
entropy with respect to the residual stream after every block (and the pre-head input), registered with
``reads="gradient"``; the probe computes them only with ``observe.gradients`` (one extra backward, by
``torch.autograd.grad``: parameters' ``.grad`` and the optimizer state are not touched).

``L`` is the mean cross entropy over the probe batch's in-window targets (position t predicts token t + 1 of the
same window, positions 0 .. T-2, over all data-parallel ranks). The window's last position has no target inside
the window, so its gradient is exactly zero; the statistics below read positions 0 .. T-2 only (the probe slices
``g[:, :-1]`` before the sums).

* **gradient kurtosis** ``grad_kurtosis_first / _rest / _all``: Kaul et al. 2024 Eq. 2 (per-token Pearson kurtosis
  over the D channels) of ``g``, exactly the forward ``token_kurtosis`` sums and finalisation.
* **max |g|** ``grad_max_abs_first / _rest / _rest_token``: the forward ``max_abs`` definition (Kaul et al. 2024
  §3.4) applied to ``g``.
* **gradient sink** (Chen, Lin, Yao 2026, arXiv 2603.17771, "Attention sinks induce gradient sinks": the
  concentration of the backpropagated gradient on the attention-sink token, the first one under a causal mask).
  Besides the paper's own ratio (below) we log two readings of it on the residual stream, both per sequence and
  averaged over sequences:
  ``grad_sink_share = ||g_0||^2 / sum_t ||g_t||^2`` (the first token's share of the squared gradient norm; 1/(T-1)
  when the gradient is spread evenly, 1 when it sits on the first token only) and
  ``grad_sink_ratio = ||g_0|| / mean_{t>0} ||g_t||`` (the form of Guo et al. 2024's residual peak, the forward
  counterpart, :func:`outlier_titan.observe.sinks.first_norm_ratio`). These two are our readings.
* **the paper's gradient-sink ratio** ``grad_sink_rgs`` = R_GS^l(0) (Chen, Lin, Yao 2026 Eq. 3, read in the
  authors' LaTeX source): ``||G_0|| / ((1/T_e) sum_{t=1..T_e} ||G_t||)``, T_e = 31, where ``G_t`` is the
  gradient w.r.t. the *post-norm attention input* of position t (the block's pre-attention norm output, input
  ``attention_input_gradient``) **summed over the sequences of the probe batch** before the norm ("aggregated over
  the full batch exactly as in one optimization step and then converted to token-wise l2 norms"; the authors'
  own comment in the source says this gradient is *not* a per-sequence statistic averaged over batches). With
  fewer than T_e + 2 positions the early window is positions 1 .. T-2. The sum makes the ratio depend on the batch
  size (incoherent per-sequence gradients partly cancel, a coherent sink gradient does not): compare runs at one
  ``observe.batch_size``. The paper reports the median (and IQR) over layers; the probe logs each layer and the
  registry's mean over layers. Blocks without a pre-attention norm (OP's own block, Post-LN) have no value.
"""

from __future__ import annotations

from outlier_titan.observe import outliers, sinks
from outlier_titan.observe.metrics import F64, TINY, Headline, register_metric

PREFIX = "grad_"
GS_EARLY = 31  # Chen, Lin, Yao 2026's T_e: the sink token 0 against the mean over positions 1 .. T_e


def _prefixed(finalize):
    """A forward metric's finalisation with its names prefixed by ``grad_``."""
    return lambda s: {PREFIX + k: v for k, v in finalize(s).items()}


def _sink_sums(r):
    n2 = r.norms2  # [B, T] squared token norms of the gradient, float64
    out = {"n_seq": r.count(r.x.shape[0]), "share": (n2[:, 0] / n2.sum(-1).clamp_min(TINY)).sum()}
    if r.x.shape[1] > 1:
        out["ratio"] = sinks.first_norm_ratio(n2.sqrt()).sum()
    return out


def _sink(s):
    n = float(s["n_seq"])
    if n <= 0:
        return {}
    out = {"grad_sink_share": float(s["share"]) / n}
    if "ratio" in s:
        out["grad_sink_ratio"] = float(s["ratio"]) / n
    return out


def _rgs_sums(r):
    k = min(GS_EARLY + 1, r.x.shape[1])  # positions 0 .. T_e (those with a target)
    return {"n_seq": r.count(r.x.shape[0]), "early_sum": r.x[:, :k].to(F64).sum(0)}  # [k, D]: G_t, summed


def _rgs(s):
    norms = s["early_sum"].norm(dim=-1)  # ||G_t||, t = 0 .. T_e
    if float(s["n_seq"]) <= 0 or norms.numel() < 2:
        return {}
    return {"grad_sink_rgs": float(sinks.first_norm_ratio(norms))}


_report = ("report", "collect", "plot")
GRAD_KURTOSIS = register_metric(
    "grad_kurtosis", ("grad_kurtosis_first", "grad_kurtosis_rest", "grad_kurtosis_all"), "gradient",
    outliers._kurtosis_sums, _prefixed(outliers._kurtosis),
    label="per-token kurtosis of dL/dx (Kaul et al. 2024 Eq. 2 on the residual-stream gradient)",
    shown={k: ("grad_kurtosis_first", "grad_kurtosis_rest") for k in _report})
GRAD_MAX_ABS = register_metric(
    "grad_max_abs", ("grad_max_abs_first", "grad_max_abs_rest", "grad_max_abs_rest_token"), "gradient",
    outliers._max_abs_sums, _prefixed(outliers._max_abs), lower_is_better=None,
    label="max |dL/dx| of the residual-stream gradient (Kaul et al. 2024 §3.4's split)",
    shown={k: ("grad_max_abs_first", "grad_max_abs_rest") for k in ("report", "collect")})
GRAD_SINK = register_metric(
    "grad_sink", ("grad_sink_share", "grad_sink_ratio"), "gradient", _sink_sums, _sink,
    label="gradient sink: first token's share of ||dL/dx||^2 (Chen, Lin, Yao 2026)",
    shown={k: ("grad_sink_share", "grad_sink_ratio") for k in _report},
    headline=(Headline("grad sink", ("grad_sink_share",), 4),))
GRAD_SINK_RGS = register_metric(
    "grad_sink_rgs", "grad_sink_rgs", "attention_input_gradient", _rgs_sums, _rgs,
    label="gradient-sink ratio R_GS(0) at the post-norm attention input (Chen, Lin, Yao 2026 Eq. 3)",
    shown={k: ("grad_sink_rgs",) for k in _report}, across_layers="median")  # the paper's median over layers
