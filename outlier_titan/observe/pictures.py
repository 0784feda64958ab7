"""Probe pictures, drawn with matplotlib into HWC uint8 arrays: the same labelled picture goes to TensorBoard
(``add_image(..., dataformats="HWC")``) and to the evaluation's PNG files.

* :func:`attention_map_image`: the mean attention map (queries down, keys across), as Kaul et al. 2024 Fig. 1, on a
  **fixed** log colour scale from 1e-4 to 1 (probabilities), so pictures of different steps and runs compare
  directly. The first key's column is outlined in red.
* :func:`hidden_magnitude_image`: hidden-state magnitude per layer (rows) and channel (columns), two panels on
  one log colour scale: the first token on top, the RMS over the other tokens below. The scale runs from the
  1st percentile to the maximum of these magnitudes; its range is written in the title and on the colour bar.
* :func:`sinks_massive_image`: per layer, the attention-sink shares and the gradient sink beside the
  massive-activation magnitudes (:mod:`outlier_titan.observe.panel`).
* :func:`lowprec_image`: per layer (rows) and cast tensor class x module group (columns), the underflow share,
  the saturation share and the quantisation SNR of the low-precision casts (:mod:`outlier_titan.observe.lowprec`),
  three heatmaps.

matplotlib (Agg, no display) is imported on the first picture only.
"""

from __future__ import annotations

import numpy as np

ATTENTION_RANGE = (1e-4, 1.0)  # fixed colour scale of the attention map (probabilities)
FIRST_TOKEN_COLOUR = "#dc2828"
MAX_COLUMNS = 1024  # wide models are max-pooled to this many channel columns (single spikes stay visible)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def _to_array(fig) -> np.ndarray:
    """Renders a figure to [H, W, 3] uint8 and closes it."""
    plt = _pyplot()
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return rgb


