"""The attention-sink remedies side by side (docs/attention.md): the papers' numbers where checked, the sink
measures, the claims per remedy and optimizer, and the report's summary table."""

from __future__ import annotations

from typing import Any

from outlier_titan.study import rules, stats
from outlier_titan.study.groups import format_value, first_match
from outlier_titan.study.rules import Claim, estimate_of, paired_relative
from outlier_titan.study.stats import estimate
from outlier_titan.study.suites.base import PaperRow, Suite, SuiteInfo


# The attention-sink remedies (docs/attention.md). Paper numbers only where checked: softpick's 0 % sink rate
# (340M and 1.8B) and sigmoid attention's absence of sinks (Gu et al., up to 1B), both from the abstracts, and
# Kaul et al.'s %First (the share of (query, head) pairs whose most-attended key is the first token) of the
# four softmax / softmax-1 x Adam / OrthoAdam models of Table 2 (the same rows as the kaul2024 suite; their norm
# is single-scale RMSNorm, ours the debug model's LayerNorm).
INFO = SuiteInfo(
    title="sinks2025: attention-sink remedies side by side (softmax-1, sink logit, gates, softpick, sigmoid, ReLU, "
          "clipped softmax)",
    citation="Zuhri et al. 2025 (arXiv 2504.20966); Gu et al. 2024 (arXiv 2410.10781); Qiu et al. 2025 (arXiv "
             "2505.06708); Ramapuram et al. 2024 (arXiv 2409.04431); Guo et al. 2024 (arXiv 2410.13835); "
             "Bondarenko et al. 2023 (arXiv 2306.12929); Kaul et al., ICLR 2025",
    metrics={"ppl": "PPL", "sink_rate": "Sink^0.3", "sink_rate_pooled": "pooled Sink^0.3",
             "first_share": "%First", "massive_ratio": "top-1 / median",
             "value_drain": "value drain", "d_int8_coarse": "Δppl int8 coarse"},
    rows=[
        PaperRow("softpick, 340M and 1.8B", {"model.attention": "softpick"}, dict(sink_rate=0.0),
                 "Zuhri et al. 2025, abstract (0 % sink rate)"),
        PaperRow("sigmoid attention without normalisation, up to 1B", {"model.attention": "sigmoid"},
                 dict(sink_rate=0.0), "Gu et al. 2024, abstract (no attention sink emerges)"),
        PaperRow("GPT2 130M, Adam, softmax (RMSNorm-S)", {"optimizer.name": "adam", "model.attention": "softmax"},
                 dict(first_share=0.527), "Kaul et al. 2024 (arXiv 2410.17174), Table 2 row 5"),
        PaperRow("GPT2 130M, Adam, softmax-1 (RMSNorm-S)", {"optimizer.name": "adam", "model.attention": "softmax1"},
                 dict(first_share=0.024), "Kaul et al. 2024, Table 2 row 6"),
        PaperRow("GPT2 130M, OrthoAdam, softmax (RMSNorm-S)",
                 {"optimizer.name": "orthoadam", "model.attention": "softmax"}, dict(first_share=0.424),
                 "Kaul et al. 2024, Table 2 row 7"),
        PaperRow("GPT2 130M, OrthoAdam, softmax-1 (RMSNorm-S)",
                 {"optimizer.name": "orthoadam", "model.attention": "softmax1"}, dict(first_share=0.019),
                 "Kaul et al. 2024, Table 2 row 8"),
    ],
    schemes=("int8_coarse",),
    kurtosis="kurtosis_rest",
    lr_search_shows=("sink_rate", "first_token_argmax_share"),  # the claims' two sink measures
    extra_probe=("sink_rate", "sink_rate_pooled", "massive_ratio", "value_drain"),
)

SINK_MEASURES = {"sink_rate": "Sink^0.3", "sink_rate_pooled": "pooled Sink^0.3",
                 "first_share": "first-token argmax share"}
"""The sink measures a remedy can be judged on: Gu et al. 2024's Sink^ε (per sequence, layer and head, the mean
weight on key 0 over the queries against ε = 0.3, then the share), its form pooled over sequences before the
threshold (what this project's probe logged before 2026-11-28, kept under its own name for those runs), and Kaul
et al. 2024's %First."""


