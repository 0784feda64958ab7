"""``sweep.py plan``: the sweep folder and its table.

Layout of a sweep folder::

    SWEEP_DIR/manifest.json          the points: name, axes, params, FLOPs/token, tokens, FLOPs, resolved config
    SWEEP_DIR/sweep.toml             the sweep file as planned
    SWEEP_DIR/points/<name>/         the point's run folder (job.dump_folder = SWEEP_DIR/points, job.name = name):
        config.toml                  the resolved config (the trainer writes the same file)
        sweep_state.json             the sweep's record: status, trainer pid, attempts, wall time, error line, the
                                     code of each attempt (`code`: commit, +dirty when changed)
        train.log, metrics.jsonl, tb/, checkpoints/   (the trainer's)
    SWEEP_DIR/replaced/              run folders of points whose config changed at a forced re-plan
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from outlier_titan.config.manager import tomllib
from outlier_titan.plugins import load_plugins
from outlier_titan.study.spec import Point, Sweep, SweepError

MANIFEST = "manifest.json"
VERSION = 1


def point_dir(sweep_dir: Path, name: str) -> Path:
    return Path(sweep_dir) / "points" / name


def manifest_entry(p: Point, sweep_dir: Path) -> dict[str, Any]:
    cfg = p.cfg
    cfg.job.dump_folder = str((Path(sweep_dir) / "points").resolve())
    return {"index": p.index, "name": p.name, "axes": p.axes, "params": p.params,
            "budget_params": p.budget_params, "flops_per_token": p.flops_per_token, "tokens": p.tokens,
            "flops": p.flops, "steps": cfg.training.steps, "config": p.config_toml}


def build_manifest(sweep: Sweep, sweep_dir: Path) -> dict[str, Any]:
    return {"version": VERSION, "sweep_file": str(sweep.path), "base": str(sweep.base), "axes": sweep.axes,
            "slurm": sweep.slurm, "points": [manifest_entry(p, sweep_dir) for p in sweep.points]}


def read_manifest(sweep_dir: str | Path) -> dict[str, Any]:
    """The sweep's manifest; the ``job.plugins`` its points use are imported (their metrics name its columns)."""
    path = Path(sweep_dir) / MANIFEST
    if not path.is_file():
        raise SweepError(f"{sweep_dir} is not a planned sweep folder (no {MANIFEST}); run "
                         f"'sweep.py plan SWEEP.toml --out {sweep_dir}' first")
    manifest = json.loads(path.read_text())
    for entry in manifest["points"]:
        load_plugins(tomllib.loads(entry["config"]).get("job", {}).get("plugins", []))
    return manifest


def _defaults() -> dict[str, dict[str, Any]]:
    """Today's default config, section -> key -> value."""
    from outlier_titan.config.job_config import JobConfig
    from outlier_titan.config.manager import to_dict

    return to_dict(JobConfig())


def _optimizer_owners() -> dict[str, set[str]]:
    """``[optimizer]`` key -> the optimizers that own it (keys common to every optimizer are absent)."""
    import dataclasses

    from outlier_titan.config.job_config import section_class
    from outlier_titan.options import owned_by

    out = {}
    for f in dataclasses.fields(section_class("optimizer")):
        owner = owned_by(f)
        if owner is not None:
            out[f.name] = set(owner[1].split(", "))
    return out


def _config_diff(old: str, new: str, defaults: dict[str, dict[str, Any]] | None = None,
                 owners: dict[str, set[str]] | None = None, ignore: tuple[str, ...] = ("job",)) -> list[str]:
    """``section.key: old -> new`` for every differing key of two resolved configs (the sections in ``ignore``,
    by default job.*, excluded). A key one
    side lacks counts at today's default (``defaults``, built when not given), so an option added since a sweep
    was planned (or no longer written) changes nothing while it is at its default; nor does an optimizer's own
    option (``optimizer.one_d``, ``optimizer.muon_*``) when neither config trains with that optimizer, so a
    changed default of one optimizer's option leaves the other optimizers' points valid (``owners``:
    :func:`_optimizer_owners`, built when not given)."""
    a, b = tomllib.loads(old), tomllib.loads(new)
    defaults = _defaults() if defaults is None else defaults
    used = {cfg.get("optimizer", {}).get("name", defaults.get("optimizer", {}).get("name")) for cfg in (a, b)}
    owners = _optimizer_owners() if owners is None else owners
    out = []
    for sec in sorted(set(a) | set(b)):
        if sec in ignore:
            continue
        sa, sb, sd = a.get(sec, {}), b.get(sec, {}), defaults.get(sec, {})
        for key in sorted(set(sa) | set(sb)):
            if sec == "optimizer" and key in owners and not owners[key] & used:
                continue
            va, vb = sa.get(key, sd.get(key)), sb.get(key, sd.get(key))
            if va != vb:
                out.append(f"{sec}.{key}: {sa.get(key, 'default')!r} -> {sb.get(key, 'default')!r}")
    return out


