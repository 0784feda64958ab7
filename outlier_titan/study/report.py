"""The report writer: ``report.md`` from the collected rows, with its figures and each point's logs beside it."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from outlier_titan.provenance import code_version
from outlier_titan.study import facts, lr_search, stats
from outlier_titan.study.adopt import ANATOMY_FILES
from outlier_titan.study.groups import aggregate, format_value, matches, first_match
from outlier_titan.study.plan import point_dir
from outlier_titan.study.report_figures import trajectory_figures
from outlier_titan.study.report_sections import (anatomy_section, peaks_table, ptq_table, tile_grid_section,
                                                 tile_study_section)
from outlier_titan.study.rules import RULES_TEXT, sources
from outlier_titan.study.suite_files import LR_SEARCH_SCALES, lr_choice, suite_file_keys, suite_scales
from outlier_titan.study.suites import SUITES


def _axes_label(row: dict[str, Any], axes: list[str]) -> str:
    return ", ".join(f"{a}={row.get(a)}" for a in axes if a != "seed")


SCALE_NOTES = {
    "smoke": "**Smoke scale:** tiny models trained for a few steps; these runs test the pipeline and say nothing about "
             "the phenomena.",
    "search": "**Calibration search:** the cpu recipe under the levers the seeds name (the suite file says which); a "
              "verdict needs the points it compares and is not determined where the search lacks them. Read the "
              "peaks table: whether any setting grows the phenomenon at this scale.",
    "provoked": "**Provoked:** every arm trains at one learning rate chosen because the baseline grows the phenomenon "
                "there (the suite file's reason is under \"How the learning rate was chosen\"), not at its own best "
                "lr; the same arms at their tuned lrs are the {base} scale's report (`reports/{suite}-{base}`). Read these "
                "verdicts beside those.",
    "tuned": "**Tuned:** each arm at its own best learning rate from the suite's lr search, with five seeds; the "
             "scale runs only the arms that search tuned, so a claim about other arms is not determined here and "
             "stays the {base} scale's (`reports/{suite}-{base}`).",
    "synthetic": "**Synthetic task:** these runs train on the Bigram-Backcopy task (`data.source = "
                 "\"bigram_backcopy\"`, Guo et al. 2024), a generated token stream where only the copy after a "
                 "trigger token needs attention and every window starts with BOS, not on text; what they show is the "
                 "mechanism at small scale, beside (not instead of) the cpu scale's runs on Python source.",
}
"""What a report at a scale says first about how to read it (after its header), where the scale needs it."""


def scale_note(suite: str, scale: str) -> list[str]:
    """The report's notes on reading a scale's verdicts (:data:`SCALE_NOTES`), or none: its own, then that of the
    scale its suite file takes its recipe from (``fixed_from``; the cpu scale when it names none), where that has
    one (a tuned synthetic scale is still a synthetic task)."""
    base = Path(suite_file_keys(suite, scale).get("fixed_from", "cpu.toml")).stem
    notes = [SCALE_NOTES[s] for s in dict.fromkeys((scale, base)) if s in SCALE_NOTES]
    return [line for note in notes for line in (note.format(suite=suite, base=base), "")]


def write_report(suite: str, scale: str, sweep_dir: Path, out: Path, manifest: dict[str, Any],
                 columns: list[str], rows: list[dict[str, Any]], eval_failed: list[str]) -> Path:
    """``out/report.md`` with figures under ``out/figures`` and each point's logs under ``out/runs``."""
    import datetime

    from outlier_titan.study.results import write_tables

    suite_def = SUITES[suite]
    info = suite_def.info
    out.mkdir(parents=True, exist_ok=True)
    fig_dir = out / "figures"
    write_tables(out, columns, rows)
    # the evidence: each point's metrics log, config and evaluation report beside the report
    # (a point not run here keeps the copy an earlier run left, which --adopt can take over; one that ran here
    # replaces its copy whole, so no file of an earlier run of it lingers)
    for r in rows:
        src = point_dir(sweep_dir, r["point"])
        dst = out / "runs" / r["point"]
        if not (src / "metrics.jsonl").is_file():
            continue
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "config.toml", "sweep_state.json", *ANATOMY_FILES):
            if (src / f).is_file():
                shutil.copy2(src / f, dst / f)
        for f in (src / "eval").glob("step-*.json") if (src / "eval").is_dir() else []:
            shutil.copy2(f, dst / f.name)
    figs = trajectory_figures(sweep_dir, rows, info, fig_dir, manifest["axes"])
    groups = aggregate(rows, manifest["axes"])
    seeds = sorted({s for g in groups for s in g["seeds"] if s is not None})
    done = sum(len(g["points"]) for g in groups)
    runs, scale_phrase = facts.header(sweep_dir, manifest, rows, seeds, lr_choice(suite, scale, manifest), out)
    lines = [f"# {info.title} — {scale} scale", "",
             f"Paper: {info.citation}. Suite file: `train_configs/suites/{suite}/{scale}.toml`; sweep folder: "
             f"`{sweep_dir}`. Written {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC by "
             f"`python scripts/reproduce.py --suite {suite} --scale {scale}` at code {code_version()}.", "",
             f"{done} of {len(rows)} points finished: {len(groups)} settings × training seeds {seeds}. Every number "
             f"of ours is the mean ± sd over the finished points' seeds (per-seed values in the appendix); "
             f"verdicts are decided from t-based 95 % intervals over the seeds by one rule set (below), and the test "
             f"is named beside each. Our numbers come from `results.csv` (collected from the run folders; copies of "
             f"each point's `metrics.jsonl` and evaluation report are under `runs/`). Every verdict holds {scale_phrase}: "
             f"the papers' models are far larger and trained far longer than ours, so the comparison is of "
             f"directions and ratios, not of values.", ""]
    if done < len(rows):  # a suite run in parts: the part so far, kept so a later session can --adopt it
        lines += [f"**Unfinished:** {done} of the suite's {len(rows)} points have run. This "
                  f"is a record of the finished part, not the suite's result: its verdicts are over the finished "
                  f"points alone. To go on: `python scripts/reproduce.py --suite {suite} --scale {scale} --adopt "
                  f"<this folder>`.", ""]
    lines += runs
    lines += tile_grid_section(manifest)
    lines += scale_note(suite, scale)
    if scale == "tiles" and info.tile_study:
        lines += tile_study_section(groups, info, fig_dir, scale_phrase)
    searching = scale in LR_SEARCH_SCALES  # a search decides learning rates: no claims, no summary of them
    if searching:
        shown = info.lr_search_shows or (info.kurtosis,)
        lines += lr_search.section(lr_search.choose(rows, manifest["axes"], shown), out)
    if eval_failed:
        lines += [f"Evaluation failed for: {', '.join(eval_failed)} (see `<point>/eval.log`).", ""]
    if suite_def.summary is not None and not searching:
        lines += suite_def.summary(groups)
    claims = [] if searching else suite_def.claims(groups)
    lines += ["## Verdicts", "", RULES_TEXT if claims else "None at this scale: it chooses learning rates.", ""]
    for text, verdict, detail in claims:
        lines.append(f"- **{verdict}** {scale_phrase} — {text}: {detail}.")
    if claims:
        lines += ["", stats.chance_calls([v for _, v, _ in claims]), "",
                  "Thresholds and where they come from:", "", *sources(suite_def.thresholds)]
    headers = list(info.metrics.values())
    if info.rows and searching:  # a grid's first point per setting is not its best lr: no like-for-like row
        lines += ["", "## The paper's numbers beside ours", "", paper_rows_elsewhere(suite, scale), ""]
    elif info.rows:
        lines += ["", "## The paper's numbers beside ours", "",
                  "Each row: the paper's setting, then `paper / ours` per metric (ours: mean ± sd over seeds of the "
                  "setting with those axes; — where a side has no number).", "",
                  "| paper row | source | our point | " + " | ".join(headers) + " |",
                  "|---|---|---|" + "---|" * len(headers)]
    for pr in info.rows if not searching else ():
        r = first_match(groups, pr.axes)
        cells = [f"{format_value(pr.paper.get(m))} / {format_value(r.get(m) if r else None)}" for m in info.metrics]
        lines.append(f"| {pr.label} | {pr.source} | {r['point'] if r else 'not in this suite'} | "
                     + " | ".join(cells) + " |")
    lines += ["", "Ours: PPL is `scripts/evaluate.py`'s full-precision perplexity; probe metrics are the last "
              "probe step of training (mean over blocks); Δppl are `scripts/evaluate.py`'s schemes.", ""
              ] if info.rows and not searching else [""]
    lines += ptq_table(groups, info, rows)
    lines += ["",
              "## Trajectories", ""]
    for p in figs:
        lines.append(f"![{p.stem}](figures/{p.name})")
    lines += ["", "## Hidden-state magnitudes (evaluation probe, first token vs the rest)", ""]
    first_seed = [r for r in rows if r.get("seed") == (seeds[0] if seeds else None)] or rows
    compared = [r for r in first_seed if any(matches(r, pr.axes) for pr in info.rows)] or first_seed
    for r in compared:
        steps = manifest_steps(manifest, r["point"])
        src = point_dir(sweep_dir, r["point"]) / "eval" / f"step-{steps}.hidden_magnitude.png"
        if src.is_file():
            shutil.copy2(src, fig_dir / f"hidden_{r['point']}.png")
            lines.append(f"**{r['point']}** ({_axes_label(r, manifest['axes'])})  ")
            lines.append(f"![hidden {r['point']}](figures/hidden_{r['point']}.png)")
            lines.append("")
    lines += ["## Peaks over training and the worst layer", "",
              "From each point's `metrics.jsonl` (training probe, every `observe.every` steps).", ""]
    lines += peaks_table(sweep_dir, rows, list(dict.fromkeys([info.kurtosis, "kurtosis_neuron_rms",
                                                              "first_token_argmax_share", "max_abs_rest",
                                                              *info.extra_probe])))
    lines += [""] + anatomy_section(out, rows)
    lines += ["## Appendix: every point, every seed (settings → final and peak metrics)", "",
              (out / "results.md").read_text().rstrip(), ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path



def paper_rows_elsewhere(suite: str, scale: str) -> str:
    """Where an lr search's paper-vs-ours rows are: the scales that run at the lr this search chooses."""
    readers = [s for s in suite_scales(suite) if suite_file_keys(suite, s).get("lr_from") == scale]
    where = ", ".join(f"[`{s}`](../{suite}-{s}/report.md)" for s in readers)
    return ("Not in a learning-rate search: a setting's first grid point is not its best lr, so a row here would "
            "compare the paper with an untuned point. "
            + (f"The paper's rows stand beside ours where the search's choice is run: {where}." if readers else
               "No scale of this suite runs at this search's choice yet."))


def manifest_steps(manifest: dict[str, Any], name: str) -> int:
    return next(e["steps"] for e in manifest["points"] if e["name"] == name)

