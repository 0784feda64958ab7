"""Franke et al. 2025 (arXiv 2505.22014), anGPT and nGPT against GPT+ at equal tokens: the paper's numbers (§5.2,
Fig. 3, Table 2; our reading: docs/papers/franke2025.md), the speed-up columns derived from the runs' logs, and
the claim."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outlier_titan.observe.logger import read_metrics
from outlier_titan.study import rules, stats
from outlier_titan.study.groups import num, first_match
from outlier_titan.study.plan import point_dir
from outlier_titan.study.rules import Claim, estimate_of
from outlier_titan.study.stats import Estimate
from outlier_titan.study.suites.base import PaperRow, Suite, SuiteInfo


INFO = SuiteInfo(
    title="franke2025: anGPT and nGPT against GPT+ at equal tokens",
    citation="Franke et al., Learning in Compact Spaces with Approximately Normalized Transformers, 2025",
    metrics={"final_val_loss": "final val loss", "speedup": "speed-up vs GPT+ (tokens ratio)",
             "step_time_ratio": "step time / GPT+'s"},
    rows=[
        PaperRow("0.5B, anGPT vs GPT+ (QK-norm)", {"model.name": "angpt"},
                 dict(speedup=1.4, step_time_ratio=1.0275), "§5.2 / Fig. 3 (average speed-up), Table 2"),
        PaperRow("0.5B, nGPT vs GPT+ (QK-norm)", {"model.name": "ngpt"},
                 dict(speedup=1.29), "§5.2 / Fig. 3 (average speed-up)"),
        PaperRow("0.5B, GPT+ (QK-norm)", {"model.name": "pre_ln"}, dict(speedup=1.0, step_time_ratio=1.0),
                 "the reference of both ratios"),
    ],
    schemes=("int8_fine",),
    kurtosis="kurtosis_rest",
)

def tokens_to_reach(records: dict[int, dict], tokens_per_step: int, target: float) -> float | None:
    """Tokens at which the validation loss first reaches ``target`` (linear between evaluations), or None."""
    prev = None
    for step in sorted(records):
        v = num(records[step].get("val_loss"))
        if v is None:
            continue
        if v <= target:
            if prev is None or prev[1] == v:
                return float(step * tokens_per_step)
            s0, v0 = prev
            frac = (v0 - target) / (v0 - v)
            return (s0 + frac * (step - s0)) * tokens_per_step
        prev = (step, v)
    return None


def add_speedup_metrics(rows: list[dict[str, Any]], sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """Per point (in place): the tokens at which it reaches the same seed's GPT+ final val loss, the speed-up
    (GPT+'s tokens over those) and the step-time ratio against GPT+."""
    for r in rows:
        r["speedup"] = r["step_time_ratio"] = r["tokens_to_target"] = None
    for r in rows:
        base = first_match(rows, {"model.name": "pre_ln", "seed": r.get("seed")})  # the same seed's GPT+
        if base and base.get("final_val_loss") is not None:
            recs = read_metrics(point_dir(sweep_dir, r["point"]) / "metrics.jsonl")
            t = tokens_to_reach(recs, r["tokens_per_step"], base["final_val_loss"])
            r["tokens_to_target"] = t
            r["speedup"] = base["tokens"] / t if t else None
            if r.get("tokens_per_s") and base.get("tokens_per_s"):
                r["step_time_ratio"] = base["tokens_per_s"] / r["tokens_per_s"]


def claims(groups: list[dict[str, Any]]) -> list[Claim]:
    """A seed whose anGPT never reaches GPT+'s final loss has a speed-up below 1 of unknown size: it enters the
    interval as 1.0, an upper bound, so it can only favour the claim; a "reproduced" is then withheld."""
    an = first_match(groups, {"model.name": "angpt"})
    text = "anGPT reaches GPT+'s final validation loss with fewer tokens (speed-up > 1, per seed against GPT+)"
    sp, finished = estimate_of(an, "speedup"), estimate_of(an, "final_val_loss")
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


SUITE = Suite(INFO, claims, [rules.SPEEDUP], add_metrics=add_speedup_metrics)
