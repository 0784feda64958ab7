"""Are attention sinks and massive activations one phenomenon or two? The 2026 remedies side by side
(docs/remedies.md): V-scale (Chen, Lin, Yao 2026), TWEO (Liang et al. 2025), QK-Clip (Kimi Team 2025), head-wise
RMSNorm (Li et al. 2026), OP (He et al. 2024), the gated attention (Qiu et al. 2025) and OrthoAdam (Kaul et al.
2024) against one Pre-LN + AdamW baseline. Each arm is a setting named by ``job.description`` in the sweep files."""

from __future__ import annotations

from typing import Any

from outlier_titan.study import rules, stats
from outlier_titan.study.groups import first_match, format_value
from outlier_titan.study.rules import Claim, Threshold, estimate_of, paired_relative
from outlier_titan.study.stats import estimate
from outlier_titan.study.suites.base import PaperRow, Suite, SuiteInfo

ARM = "job.description"
BASELINE = "baseline"
REMEDIES = ("v_scale", "tweo", "qk_clip", "head_norm", "op", "gated", "orthoadam")

TWEO_MAX_ACT = Threshold(20.0, "the paper: Liang et al. 2025 (arXiv 2511.23225), abstract: TWEO brings the "
                               "outliers 'from 10000+ to less than 20'")
TWEO_W8A8_COST = Threshold(0.05, "ours: Liang et al. 2025 call W8A8 per-tensor static PTQ of TWEO models "
                                 "state of the art without a number we can carry to toy scale; 5 % of the "
                                 "full-precision PPL is the largest cost we read as usable")
MA_METRIC = "massive_t0_early"
"""Chen et al. 2026's massive-activation measure: the first token's block-output norm over the mean of positions
1-15 (their rebuttal's t0/early)."""
V_SCALE_MA_FACTOR = Threshold(2.0, "ours: Chen et al. 2026's 0.3B table (OpenReview response) has t0/early 11.12 "
                                   "-> 3.03 under V-scale (3.7x); 2x asks for a clear share of that at toy scale")
QK_CLIP_TAU = Threshold(20.0, "ours: the suite's remedies.qk_clip_tau; Kimi K2 clips at 100, a MaxLogit a 2-layer "
                              "width-128 model does not reach (its baseline's ~33 in the recipe search), so the suite "
                              "clips below where its baseline's heads go")

INFO = SuiteInfo(
    title="sinks_vs_massive2026: attention sinks and massive activations under the 2026 remedies",
    citation="Chen, Lin, Yao 2026 (arXiv 2603.17771); Liang et al. 2025 (arXiv 2511.23225); Kimi Team 2025 (arXiv "
             "2507.20534); Li et al. 2026 (arXiv 2605.06611); Sun, Canziani, LeCun, Zhu 2026 (arXiv 2603.05498); "
             "He et al. 2024 (arXiv 2405.19279); Qiu et al. 2025 (arXiv 2505.06708); Kaul et al., ICLR 2025",
    metrics={"ppl": "PPL", "sink_rate": "Sink^0.3", "first_share": "%First", "massive_t0_early": "t0/early",
             "max_abs_all": "max |act|", "grad_sink_rgs": "R_GS", "max_logit": "MaxLogit",
             "d_w8a8": "Δppl W8A8 static"},
    rows=[
        PaperRow("0.3B Llama-style, AdamW (baseline)", {ARM: BASELINE}, dict(sink_rate=0.6172, massive_t0_early=11.12),
                 "Chen et al. 2026, OpenReview response table (0.3B, step 20,000; Sink^0.3 mean over layers)"),
        PaperRow("0.3B Llama-style, AdamW, V-scale", {ARM: "v_scale"}, dict(sink_rate=0.5018, massive_t0_early=3.03),
                 "Chen et al. 2026, OpenReview response table"),
        PaperRow("TWEO (LLMs, 10000+ outliers without it)", {ARM: "tweo"}, dict(max_abs_all=20.0),
                 "Liang et al. 2025, abstract (max |act| below 20)"),
        PaperRow("QK-Clip, Kimi K2 (tau 100)", {ARM: "qk_clip"}, dict(max_logit=100.0),
                 "Kimi Team 2025, MuonClip (MaxLogit capped at tau)"),
    ],
    schemes=("w8a8_static",),
    kurtosis="kurtosis_rest",
    extra_probe=("sink_rate", "massive_t0_early", "massive_ratio", "max_abs_all", "grad_sink_rgs", "max_logit"),
)


