"""Kaul et al. 2024 (arXiv 2410.17174; ICLR 2025), softmax-1 and OrthoAdam: the paper's numbers (Tables 2, 3, 5;
our reading: docs/papers/kaul2024.md) and its claims. The model sizes differ from ours; the rows are the paper's
settings that our points mirror, not predictions of our numbers."""

from __future__ import annotations

from typing import Any

from outlier_titan.study import rules, stats
from outlier_titan.study.groups import first_match
from outlier_titan.study.rules import Claim, estimate_of
from outlier_titan.study.suites.base import PTQ_THRESHOLDS, REDUCTION_THRESHOLDS, PaperRow, Suite, SuiteInfo


def _kaul_axes(opt: str, sm: str, norm: str) -> dict[str, object]:
    return {"optimizer.name": opt, "model.softmax": sm, "model.norm": norm}


INFO = SuiteInfo(
    title="kaul2024: softmax-1 and OrthoAdam against first-token dominance and outlier activations",
    citation="Kaul et al., From Attention to Activation: Unravelling the Enigmas of Large Language Models, ICLR 2025",
    metrics={"ppl": "PPL", "kurtosis_first": "κ₁", "kurtosis_rest": "κ>₁", "max_abs_first": "A₁",
             "max_abs_rest": "A>₁", "first_share": "%First", "d_int8_coarse": "Δppl int8 coarse",
             "d_int4": "Δppl int4 zero-point"},
    rows=[
        PaperRow("GPT2 130M, Adam, softmax, RMSNorm-S", _kaul_axes("adam", "softmax", "rmsnorm_single"),
                 dict(ppl=22.9, kurtosis_first=514.9, kurtosis_rest=141.5, max_abs_first=7018.1,
                      max_abs_rest=1014.8, first_share=0.527, d_int8_coarse=23.60, d_int4=657.0),
                 "Table 2 row 5, Table 3 row 3"),
        PaperRow("GPT2 130M, Adam, softmax-1, RMSNorm-S", _kaul_axes("adam", "softmax1", "rmsnorm_single"),
                 dict(ppl=22.7, kurtosis_first=175.4, kurtosis_rest=144.2, max_abs_first=1134.3,
                      max_abs_rest=967.5, first_share=0.024), "Table 2 row 6"),
        PaperRow("GPT2 130M, OrthoAdam, softmax, RMSNorm-S", _kaul_axes("orthoadam", "softmax", "rmsnorm_single"),
                 dict(ppl=23.1, kurtosis_first=446.4, kurtosis_rest=20.2, max_abs_first=4285.0,
                      max_abs_rest=433.4, first_share=0.424), "Table 2 row 7"),
        PaperRow("GPT2 130M, OrthoAdam, softmax-1, RMSNorm-S", _kaul_axes("orthoadam", "softmax1", "rmsnorm_single"),
                 dict(ppl=22.8, kurtosis_first=10.1, kurtosis_rest=7.3, max_abs_first=318.1, max_abs_rest=261.6,
                      first_share=0.019, d_int8_coarse=0.43, d_int4=1.2), "Table 2 row 8, Table 3 row 4"),
        # Table 5 (GPT2 ~130M, 40k steps): its single kurtosis / max column does not say which layers it covers,
        # so only PPL and %First are compared
        PaperRow("GPT2 130M ablation, Adam, softmax, LayerNorm", _kaul_axes("adam", "softmax", "layernorm"),
                 dict(ppl=26.9, first_share=0.308), "Table 5 row 2"),
        PaperRow("GPT2 130M ablation, Adam, softmax-1, LayerNorm", _kaul_axes("adam", "softmax1", "layernorm"),
                 dict(ppl=26.5, first_share=0.022), "Table 5 row 5"),
        PaperRow("GPT2 130M ablation, OrthoAdam, softmax-1, LayerNorm",
                 _kaul_axes("orthoadam", "softmax1", "layernorm"),
                 dict(ppl=26.6, first_share=0.023), "Table 5 row 14"),
    ],
    schemes=("int8_fine", "int8_moderate", "int8_coarse", "int4_zeropoint"),
    kurtosis="kurtosis_rest",
    tile_study=({"optimizer.name": "adam"}, {"optimizer.name": "orthoadam"}, "kurtosis_rest",
                ("peak_kurtosis_rest", "kurtosis_rest", "max_abs_rest", "first_share", "d_int8_coarse", "d_int4",
                 "final_val_loss")),
)


def claims(groups: list[dict[str, Any]]) -> list[Claim]:
    """The first-token claim (softmax-1 removes the sink the baseline forms), the kurtosis claim (OrthoAdam +
    softmax-1 + RMSNorm-S removes the outlier features at the baseline's loss) and the int4 claim, on the
    paper's final metrics (Table 2: kurtosis of the other tokens; Table 3: int4 zero-point Δppl)."""
    base = first_match(groups, {"optimizer.name": "adam", "model.softmax": "softmax", "model.norm": "layernorm"})
    s1 = first_match(groups, {"optimizer.name": "adam", "model.softmax": "softmax1", "model.norm": "layernorm"})
    rem = first_match(groups, {"optimizer.name": "orthoadam", "model.softmax": "softmax1",
                               "model.norm": "rmsnorm_single"})
    present, removed = rules.SINK_PRESENT.value, rules.SINK_REMOVED.value
    out: list[Claim] = []
    text = f"first-token argmax share: baseline (Adam, softmax, LayerNorm) ≥ {present:g} and softmax-1 ≤ {removed:g}"
    sink = stats.threshold_verdict(estimate_of(base, "first_share"), present, above=True)
    gone = stats.threshold_verdict(estimate_of(s1, "first_share"), removed, above=False)
    if sink[0] == stats.NOT_REPRODUCED:
        out.append((text, stats.UNTESTABLE, f"the baseline forms no sink: {sink[1]}; softmax-1 {gone[1]}"))
    else:
        out.append((text, stats.combine(sink, gone), f"baseline {sink[1]}; softmax-1 {gone[1]}"))
    out.append(rules.reduction(
        f"kurtosis (other tokens, final): baseline ≥ {rules.REDUCTION_FACTOR.value:g}× that of OrthoAdam + "
        f"softmax-1 + RMSNorm-S, at a val loss at most {rules.LOSS_COST.value:.0%} above the baseline's",
        base, rem, "kurtosis_rest"))
    out.append(rules.ptq_reduction("int4 zero-point Δppl of the remedy below a third of the baseline's", base, rem,
                                   "d_int4"))
    return out


SUITE = Suite(INFO, claims, [rules.SINK_PRESENT, rules.SINK_REMOVED, *REDUCTION_THRESHOLDS, *PTQ_THRESHOLDS])
