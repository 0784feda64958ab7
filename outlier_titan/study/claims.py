"""Each paper's claims, decided on the groups of :func:`outlier_titan.study.groups.aggregate` by the one rule set
of :mod:`outlier_titan.study.rules` (gate on the baseline's effect, Welch test of the reduction, one-sided loss
cost, the baseline's health said beside the verdict). :data:`CLAIMS` maps a suite to its claims and
:data:`THRESHOLDS` to the thresholds they use, whose sources a report prints."""

from __future__ import annotations

from typing import Any, Callable

from outlier_titan.study import rules, stats
from outlier_titan.study.groups import fmt, select
from outlier_titan.study.rules import Claim, Threshold, get, paired_relative
from outlier_titan.study.stats import Estimate, estimate


# --- kaul2024 (Kaul et al. 2024: softmax-1 + OrthoAdam) ---

def claims_kaul(groups: list[dict[str, Any]]) -> list[Claim]:
    """The first-token claim (softmax-1 removes the sink the baseline forms), the kurtosis claim (OrthoAdam +
    softmax-1 + RMSNorm-S removes the outlier features at the baseline's loss) and the int4 claim, on the
    paper's final metrics (Table 2: kurtosis of the other tokens; Table 3: int4 zero-point Δppl)."""
    base = select(groups, {"optimizer.name": "adam", "model.softmax": "softmax", "model.norm": "layernorm"})
    s1 = select(groups, {"optimizer.name": "adam", "model.softmax": "softmax1", "model.norm": "layernorm"})
    rem = select(groups, {"optimizer.name": "orthoadam", "model.softmax": "softmax1", "model.norm": "rmsnorm_single"})
    present, removed = rules.SINK_PRESENT.value, rules.SINK_REMOVED.value
    out: list[Claim] = []
    text = f"first-token argmax share: baseline (Adam, softmax, LayerNorm) ≥ {present:g} and softmax-1 ≤ {removed:g}"
    sink = stats.threshold_verdict(get(base, "first_share"), present, above=True)
    gone = stats.threshold_verdict(get(s1, "first_share"), removed, above=False)
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


# --- he2024 (He et al. 2024: OP block + SOAP) ---

def claims_he(groups: list[dict[str, Any]]) -> list[Claim]:
    """The kurtosis claim on the paper's metric (Table 2: the final kurtosis of neuron RMS), the same on the peak
    over probe steps as a secondary line (not the paper's metric), and the W8A8 claim."""
    base = select(groups, {"model.block": "pre_ln", "optimizer.name": "adamw"})
    rem = select(groups, {"model.block": "op", "optimizer.name": "soap"})
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


# --- franke2025 (Franke et al. 2025: anGPT) ---

def claims_franke(groups: list[dict[str, Any]]) -> list[Claim]:
    """A seed whose anGPT never reaches GPT+'s final loss has a speed-up below 1 of unknown size: it enters the
    interval as 1.0, an upper bound, so it can only favour the claim; a "reproduced" is then withheld."""
    an = select(groups, {"model.name": "angpt"})
    text = "anGPT reaches GPT+'s final validation loss with fewer tokens (speed-up > 1, per seed against GPT+)"
    sp, finished = get(an, "speedup"), get(an, "final_val_loss")
    if an is not None and sp is None and finished is not None:
        return [(text, stats.NOT_REPRODUCED, "anGPT never reached GPT+'s final val loss at any seed")]
    never = (finished.n - sp.n) if sp is not None and finished is not None else 0
    if not never:
        return [(text, *stats.threshold_verdict(sp, rules.SPEEDUP.value, above=True))]
    verdict, detail = stats.threshold_verdict(Estimate(sp.values + (1.0,) * never), rules.SPEEDUP.value, above=True)
    if verdict == stats.REPRODUCED:
        verdict = stats.INCONCLUSIVE
    return [(text, verdict, f"{detail}; {never} of {finished.n} seeds never reached GPT+'s final val loss (a "
                            "speed-up below 1 there, counted as 1, an upper bound)")]