def plan_changes(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(human-readable changes, names of existing points whose results would no longer match)."""
    old_pts = {p["name"]: p for p in old["points"]}
    new_pts = {p["name"]: p for p in new["points"]}
    lines, stale = [], []
    defaults, owners = _defaults(), _optimizer_owners()  # once for all points
    for name in old_pts.keys() - new_pts.keys():
        lines.append(f"removed point {name}")
        stale.append(name)
    for name in sorted(new_pts.keys() - old_pts.keys()):
        lines.append(f"new point {name}")
    for name in sorted(old_pts.keys() & new_pts.keys()):
        diff = _config_diff(old_pts[name]["config"], new_pts[name]["config"], defaults, owners)
        if diff:
            lines.append(f"changed point {name}: " + "; ".join(diff))
            stale.append(name)
    if old.get("axes") != new.get("axes"):
        lines.append(f"axes {old.get('axes')} -> {new.get('axes')}")
    return lines, sorted(stale)


STATE = "sweep_state.json"
"""A point's run record (status, pid, code, versions), in its folder."""


def read_state(folder: Path) -> dict[str, Any]:
    """A point's run record, or {} where it has none (or a torn one)."""
    path = folder / STATE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError:
        return {}


def write_plan(sweep: Sweep, sweep_dir: str | Path, force: bool = False) -> tuple[dict[str, Any], list[str]]:
    """Writes (or re-writes) the sweep folder; returns the manifest and the list of changes.

    Re-planning with changes that touch existing points raises :class:`SweepError` unless ``force``; with
    ``force`` the run folders of changed or removed points are moved to ``replaced/`` (never deleted), so
    results of different configs are not mixed.
    """
    sweep_dir = Path(sweep_dir)
    manifest = build_manifest(sweep, sweep_dir)
    changes: list[str] = []
    if (sweep_dir / MANIFEST).is_file():
        old = read_manifest(sweep_dir)
        changes, stale = plan_changes(old, manifest)
        if changes and not force:
            raise SweepError(f"{sweep_dir} was planned from a different sweep ({'; '.join(changes)}); plan into "
                             f"another --out folder, or pass --force to re-plan (changed points restart)")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for name in stale:
            src = point_dir(sweep_dir, name)
            if src.exists():
                dst = sweep_dir / "replaced" / f"{name}-{stamp}"
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(src), str(dst))
    elif sweep_dir.exists() and any(sweep_dir.iterdir()):
        raise SweepError(f"--out {sweep_dir} exists and is not a sweep folder; choose a new or empty folder")
    for entry in manifest["points"]:
        folder = point_dir(sweep_dir, entry["name"])
        folder.mkdir(parents=True, exist_ok=True)
        if read_state(folder).get("status") != "done":  # a finished point keeps the config its run recorded
            (folder / "config.toml").write_text(entry["config"])
    (sweep_dir / "sweep.toml").write_text(sweep.text)
    tmp = sweep_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(manifest, indent=1) + "\n")
    os.replace(tmp, sweep_dir / MANIFEST)
    return manifest, changes


def fmt_count(x: float) -> str:
    """1.23M / 4.5e+12 style numbers for tables."""
    if x >= 1e15 or (x and x < 1e-3):
        return f"{x:.3g}"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.4g}"


def plan_table(manifest: dict[str, Any]) -> str:
    """The plan as a fixed-width table: point, axes, params, FLOPs/token, steps, tokens, total FLOPs."""
    axes = manifest["axes"]
    header = ["point", *axes, "params", "FLOPs/token", "steps", "tokens", "FLOPs"]
    rows = [[p["name"], *(str(p["axes"].get(a, "")) for a in axes), fmt_count(p["params"]),
             fmt_count(p["flops_per_token"]), str(p["steps"]), fmt_count(p["tokens"]), f"{p['flops']:.3g}"]
            for p in manifest["points"]]
    total = sum(p["flops"] for p in manifest["points"])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *rows]]
    lines.append(f"{len(rows)} points, {total:.3g} training FLOPs in total")
    return "\n".join(lines)
