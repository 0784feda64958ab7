"""Does a remedy keep training at BF16's loss in FP8 or FP4? The stack's outlier remedies, each trained in BF16, FP8
(per row and per tensor) and NVFP4 (``[low_precision]``, docs/low_precision.md) at the learning rate its BF16 search
chose.

Arms (``job.description``): the Pre-LN + AdamW baseline, OrthoAdam + softmax-1 + single-scale RMSNorm (Kaul et al.
2024), OP + SOAP (He et al. 2024), the OSP recipe, Muon + single-scale RMSNorm + EmbProj (Park et al. 2025), the
elementwise-gated attention (Qiu et al. 2025) against the first-token sink, and the TWEO loss term (Liang et al.
2025). The claims (docs/low_precision.md, "The suite lowprec2026"): per low precision, a remedy trains within 2 % of
its own BF16 loss where the baseline does not (the field's question; NVIDIA 2025, arXiv 2509.25149, and Fishman et
al. 2024, arXiv 2409.12517, saw the gap open from outliers; TWEO's paper claims it for per-tensor FP8); and the BF16
run's kurtosis ranks the gaps (Hernández-Cano et al. 2025, arXiv 2505.20524, monitor kurtosis to predict FP8
divergence). Claims are made for the arms and precisions a scale ran."""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

from outlier_titan.exit_codes import DIVERGED
from outlier_titan.observe.logger import read_metrics
from outlier_titan.study import stats
from outlier_titan.study.groups import first_match, format_value
from outlier_titan.study.plan import point_dir
from outlier_titan.study.rules import Claim, Threshold, estimate_of, paired_relative
from outlier_titan.study.suites.base import Suite, SuiteInfo

ARM = "job.description"
PRECISION = "low_precision.recipe"
BASELINE = "baseline"
REMEDIES = ("orthoadam", "op_soap", "osp", "gated", "tweo")
HIGH = "bf16"
LOW = ("fp8_rowwise", "fp8_tensorwise", "nvfp4")
"""The low precisions a claim can be about, in table order; a report has the ones its scale ran."""
PAPER_CLAIMS = {"tweo": (("fp8_rowwise", "fp8_tensorwise"),
                         "the claim of Liang et al. 2025 (arXiv 2511.23225), made for per-tensor FP8 with delayed "
                         "scaling: GPT-2 124M ends at PPL 19.3 against BF16's 18.7, where the baseline's FP8 run ends "
                         "at 169.8")}
"""Arms whose paper makes the claim itself, with the precisions it makes it for (elsewhere, and for the other
arms, the claim is the field's question)."""
PREDICTOR = "kurtosis_rest"
"""The BF16 run's measure whose rank order the gap claim tests (Hernández-Cano et al. 2025 monitor activation
kurtosis; ours is the probe's per-token kurtosis of the other tokens, the suites' common measure)."""

LOW_PRECISION_GAP = Threshold(0.02, "ours: the same 2 % as the suites' loss-cost rule; NVIDIA 2025 (arXiv "
                                    "2509.25149) call NVFP4 pretraining at 12B 'comparable' to FP8 with a val loss "
                                    "about 1 % above it, a number we cannot carry to toy scale")

INFO = SuiteInfo(
    title="lowprec2026: which outlier remedy keeps training at BF16's loss in FP8 and NVFP4",
    citation="NVIDIA 2025 (arXiv 2509.25149); Hernández-Cano et al. 2025 (arXiv 2505.20524); Fishman et al. 2024 "
             "(arXiv 2409.12517); Kaul et al., ICLR 2025 (arXiv 2410.17174); He et al. 2024 (arXiv 2405.19279); "
             "Park et al. 2025 (arXiv 2506.19697); Qiu et al. 2025 (arXiv 2505.06708); Liang et al. 2025 "
             "(arXiv 2511.23225)",
    metrics={"ppl": "PPL", "kurtosis_rest": "κ>₁", "max_abs_all": "max |act|", "first_share": "%First"},
    schemes=(),  # no paper's PTQ scheme: the 4-bit rows every suite adds are tabled, no verdict rests on them
    kurtosis="kurtosis_rest",
    extra_probe=("max_abs_all",),
)


