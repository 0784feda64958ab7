"""Where a suite's sweep files are and what they say: the scales, the sweep file of a (suite, scale), and the
learning rates a scale takes from its lr search."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from outlier_titan.errors import UserError
from outlier_titan.packaged import configs_dir
from outlier_titan.study import lr_search
from outlier_titan.study.suites import SUITE_NAMES

SCALES = ("smoke", "cpu", "search", "lr", "cpu_lr", "tuned", "provoked", "synthetic", "tiles", "gpu")
"""``search``: the calibration search of the cpu scale, where a suite has one: the seeds' levers on
the cpu recipe, evaluated and reported like a suite, so the settings tried and the peaks they gave are kept.
``lr``: the learning-rate search: the arms a claim compares at every lr of a grid, seed 0 (``lr_choice.json``).
``cpu_lr``: a second learning-rate search, on the cpu recipe, for a suite whose ``lr`` search tunes another scale
(sinks_vs_massive2026's ``lr`` tunes its synthetic scale); its cpu scale reads it with ``lr_from = "cpu_lr"``.
``tuned``: the claims' arms re-run on the recipe their lr search tuned (the cpu one; sinks2025's synthetic one), each
at the lr that search chose (``lr_from = "lr"``), at the seeds a quoted verdict needs (five).
``provoked``: the cpu recipe with every arm at one lr taken from the lr search because the baseline grows the
phenomenon there, for a suite whose tuned baseline shows none (its report says so; the cpu scale is the comparison
at tuned lrs).
``synthetic``: the suite's grid on the synthetic Bigram-Backcopy task (``data.source = "bigram_backcopy"``), where
a suite has one: a small-scale testbed for the attention sink, which the embedded corpus (Python source) does not make at cpu scale.
``tiles``: the tile-size study, where a suite has one: the cpu recipe's baseline and remedy with the remedy's
rotation over whole axes and in shard-local tiles of 128, 64 and 32, reported against the tile edge."""
LR_SEARCH_SCALES = ("lr", "cpu_lr")
"""The scales that choose learning rates: their reports have the search's table and ``lr_choice.json``, no claims."""
OPTIONAL_SCALES = {"search": "calibration search", "lr": "learning-rate search",
                   "cpu_lr": "learning-rate search on the cpu recipe",
                   "tuned": "re-run at the searched learning rates",
                   "provoked": "re-run at a learning rate that provokes the phenomenon",
                   "synthetic": "synthetic-task suite",
                   "tiles": "tile-size study"}


def suite_scales(suite: str) -> list[str]:
    """The scales (in :data:`SCALES` order) whose sweep file the suite has."""
    return [s for s in SCALES if (configs_dir() / "suites" / suite / f"{s}.toml").is_file()]


def suite_file(suite: str, scale: str) -> Path:
    """The sweep file of a suite at a scale."""
    if suite not in SUITE_NAMES:
        raise UserError(f"--suite {suite!r} is not a suite; choose one of {', '.join(SUITE_NAMES)}")
    if scale not in SCALES:
        raise UserError(f"--scale {scale!r} is not a scale; choose one of {', '.join(SCALES)}")
    path = configs_dir() / "suites" / suite / f"{scale}.toml"
    if scale in OPTIONAL_SCALES and not path.is_file():
        have = sorted(p.parent.name for p in (configs_dir() / "suites").glob(f"*/{scale}.toml"))
        raise UserError(f"suite {suite} has no {OPTIONAL_SCALES[scale]} (train_configs/suites/{suite}/{scale}.toml)"
                        f"; suites with one: {', '.join(have) or 'none'}")
    if not path.is_file():
        have = suite_scales(suite)
        if have:
            raise UserError(f"suite {suite} has no {scale} scale (train_configs/suites/{suite}/{scale}.toml); its "
                            f"scales: {', '.join(have)}")
        raise UserError(f"suite file {path} is missing; reinstall the package (or restore it from git)")
    return path


def suite_file_keys(suite: str, scale: str) -> dict[str, Any]:
    """The sweep file's top-level keys, or {} where the suite has no such scale."""
    from outlier_titan.config.manager import tomllib

    path = configs_dir() / "suites" / suite / f"{scale}.toml"
    return tomllib.loads(path.read_text()) if path.is_file() else {}


def lr_search_of(suite: str, scale: str) -> tuple[Path, dict[str, Any]] | None:
    """The lr search a scale takes its learning rates from (its suite file's ``lr_from``): the search's report
    folder and its choice, or None; a one-line error naming that search's command when its report is missing."""
    source = suite_file_keys(suite, scale).get("lr_from")
    if not source:
        return None
    report = Path("reports") / f"{suite}-{source}"
    return report, lr_search.read_choice(report, suite, source)


def suite_sweep(suite: str, scale: str):
    """The suite's sweep at a scale, each tuned setting at the learning rate its lr search chose (``lr_from``)."""
    from outlier_titan.study.spec import load_sweep

    sweep = load_sweep(suite_file(suite, scale))
    search = lr_search_of(suite, scale)
    if search is not None:
        lr_search.apply_choice(sweep, search[1])
    return sweep


def lr_choice(suite: str, scale: str, manifest: dict[str, Any]) -> str:
    """How the learning rates of the planned points (``manifest``) were chosen: from the lr search the suite file
    names (``lr_from``), else the suite file's own words (``lr_choice``), or ""."""
    search = lr_search_of(suite, scale)
    if search is None:
        return str(suite_file_keys(suite, scale).get("lr_choice", ""))
    report, choice = search
    return lr_search.header_line(choice, str(report), lr_search.untuned_points(manifest, choice))