def sink_measures(groups: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The measures the suite's points have: Gu et al.'s Sink^ε where logged, else the pooled form; %First."""
    rate = "sink_rate" if any(estimate_of(g, "sink_rate") for g in groups) else "sink_rate_pooled"
    return [(rate, SINK_MEASURES[rate]), ("first_share", SINK_MEASURES["first_share"])]


def _sink_claim(variant: str, opt: Any, base: dict[str, Any] | None, g: dict[str, Any], key: str,
                label: str) -> tuple[Claim, str]:
    """One remedy, one optimizer, one sink measure: removed (interval ≤ :data:`rules.SINK_REMOVED`) at a loss at
    most :data:`rules.LOSS_COST` above the baseline's; untestable where that optimizer's softmax baseline shows no
    sink. With the claim, the verdict in a few words for the summary table, naming the part that failed."""
    removed = rules.SINK_REMOVED.value
    with_opt = f" with {opt}" if opt is not None else ""
    text = f"{variant}{with_opt} removes the {label} sink of softmax{with_opt} ({label} ≤ {removed:g})"
    b, r = estimate_of(base, key), estimate_of(g, key)
    if b is None or r is None:
        return (text, stats.MISSING, "a point or its probe metric is missing"), "missing"
    diff = (estimate(y - x for x, y in zip(b.values, r.values))
            if base["seeds"] == g["seeds"] and b.n == r.n == len(g["seeds"]) else None)
    change = f"; change vs the baseline {diff.text()} (paired by seed)" if diff else ""
    cost = rules.loss_cost(base, g)
    if not stats.effect_present(b, removed):
        return (text, stats.UNTESTABLE, (f"the baseline forms no sink ({label} {b.text()}, t-interval not above "
                                         f"{removed:g}); {variant} {r.text()}{change}; {cost[1]}")), "no baseline sink"
    gone = stats.threshold_verdict(r, removed, above=False)
    verdict = stats.combine(gone, cost)
    if verdict == stats.MISSING:
        short = "missing"
    elif gone[0] != stats.REPRODUCED:
        short = "kept" if gone[0] == stats.NOT_REPRODUCED else "inside the noise"
    else:
        short = {stats.REPRODUCED: "removed", stats.NOT_REPRODUCED: "removed, loss cost > 2 %"}.get(
            cost[0], "removed, loss cost unclear")
    return (text, verdict, f"baseline {b.text()}; {variant} {gone[1]}{change}; {cost[1]}"), short


def _sink_claims(groups: list[dict[str, Any]]) -> dict[tuple[Any, Any, str], tuple[Claim, str]]:
    """Every remedy's claim and its short form per sink measure and optimizer, keyed ``(variant, optimizer,
    measure key)``, in report order (measure, then the groups' order)."""
    out: dict[tuple[Any, Any, str], tuple[Claim, str]] = {}
    for key, label in sink_measures(groups):
        for g in groups:
            variant, opt = g.get("model.attention"), g.get("optimizer.name")
            if variant != "softmax":
                base = first_match(groups, {"model.attention": "softmax", "optimizer.name": opt})
                out[variant, opt, key] = _sink_claim(variant, opt, base, g, key, label)
    return out


def claims(groups: list[dict[str, Any]]) -> list[Claim]:
    """Per remedy, per optimizer (where the suite varies ``optimizer.name``) and per sink measure
    (:func:`sink_measures`): whether it removes the sink of the softmax baseline trained with the same optimizer
    at that baseline's loss, with the change against that baseline, paired by seed."""
    return [claim for claim, _ in _sink_claims(groups).values()]


def sinks_table(groups: list[dict[str, Any]]) -> list[str]:
    """Markdown: one row per attention variant and optimizer, each sink measure (mean ± sd over seeds) with its
    verdict from :func:`claims` in short form, and the validation loss with its change against that
    optimizer's softmax baseline (relative, paired by seed)."""
    measures = sink_measures(groups)
    short = {k: words for k, (_, words) in _sink_claims(groups).items()}
    head = ["| attention | optimizer | " + " | ".join(label for _, label in measures)
            + " | val loss | val loss change vs softmax |", "|---|---|" + "---|" * (len(measures) + 2)]
    body = []
    for g in groups:
        variant, opt = g.get("model.attention"), g.get("optimizer.name")
        base = first_match(groups, {"model.attention": "softmax", "optimizer.name": opt})
        cells = [format_value(estimate_of(g, key))
                 + (" (baseline)" if variant == "softmax" else f" ({short[variant, opt, key]})") for key, _ in measures]
        d = paired_relative(base, g, "final_val_loss") if base and variant != "softmax" else None
        change = f"{d.mean:+.2%} ± {(d.sd or 0):.2%}" if d else "—"
        body.append(f"| {variant} | {opt if opt is not None else '—'} | " + " | ".join(cells)
                    + f" | {format_value(estimate_of(g, 'final_val_loss'))} | {change} |")
    return head + body


def summary_section(groups: list[dict[str, Any]]) -> list[str]:
    """The report's summary before the verdicts: :func:`sinks_table` with how to read it."""
    return ["## Summary: each remedy against the softmax baseline of its optimizer", "",
            "Each cell: mean ± sd over seeds at the last probe step, and in brackets the verdict below in "
            "short (removed: the t-interval over seeds lies at or below 0.05, and the val loss costs at "
            "most 2 %, else the loss cost is named; kept: the interval lies wholly above 0.05; no baseline "
            "sink: that optimizer's softmax interval does not lie above 0.05). Sink^0.3 is Gu et al. 2024's "
            "(per sequence, then averaged); pooled Sink^0.3 is the form the probe logged until 2026-11-28 "
            "(averaged over sequences before the threshold), the only one runs of that time have.", "",
            *sinks_table(groups), ""]


SUITE = Suite(INFO, claims, [rules.SINK_REMOVED, rules.LOSS_COST], summary=summary_section)
