"""Probe pictures as HWC uint8 arrays (TensorBoard ``add_image(..., dataformats="HWC")``), in numpy only.

* :func:`attention_map_image`: the mean attention map (queries down, keys across), as seed 000 Fig. 1.
* :func:`hidden_magnitude_image`: hidden-state magnitude per layer (rows) and channel (columns), two panels:
  the first token on top (marked by a red stripe on the left) and the RMS over the other tokens below
  (grey stripe), on one shared log colour scale so that first-token outlier channels stand out.

No matplotlib: the colours come from a small built-in perceptual ramp, so making a picture costs
microseconds to milliseconds and the trainer does not import a plotting stack.
"""

from __future__ import annotations

import numpy as np

# Anchor colours of a dark-blue -> teal -> yellow ramp (close to viridis), interpolated linearly.
_RAMP = np.array([
    [68, 1, 84], [71, 44, 122], [59, 81, 139], [44, 113, 142], [33, 144, 141],
    [39, 173, 129], [92, 200, 99], [170, 220, 50], [253, 231, 37],
], dtype=np.float64)
FIRST_TOKEN_MARK = (220, 40, 40)
REST_MARK = (128, 128, 128)
SEPARATOR = (255, 255, 255)


def colorize(values: np.ndarray) -> np.ndarray:
    """Maps values in [0, 1] (NaN -> 0) to RGB uint8 with the built-in ramp; shape [...] -> [..., 3]."""
    v = np.nan_to_num(np.asarray(values, dtype=np.float64), nan=0.0)
    v = np.clip(v, 0.0, 1.0) * (len(_RAMP) - 1)
    lo = np.floor(v).astype(np.int64)
    hi = np.minimum(lo + 1, len(_RAMP) - 1)
    frac = (v - lo)[..., None]
    rgb = _RAMP[lo] * (1.0 - frac) + _RAMP[hi] * frac
    return np.round(rgb).astype(np.uint8)


def _upscale(img: np.ndarray, fy: int, fx: int) -> np.ndarray:
    return np.repeat(np.repeat(img, fy, axis=0), fx, axis=1)


def _max_pool_columns(a: np.ndarray, max_cols: int) -> np.ndarray:
    """Max-pools the last axis down to at most ``max_cols`` columns (keeps single-channel spikes visible)."""
    d = a.shape[-1]
    if d <= max_cols:
        return a
    group = -(-d // max_cols)
    pad = group * (-(-d // group)) - d
    if pad:
        a = np.concatenate([a, np.full(a.shape[:-1] + (pad,), -np.inf)], axis=-1)
    return a.reshape(a.shape[:-1] + (-1, group)).max(-1)


def attention_map_image(attn: np.ndarray, target_px: int = 256) -> np.ndarray:
    """Mean attention map [K, K] (rows: queries, columns: keys) -> [H, W, 3] uint8.

    The scale runs from 0 to the largest weight outside query 0 (query 0 always puts all of its softmax
    mass on key 0, which would otherwise wash out the picture); larger values saturate.
    """
    a = np.asarray(attn, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ValueError(f"attention map must be square [K, K], got shape {a.shape}")
    k = a.shape[0]
    top = a[1:].max() if k > 1 else a.max()
    top = top if top > 0 else 1.0
    img = colorize(a / top)
    f = max(1, target_px // k)
    return _upscale(img, f, f)


def hidden_magnitude_image(first: np.ndarray, rest: np.ndarray, max_width: int = 1024,
                           panel_px: int = 128) -> np.ndarray:
    """Two [layers, D] magnitude maps (first token; the other tokens) -> [H, W, 3] uint8.

    Colour = log10 of the magnitude, on one scale for both panels (from the 1st to the 100th percentile of
    the log magnitudes). Wide models are max-pooled to ``max_width`` columns, narrow ones are widened to at
    least 256 pixels. A red stripe marks the first-token rows, a grey one the rest, a white line separates them.
    """
    first = np.asarray(first, dtype=np.float64)
    rest = np.asarray(rest, dtype=np.float64)
    if first.shape != rest.shape or first.ndim != 2 or first.size == 0:
        raise ValueError(f"need two equal [layers, D] arrays, got {first.shape} and {rest.shape}")
    n_layers = first.shape[0]
    logs = np.log10(np.maximum(np.abs(np.stack([first, rest])), 1e-12))
    logs = _max_pool_columns(logs, max_width)
    lo, hi = np.percentile(logs, 1.0), logs.max()
    norm = (logs - lo) / (hi - lo) if hi > lo else np.zeros_like(logs)
    fy = min(16, max(1, -(-panel_px // n_layers)))
    fx = max(1, -(-256 // norm.shape[-1]))
    panels = [_upscale(colorize(norm[i]), fy, fx) for i in range(2)]
    stripe_w = 6
    rows = []
    for panel, mark in zip(panels, (FIRST_TOKEN_MARK, REST_MARK)):
        stripe = np.empty((panel.shape[0], stripe_w, 3), dtype=np.uint8)
        stripe[:] = mark
        rows.append(np.concatenate([stripe, panel], axis=1))
    sep = np.empty((2, rows[0].shape[1], 3), dtype=np.uint8)
    sep[:] = SEPARATOR
    return np.ascontiguousarray(np.concatenate([rows[0], sep, rows[1]], axis=0))
