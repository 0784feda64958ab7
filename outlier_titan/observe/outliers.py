"""Outlier-feature and attention-sink metrics of the three seed papers, as pure tensor functions.

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

The attention-sink metrics of the field (see docs/attention.md; "weights" are the weights that multiply the
values, unnormalised for sigmoid / ReLU / softpick attention):

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
* **dormant heads** (after Guo et al.): a head is dormant when its mean output norm on the non-first tokens
  (after any gate, before ``wo``) is below ``DORMANT_TAU`` = 0.1 times the mean of that quantity over the
  layer's heads; ``dormant_head_share`` is the share of such heads.

Everything that has to be reduced across data-parallel ranks is expressed as **sums** (:func:`residual_sums`,
:func:`attention_sums`), so the distributed probe adds them up and finalises once
(:func:`finalize_residual`, :func:`finalize_attention`); the direct functions are for tests and analysis.
Maths that matters is done in float64.
"""

from __future__ import annotations

import torch

F64 = torch.float64


# ----------------------------------------------------------------------------------------------------------
# Direct definitions


def token_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Kaul et al. 2024 Eq. 2: Pearson kurtosis over the last dim, one value per token (float64)."""
    x = x.to(F64)
    c = x - x.mean(-1, keepdim=True)
    c2 = c.square()
    m2 = c2.mean(-1)
    m4 = c2.square().mean(-1)
    return m4 / m2.square().clamp_min(torch.finfo(F64).tiny)


def neuron_rms_kurtosis_from_sq(s2: torch.Tensor) -> torch.Tensor:
    """He et al. 2024 Eq. 1 from the per-neuron mean squares ``s_j^2`` (shape [D]): ``mean s^4 / (mean s^2)^2``."""
    s2 = s2.to(F64)
    return s2.square().mean(-1) / s2.mean(-1).square().clamp_min(torch.finfo(F64).tiny)


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
    t = c2 / c2.mean(-1, keepdim=True).clamp_min(torch.finfo(F64).tiny)
    return t.var(-1, unbiased=True)


def neuron_rms_kurtosis_centred(x: torch.Tensor) -> torch.Tensor:
    x = x.to(F64).reshape(-1, x.shape[-1])
    x = x - x.mean(-1, keepdim=True)
    return neuron_rms_kurtosis_centred_from_sq(x.square().mean(0))


def max_median_ratio(x: torch.Tensor) -> torch.Tensor:
    """He et al. 2024 Eq. 2 per token: ``max_d |x| / median_d |x|`` (aggregate with a mean over tokens)."""
    a = x.abs().float()
    med = a.median(-1).values.to(F64)
    return a.amax(-1).to(F64) / med.clamp_min(torch.finfo(F64).tiny)


def norm_ratio(x: torch.Tensor) -> torch.Tensor:
    """Kaul et al. 2024 §3.7 per token: ``||x||_inf^2 / ||x||_2^2`` (1 for one dominant channel, 1/D for a flat one)."""
    x = x.to(F64)
    return x.abs().amax(-1).square() / x.square().sum(-1).clamp_min(torch.finfo(F64).tiny)


def mean_pairwise_cosine(x: torch.Tensor) -> torch.Tensor:
    """Mean cosine similarity over all ordered pairs alpha != beta of token vectors (leading dims pooled).

    Uses ``sum_{a != b} u_a . u_b = ||sum_a u_a||^2 - n`` for unit vectors u: no n x n Gram matrix.
    """
    u = _unit(x.to(F64).reshape(-1, x.shape[-1]))
    n = u.shape[0]
    return (u.sum(0).square().sum() - n) / (n * (n - 1))


def signal_prop_corr(x: torch.Tensor) -> torch.Tensor:
    """He et al. 2024 §2.1: mean off-diagonal of ``X~ X~^T / d`` with ``X~ = X / sqrt(||X||_F^2 / (n d))``."""
    x = x.to(F64).reshape(-1, x.shape[-1])
    n = x.shape[0]
    s = x.square().sum()
    return (x.sum(0).square().sum() - s) / ((n - 1) * s)


def first_token_argmax_share(probs: torch.Tensor, exclude_first_query: bool = False) -> torch.Tensor:
    """Kaul et al. 2024 §3.5: fraction of (batch, head, query) rows whose argmax key is key 0 (ties: lowest index)."""
    hit = probs.argmax(-1) == 0
    if exclude_first_query:
        hit = hit[..., 1:]
    return hit.to(F64).mean()


def first_token_attention_mass(probs: torch.Tensor, normalise_rows: bool = False) -> torch.Tensor:
    """Kaul et al. 2024 §3.6: mean probability on key 0 (raw; or divided by the row mass, which differs under
    softmax-1)."""
    p0 = probs[..., 0].to(F64)
    if normalise_rows:
        p0 = p0 / probs.to(F64).sum(-1).clamp_min(torch.finfo(F64).tiny)
    return p0.mean()


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)


# ----------------------------------------------------------------------------------------------------------
# Reducible sums (one layer) and their finalisation


RESIDUAL_METRICS = (
    "kurtosis_first", "kurtosis_rest", "kurtosis_all", "max_abs_first", "max_abs_rest", "max_abs_rest_token",
    "kurtosis_neuron_rms", "max_median_ratio", "norm_ratio", "signal_prop_cos", "signal_prop_corr",
    "residual_rms", "residual_norm", "massive_ratio", "massive_count", "residual_peak",
)
ATTENTION_METRICS = (
    "first_token_argmax_share", "first_token_argmax_share_excl_q0", "first_token_attention_mass",
    "first_token_attention_mass_norm", "attention_sink_mass", "attention_entropy", "sink_rate", "sink_rate_pooled",
)
HEAD_METRICS = ("value_drain", "dormant_head_share")

SINK_EPS = 0.3  # Gu et al. 2024's threshold of the sink rate
MASSIVE_FACTOR = 100.0  # Sun et al. 2024: "massive" = more than this times the median magnitude
DORMANT_TAU = 0.1  # a head is dormant below this share of its layer's mean head-output norm


def sink_rate(probs: torch.Tensor, eps: float = SINK_EPS) -> torch.Tensor:
    """Gu et al. 2024's Sink^eps of one layer [B, H, T, T]: the share of (sequence, head) pairs whose mean weight on
    key 0 over the queries exceeds ``eps``."""
    alpha = probs[..., 0].to(F64).mean(2)  # [B, H]
    return (alpha > eps).to(F64).mean()


def sink_rate_pooled(probs: torch.Tensor, eps: float = SINK_EPS) -> torch.Tensor:
    """The pooled form (not Gu et al.'s): the share of heads whose mean weight on key 0 over all sequences and
    queries exceeds ``eps``."""
    alpha = probs[..., 0].to(F64).mean((0, 2))  # [H]
    return (alpha > eps).to(F64).mean()


def massive_mask(x: torch.Tensor, factor: float = MASSIVE_FACTOR
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sun et al. 2024's massive entries of a residual stream [B, T, D]: ``(|x| in float64, the median |x| per
    sequence [B], mask)``, the mask true where ``|x|`` exceeds ``factor`` x its sequence's median."""
    a = x.to(F64).abs()
    med = a.reshape(x.shape[0], -1).median(-1).values
    return a, med, a > factor * med.view(-1, *([1] * (x.dim() - 1)))


def massive_activations(x: torch.Tensor, factor: float = MASSIVE_FACTOR) -> tuple[torch.Tensor, torch.Tensor]:
    """Sun et al. 2024 on a residual stream [B, T, D]: per sequence max |x| / median |x| and the count of
    entries above ``factor`` x median (:func:`massive_mask`); both averaged over sequences."""
    a, med, mask = massive_mask(x, factor)
    ratio = a.reshape(x.shape[0], -1).amax(-1) / med.clamp_min(torch.finfo(F64).tiny)
    count = mask.reshape(x.shape[0], -1).to(F64).sum(-1)
    return ratio.mean(), count.mean()


def first_token_norm_ratio(x: torch.Tensor) -> torch.Tensor:
    """[..., T, C] -> mean over the leading dims of ``||x_0|| / mean_{j>0} ||x_j||`` (residual peak of a
    residual stream [B, T, D]; value drain of value states [B, H, T, d_h])."""
    n = x.to(F64).norm(dim=-1)
    return (n[..., 0] / n[..., 1:].mean(-1).clamp_min(torch.finfo(F64).tiny)).mean()


def dormant_head_share(out: torch.Tensor, tau: float = DORMANT_TAU) -> torch.Tensor:
    """Share of heads of ``out`` [B, H, T, d_h] (per-head attention outputs) whose mean output norm over the
    non-first tokens is below ``tau`` x the mean of that over the heads."""
    r = out[:, :, 1:].to(F64).norm(dim=-1).mean((0, 2))  # [H]
    return (r < tau * r.mean()).to(F64).mean()


def residual_sums(x: torch.Tensor, centred: bool = False) -> dict[str, torch.Tensor]:
    """Sufficient statistics of one layer's residual stream ``x`` [B, T, D] as float64 sums.

    Scalars and [D] vectors; adding the dicts of disjoint token sets (other DP ranks, other batches) and
    calling :func:`finalize_residual` gives the metrics of the union. Runs on x's device without host syncs.
    """
    if x.dim() != 3:
        raise ValueError(f"residual stream must be [B, T, D], got shape {tuple(x.shape)}")
    b, t, d = x.shape
    x64 = x.to(F64)
    sq = x64.square()
    kurt = token_kurtosis(x64)  # [B, T]
    absx = x.abs()
    tok_max = absx.amax(-1).to(F64)  # [B, T]
    norms2 = sq.sum(-1)  # [B, T]
    out = {
        # counts via fill kernels (new_full), not host-to-device copies, so that hooks never sync the host
        "n_seq": x64.new_full((), float(b)),
        "n_tok": x64.new_full((), float(b * t)),
        "n_rest": x64.new_full((), float(b * (t - 1))),
        "kurt_first": kurt[:, 0].sum(),
        "kurt_rest": kurt[:, 1:].sum(),
        "maxabs_first": tok_max[:, 0].sum(),
        "maxabs_rest": tok_max[:, 1:].amax(-1).sum() if t > 1 else x64.new_zeros(()),
        "maxabs_rest_token": tok_max[:, 1:].sum(),
        "mmr": max_median_ratio(x).sum(),
        "norm_ratio": (tok_max.square() / norms2.clamp_min(torch.finfo(F64).tiny)).sum(),
        "norm": norms2.sqrt().sum(),
        "sq_first": sq[:, 0].sum(0),
        "sq_rest": sq[:, 1:].sum((0, 1)),
        "vec": x64.sum((0, 1)),
        "unit": _unit(x64).sum((0, 1)),
    }
    if centred:
        out["csq"] = (x64 - x64.mean(-1, keepdim=True)).square().sum((0, 1))
    a = absx.to(F64).reshape(b, -1)
    med = a.median(-1).values.clamp_min(torch.finfo(F64).tiny)
    out["massive_ratio"] = (a.amax(-1) / med).sum()
    out["massive_count"] = (a > MASSIVE_FACTOR * med.unsqueeze(-1)).to(F64).sum()
    if t > 1:
        norms = norms2.sqrt()
        out["peak"] = (norms[:, 0] / norms[:, 1:].mean(-1).clamp_min(torch.finfo(F64).tiny)).sum()
    return out


def finalize_residual(s: dict[str, torch.Tensor]) -> dict[str, float]:
    """Metrics of one layer from (summed) :func:`residual_sums`; metrics without data are left out."""
    s = {k: v.to(F64).cpu() for k, v in s.items()}
    n_seq, n_tok, n_rest = float(s["n_seq"]), float(s["n_tok"]), float(s["n_rest"])
    sq = s["sq_first"] + s["sq_rest"]
    total_sq = float(sq.sum())
    d = sq.numel()
    out: dict[str, float] = {}
    if n_seq > 0:
        out["kurtosis_first"] = float(s["kurt_first"]) / n_seq
        out["max_abs_first"] = float(s["maxabs_first"]) / n_seq
    if n_rest > 0:
        out["kurtosis_rest"] = float(s["kurt_rest"]) / n_rest
        out["max_abs_rest"] = float(s["maxabs_rest"]) / n_seq
        out["max_abs_rest_token"] = float(s["maxabs_rest_token"]) / n_rest
    if n_tok > 0:
        out["kurtosis_all"] = (float(s["kurt_first"]) + float(s["kurt_rest"])) / n_tok
        out["kurtosis_neuron_rms"] = float(neuron_rms_kurtosis_from_sq(sq / n_tok))
        out["max_median_ratio"] = float(s["mmr"]) / n_tok
        out["norm_ratio"] = float(s["norm_ratio"]) / n_tok
        out["residual_rms"] = (total_sq / (n_tok * d)) ** 0.5
        out["residual_norm"] = float(s["norm"]) / n_tok
        if "csq" in s:
            out["kurtosis_neuron_rms_centred"] = float(neuron_rms_kurtosis_centred_from_sq(s["csq"] / n_tok))
    if n_seq > 0 and "massive_ratio" in s:
        out["massive_ratio"] = float(s["massive_ratio"]) / n_seq
        out["massive_count"] = float(s["massive_count"]) / n_seq
        if "peak" in s:
            out["residual_peak"] = float(s["peak"]) / n_seq
    if n_tok > 1:
        out["signal_prop_cos"] = (float(s["unit"].square().sum()) - n_tok) / (n_tok * (n_tok - 1))
        if total_sq > 0:
            out["signal_prop_corr"] = (float(s["vec"].square().sum()) - total_sq) / ((n_tok - 1) * total_sq)
    return out


def attention_sums(probs: torch.Tensor, map_size: int = 0, sink: bool = False) -> dict[str, torch.Tensor]:
    """Sufficient statistics of one layer's attention probabilities [B, H, T, T] as float64 sums.

    ``sink``: the probabilities come from softmax-1, whose rows sum to < 1; the mass left to the sink is
    then summed too (``attention_sink_mass``).

    With ``map_size > 0`` also the sum over batch and heads of the top-left ``map_size`` x ``map_size``
    corner (exact for causal maps: the first k queries only see the first k keys) and its count.
    """
    if probs.dim() != 4:
        raise ValueError(f"attention probabilities must be [B, H, T, T], got shape {tuple(probs.shape)}")
    b, h, t, _ = probs.shape
    p = probs.float()
    hit = (p.argmax(-1) == 0).to(F64)  # [B, H, T]
    row = p.sum(-1, dtype=F64)
    p0 = p[..., 0].to(F64)
    plogp = torch.where(p > 0, p * p.clamp_min(torch.finfo(p.dtype).tiny).log(), p.new_zeros(()))
    out = {
        "n_rows": p0.new_full((), float(b * h * t)),
        "n_rows_excl_q0": p0.new_full((), float(b * h * (t - 1))),
        "argmax_first": hit.sum(),
        "argmax_first_excl_q0": hit[..., 1:].sum(),
        "mass_first": p0.sum(),
        "mass_first_norm": (p0 / row.clamp_min(torch.finfo(F64).tiny)).sum(),
        "entropy": -plogp.sum(-1, dtype=F64).sum(),
    }
    if sink:
        out["sink_mass"] = (1.0 - row).clamp_min(0.0).sum()
    # per head (a [H] vector: the probe lays local heads out at their global positions under TP)
    out["head_mass_first"] = p0.sum((0, 2))
    out["head_n_rows"] = p0.new_full((h,), float(b * t))
    out["head_sink_seqs"] = (p0.mean(2) > SINK_EPS).to(F64).sum(0)  # sequences whose head sinks (Gu et al.)
    out["head_n_seqs"] = p0.new_full((h,), float(b))
    if map_size > 0:
        k = min(map_size, t)
        out["map"] = p[:, :, :k, :k].sum((0, 1), dtype=F64)
        out["n_maps"] = p0.new_full((), float(b * h))
    return out


def finalize_attention(s: dict[str, torch.Tensor]) -> dict[str, float]:
    """Metrics of one layer from (summed) :func:`attention_sums`."""
    s = {k: v.to(F64).cpu() for k, v in s.items()}
    n, n1 = float(s["n_rows"]), float(s["n_rows_excl_q0"])
    out: dict[str, float] = {}
    if n > 0:
        out["first_token_argmax_share"] = float(s["argmax_first"]) / n
        out["first_token_attention_mass"] = float(s["mass_first"]) / n
        out["first_token_attention_mass_norm"] = float(s["mass_first_norm"]) / n
        out["attention_entropy"] = float(s["entropy"]) / n
        if "sink_mass" in s:
            out["attention_sink_mass"] = float(s["sink_mass"]) / n
    if n1 > 0:
        out["first_token_argmax_share_excl_q0"] = float(s["argmax_first_excl_q0"]) / n1
    if "head_mass_first" in s and bool((s["head_n_rows"] > 0).all()):
        alpha = s["head_mass_first"] / s["head_n_rows"]
        out["sink_rate_pooled"] = float((alpha > SINK_EPS).to(F64).mean())
    if "head_sink_seqs" in s and float(s["head_n_seqs"].sum()) > 0:
        out["sink_rate"] = float(s["head_sink_seqs"].sum() / s["head_n_seqs"].sum())
    return out


def head_sums(out: torch.Tensor, v: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for value drain and dormant heads from one layer's per-head attention outputs ``out`` and value
    states ``v`` (both [B, H, T, d_h]; v repeated to the query heads under GQA). Keys ``head_*`` are [H] vectors
    (laid out at the global head positions by the probe under TP)."""
    b, h, t, _ = out.shape
    o = out.to(F64).norm(dim=-1)  # [B, H, T]
    vn = v.to(F64).norm(dim=-1)
    res = {"n_head_seqs": o.new_full((), float(b * h)), "head_n_rest": o.new_full((h,), float(b * (t - 1))),
           "head_out_rest": o[:, :, 1:].sum((0, 2))}
    if t > 1:
        res["value_drain"] = (vn[..., 0] / vn[..., 1:].mean(-1).clamp_min(torch.finfo(F64).tiny)).sum()
    else:
        res["value_drain"] = o.new_zeros(())
    return res


def finalize_heads(s: dict[str, torch.Tensor]) -> dict[str, float]:
    """Value drain and the dormant-head share from (summed, head-aligned) :func:`head_sums`."""
    s = {k: v.to(F64).cpu() for k, v in s.items()}
    out: dict[str, float] = {}
    if bool((s["head_n_rest"] > 0).all()):
        out["value_drain"] = float(s["value_drain"]) / float(s["n_head_seqs"])
        r = s["head_out_rest"] / s["head_n_rest"]
        out["dormant_head_share"] = float((r < DORMANT_TAU * r.mean()).to(F64).mean())
    return out


def add_sums(acc: dict[str, torch.Tensor] | None, new: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Element-wise sum of two statistics dicts (``acc`` may be None)."""
    if acc is None:
        return dict(new)
    if acc.keys() != new.keys():
        raise ValueError(f"statistics differ in keys: {sorted(acc)} vs {sorted(new)}")
    return {k: acc[k] + new[k] for k in acc}


def layer_mean(per_layer: list[dict[str, float]]) -> dict[str, float]:
    """Mean over layers of each metric present in every layer."""
    if not per_layer:
        return {}
    keys = set(per_layer[0])
    for m in per_layer[1:]:
        keys &= set(m)
    return {k: sum(m[k] for m in per_layer) / len(per_layer) for k in sorted(keys)}