def _max_pool_columns(a: np.ndarray, max_cols: int) -> tuple[np.ndarray, int]:
    """Max-pools the last axis down to at most ``max_cols`` columns; returns the array and the group size."""
    d = a.shape[-1]
    if d <= max_cols:
        return a, 1
    group = -(-d // max_cols)
    pad = group * (-(-d // group)) - d
    if pad:
        a = np.concatenate([a, np.full(a.shape[:-1] + (pad,), -np.inf)], axis=-1)
    return a.reshape(a.shape[:-1] + (-1, group)).max(-1), group


def attention_map_image(attn: np.ndarray, title: str = "mean attention map (all layers and heads)",
                        size_in: float = 4.8, dpi: int = 100) -> np.ndarray:
    """Mean attention map [K, K] (rows: queries, columns: keys) -> [H, W, 3] uint8, labelled."""
    from matplotlib.colors import LogNorm
    from matplotlib.patches import Rectangle

    a = np.asarray(attn, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] != a.shape[1] or a.shape[0] == 0:
        raise ValueError(f"attention map must be square [K, K], got shape {a.shape}")
    k = a.shape[0]
    lo, hi = ATTENTION_RANGE
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(size_in * 1.2, size_in), dpi=dpi, layout="constrained")
    masked = np.ma.masked_less_equal(np.clip(a, 0.0, hi), 0.0)  # causal zeros: blank, not "tiny"
    im = ax.imshow(masked, cmap="viridis", norm=LogNorm(vmin=lo, vmax=hi, clip=True), interpolation="nearest",
                   extent=(-0.5, k - 0.5, k - 0.5, -0.5))
    ax.add_patch(Rectangle((-0.5, -0.5), 1, k, fill=False, edgecolor=FIRST_TOKEN_COLOUR, linewidth=1.5))
    ax.set_xlabel("key position (red: first token)")
    ax.set_ylabel("query position")
    ax.set_title(f"{title}\nfirst {k} positions; key 0 mean share {a[:, 0].mean():.3f}", fontsize=9)
    fig.colorbar(im, ax=ax, label="attention probability (fixed log scale)")
    return _to_array(fig)


def hidden_magnitude_image(first: np.ndarray, rest: np.ndarray, dpi: int = 100) -> np.ndarray:
    """Two [layers, D] magnitude maps (first token; RMS over the other tokens) -> [H, W, 3] uint8, labelled."""
    from matplotlib.colors import LogNorm

    first = np.asarray(first, dtype=np.float64)
    rest = np.asarray(rest, dtype=np.float64)
    if first.shape != rest.shape or first.ndim != 2 or first.size == 0:
        raise ValueError(f"need two equal [layers, D] arrays, got {first.shape} and {rest.shape}")
    n_layers, d = first.shape
    mags = np.maximum(np.abs(np.stack([first, rest])), 1e-12)
    mags, group = _max_pool_columns(mags, MAX_COLUMNS)
    lo, hi = float(np.percentile(mags, 1.0)), float(mags.max())
    hi = hi if hi > lo else lo * 10
    plt = _pyplot()
    height = 1.6 + 2 * max(1.0, 0.18 * n_layers)
    fig, axes = plt.subplots(2, 1, figsize=(8.0, height), dpi=dpi, sharex=True, layout="constrained")
    norm = LogNorm(vmin=lo, vmax=hi, clip=True)
    pooled = f" (max over groups of {group})" if group > 1 else ""
    for ax, m, label, colour in zip(axes, mags, ("first token (RMS over sequences)", "other tokens (RMS)"),
                                    (FIRST_TOKEN_COLOUR, "black")):
        im = ax.imshow(m, aspect="auto", cmap="magma", norm=norm, interpolation="nearest",
                       extent=(-0.5 * group, (m.shape[1] - 0.5) * group, n_layers - 0.5, -0.5))
        ax.set_ylabel("layer")
        ax.set_title(label, fontsize=9, color=colour, loc="left")
    axes[-1].set_xlabel(f"residual channel (of {d}){pooled}")
    fig.suptitle(f"hidden-state magnitude |x| per layer and channel; colour range {lo:.2g} to {hi:.2g}",
                 fontsize=9)
    fig.colorbar(im, ax=list(axes), label="|x| (log scale)")
    return _to_array(fig)


def sinks_massive_image(layers: list[str], columns: dict[str, list[float]], shares: tuple[str, ...],
                        dpi: int = 100) -> np.ndarray:
    """Per-layer curves side by side (layers across): the share columns (sink rate, first-token attention mass,
    gradient sink share) on a linear [0, 1] axis on the left, the magnitudes (massive ratio, first-token max |x|)
    on a log axis on the right -> [H, W, 3] uint8, labelled."""
    if not layers or not columns:
        raise ValueError("the sinks-vs-massive panel needs at least one layer and one column")
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(10.0, 3.6), dpi=dpi, sharex=True, layout="constrained")
    x = np.arange(len(layers))
    for ax, picked, ylabel in ((left, [c for c in columns if c in shares], "share (0 to 1)"),
                               (right, [c for c in columns if c not in shares], "magnitude (log scale)")):
        for name in picked:
            ax.plot(x, columns[name], marker="o", markersize=3, label=name,
                    linestyle="--" if name.startswith("grad_") else "-")
        if ax is left:
            ax.set_ylim(-0.02, 1.02)
        elif picked and min(min(columns[c]) for c in picked) > 0:
            ax.set_yscale("log")
        ax.set_ylabel(ylabel)
        ax.set_xlabel("layer")
        ax.set_xticks(x, layers, fontsize=7)
        if picked:
            ax.legend(fontsize=7, loc="best")
    left.set_title("attention sinks and the gradient sink (dashed)", fontsize=9, loc="left")
    right.set_title("massive activations", fontsize=9, loc="left")
    return _to_array(fig)


def lowprec_image(layers: list[str], columns: list[str], table: dict[str, list[list[float]]],
                  dpi: int = 100) -> np.ndarray:
    """Heatmaps [layers x columns] of ``table``'s ``underflow`` and ``saturation`` shares and ``snr_db``, each on
    its own range (in its title; shares from 0), blank where a cast is absent -> [H, W, 3] uint8, labelled. (No
    values in the cells: the scalars carry them, and text is most of a picture's drawing time.)"""
    if not layers or not columns:
        raise ValueError("the low-precision picture needs at least one layer and one column")
    plt = _pyplot()
    panels = (("underflow", "underflow share (nonzero -> 0)", "Reds", True),
              ("saturation", "saturation share (clamped at max)", "Oranges", True),
              ("snr_db", "quantisation SNR (dB)", "viridis", False))
    fig, axes = plt.subplots(1, 3, figsize=(3.0 + 3 * max(2.2, 0.45 * len(columns)), 2.0 + 0.25 * len(layers)),
                             dpi=dpi)
    for ax, (key, title, cmap, share) in zip(axes, panels):
        a = np.asarray(table[key], dtype=np.float64)
        finite = a[np.isfinite(a)]
        lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
        lo = 0.0 if share else lo
        im = ax.imshow(np.ma.masked_invalid(a), aspect="auto", cmap=cmap, vmin=lo, vmax=hi if hi > lo else lo + 1,
                       interpolation="nearest")
        ax.set_xticks(range(len(columns)), columns, rotation=45, ha="right", fontsize=7)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_ylabel("layer", fontsize=8)
        ax.set_title(f"{title}: {lo:.3g} to {hi:.3g}", fontsize=8, loc="left")
        fig.colorbar(im, ax=ax, shrink=0.8)
    fig.suptitle("low-precision casts per layer: tensor class (act / weight / grad) x module group", fontsize=9)
    fig.subplots_adjust(left=0.05, right=0.98, bottom=0.3, top=0.82, wspace=0.35)
    return _to_array(fig)
