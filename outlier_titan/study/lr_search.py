"""Each arm at its own best learning rate: a suite's ``lr`` scale and how its other scales use the choice.

``train_configs/suites/<suite>/lr.toml`` is an ordinary sweep file: the settings whose learning rate is tuned
(the arms a claim compares), each at every value of a grid of at least three, at one training seed. Its report
(``reports/<suite>-lr``) tables the final validation loss per setting and value, names the best (lowest final
validation loss) and writes it to ``lr_choice.json``. A scale whose suite file sets ``lr_from = "lr"`` then runs
every tuned setting at its chosen values (:func:`apply_choice`) and states the grid and the choice in its report
header; settings the search did not tune keep the suite file's values, and the header says which.

The tuned keys are the search file's learning-rate axes (``optimizer.lr`` and any other ``optimizer.*lr`` zipped
with it, e.g. Muon's AdamW lr); a setting is identified by its values of the other axes but the seed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from outlier_titan.errors import UserError
from outlier_titan.study.groups import format_value, num

CHOICE_FILE = "lr_choice.json"


def tuned_axes(axes: list[str]) -> list[str]:
    """The search's tuned axes: its learning-rate keys (``optimizer.lr``, ``optimizer.muon_adamw_lr``, ...)."""
    return [a for a in axes if a.startswith("optimizer.") and a.endswith("lr")]


def setting_key(values: dict[str, Any], setting_axes: list[str]) -> str:
    """A setting's identity: its values of the setting axes, as stable text."""
    return json.dumps({a: values.get(a) for a in setting_axes}, sort_keys=True)


def choose(rows: list[dict[str, Any]], axes: list[str], shown: tuple[str, ...] = ()) -> dict[str, Any]:
    """From an lr search's finished rows: per setting, the final validation loss at each tuned combination (and
    the row's ``shown`` metrics beside it, e.g. the claim's kurtosis, so the report shows what the choice does to
    the phenomenon) and the combination with the lowest loss (ties: the first in the grid); a setting with no
    finished point is left out."""
    tuned = tuned_axes(axes)
    setting_axes = [a for a in axes if a not in tuned and a != "seed"]
    settings: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r.get("status", "done") != "done" or num(r.get("final_val_loss")) is None:
            continue
        key = setting_key(r, setting_axes)
        s = settings.setdefault(key, {"setting": {a: r.get(a) for a in setting_axes}, "grid": []})
        s["grid"].append({"values": {a: r.get(a) for a in tuned}, "final_val_loss": r["final_val_loss"],
                          "point": r["point"], **{m: num(r.get(m)) for m in shown}})
    for s in settings.values():
        best = min(s["grid"], key=lambda g: g["final_val_loss"])
        s["chosen"] = best["values"]
        edge = {a: sorted({g["values"][a] for g in s["grid"]}) for a in tuned}
        s["at_edge"] = [a for a in tuned if len(edge[a]) > 1 and best["values"][a] in (edge[a][0], edge[a][-1])]
    return {"tuned_axes": tuned, "setting_axes": setting_axes, "shown": list(shown),
            "settings": list(settings.values())}