# --- sinks2025 (the attention-sink remedies) ---

SINK_MEASURES = {"sink_rate": "Sink^0.3", "sink_rate_pooled": "pooled Sink^0.3",
                 "first_share": "first-token argmax share"}
"""The sink measures a remedy can be judged on: Gu et al. 2024's Sink^ε (per sequence, layer and head, the mean
weight on key 0 over the queries against ε = 0.3, then the share), its form pooled over sequences before the
threshold (what this project's probe logged before 2026-11-28, kept under its own name for those runs), and Kaul
et al. 2024's %First."""


def sink_measures(groups: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The measures the suite's points have: Gu et al.'s Sink^ε where logged, else the pooled form; %First."""
    rate = "sink_rate" if any(get(g, "sink_rate") for g in groups) else "sink_rate_pooled"
    return [(rate, SINK_MEASURES[rate]), ("first_share", SINK_MEASURES["first_share"])]


def _sink_claim(variant: str, opt: Any, base: dict[str, Any] | None, g: dict[str, Any], key: str,
                label: str) -> tuple[Claim, str]:
    """One remedy, one optimizer, one sink measure: removed (interval ≤ :data:`rules.SINK_REMOVED`) at a loss at
    most :data:`rules.LOSS_COST` above the baseline's; untestable where that optimizer's softmax baseline shows no
    sink. With the claim, the verdict in a few words for the summary table, naming the part that failed."""
    removed = rules.SINK_REMOVED.value
    with_opt = f" with {opt}" if opt is not None else ""
    text = f"{variant}{with_opt} removes the {label} sink of softmax{with_opt} ({label} ≤ {removed:g})"
    b, r = get(base, key), get(g, key)
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
                base = select(groups, {"model.attention": "softmax", "optimizer.name": opt})
                out[variant, opt, key] = _sink_claim(variant, opt, base, g, key, label)
    return out


def claims_sinks(groups: list[dict[str, Any]]) -> list[Claim]:
    """Per remedy, per optimizer (where the suite varies ``optimizer.name``) and per sink measure
    (:func:`sink_measures`): whether it removes the sink of the softmax baseline trained with the same optimizer
    at that baseline's loss, with the change against that baseline, paired by seed."""
    return [claim for claim, _ in _sink_claims(groups).values()]


def sinks_table(groups: list[dict[str, Any]]) -> list[str]:
    """Markdown: one row per attention variant and optimizer, each sink measure (mean ± sd over seeds) with its
    verdict from :func:`claims_sinks` in short form, and the validation loss with its change against that
    optimizer's softmax baseline (relative, paired by seed)."""
    measures = sink_measures(groups)
    short = {k: words for k, (_, words) in _sink_claims(groups).items()}
    head = ["| attention | optimizer | " + " | ".join(label for _, label in measures)
            + " | val loss | val loss change vs softmax |", "|---|---|" + "---|" * (len(measures) + 2)]
    body = []
    for g in groups:
        variant, opt = g.get("model.attention"), g.get("optimizer.name")
        base = select(groups, {"model.attention": "softmax", "optimizer.name": opt})
        cells = [fmt(get(g, key)) + (" (baseline)" if variant == "softmax" else f" ({short[variant, opt, key]})")
                 for key, _ in measures]
        d = paired_relative(base, g, "final_val_loss") if base and variant != "softmax" else None
        change = f"{d.mean:+.2%} ± {(d.sd or 0):.2%}" if d else "—"
        body.append(f"| {variant} | {opt if opt is not None else '—'} | " + " | ".join(cells)
                    + f" | {fmt(get(g, 'final_val_loss'))} | {change} |")
    return head + body


# --- park2025 (Park et al. 2025: Outlier-Safe Pre-Training) ---

def ours_park(rows: list[dict[str, Any]]) -> None:
    """park2025's own columns (in place): the OSP script's excess kurtosis of the evaluation, and per 4-bit scheme
    its Δppl and quantised PPL (the paper prints the quantised PPL)."""
    for r in rows:
        r["osp_kurtosis"] = r.get("eval_osp_kurtosis")
        for scheme in ("w4a4kv4_rtn", "w4a4kv4_rtn_hadamard"):
            d = r.get(f"ptq_delta_ppl_{scheme}")
            r[f"d_{scheme}"] = d
            r[f"ppl_{scheme}"] = r["ppl"] + d if d is not None and r.get("ppl") is not None else None


def _parity(text: str, base: dict | None, other: dict | None) -> Claim:
    return (text, *rules.loss_cost(base, other))


def claims_park2025(groups: list[dict[str, Any]]) -> list[Claim]:
    """Park et al. 2025's claims on the suite's settings (selected by ``job.name``): the OSP recipe removes the
    kurtosis Adam grows (both measures), SSNorm and EmbProj each take a step of it, its 4-bit damage is small
    against Adam's, at Adam's loss; and MuonBP's claim that block steps with periodic full ones keep full Muon's
    loss (Khaled et al. 2025)."""
    g = {name: select(groups, {"job.name": name}) for name in ("adam", "muon", "muon_ssnorm", "osp",
                                                                 "osp_block_periodic")}
    k, cost = f"{rules.REDUCTION_FACTOR.value:g}", f"{rules.LOSS_COST.value:.0%}"
    return [
        rules.reduction(f"excess kurtosis (OSP script): Adam ≥ {k}× the OSP recipe's (Muon + SSNorm + EmbProj)",
                        g["adam"], g["osp"], "osp_kurtosis"),
        rules.reduction(f"neuron-RMS kurtosis (final): Adam ≥ {k}× the OSP recipe's", g["adam"], g["osp"],
                        "kurtosis_neuron_rms"),
        rules.reduction(f"SSNorm's step (OSP script's kurtosis): Muon ≥ {k}× Muon + SSNorm", g["muon"],
                        g["muon_ssnorm"], "osp_kurtosis"),
        rules.reduction(f"EmbProj's step (OSP script's kurtosis): Muon + SSNorm ≥ {k}× Muon + SSNorm + EmbProj",
                        g["muon_ssnorm"], g["osp"], "osp_kurtosis"),
        rules.ptq_reduction("W4A4KV4 RTN Δppl of the OSP recipe below a third of Adam's", g["adam"], g["osp"],
                            "d_w4a4kv4_rtn"),
        rules.ptq_reduction("W4A4KV4 RTN + Hadamard (QuaRot) Δppl of the OSP recipe below a third of Adam's",
                            g["adam"], g["osp"], "d_w4a4kv4_rtn_hadamard"),
        _parity(f"the OSP recipe's val loss at most {cost} above Adam's", g["adam"], g["osp"]),
        _parity(f"MuonBP: block_periodic Muon's val loss at most {cost} above full Muon's (OSP recipe; Khaled et "
                f"al. 2025)", g["osp"], g["osp_block_periodic"]),
    ]


CLAIMS: dict[str, Callable[[list[dict[str, Any]]], list[Claim]]] = {
    "kaul2024": claims_kaul, "he2024": claims_he, "franke2025": claims_franke, "sinks2025": claims_sinks,
    "park2025": claims_park2025}

_REDUCTION = [rules.REDUCTION_FACTOR, rules.GAUSSIAN_KURTOSIS, rules.LOSS_COST]
_PTQ = [rules.PTQ_FACTOR, rules.PTQ_FLOOR]
THRESHOLDS: dict[str, list[Threshold]] = {
    "kaul2024": [rules.SINK_PRESENT, rules.SINK_REMOVED, *_REDUCTION, *_PTQ],
    "he2024": [*_REDUCTION, *_PTQ],
    "franke2025": [rules.SPEEDUP],
    "sinks2025": [rules.SINK_REMOVED, rules.LOSS_COST],
    "park2025": [rules.REDUCTION_FACTOR, rules.GAUSSIAN_EXCESS_KURTOSIS, rules.GAUSSIAN_KURTOSIS, rules.LOSS_COST,
                 *_PTQ],
}
"""The thresholds each suite's verdicts compare with (their sources are printed under the verdicts)."""
