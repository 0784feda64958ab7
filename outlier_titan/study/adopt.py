"""Adopting the finished, evaluated points of a report folder into a sweep folder instead of training them
again (``scripts/reproduce.py --adopt``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from outlier_titan.errors import UserError
from outlier_titan.provenance import code_version, uncommitted
from outlier_titan.study.evaluations import EVAL_ARGS, is_evaluated
from outlier_titan.study.plan import point_dir

ADOPT_IGNORES = ("job", "checkpoint")
"""Config sections that may differ between an adopted run and the planned point: where and how often a run saves
changes none of its numbers (a tile study adopts its cpu suite's whole-axis points, which keep more checkpoints)."""


ANATOMY_FILES = ("anatomy.md", "anatomy.json")  # what scripts/anatomy.py writes into a run folder, if it was run


def _from_here(source: Path) -> str:
    """The report folder relative to the working directory where it lies under it (``reports/X``, as a report's
    header names it, not a machine's absolute path), else as given."""
    try:
        return str(source.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(source)


def untraced_code(trained: list[str], evaluated: str | None) -> str:
    """Why a finished point's numbers cannot be traced to a commit ("" when they can): trained or evaluated by
    uncommitted (``+dirty``) code, or with no record of the code."""
    if not trained:
        return "no record of the code that trained it"
    if dirty := [c for c in trained if uncommitted(c)]:
        return f"trained by uncommitted code ({dirty[0]})"
    if not evaluated:
        return "no record of the code that evaluated it"
    if uncommitted(evaluated):
        return f"evaluated by uncommitted code ({evaluated})"
    return ""


def adopt_points(sweep_dir: Path, manifest: dict[str, Any], source: Path, schemes: tuple[str, ...],
                 scale: str, as_evaluated: bool = False) -> tuple[list[str], list[str]]:
    """Takes over the finished, evaluated points of an earlier run from its report folder (``source/runs/<point>/``,
    written on this or another machine), so a suite too long for one machine's session can be finished in parts,
    and a study can take the points it shares with another suite. A planned point that is unfinished here takes
    the run of the same name, else any run of ``source`` with the same config, when that run's recorded config
    equals the planned one (:data:`ADOPT_IGNORES` aside), its ``metrics.jsonl`` holds the whole run and its
    evaluation report covers every scheme with this scale's evaluation settings, and (where this code is committed)
    committed code trained and evaluated it (:func:`untraced_code`). Its logs and evaluation report
    (with the hidden-state picture, where the report kept one) are copied into the run folder, whose
    ``sweep_state.json`` keeps the original record plus ``adopted_from``. An adopted point has no checkpoint: it
    is neither trained nor evaluated again.

    ``as_evaluated``: re-rendering a report from its own runs: a point's evaluation report is taken as it was made
    (schemes added to the suite since then print as missing; other evaluation settings are kept), only its config
    and its finished run are checked (the report's header flags untraced points).

    Returns (adopted point names, one line per run of the same name that was not adopted, saying why)."""
    from outlier_titan.study.plan import _config_diff, _defaults, _optimizer_owners
    from outlier_titan.study.runner import is_finished, read_state, run_is_complete, write_state

    runs = Path(source) / "runs"
    if not runs.is_dir():
        raise UserError(f"--adopt {source}: no runs/ folder there; name a report folder written by "
                        f"scripts/reproduce.py (it holds runs/<point>/ with each point's logs)")
    configs = {d.name: (d / "config.toml").read_text() for d in sorted(runs.iterdir()) if (d / "config.toml").is_file()}
    defaults, owners = _defaults(), _optimizer_owners()
    want = EVAL_ARGS[scale]
    adopted, refused, taken = [], [], set()
    # committed code adopts only points it can trace to a commit; uncommitted code's own report is flagged anyway
    committed = not uncommitted(code_version())

    def why_not(name: str, e: dict[str, Any]) -> str:
        src, steps = runs / name, e["steps"]
        if name not in configs:
            return "no config.toml"
        if diff := _config_diff(configs[name], e["config"], defaults, owners, ADOPT_IGNORES):
            return "its config differs from the suite's: " + "; ".join(diff)
        if read_state(src).get("status") != "done" or not run_is_complete(src / "metrics.jsonl", e):
            return "its run did not finish"
        if not is_evaluated(src / f"step-{steps}.json", () if as_evaluated else schemes):
            return f"its evaluation report step-{steps}.json is missing or lacks a scheme of the suite"
        if as_evaluated:
            return ""
        ev = json.loads((src / f"step-{steps}.json").read_text())
        if committed and (untraced := untraced_code(read_state(src).get("code", []), ev.get("code"))):
            return f"{untraced}; it is trained and evaluated again here (a report's points come from committed code)"
        cal = ev.get("calibration", {})
        if (ev.get("tokens_requested"), cal.get("batches"), cal.get("seeds")) != \
                (want["tokens"], want["calib_batches"], want["calib_seeds"]):
            return (f"it was evaluated on {ev.get('tokens_requested')} tokens with {cal.get('batches')} calibration "
                    f"batches x {cal.get('seeds')} seeds, this scale evaluates {want['tokens']} with "
                    f"{want['calib_batches']} x {want['calib_seeds']}")
        return ""

    for e in manifest["points"]:
        folder = point_dir(sweep_dir, e["name"])
        if is_finished(folder, e):
            continue
        name = None
        if e["name"] in configs:
            if why := why_not(e["name"], e):
                refused.append(f"{e['name']}: {why}")
            else:
                name = e["name"]
        if name is None:  # a run of another name with this config (another suite's shared point)
            others = [n for n in configs if n != e["name"] and n not in taken]
            name = next((n for n in others if not why_not(n, e)), None)
            if name is None and e["name"] not in configs:  # say why a run with this very config was not taken
                same = next((n for n in others if not _config_diff(configs[n], e["config"], defaults, owners,
                                                                     ADOPT_IGNORES)), None)
                if same is not None:
                    refused.append(f"{e['name']}: {same}, a run with its config: {why_not(same, e)}")
        if name is None:
            continue
        src, steps = runs / name, e["steps"]
        taken.add(name)
        (folder / "eval").mkdir(parents=True, exist_ok=True)
        for f in ("metrics.jsonl", "config.toml"):
            shutil.copy2(src / f, folder / f)
        for f in ANATOMY_FILES:  # only where scripts/anatomy.py was run
            if (src / f).is_file():
                shutil.copy2(src / f, folder / f)
        shutil.copy2(src / f"step-{steps}.json", folder / "eval" / f"step-{steps}.json")
        picture = Path(source) / "figures" / f"hidden_{name}.png"
        if picture.is_file():
            shutil.copy2(picture, folder / "eval" / f"step-{steps}.hidden_magnitude.png")
        state = read_state(src)  # a point the source had adopted itself keeps its first origin
        write_state(folder, {"adopted_from": _from_here(Path(source)), "adopted_point": name, **state})
        adopted.append(e["name"] if name == e["name"] else f"{e['name']} (= {name})")
    return adopted, refused