def _arm(groups: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return first_match(groups, {ARM: name})


def _relative_ptq(g: dict[str, Any] | None):
    """Per seed, the W8A8 static Δppl as a share of the full-precision PPL."""
    d, p = estimate_of(g, "d_w8a8"), estimate_of(g, "ppl")
    if d is None or p is None or d.n != p.n:
        return None
    return estimate(x / y for x, y in zip(d.values, p.values))


def _v_scale_claim(base, vs) -> Claim:
    """Chen et al. 2026's claim on their own measures: the sink rate Sink^0.3 and the first token's block-output
    norm over the early tokens' (t0/early)."""
    removed, factor = rules.SINK_REMOVED.value, V_SCALE_MA_FACTOR.value
    text = (f"V-scale keeps the attention sink (Sink^0.3 above {removed:g}) and suppresses the massive activations "
            f"(baseline t0/early ≥ {factor:g}× V-scale's) at the baseline's loss (Chen et al. 2026)")
    b_sink, v_sink = estimate_of(base, "sink_rate"), estimate_of(vs, "sink_rate")
    if b_sink is None or v_sink is None:
        return text, stats.MISSING, "a point or its probe metric is missing"
    if not stats.effect_present(b_sink, removed):
        return text, stats.UNTESTABLE, (f"the baseline forms no sink (Sink^0.3 {b_sink.text()}, t-interval not "
                                        f"above {removed:g}); V-scale {v_sink.text()}")
    kept = stats.threshold_verdict(v_sink, removed, above=True)
    ma = rules.reduction(text, base, vs, MA_METRIC, factor=V_SCALE_MA_FACTOR)
    if ma[1] == stats.UNTESTABLE:
        return text, stats.UNTESTABLE, f"{ma[2]}; sink: baseline {b_sink.text()}, V-scale {kept[1]}"
    return text, stats.combine(kept, (ma[1], ma[2])), f"sink: V-scale {kept[1]}; massive activations: {ma[2]}"


def _below_claim(text: str, base, rem, key: str, bound: float) -> Claim:
    """The remedy's ``key`` at most ``bound`` (t-interval) at the baseline's loss, testable where the baseline's
    interval lies above ``bound``."""
    b, r = estimate_of(base, key), estimate_of(rem, key)
    if b is None or r is None:
        return text, stats.MISSING, "a point or its probe metric is missing"
    if not stats.effect_present(b, bound):
        return text, stats.UNTESTABLE, (f"the baseline's {key} {b.text()} is not above {bound:g} (t-interval over "
                                        f"seeds): nothing to bring under it; the remedy's {r.text()}")
    under = stats.threshold_verdict(r, bound, above=False)
    cost = rules.loss_cost(base, rem)
    return text, stats.combine(under, cost), (f"baseline {b.text()}; remedy {under[1]}; {cost[1]}"
                                              f"{rules.baseline_health(base, rem)}")


def _tweo_ptq_claim(base, tweo) -> Claim:
    tol = TWEO_W8A8_COST.value
    text = f"TWEO makes W8A8 per-tensor static PTQ cost at most {tol:.0%} of the PPL (Liang et al. 2025)"
    b, t = _relative_ptq(base), _relative_ptq(tweo)
    if b is None or t is None:
        return text, stats.MISSING, "an evaluation report is missing"
    if not stats.effect_present(b, tol):
        return text, stats.UNTESTABLE, (f"the baseline's W8A8 static Δppl is {b.mean:.2%} ± {(b.sd or 0):.2%} of its "
                                        f"PPL, not above {tol:.0%} (t-interval): nothing for TWEO to repair; "
                                        f"TWEO's {t.mean:.2%}")
    verdict, detail = stats.at_most_verdict(t, tol, "TWEO's Δppl / PPL", paired=False)
    return text, verdict, f"baseline {b.mean:.2%} ± {(b.sd or 0):.2%} of its PPL; {detail}"


def claims(groups: list[dict[str, Any]]) -> list[Claim]:
    """V-scale's (sink kept, massive activations removed), TWEO's two (max |act| under 20; W8A8 static within
    5 % of PPL) and QK-Clip's (MaxLogit at most tau), each against the Pre-LN + AdamW baseline at its loss."""
    base = _arm(groups, BASELINE)
    return [
        _v_scale_claim(base, _arm(groups, "v_scale")),
        _below_claim(f"TWEO brings max |act| under {TWEO_MAX_ACT.value:g} at the baseline's loss (Liang et al. 2025)",
                     base, _arm(groups, "tweo"), "max_abs_all", TWEO_MAX_ACT.value),
        _tweo_ptq_claim(base, _arm(groups, "tweo")),
        _below_claim(f"QK-Clip keeps the MaxLogit at most tau = {QK_CLIP_TAU.value:g} at the baseline's loss "
                     f"(Kimi Team 2025)", base, _arm(groups, "qk_clip"), "max_logit", QK_CLIP_TAU.value),
    ]


def _sink_removed(base, r) -> str:
    return stats.threshold_verdict(r, rules.SINK_REMOVED.value, above=False)[0]


def _ma_removed(base, r) -> str:
    return stats.ratio_verdict(base, r, V_SCALE_MA_FACTOR.value)[0]


def _phenomenon(base, g, key: str, removed) -> str:
    """One arm's phenomenon against the baseline's, in a word (``removed(b, r)`` is the rule's verdict for
    "removed"): removed / kept / unclear."""
    b, r = estimate_of(base, key), estimate_of(g, key)
    if b is None or r is None:
        return "missing"
    return {stats.REPRODUCED: "removed", stats.NOT_REPRODUCED: "kept"}.get(removed(b, r), "unclear")


TABLE = (("sink_rate", "Sink^0.3"), ("first_share", "%First"), (MA_METRIC, "t0/early"),
         ("massive_ratio", "top-1 / median"), ("max_abs_all", "max \\|act\\|"), ("grad_sink_rgs", "R_GS"),
         ("max_logit", "MaxLogit"), ("final_val_loss", "val loss"))


def decoupling_table(groups: list[dict[str, Any]]) -> list[str]:
    """Markdown: per arm, the sink (Sink^0.3; removed when its t-interval lies at or below 0.05) and the massive
    activations (t0/early; removed when the baseline's is ≥ 2× the arm's by the rule set's ratio test) side by
    side, with the other sink and activation measures, the gradient sink, MaxLogit and the val loss change against
    the baseline."""
    base = _arm(groups, BASELINE)
    head = ["| arm | " + " | ".join(label for _, label in TABLE) + " | val loss change vs baseline |",
            "|---|" + "---|" * (len(TABLE) + 1)]
    body = []
    for g in groups:
        arm = g.get(ARM)
        cells = {k: format_value(estimate_of(g, k)) for k, _ in TABLE}
        if arm != BASELINE:
            cells["sink_rate"] += f" ({_phenomenon(base, g, 'sink_rate', _sink_removed)})"
            cells[MA_METRIC] += f" ({_phenomenon(base, g, MA_METRIC, _ma_removed)})"
        d = paired_relative(base, g, "final_val_loss") if arm != BASELINE else None
        change = f"{d.mean:+.2%} ± {(d.sd or 0):.2%}" if d else "—"
        body.append(f"| {arm} | " + " | ".join(cells[k] for k, _ in TABLE) + f" | {change} |")
    return head + body


def summary_section(groups: list[dict[str, Any]]) -> list[str]:
    """The report's summary before the verdicts: which arm removes the sink, which the massive activations."""
    return ["## Summary: sinks and massive activations per remedy", "",
            "Each cell: mean ± sd over seeds at the last probe step. In brackets, against the baseline: the sink "
            f"is *removed* when the arm's Sink^0.3 t-interval lies at or below {rules.SINK_REMOVED.value:g} "
            "and *kept* when it lies wholly above; the massive activations are *removed* when the Welch test puts "
            f"the baseline's t0/early (Chen et al. 2026's measure) at ≥ {V_SCALE_MA_FACTOR.value:g}× the arm's "
            "and *kept* when it puts it below; *unclear* otherwise. An arm that removes one and keeps the other decouples them. The "
            "words compare with the baseline only; whether the baseline has either phenomenon at all is decided "
            "under the verdicts (its gate).", "",
            *decoupling_table(groups), ""]


SUITE = Suite(INFO, claims, [rules.SINK_REMOVED, rules.MASSIVE_EARLY, V_SCALE_MA_FACTOR, rules.LOSS_COST,
                             TWEO_MAX_ACT, TWEO_W8A8_COST, QK_CLIP_TAU], summary=summary_section)
