"""Settings over seeds: the finished points of a collected table grouped by setting, each metric as an
:class:`~outlier_titan.study.stats.Estimate` over seeds, and how reports select and print them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from outlier_titan.study.stats import Estimate, estimate


def num(v: Any) -> float | None:
    """A finite number, else None (text, booleans, NaN and infinities are not numbers of a table)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def finished(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows of finished points (``status`` done; a row without a status, e.g. a test table, counts as done):
    a point still running or interrupted counts in no number, sentence or seed list of a report."""
    return [r for r in rows if r.get("status", "done") == "done"]


def aggregate(rows: list[dict[str, Any]], axes: list[str]) -> list[dict[str, Any]]:
    """One group per setting (the axes without ``seed``), in manifest order: its axis values, ``points`` and
    ``seeds`` (lists, in seed order), and every numeric metric of its rows as an :class:`Estimate` over seeds.
    A point not finished (``status`` other than ``done``: still running, interrupted) is left out, so that an
    in-progress report never averages a partial run."""
    keys = [a for a in axes if a != "seed"]
    groups: dict[tuple, dict[str, Any]] = {}
    rows = finished(rows)
    for r in sorted(rows, key=lambda r: (r.get("seed") is None, r.get("seed") or 0)):
        g = groups.setdefault(tuple(repr(r.get(a)) for a in keys),
                              {**{a: r.get(a) for a in keys}, "points": [], "seeds": [], "_rows": []})
        g["points"].append(r["point"])
        g["seeds"].append(r.get("seed"))
        g["_rows"].append(r)
    order = {r["point"]: i for i, r in enumerate(rows)}
    out = []
    for g in sorted(groups.values(), key=lambda g: min(order[p] for p in g["points"])):
        members = g.pop("_rows")
        metrics = {k for r in members for k, v in r.items() if num(v) is not None and k not in keys
                   and k not in ("seed", "point", "status")}
        for k in sorted(metrics):
            g[k] = estimate(num(r.get(k)) for r in members)
        g["point"] = g["points"][0].rsplit("_s", 1)[0] if len(g["points"]) > 1 else g["points"][0]
        out.append(g)
    return out


def matches(row: dict[str, Any], axes: dict[str, Any]) -> bool:
    return all(row.get(k) == v for k, v in axes.items())


def first_match(rows: list[dict[str, Any]], axes: dict[str, Any]) -> dict[str, Any] | None:
    """The first point (manifest order) whose axes equal ``axes``; points of a suite that vary other axes (e.g.
    a learning-rate lever) contribute their first value."""
    for r in rows:
        if matches(r, axes):
            return r
    return None


def format_value(v: Any) -> str:
    """How every number appears in the report (the test parses the same format): mean ± sd over seeds for an
    :class:`Estimate`."""
    if v is None:
        return "—"
    if isinstance(v, Estimate):
        return v.text()
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def seed_band(curves: list[tuple[list, list[float]]]) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    """(x, mean, min, max) over several runs' curves ``(xs, ys)`` at the x values all of them have: the line and
    band every figure over seeds draws."""
    common = sorted(set.intersection(*(set(xs) for xs, _ in curves))) if curves else []
    if not common:
        return [], np.array([]), np.array([]), np.array([])
    vals = np.array([[dict(zip(xs, ys))[x] for x in common] for xs, ys in curves])
    return common, vals.mean(0), vals.min(0), vals.max(0)
