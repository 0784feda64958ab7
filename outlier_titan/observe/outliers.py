"""Outlier-feature and first-token attention metrics of the three seed papers: the formulas and their registration.

Notation: a hidden state ``x`` is ``[..., D]`` (D = residual width, the "channels"/"neurons"); a residual
stream of one layer is ``[B, T, D]``; attention probabilities are ``[B, H, T, T]`` (query i, key j, causal;
softmax-1 rows sum to < 1 because its sink is not a key).

Definitions (the papers' equations; docs/observatory.md):

* Kaul et al. 2024 (arXiv 2410.17174) Eq. 2, **per-token kurtosis**: Pearson (non-excess) kurtosis over the D
  channels of one token,
  population moments, centred: ``E_d[(x - mu)^4] / E_d[(x - mu)^2]^2``. Gaussian ~ 3. Reported separately
  for the first token and as the mean over the other tokens.
* He et al. 2024 Eq. 1, **kurtosis of neuron RMS**: ``s_j^2 = mean_tokens x_j^2`` (all tokens pooled), then
  ``mean_j s_j^4 / (mean_j s_j^2)^2``: uncentred, raw moments. Equal RMS per neuron gives 1, one dominant
  neuron gives D. The authors' code logs a centred variant instead (each token centred over width, then the
  unbiased variance over j of s_j^2 / mean s^2, i.e. ~ Kurt - 1); :func:`neuron_rms_kurtosis_centred`.
* He et al. 2024 Eq. 2, **max-median ratio**: per token ``max_d |x_d| / median_d |x_d|``, mean over tokens.
* **signal propagation**: mean pairwise cosine similarity of the token vectors (all tokens of the batch
  pooled, pairs alpha != beta); He et al. 2024's own plotted quantity, the mean off-diagonal of ``X~ X~^T / d``
  with ``X~ = X / rms(X)``, is :func:`signal_prop_corr`.
* Kaul et al. 2024 §3.4 **max |activation|**: first token ``max_d |x_{1,d}|``; the rest ``max_{l>1,d} |x_{l,d}|``
  per sample; both averaged over samples.
* Kaul et al. 2024 §3.5/3.6 **first-token attention**: the share of (query, head) pairs whose most-attended key is
  key 0 (ties: lowest index; the sink is not a candidate) and the mean probability on key 0.
* **attention sink mass** (softmax-1 only): the mean probability kept by softmax-1's implicit sink,
  ``1 - sum_j A_ij`` = ``1 / (1 + sum_j exp(s_ij))``, i.e. how much a query "attends to nothing". Under plain
  softmax the rows sum to 1, so it is zero by construction (what is left is float rounding noise) and it is
  not reported; under both, Kaul et al. 2024 §3.6's first-key mass is the comparable quantity.

The attention-sink metrics of the field (sink rate, massive activations, residual peak, value drain, dormant
heads) are defined in :mod:`outlier_titan.observe.sinks`.

Each metric is registered (:mod:`outlier_titan.observe.metrics`) with its per-layer **sums**, which the
distributed probe adds up over ranks, and its finalisation from them. A direct form with a sums form is a call of the two on one shard; the others
(per-token values, neuron-RMS kurtosis of a matrix) are the formulas the sums use. Maths that matters is done in
float64.
"""

from __future__ import annotations

import torch

from outlier_titan.observe.metrics import F64, TINY, Headline, register_metric

# ----------------------------------------------------------------------------------------------------------
# Direct definitions (the formulas the sums use)


