"""The sinks-vs-massive-activations panel: per layer, side by side, the attention-sink metrics (Gu et al. 2024's
sink rate, Kaul et al. 2024's first-token attention mass), the massive activations (Sun et al. 2024's max/median
ratio, Kaul et al. 2024's first-token max |x|, Chen, Lin, Yao 2026's t0/early) and the gradient sink (Chen, Lin,
Yao 2026, arXiv 2603.17771) that is proposed to link them. It reads the probe's finalised per-layer scalars (nothing is computed twice): the
probe's TensorBoard picture (:func:`outlier_titan.observe.pictures.sinks_massive_image`) and the evaluation
report's per-layer table both come from :func:`panel_rows`."""

from __future__ import annotations

import re

PANEL = ("sink_rate", "first_token_attention_mass", "massive_ratio", "max_abs_first", "massive_t0_early",
         "grad_sink_share", "grad_sink_rgs")
"""The columns, in order: two attention-sink measures, three massive-activation measures (the last Chen, Lin, Yao
2026's t0/early), the gradient sink (our share reading, then the paper's R_GS)."""
SHARES = ("sink_rate", "first_token_attention_mass", "grad_sink_share")
"""The columns that are shares in [0, 1] (one axis); the others are magnitudes (a log axis)."""
_LAYER = re.compile(r"^outliers/layer_(.+)/(.+)$")


def panel_rows(scalars: dict[str, float]) -> tuple[list[str], dict[str, list[float]]]:
    """``(layer names in logged order, {column: per-layer values})`` from a probe's scalars; a column is kept only
    when every layer has it (the sink columns need ``observe.mode = "full"``, the gradient one
    ``observe.gradients``)."""
    values: dict[str, dict[str, float]] = {}
    for key, v in scalars.items():
        m = _LAYER.match(key)
        if m and m.group(2) in PANEL:
            values.setdefault(m.group(1), {})[m.group(2)] = v
    layers = list(values)
    columns = {c: [values[n][c] for n in layers] for c in PANEL if layers and all(c in values[n] for n in layers)}
    return (layers, columns) if columns else ([], {})