def section(choice: dict[str, Any], out: Path) -> list[str]:
    """The lr report's section: per setting the loss at every grid value and the choice; writes the choice to
    ``out/lr_choice.json``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / CHOICE_FILE).write_text(json.dumps(choice, indent=1) + "\n")
    tuned, shown = choice["tuned_axes"], choice["shown"]
    lines = ["## Learning-rate search", "",
             f"Each setting at every value of the grid, one seed; the chosen value is the one with the lowest final "
             f"validation loss (written to `{CHOICE_FILE}`, which a scale of the suite reads when its sweep file's "
             f"`lr_from` names this search). A choice at the grid's edge is marked: the best value may lie beyond it.", "",
             "| setting | " + ", ".join(tuned) + ": final val loss" + (f" ({', '.join(shown)})" if shown else "")
             + " | chosen |",
             "|---|---|---|"]
    for s in choice["settings"]:
        name = ", ".join(f"{a}={v}" for a, v in s["setting"].items()) or "the only setting"
        cells = "; ".join(", ".join(f"{g['values'][a]:g}" if isinstance(g["values"][a], float)
                                    else str(g["values"][a]) for a in tuned) + f": {format_value(g['final_val_loss'])}"
                          + (f" ({', '.join(format_value(g.get(m)) for m in shown)})" if shown else "")
                          for g in s["grid"])
        chosen = ", ".join(f"{a.split('.')[-1]} {v:g}" if isinstance(v, float) else f"{a.split('.')[-1]} {v}"
                           for a, v in s["chosen"].items())
        lines.append(f"| {name} | {cells} | {chosen}" + (" (at the grid's edge)" if s["at_edge"] else "") + " |")
    return lines + [""]


def read_choice(report: Path, suite: str = "SUITE", scale: str = "lr") -> dict[str, Any]:
    """The choice an lr report wrote; a one-line error naming the search's command when it has not been reported."""
    path = report / CHOICE_FILE
    if not path.is_file():
        raise UserError(f"{path} is missing: this scale takes each setting's learning rate from the suite's lr "
                        f"search; run it first (python scripts/reproduce.py --suite {suite} --scale {scale}) or "
                        f"commit its report")
    return json.loads(path.read_text())


def _chosen(choice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Setting identity -> the values chosen for it."""
    return {setting_key(s["setting"], choice["setting_axes"]): s["chosen"] for s in choice["settings"]}


def apply_choice(sweep, choice: dict[str, Any]) -> list[str]:
    """Sets each point of ``sweep`` whose setting the search tuned to its chosen values (in place); returns the
    names of the points left at the suite file's values."""
    from outlier_titan.config.manager import set_values, validate
    from outlier_titan.errors import ConfigError

    chosen, untuned = _chosen(choice), []
    for p in sweep.points:
        values = {a: p.axes.get(a, _resolved(p.cfg, a)) for a in choice["setting_axes"]}
        tuned = chosen.get(setting_key(values, choice["setting_axes"]))
        if tuned is None:
            untuned.append(p.name)
            continue
        try:
            set_values(p.cfg, dict(tuned))
            validate(p.cfg)
        except ConfigError as e:
            raise UserError(f"point {p.name}: the lr search's choice {tuned} does not apply: {e}") from None
    return untuned


def untuned_points(manifest: dict[str, Any], choice: dict[str, Any]) -> list[str]:
    """The planned points (a manifest's) whose setting the search did not tune, from their recorded configs."""
    from outlier_titan.config.manager import tomllib

    chosen, out = _chosen(choice), []
    for e in manifest["points"]:
        cfg = tomllib.loads(e["config"])
        values = {a: e["axes"].get(a, cfg.get(a.split(".", 1)[0], {}).get(a.split(".", 1)[1]))
                  for a in choice["setting_axes"]}
        if setting_key(values, choice["setting_axes"]) not in chosen:
            out.append(e["name"])
    return out


def _resolved(cfg, key: str) -> Any:
    section_name, name = key.split(".", 1)
    return getattr(getattr(cfg, section_name, None), name, None)


def header_line(choice: dict[str, Any], source: str, untuned: list[str]) -> str:
    """The report header's statement of how the learning rates were chosen."""
    parts = []
    for s in choice["settings"]:
        name = ", ".join(f"{v}" for v in s["setting"].values())
        first = choice["tuned_axes"][0]
        grid = ", ".join(f"{v:g}" for v in sorted({g["values"][first] for g in s["grid"]}))
        chosen = ", ".join(f"{a.rsplit('.', 1)[-1]} {v:g}" for a, v in s["chosen"].items())
        parts.append(f"{name}: {chosen} from {{{grid}}}" + (" (at the grid's edge)" if s["at_edge"] else ""))
    text = (f"each tuned setting at its own best value (lowest final val loss at one seed, `{source}`): "
            + "; ".join(parts))
    if untuned:
        text += f"; not tuned, at the suite file's values: {', '.join(untuned)}"
    return text
