"""A toy probe metric as a plug-in: per sequence, the residual stream's max |x| over its RMS (over the sequence's
tokens and channels), averaged over sequences. ``job.plugins = ["tests/plugins/toy_metric.py"]`` or
``outlier_titan.plugins.load_plugin(path)`` registers it; the probe then logs ``outliers/layer_<i>/peak_to_rms``,
``outliers/head_input/peak_to_rms`` and the layer mean ``outliers/peak_to_rms``."""

import torch

from outlier_titan.observe.metrics import Headline, register_metric


def sums(r):
    """Per-rank sums of one layer (``r``: the probe's ResidualInput, ``r.x`` [B, T, D]); ranks add them up."""
    peak = r.x.abs().amax((1, 2)).to(torch.float64)  # [B]
    rms = r.sq.mean((1, 2)).sqrt()  # r.sq: x^2 in float64, shared with the built-ins
    return {"n_seq": r.count(r.x.shape[0]), "ratio": (peak / rms.clamp_min(torch.finfo(torch.float64).tiny)).sum()}


def finalize(s):
    """The metric from the sums added over ranks (host float64 tensors); nothing without data."""
    n = float(s["n_seq"])
    return {"peak_to_rms": float(s["ratio"]) / n} if n > 0 else {}


register_metric("toy_peak_to_rms", "peak_to_rms", "residual", sums, finalize,
                label="max |x| / RMS of the residual stream (toy)", lower_is_better=True,
                shown={"report": ("peak_to_rms",), "collect": ("peak_to_rms",), "plot": ("peak_to_rms",)},
                headline=(Headline("peak/RMS", ("peak_to_rms",), rank=10),))