def token_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Kaul et al. 2024 Eq. 2: Pearson kurtosis over the last dim, one value per token (float64)."""
    x = x.to(F64)
    c = x - x.mean(-1, keepdim=True)
    c2 = c.square()
    m2 = c2.mean(-1)
    m4 = c2.square().mean(-1)
    return m4 / m2.square().clamp_min(TINY)


def neuron_rms_kurtosis_from_sq(s2: torch.Tensor) -> torch.Tensor:
    """He et al. 2024 Eq. 1 from the per-neuron mean squares ``s_j^2`` (shape [D]): ``mean s^4 / (mean s^2)^2``."""
    s2 = s2.to(F64)
    return s2.square().mean(-1) / s2.mean(-1).square().clamp_min(TINY)


def neuron_rms_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """He et al. 2024 Eq. 1 of an activation matrix: all leading dims are tokens, the last dim is the neurons."""
    x = x.to(F64).reshape(-1, x.shape[-1])
    return neuron_rms_kurtosis_from_sq(x.square().mean(0))


def neuron_rms_kurtosis_centred_from_sq(c2: torch.Tensor) -> torch.Tensor:
    """The authors' code variant from ``mean_tokens (x_j - mean_d x)^2`` per neuron (shape [D]).

    After normalising by the global mean square, it is the unbiased variance over neurons: ~ Kurt - 1
    (``D/(D-1) * (Eq1(centred x) - 1)``), so Gaussian activations give ~ 0.
    """
    c2 = c2.to(F64)
    t = c2 / c2.mean(-1, keepdim=True).clamp_min(TINY)
    return t.var(-1, unbiased=True)


def neuron_rms_kurtosis_centred(x: torch.Tensor) -> torch.Tensor:
    x = x.to(F64).reshape(-1, x.shape[-1])
    x = x - x.mean(-1, keepdim=True)
    return neuron_rms_kurtosis_centred_from_sq(x.square().mean(0))


def max_median_ratio(x: torch.Tensor) -> torch.Tensor:
    """He et al. 2024 Eq. 2 per token: ``max_d |x| / median_d |x|`` (aggregate with a mean over tokens)."""
    a = x.abs().float()
    med = a.median(-1).values.to(F64)
    return a.amax(-1).to(F64) / med.clamp_min(TINY)


def _norm_ratio(tok_max: torch.Tensor, norms2: torch.Tensor) -> torch.Tensor:
    return tok_max.square() / norms2.clamp_min(TINY)


def norm_ratio(x: torch.Tensor) -> torch.Tensor:
    """Kaul et al. 2024 §3.7 per token: ``||x||_inf^2 / ||x||_2^2`` (1 for one dominant channel, 1/D for a flat
    one)."""
    x = x.to(F64)
    return _norm_ratio(x.abs().amax(-1), x.square().sum(-1))


def _pooled(x: torch.Tensor) -> torch.Tensor:
    """Token vectors with all leading dims pooled, as one sequence [1, N, D]."""
    return x.to(F64).reshape(1, -1, x.shape[-1])


def mean_pairwise_cosine(x: torch.Tensor) -> float:
    """Mean cosine similarity over all ordered pairs alpha != beta of token vectors (leading dims pooled).

    Uses ``sum_{a != b} u_a . u_b = ||sum_a u_a||^2 - n`` for unit vectors u: no n x n Gram matrix.
    """
    return SIGNAL_PROP(_pooled(x))["signal_prop_cos"]


def signal_prop_corr(x: torch.Tensor) -> float:
    """He et al. 2024 §2.1: mean off-diagonal of ``X~ X~^T / d`` with ``X~ = X / sqrt(||X||_F^2 / (n d))``."""
    return SIGNAL_PROP(_pooled(x))["signal_prop_corr"]


def first_token_argmax_share(probs: torch.Tensor, exclude_first_query: bool = False) -> float:
    """Kaul et al. 2024 §3.5: fraction of (batch, head, query) rows whose argmax key is key 0 (ties: lowest index)."""
    return FIRST_TOKEN(probs)["first_token_argmax_share_excl_q0" if exclude_first_query else "first_token_argmax_share"]


def first_token_attention_mass(probs: torch.Tensor, normalise_rows: bool = False) -> float:
    """Kaul et al. 2024 §3.6: mean probability on key 0 (raw; or divided by the row mass, which differs under
    softmax-1)."""
    return FIRST_TOKEN(probs)["first_token_attention_mass_norm" if normalise_rows else "first_token_attention_mass"]


def unit(x: torch.Tensor) -> torch.Tensor:
    """Rows scaled to unit norm (zero rows stay zero)."""
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


# ----------------------------------------------------------------------------------------------------------
# Sums of one layer and their finalisation (metrics without data are left out)


def _counts(r) -> dict[str, torch.Tensor]:
    b, t, _ = r.x.shape
    return {"n_seq": r.count(b), "n_tok": r.count(b * t), "n_rest": r.count(b * (t - 1))}


def channel_sq(r) -> dict[str, torch.Tensor]:
    """Per-channel sums of squares [D], the first token apart (also the probe's hidden-magnitude picture)."""
    return {**_counts(r), "sq_first": r.sq[:, 0].sum(0), "sq_rest": r.sq[:, 1:].sum((0, 1))}


def _n(s, key: str) -> float:
    return float(s[key])


def _kurtosis_sums(r):
    kurt = token_kurtosis(r.x64)  # [B, T]
    return {**_counts(r), "kurt_first": kurt[:, 0].sum(), "kurt_rest": kurt[:, 1:].sum()}


def _kurtosis(s):
    out = {}
    if _n(s, "n_seq") > 0:
        out["kurtosis_first"] = float(s["kurt_first"]) / _n(s, "n_seq")
    if _n(s, "n_rest") > 0:
        out["kurtosis_rest"] = float(s["kurt_rest"]) / _n(s, "n_rest")
    if _n(s, "n_tok") > 0:
        out["kurtosis_all"] = (float(s["kurt_first"]) + float(s["kurt_rest"])) / _n(s, "n_tok")
    return out


def _neuron_rms(s):
    n = _n(s, "n_tok")
    if n <= 0:
        return {}
    return {"kurtosis_neuron_rms": float(neuron_rms_kurtosis_from_sq((s["sq_first"] + s["sq_rest"]) / n))}


def _centred_sums(r):
    return {"n_tok": _counts(r)["n_tok"], "csq": (r.x64 - r.x64.mean(-1, keepdim=True)).square().sum((0, 1))}


def _centred(s):
    n = _n(s, "n_tok")
    return {"kurtosis_neuron_rms_centred": float(neuron_rms_kurtosis_centred_from_sq(s["csq"] / n))} if n > 0 else {}


def _max_abs_sums(r):
    t = r.x.shape[1]
    rest = r.tok_max[:, 1:]
    return {**_counts(r), "maxabs_first": r.tok_max[:, 0].sum(),
            "maxabs_rest": rest.amax(-1).sum() if t > 1 else r.x64.new_zeros(()), "maxabs_rest_token": rest.sum()}


def _max_abs(s):
    out = {}
    if _n(s, "n_seq") > 0:
        out["max_abs_first"] = float(s["maxabs_first"]) / _n(s, "n_seq")
    if _n(s, "n_rest") > 0:
        out["max_abs_rest"] = float(s["maxabs_rest"]) / _n(s, "n_seq")
        out["max_abs_rest_token"] = float(s["maxabs_rest_token"]) / _n(s, "n_rest")
    return out


def _per_token_mean(sums_key: str, name: str, per_token):
    """A metric that is the mean over tokens of ``per_token(r)`` [B, T]: its sums and finalisation."""
    def sums(r):
        return {"n_tok": _counts(r)["n_tok"], sums_key: per_token(r).sum()}

    def finalize(s):
        return {name: float(s[sums_key]) / _n(s, "n_tok")} if _n(s, "n_tok") > 0 else {}
    return sums, finalize


def _signal_prop_sums(r):
    return {**channel_sq(r), "vec": r.x64.sum((0, 1)), "unit": unit(r.x64).sum((0, 1))}


def _signal_prop(s):
    n = _n(s, "n_tok")
    total_sq = float((s["sq_first"] + s["sq_rest"]).sum())
    out = {}
    if n > 1:
        out["signal_prop_cos"] = (float(s["unit"].square().sum()) - n) / (n * (n - 1))
        if total_sq > 0:
            out["signal_prop_corr"] = (float(s["vec"].square().sum()) - total_sq) / ((n - 1) * total_sq)
    return out


def _scale_sums(r):
    return {**channel_sq(r), "norm": r.norms2.sqrt().sum()}


def _scale(s):
    n = _n(s, "n_tok")
    sq = s["sq_first"] + s["sq_rest"]
    if n <= 0:
        return {}
    return {"residual_rms": (float(sq.sum()) / (n * sq.numel())) ** 0.5, "residual_norm": float(s["norm"]) / n}


def _rows(a) -> dict[str, torch.Tensor]:
    b, h, t, _ = a.probs.shape
    return {"n_rows": a.p0.new_full((), float(b * h * t)), "n_rows_excl_q0": a.p0.new_full((), float(b * h * (t - 1)))}


def _first_token_sums(a):
    hit = (a.p.argmax(-1) == 0).to(F64)  # [B, H, T]
    return {**_rows(a), "argmax_first": hit.sum(), "argmax_first_excl_q0": hit[..., 1:].sum(),
            "mass_first": a.p0.sum(), "mass_first_norm": (a.p0 / a.row.clamp_min(TINY)).sum()}


def _first_token(s):
    n, n1 = _n(s, "n_rows"), _n(s, "n_rows_excl_q0")
    out = {}
    if n > 0:
        out["first_token_argmax_share"] = float(s["argmax_first"]) / n
        out["first_token_attention_mass"] = float(s["mass_first"]) / n
        out["first_token_attention_mass_norm"] = float(s["mass_first_norm"]) / n
    if n1 > 0:
        out["first_token_argmax_share_excl_q0"] = float(s["argmax_first_excl_q0"]) / n1
    return out


def _entropy_sums(a):
    p = a.p
    plogp = torch.where(p > 0, p * p.clamp_min(torch.finfo(p.dtype).tiny).log(), p.new_zeros(()))
    return {"n_rows": _rows(a)["n_rows"], "entropy": -plogp.sum(-1, dtype=F64).sum()}


def _entropy(s):
    return {"attention_entropy": float(s["entropy"]) / _n(s, "n_rows")} if _n(s, "n_rows") > 0 else {}


def _sink_mass_sums(a):
    """Only for softmax-1 (under plain softmax the sink mass is 0 by construction)."""
    return {"n_rows": _rows(a)["n_rows"], "sink_mass": (1.0 - a.row).clamp_min(0.0).sum()} if a.sink else {}


def _sink_mass(s):
    return {"attention_sink_mass": float(s["sink_mass"]) / _n(s, "n_rows")} if s and _n(s, "n_rows") > 0 else {}


# Registration order is the order of each layer's keys in metrics.jsonl; ranks order the shown lists.
_report = ("report", "collect", "plot")
register_metric("token_kurtosis", ("kurtosis_first", "kurtosis_rest", "kurtosis_all"), "residual", _kurtosis_sums,
                _kurtosis, label="per-token kurtosis (Kaul et al. 2024 Eq. 2)",
                shown={k: ("kurtosis_first", "kurtosis_rest") for k in _report},
                headline=(Headline("kurtosis first/rest", ("kurtosis_first", "kurtosis_rest"), 0),))
register_metric("neuron_rms_kurtosis", "kurtosis_neuron_rms", "residual", channel_sq, _neuron_rms,
                label="neuron-RMS kurtosis (He et al. 2024 Eq. 1)",
                shown={**{k: ("kurtosis_neuron_rms",) for k in _report}, "profile": (("kurtosis_neuron_rms", 1),)},
                headline=(Headline("neuron-RMS kurtosis", ("kurtosis_neuron_rms",), 3),))
register_metric("neuron_rms_kurtosis_centred", "kurtosis_neuron_rms_centred", "residual", _centred_sums, _centred,
                label="centred neuron-RMS kurtosis (He et al. 2024's code)", when=lambda cfg: cfg.kurtosis_centered)
register_metric("max_abs", ("max_abs_first", "max_abs_rest", "max_abs_rest_token"), "residual", _max_abs_sums,
                _max_abs, label="max |activation| (Kaul et al. 2024 §3.4)",
                shown={k: ("max_abs_first", "max_abs_rest") for k in _report},
                headline=(Headline("max|act| first/rest", ("max_abs_first", "max_abs_rest"), 1),))
register_metric("max_abs_all", "max_abs_all", "residual", lambda r: {"max_abs": r.tok_max.amax()},
                lambda s: {"max_abs_all": float(s["max_abs"])},
                label="largest |activation| anywhere (TWEO's peak outlier, Liang et al. 2025)",
                shown={k: ("max_abs_all",) for k in _report}, across_layers="max")
register_metric("max_median_ratio", "max_median_ratio", "residual",
                *_per_token_mean("mmr", "max_median_ratio", lambda r: max_median_ratio(r.x)),
                label="max/median |activation| (He et al. 2024 Eq. 2)",
                shown={"report": ("max_median_ratio",), "plot": ("max_median_ratio",)})
SIGNAL_PROP = register_metric("signal_prop", ("signal_prop_cos", "signal_prop_corr"), "residual", _signal_prop_sums,
                              _signal_prop, label="signal propagation (mean pairwise cosine; He et al. 2024 §2.1)",
                              shown={"report": ("signal_prop_cos",), "plot": ("signal_prop_cos",)})
FIRST_TOKEN = register_metric("first_token", ("first_token_argmax_share", "first_token_attention_mass",
                                "first_token_attention_mass_norm", "first_token_argmax_share_excl_q0"), "attention",
                _first_token_sums, _first_token, label="first-token attention (Kaul et al. 2024 §3.5-3.6)",
                shown={k: ("first_token_argmax_share", "first_token_attention_mass") for k in _report},
                headline=(Headline("first-token share", ("first_token_argmax_share",), 2),))
register_metric("residual_scale", ("residual_rms", "residual_norm"), "residual", _scale_sums, _scale,
                label="residual-stream RMS / token norm",
                shown={"report": ("residual_rms",), "plot": ("residual_rms",), "profile": (("residual_rms", 0),)})
register_metric("norm_ratio", "norm_ratio", "residual",
                *_per_token_mean("norm_ratio", "norm_ratio", lambda r: _norm_ratio(r.tok_max, r.norms2)),
                label="||x||_inf^2 / ||x||_2^2 (Kaul et al. 2024 §3.7)")
register_metric("attention_entropy", "attention_entropy", "attention", _entropy_sums, _entropy,
                label="attention entropy", lower_is_better=False)
register_metric("attention_sink_mass", "attention_sink_mass", "attention", _sink_mass_sums, _sink_mass,
                label="softmax-1 sink mass", lower_is_better=None)

