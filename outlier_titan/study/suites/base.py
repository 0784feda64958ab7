"""What a reproduction suite is: the paper's rows beside ours (:class:`SuiteInfo`) and its claims, thresholds and
suite-specific report parts (:class:`Suite`). Each paper's suite is one module of this package."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from outlier_titan.study import rules
from outlier_titan.study.rules import Claim, Threshold


@dataclass(frozen=True)
class PaperRow:
    label: str
    axes: dict[str, object]  # the axis values of our point that mirrors the paper's row
    paper: dict[str, float]
    source: str


FOUR_BIT_SCHEMES = ("w4a4kv4_rtn", "w4a4kv4_rtn_hadamard")
"""The 4-bit rows every suite's report adds beside its paper's own schemes: W4A4KV4 round-to-nearest and the same
after a QuaRot-style Hadamard rotation (``quant/ptq.py``). They ask whether a training-time remedy still matters
once an inference-time one is applied; only park2025's verdicts rest on them. (GPTQ + rotation is left out for
its cost: 22.1 s a run at 8,192 tokens against 6.5 s for RTN + rotation in docs/quantisation.md's table, one run per
calibration seed; ``scripts/evaluate.py --schemes`` runs it on a checkpoint.)"""


@dataclass(frozen=True)
class SuiteInfo:
    title: str
    citation: str
    metrics: dict[str, str]           # metric key -> column header (order = table order)
    rows: list[PaperRow] = field(default_factory=list)
    schemes: tuple[str, ...] = ()     # the paper's own PTQ schemes (scripts/evaluate.py --schemes): verdicts use these
    extra_schemes: tuple[str, ...] = FOUR_BIT_SCHEMES  # evaluated and tabled too, no verdict rests on them
    kurtosis: str = "kurtosis_rest"   # the probe metric of the kurtosis trajectory figure
    lr_search_shows: tuple[str, ...] = ()  # beside each loss of the lr search: the claims' phenomenon (default: kurtosis)
    extra_probe: tuple[str, ...] = ()  # further probe metrics of the report's peaks table
    # the tile-size study (``--scale tiles``): the baseline's and the remedy's axes, the claim's metric (decided by
    # the rule set's reduction, study/rules.py) and the metrics plotted against the tile edge
    tile_study: tuple[dict[str, object], dict[str, object], str, tuple[str, ...]] | None = None

    @property
    def all_schemes(self) -> tuple[str, ...]:
        """Every scheme the suite's evaluation runs: the paper's, then the added ones."""
        return tuple(dict.fromkeys(self.schemes + self.extra_schemes))


@dataclass(frozen=True)
class Suite:
    """One paper's suite: its numbers (``info``), its claims decided on the report's groups, the thresholds those
    compare with (their sources are printed under the verdicts), and the optional suite-specific parts: columns
    derived from each collected row (``add_metrics(rows, sweep_dir, manifest)``, in place) and a report section
    before the verdicts (``summary(groups)``)."""
    info: SuiteInfo
    claims: Callable[[list[dict[str, Any]]], list[Claim]]
    thresholds: list[Threshold]
    add_metrics: Callable[[list[dict[str, Any]], Path, dict[str, Any]], None] | None = None
    summary: Callable[[list[dict[str, Any]]], list[str]] | None = None


REDUCTION_THRESHOLDS = [rules.REDUCTION_FACTOR, rules.GAUSSIAN_KURTOSIS, rules.LOSS_COST]
PTQ_THRESHOLDS = [rules.PTQ_FACTOR, rules.PTQ_FLOOR]
