"""The evaluation report: quantised perplexity per scheme and the probe metrics, as JSON and markdown."""

from __future__ import annotations

import math
import statistics
from typing import Any

from outlier_titan.observe import metrics as registry
from outlier_titan.observe.panel import panel_rows


def scheme_entry(name: str, description: str, head: str, ppls: list[float], fp_ppl: float) -> dict[str, Any]:
    """One row: the PPL (mean over calibration seeds when there are several), its std and Δ vs full precision."""
    mean = statistics.fmean(ppls)
    std = statistics.stdev(ppls) if len(ppls) > 1 else 0.0
    return {"scheme": name, "description": description, "head": head, "ppl": mean, "ppl_std": std,
            "ppl_runs": list(ppls), "delta": mean - fp_ppl}


def _fmt(x: float) -> str:
    if not math.isfinite(x):
        return str(x)
    if abs(x) >= 1e5:
        return f"{x:.4g}"
    return f"{x:.3f}"


def markdown(report: dict[str, Any]) -> str:
    """Markdown: a header line, the PPL table (full precision first), the probe-metric table (the registered
    metrics shown in reports), the per-layer sinks-vs-massive-activations table and the whole-model measures."""
    lines = [f"# Evaluation of `{report.get('checkpoint', '?')}`", "",
             f"{report['tokens']:,} validation tokens, sequence length {report['seq_len']}.", "",
             "| scheme | PPL | Δ PPL | LM head | description |", "|---|---|---|---|---|"]
    fp = report["full_precision"]
    lines.append(f"| full precision | {_fmt(fp['ppl'])} | 0 | fp | no quantisation |")
    for e in report["schemes"]:
        ppl = _fmt(e["ppl"]) + (f" ± {_fmt(e['ppl_std'])}" if len(e["ppl_runs"]) > 1 else "")
        lines.append(f"| {e['scheme']} | {ppl} | {_fmt(e['delta'])} | {e['head']} | {e['description']} |")
    rotated = next((e["rotation"] for e in report["schemes"] if e.get("rotation")), None)
    if rotated:
        lines += ["", f"Rotated schemes (`_hadamard`, QuaRot): {rotated['residual_rotation']}; online: "
                      f"{', '.join(rotated['online'])}; K and V per head"
                      + (f"; rotation seeds {', '.join(map(str, rotated['seeds']))}" if rotated.get("seeds") else "")
                      + ". ± is the spread over calibration seeds "
                      f"(GPTQ, static ranges) or rotation seeds (random signs)."]
    probe = report.get("probe") or {}
    rows = [(k, probe[f"outliers/{k}"]) for k in registry.shown("report") if f"outliers/{k}" in probe]
    if rows:
        lines += ["", "| probe metric (mean over layers) | value |", "|---|---|"]
        lines += [f"| {k} | {v:.4g} |" for k, v in rows]
    layers, columns = panel_rows(probe)
    if columns:
        lines += ["", "Attention sinks vs massive activations per layer (and the gradient sink with "
                      "`observe.gradients`; Chen, Lin, Yao 2026):", "",
                  "| layer | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        lines += [f"| {n} | " + " | ".join(f"{columns[c][i]:.4g}" for c in columns) + " |"
                  for i, n in enumerate(layers)]
    for e in registry.evaluations():
        value = (report.get(e.key) or {}).get(e.key)
        if value is not None:
            lines += ["", e.note.format(value=value)]
    return "\n".join(lines) + "\n"
