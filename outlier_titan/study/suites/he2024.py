"""He et al. 2024 (arXiv 2405.19279; NeurIPS 2024), the Outlier Protected block and SOAP: the paper's numbers
(Table 2, OPT-125m; our reading: docs/papers/he2024.md) and its claims."""

from __future__ import annotations

from typing import Any

from outlier_titan.study import rules
from outlier_titan.study.groups import first_match
from outlier_titan.study.rules import Claim
from outlier_titan.study.suites.base import PTQ_THRESHOLDS, REDUCTION_THRESHOLDS, PaperRow, Suite, SuiteInfo


def _he_axes(block: str, opt: str) -> dict[str, object]:
    return {"model.block": block, "optimizer.name": opt}


INFO = SuiteInfo(
    title="he2024: the Outlier Protected block and SOAP against outlier features",
    citation="He et al., Understanding and Minimising Outlier Features in Transformer Training, NeurIPS 2024",
    metrics={"ppl": "PPL", "kurtosis_neuron_rms": "kurtosis (neuron RMS, final)",
             "peak_kurtosis_neuron_rms": "kurtosis (neuron RMS, peak)", "d_w8a8": "Δppl W8A8"},
    rows=[
        PaperRow("OPT-125m, Pre-LN, AdamW (default)", _he_axes("pre_ln", "adamw"),
                 dict(ppl=16.00, kurtosis_neuron_rms=25.6, d_w8a8=47.40), "Table 2 row 1"),
        PaperRow("OPT-125m, Pre-LN, SOAP", _he_axes("pre_ln", "soap"),
                 dict(ppl=14.80, kurtosis_neuron_rms=5.1, d_w8a8=1.63), "Table 2 row 5"),
        PaperRow("OPT-125m, OP, AdamW (default)", _he_axes("op", "adamw"),
                 dict(ppl=15.64, kurtosis_neuron_rms=3.6, d_w8a8=0.37), "Table 2 row 11"),
        PaperRow("OPT-125m, OP, SOAP", _he_axes("op", "soap"),
                 dict(ppl=14.71, kurtosis_neuron_rms=1.2, d_w8a8=0.16), "Table 2 row 15"),
    ],
    schemes=("w8a8_static",),
    kurtosis="kurtosis_neuron_rms",
    tile_study=({"optimizer.name": "adamw"}, {"optimizer.name": "soap"}, "kurtosis_neuron_rms",
                ("kurtosis_neuron_rms", "peak_kurtosis_neuron_rms", "max_abs_rest", "d_w8a8", "final_val_loss")),
    extra_probe=("signal_prop_corr",),  # He et al. 2024 §2: mean input correlation tracks the kurtosis
)

def claims(groups: list[dict[str, Any]]) -> list[Claim]:
    """The kurtosis claim on the paper's metric (Table 2: the final kurtosis of neuron RMS), the same on the peak
    over probe steps as a secondary line (not the paper's metric), and the W8A8 claim."""
    base = first_match(groups, {"model.block": "pre_ln", "optimizer.name": "adamw"})
    rem = first_match(groups, {"model.block": "op", "optimizer.name": "soap"})
    k, cost = f"{rules.REDUCTION_FACTOR.value:g}", f"{rules.LOSS_COST.value:.0%}"
    return [
        rules.reduction(f"neuron-RMS kurtosis (final, the paper's Table 2 metric): Pre-LN + AdamW ≥ {k}× that of "
                        f"OP + SOAP, at a val loss at most {cost} above the baseline's", base, rem,
                        "kurtosis_neuron_rms"),
        rules.reduction(f"secondary, not the paper's metric — neuron-RMS kurtosis at its peak over probe steps: "
                        f"Pre-LN + AdamW ≥ {k}× that of OP + SOAP, same loss condition", base, rem,
                        "peak_kurtosis_neuron_rms"),
        rules.ptq_reduction("W8A8 Δppl of OP + SOAP below a third of Pre-LN + AdamW's", base, rem, "d_w8a8"),
    ]


SUITE = Suite(INFO, claims, [*REDUCTION_THRESHOLDS, *PTQ_THRESHOLDS])