def _group(groups: list[dict[str, Any]], arm: str, precision: str) -> dict[str, Any] | None:
    return first_match(groups, {ARM: arm, PRECISION: precision})


def _ran(groups: list[dict[str, Any]]) -> tuple[list[str], list[str]]:
    """The remedies and the low precisions with a finished point in ``groups`` (a scale runs a subset), in table
    order."""
    return ([a for a in REMEDIES if any(g.get(ARM) == a for g in groups)],
            [p for p in LOW if any(g.get(PRECISION) == p for g in groups)])


def gap(groups: list[dict[str, Any]], arm: str, precision: str):
    """Per seed, the arm's final val loss in ``precision`` relative to its own in BF16 ((low − bf16) / bf16)."""
    return paired_relative(_group(groups, arm, HIGH), _group(groups, arm, precision), "final_val_loss")


COLLAPSED = "collapsed_{}"
"""On a BF16 row, per low precision: 1 where the same arm and seed stopped as diverged in that precision (the
divergence guard's exit, ``exit_codes.DIVERGED``), 0 where it finished. A collapse has no final loss, hence no gap,
yet it is the strongest form of the effect the claims ask about (Liang et al.'s baseline collapses in FP8)."""


def add_collapses(rows: list[dict[str, Any]], sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """Marks :data:`COLLAPSED` on each BF16 row (in place) for every low precision its arm and seed ran."""
    from outlier_titan.study.runner import read_state  # the sweep engine's state file; heavy imports, only here

    by_key = {(r.get(ARM), r.get(PRECISION), r.get("seed")): r for r in rows}
    for (arm, precision, seed), r in by_key.items():
        high = by_key.get((arm, HIGH, seed))
        if precision == HIGH or high is None:
            continue
        if r.get("status") == "done":
            high[COLLAPSED.format(precision)] = 0
        elif read_state(point_dir(sweep_dir, r["point"])).get("returncode") == DIVERGED:
            high[COLLAPSED.format(precision)] = 1


def collapsed_seeds(groups: list[dict[str, Any]], arm: str, precision: str) -> list[int] | None:
    """The seeds at which the arm's ``precision`` run collapsed, or None unless each of its BF16 seeds' run in
    ``precision`` either finished or collapsed."""
    high = _group(groups, arm, HIGH)
    flags = estimate_of(high, COLLAPSED.format(precision))
    if flags is None or flags.n != len(high["seeds"]):
        return None
    return [seed for seed, f in zip(high["seeds"], flags.values) if f]


def _pct(e) -> str:
    """A relative gap over seeds: mean ± sd, or the one value with "(1 seed)"."""
    return f"{e.mean:+.2%} ± {e.sd:.2%}" if e.sd is not None else f"{e.mean:+.2%} (1 seed)"


def _keeps_claim(groups: list[dict[str, Any]], arm: str, precision: str) -> Claim:
    tol = LOW_PRECISION_GAP.value
    precisions, quote = PAPER_CLAIMS.get(arm, ((), ""))
    text = (f"{arm} trains in {precision} within {tol:.0%} of its BF16 val loss, where the baseline does not "
            f"(paired by seed" + (f"; {quote})" if precision in precisions else ")"))
    b, r = gap(groups, BASELINE, precision), gap(groups, arm, precision)
    b_down, r_down = collapsed_seeds(groups, BASELINE, precision), collapsed_seeds(groups, arm, precision)
    if b_down or r_down:  # a collapse has no gap: decided on the collapses themselves
        return (text, *_collapse_verdict(groups, arm, precision, b, r, b_down, r_down))
    if b is None or r is None:
        return text, stats.MISSING, "a point is missing, or the arms ran different seeds"
    if not stats.effect_present(b, tol):
        return text, stats.UNTESTABLE, (f"the baseline's gap {_pct(b)} is not above {tol:.0%} (t-interval over "
                                        f"seeds): no loss for the remedy to keep; {arm}'s {_pct(r)}")
    verdict, detail = stats.at_most_verdict(r, tol, f"{arm}'s gap")
    return text, verdict, f"baseline's gap {_pct(b)}; {detail}"


def _collapse_verdict(groups, arm, precision, b, r, b_down, r_down) -> tuple[str, str]:
    """Where a run in ``precision`` collapsed: the baseline shows the effect when it collapsed at every seed (or
    none and its gap's interval lies above the threshold); at some seeds only, the effect is not established
    either way (inconclusive). A remedy that collapsed at any seed does not keep BF16's loss."""
    seeds = _group(groups, BASELINE, HIGH)["seeds"]

    def said(who: str, down: list[int] | None, e) -> str:
        if down:
            return f"{who} collapsed (diverged) in {precision} at seed(s) {down} of {seeds}"
        return f"{who}'s gap {_pct(e)}" if e is not None else f"{who}'s gap missing"

    detail = f"{said('the baseline', b_down, b)}; {said(arm, r_down, r)}"
    every = b_down is not None and len(b_down) == len(seeds)
    if b_down and not every:
        return stats.INCONCLUSIVE, detail + " (the baseline's effect holds at some seeds only)"
    if not (every or stats.effect_present(b, LOW_PRECISION_GAP.value)):
        return stats.UNTESTABLE, detail + " (no loss for the remedy to keep)"
    if r_down:
        return stats.NOT_REPRODUCED, detail
    verdict, gap_detail = stats.at_most_verdict(r, LOW_PRECISION_GAP.value, f"{arm}'s gap")
    return verdict, f"{said('the baseline', b_down, b)}; {gap_detail}"


def _predictor_claim(groups: list[dict[str, Any]], precision: str) -> Claim:
    """Pooled over arms and seeds: the BF16 run's final kurtosis against the same seed's gap in ``precision``."""
    text = (f"the BF16 run's final kurtosis (other tokens) ranks the {precision} loss gap: the more kurtosis, the "
            f"larger the gap (Hernández-Cano et al. 2025; over every arm and seed)")
    xs, ys = [], []
    for arm in (BASELINE, *_ran(groups)[0]):
        high, d = _group(groups, arm, HIGH), gap(groups, arm, precision)
        k = estimate_of(high, PREDICTOR)
        if d is None or k is None or k.n != d.n:
            continue
        xs += list(k.values)
        ys += list(d.values)
    if not xs:
        return text, stats.MISSING, "no arm has both precisions at the same seeds"
    verdict, detail = stats.rank_correlation_verdict(xs, ys, "kurtosis vs gap")
    return text, verdict, detail


def claims(groups: list[dict[str, Any]]) -> list[Claim]:
    """Per low precision the scale ran: each remedy it ran keeps BF16's loss where the baseline does not; the
    kurtosis ranks the gaps."""
    arms, lows = _ran(groups)
    out: list[Claim] = []
    for precision in lows:
        out += [_keeps_claim(groups, arm, precision) for arm in arms]
        out.append(_predictor_claim(groups, precision))
    return out


def gap_table(groups: list[dict[str, Any]]) -> list[str]:
    """Markdown: per arm, the BF16 val loss and kurtosis, and per low precision the val loss and the paired gap."""
    arms, lows = _ran(groups)
    head = ["| arm | BF16 val loss | BF16 κ>₁ | " + " | ".join(f"{p} val loss | {p} gap" for p in lows) + " |",
            "|---|---|---|" + "---|---|" * len(lows)]
    body = []
    for arm in (BASELINE, *arms):
        high = _group(groups, arm, HIGH)
        if high is None and all(_group(groups, arm, p) is None for p in lows):
            continue
        cells = [format_value(estimate_of(high, "final_val_loss")), format_value(estimate_of(high, PREDICTOR))]
        for p in lows:
            d, down = gap(groups, arm, p), collapsed_seeds(groups, arm, p)
            cells += [format_value(estimate_of(_group(groups, arm, p), "final_val_loss")),
                      f"collapsed at seed(s) {down}" if down else _pct(d) if d else "—"]
        body.append(f"| {arm} | " + " | ".join(cells) + " |")
    return head + body


LAYER_SNR = "lp_worst_snr_layer_{}"
_CAST_SNR = re.compile(r"^outliers/layer_(\d+)/lp_(act|grad)_(attn|mlp)_snr_db$")


def add_layer_snr(rows: list[dict[str, Any]], sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """Per point (in place), per block: the lowest quantisation SNR (dB) of its activation and output-gradient casts
    at the last training probe (``observe/lowprec.py``), ``lp_worst_snr_layer_<i>``; blocks without casts (BF16)
    get none."""
    for r in rows:
        by_step = read_metrics(point_dir(sweep_dir, r["point"]) / "metrics.jsonl")
        recs = [by_step[s] for s in sorted(by_step) if any(_CAST_SNR.match(k) for k in by_step[s])]
        worst: dict[int, float] = {}
        for k, v in (recs[-1] if recs else {}).items():
            if (m := _CAST_SNR.match(k)) and isinstance(v, (int, float)) and math.isfinite(v):
                worst[int(m.group(1))] = min(worst.get(int(m.group(1)), math.inf), float(v))
        r.update({LAYER_SNR.format(i): v for i, v in worst.items()})


def layer_table(groups: list[dict[str, Any]]) -> list[str]:
    """Markdown: per arm and low precision, each block's worst cast SNR (mean ± sd over seeds)."""
    layers = sorted({int(k.rsplit("_", 1)[1]) for g in groups for k in g if k.startswith(LAYER_SNR.format(""))})
    if not layers:
        return ["No cast statistics were logged (they need the probe: observe.every > 0)."]
    head = ["| arm | precision | " + " | ".join(f"block {i}" for i in layers) + " |", "|---|---|" + "---|" * len(layers)]
    body = [f"| {arm} | {p} | " + " | ".join(format_value(estimate_of(_group(groups, arm, p), LAYER_SNR.format(i)))
                                              for i in layers) + " |"
            for p in LOW for arm in (BASELINE, *REMEDIES) if _group(groups, arm, p) is not None]
    return head + body


def summary_section(groups: list[dict[str, Any]]) -> list[str]:
    return ["## Summary: the loss gap to BF16 per arm", "",
            "Each cell: mean ± sd over seeds. The gap is the arm's final validation loss in the low precision "
            "relative to its own in BF16, paired by seed (same initialisation and data order); each arm trains at "
            "one learning rate in every precision (\"How the learning rate was chosen\" above says which).", "",
            *gap_table(groups), "",
            "## Which blocks the casts hurt most", "",
            "Per block, the lowest quantisation SNR (dB) of its activation and output-gradient casts (attention and "
            "MLP projections) at the last training probe, mean ± sd over seeds; lower is a coarser cast. NVIDIA's "
            "NVFP4 recipe keeps the last blocks in BF16; here every block is cast, so a low SNR in the last blocks "
            "that a remedy lifts is what would make that exception unnecessary.", "",
            *layer_table(groups), ""]


def add_metrics(rows: list[dict[str, Any]], sweep_dir: Path, manifest: dict[str, Any]) -> None:
    """The suite's derived columns: each block's worst cast SNR and the low-precision runs' collapses."""
    add_layer_snr(rows, sweep_dir, manifest)
    add_collapses(rows, sweep_dir, manifest)


SUITE = Suite(INFO, claims, [LOW_PRECISION_GAP], add_metrics=add_metrics, summary=summary_section)
