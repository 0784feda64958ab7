"""Sweep files: a base train config, fixed overrides and axes, expanded into validated points.

A sweep file is TOML::

    base = "../debug.toml"                  # train config, relative to the sweep file
    name = "d{model.dim}_k{tokens_per_param}_s{seed}"   # point names; {key} or {key:format}
    seeds = [0, 1]                           # an axis over training.seed (column "seed")
    tokens_per_param = 20                    # optional budget: training.steps from k x params (or an axis)
    budget_params = "total"                  # params counted by the budget: total | non_embedding

    [fixed]                                  # overrides of every point
    training.seq_len = 64
    [grid]                                   # cartesian product
    model.dim = [32, 64, 96]
    tokens_per_param = [2, 5]
    [[zip]]                                  # values that move together (one table per group)
    model.n_layers = [2, 4]
    optimizer.lr = [3e-3, 1e-3]
    [slurm]                                  # defaults of `run --slurm`
    nodes = 1

``fixed_from = "cpu.toml"`` (a path relative to the sweep file) takes ``base`` and ``[fixed]`` from another sweep
file (and from the one it names, in turn): a search or re-run of a recipe states only what it changes. This file's
``base`` and ``[fixed]`` keys override the inherited ones, and a key that is an axis here drops the inherited fixed
value; nothing else (name, seeds, axes, lr_from, slurm) is inherited.

An axis value ``{}`` (an empty inline table) leaves the key unset at that point: for a ``[model]`` key the spec's or
flavor's own default, so that arms on different model specs can share a zip group (``model.norm = ["layernorm",
{}]`` beside ``model.name = ["pre_ln", "op"]``: the op spec has no ``norm``). Its column holds None.

Keys in ``fixed``/``grid``/``zip`` are any ``section.key`` of the train config (dotted or as nested
tables) plus ``tokens_per_param``. Every point is resolved and validated by the config code of ``train.py``
(:func:`outlier_titan.config.manager.set_values` / ``validate``) and its model is built on the meta device
for the parameter count and the trainer's own FLOPs per token.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from outlier_titan.config.job_config import JobConfig
from outlier_titan.config.manager import load_toml, parse_args, set_values, to_toml, validate
from outlier_titan.errors import ConfigError, UserError
from outlier_titan.packaged import renamed_config, resolve_config
from outlier_titan.plugins import absolute, load_plugins

TOP_KEYS = ("base", "fixed_from", "name", "seeds", "tokens_per_param", "budget_params", "fixed", "grid", "zip", "slurm",
            "lr_choice", "lr_from")
SLURM_KEYS = {"nodes": int, "gpus_per_node": int, "cpus_per_task": int, "time": str, "partition": str,
              "account": str, "signal_seconds": int, "extra": list}
SEED = "seed"
BUDGET = "tokens_per_param"
PLUGINS = "job.plugins"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")
PLACEHOLDER_RE = re.compile(r"\{([^{}:]+)(?::([^{}]*))?\}")


class SweepError(UserError):
    """A bad sweep file or point; the message is one line."""


@dataclass
class Point:
    """One run of the sweep: its axis values, overrides and resolved, validated config."""
    index: int
    name: str
    axes: dict[str, Any]
    cfg: JobConfig
    params: int
    flops_per_token: float
    tokens: int
    flops: float
    budget_params: int = 0

    @property
    def config_toml(self) -> str:
        return to_toml(self.cfg)


@dataclass
class Sweep:
    path: Path
    base: Path
    text: str
    axes: list[str]
    points: list[Point] = field(default_factory=list)
    slurm: dict[str, Any] = field(default_factory=dict)


def _flatten(table: dict[str, Any], where: str, prefix: str = "") -> dict[str, Any]:
    """``{"model": {"dim": 1}}`` and ``{"model.dim": 1}`` both give ``{"model.dim": 1}``."""
    out: dict[str, Any] = {}
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, where, key + "."))
        else:
            if key in out:
                raise SweepError(f"{where}: key '{key}' is given twice")
            out[key] = v
    return out


def _axis_values(key: str, values: Any, where: str) -> list[Any]:
    if not isinstance(values, list):
        raise SweepError(f"{where}: axis '{key}' must be a list of values, got {values!r}")
    if not values:
        raise SweepError(f"{where}: axis '{key}' is empty; give at least one value")
    return values


def _unset(value: Any) -> Any:
    """An axis value as set: ``{}`` (the sweep file's "leave unset") is None."""
    return None if value == {} else value


def _check_key(key: str, where: str) -> None:
    if key in (SEED, "training.seed"):
        raise SweepError(f"{where}: set seeds with the top-level 'seeds = [...]' list, not '{key}'")
    if key != BUDGET and "." not in key:
        raise SweepError(f"{where}: '{key}' is not a section.key of the train config (or '{BUDGET}')")


def _plugin_paths(value: Any, folder: Path, where: str) -> list[str]:
    """``job.plugins`` of a sweep file, ``.py`` paths made absolute (relative to the sweep file's folder)."""
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise SweepError(f"{where}: {PLUGINS} must be a list of module names or .py paths, got {value!r}")
    return absolute(value, folder)


def _format_value(v: Any, spec: str | None) -> str:
    if spec:
        return format(v, spec)
    if isinstance(v, float):
        return format(v, "g")
    return str(v)


def point_name(template: str, values: dict[str, Any], cfg: JobConfig, index: int, where: str) -> str:
    """Fills ``{key}``/``{key:format}`` from the point's axes, ``index`` or any resolved ``section.key``."""
    def fill(m: re.Match) -> str:
        key, spec = m.group(1).strip(), m.group(2)
        if key in values:
            v = values[key]
        elif key == "index":
            v = index
        elif "." in key and hasattr(cfg, key.split(".", 1)[0]) and hasattr(getattr(cfg, key.split(".", 1)[0]),
                                                                            key.split(".", 1)[1]):
            v = getattr(getattr(cfg, key.split(".", 1)[0]), key.split(".", 1)[1])
        else:
            raise SweepError(f"{where}: name template placeholder '{{{key}}}' is not an axis, 'index' or a "
                             f"section.key of the config")
        try:
            return _format_value(v, spec)
        except (ValueError, TypeError):
            raise SweepError(f"{where}: name template '{{{m.group(0)[1:-1]}}}' cannot format {v!r}") from None
    name = PLACEHOLDER_RE.sub(fill, template)
    if not NAME_RE.match(name):
        raise SweepError(f"{where}: point name {name!r} from template {template!r} is not a valid folder name "
                         f"(letters, digits and . _ + = - only)")
    return name


def _default_template(axes: list[str]) -> str:
    parts = [f"{a.split('.')[-1]}{{{a}}}" for a in axes if a != SEED]
    if SEED in axes:
        parts.append(f"s{{{SEED}}}")
    return "_".join(parts) or "p{index}"


def _inherited(raw: dict[str, Any], path: Path, where: str, seen: tuple[Path, ...] = ()) -> tuple[Path | None,
                                                                                               dict[str, Any]]:
    """The base config (resolved) and flattened ``[fixed]`` that ``fixed_from`` hands down to ``raw`` (the file at
    ``path``): the named file's own, over what it inherits in turn; (None, {}) without ``fixed_from``."""
    source = raw.get("fixed_from")
    if source is None:
        return None, {}
    if not isinstance(source, str):
        raise SweepError(f"{where}: 'fixed_from' must be a string (a sweep file's path), got {source!r}")
    parent, chain = (path.parent / source).resolve(), (*seen, path.resolve())
    if not parent.is_file():
        raise SweepError(f"{where}: fixed_from {source!r} not found (looked at {parent}); name a sweep file "
                         f"relative to this one")
    if parent in chain:
        raise SweepError(f"{where}: fixed_from {source!r} leads back to a file already read ({parent}); break the "
                         f"cycle")
    try:
        up = load_toml(parent)
    except ConfigError as e:
        raise SweepError(str(e)) from None
    base, fixed = _inherited(up, parent, str(parent), chain)
    if isinstance(up.get("base"), str):
        base = (parent.parent / up["base"]).resolve()
    own = _flatten(up.get("fixed", {}), f"{parent} [fixed]")
    if PLUGINS in own:  # relative to the file that names them
        own[PLUGINS] = _plugin_paths(own[PLUGINS], parent.parent, f"{parent} [fixed]")
    return base, {**fixed, **own}


def load_sweep(path: str | Path) -> Sweep:
    """Reads, expands and validates a sweep file; raises :class:`SweepError`/``ConfigError`` with one line."""
    found = resolve_config(path)  # a file, else a packaged sweep file by name (sweeps/debug_scaling)
    if found is None:
        raise SweepError(f"sweep file not found: {path} (pass an existing TOML file or a packaged name, e.g. "
                         f"train_configs/sweeps/debug_scaling.toml)")
    path = found
    try:
        raw = load_toml(path)
    except ConfigError as e:
        raise SweepError(str(e)) from None
    where = str(path)
    unknown = sorted(set(raw) - set(TOP_KEYS))
    if unknown:
        raise SweepError(f"{where}: unknown key '{unknown[0]}'; valid: {', '.join(TOP_KEYS)}")
    inherited_base, inherited_fixed = _inherited(raw, path, where)
    if "base" in raw and not isinstance(raw["base"], str) or "base" not in raw and inherited_base is None:
        raise SweepError(f"{where}: 'base' (the train config path, relative to the sweep file) is required")
    base = (path.parent / raw["base"]).resolve() if "base" in raw else inherited_base
    base = base if base.is_file() else renamed_config(base) or base
    if not base.is_file():
        raise SweepError(f"{where}: base config {raw['base']!r} not found (looked at {base})")
    for key, kind in (("fixed", dict), ("grid", dict), ("slurm", dict), ("name", str), ("budget_params", str),
                      ("lr_choice", str), ("lr_from", str)):
        if key in raw and not isinstance(raw[key], kind):
            raise SweepError(f"{where}: '{key}' must be a {'table' if kind is dict else 'string'}, "
                             f"got {raw[key]!r}")
    own_fixed = _flatten(raw.get("fixed", {}), f"{where} [fixed]")
    fixed = {**inherited_fixed, **own_fixed}
    for key in fixed:
        _check_key(key, f"{where} [fixed]")
    if PLUGINS in fixed:  # imported before the points are read: their options and choices exist then
        fixed[PLUGINS] = _plugin_paths(fixed[PLUGINS], path.parent, f"{where} [fixed]")
        load_plugins(fixed[PLUGINS])
    grid = _flatten(raw.get("grid", {}), f"{where} [grid]")
    for key, values in grid.items():
        _check_key(key, f"{where} [grid]")
        _axis_values(key, values, f"{where} [grid]")
    zips = raw.get("zip", [])
    if isinstance(zips, dict):
        zips = [zips]
    if not isinstance(zips, list) or not all(isinstance(z, dict) for z in zips):
        raise SweepError(f"{where}: 'zip' must be a table or an array of tables ([[zip]])")
    zip_groups = []
    for n, group in enumerate(zips):
        w = f"{where} [zip #{n + 1}]"
        flat = _flatten(group, w)
        if not flat:
            raise SweepError(f"{w}: empty zip group; give at least one key")
        lengths = {k: len(_axis_values(k, v, w)) for k, v in flat.items()}
        for k in flat:
            _check_key(k, w)
        if len(set(lengths.values())) > 1:
            raise SweepError(f"{w}: zipped axes must have equal lengths, got "
                             + ", ".join(f"{k}={n}" for k, n in lengths.items()))
        zip_groups.append(flat)
    for key in list(grid) + [k for g in zip_groups for k in g]:  # an axis here overrides an inherited fixed value
        if key not in own_fixed:
            fixed.pop(key, None)
    seeds = raw.get("seeds")
    if seeds is not None:
        _axis_values(SEED, seeds, where)
        if not all(isinstance(s, int) and not isinstance(s, bool) for s in seeds):
            raise SweepError(f"{where}: 'seeds' must be a list of integers, got {seeds!r}")
    budget = raw.get(BUDGET)
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise SweepError(f"{where}: '{BUDGET}' must be a positive number, got {budget!r}")
    budget_params = raw.get("budget_params", "total")
    if budget_params not in ("total", "non_embedding"):
        raise SweepError(f"{where}: budget_params must be 'total' or 'non_embedding', got {budget_params!r}")
    slurm = raw.get("slurm", {})
    for k, v in slurm.items():
        if k not in SLURM_KEYS:
            raise SweepError(f"{where} [slurm]: unknown key '{k}'; valid: {', '.join(SLURM_KEYS)}")
        if not isinstance(v, SLURM_KEYS[k]) or isinstance(v, bool):
            raise SweepError(f"{where} [slurm]: '{k}' must be {SLURM_KEYS[k].__name__}, got {v!r}")

    # every axis key once, and never also fixed
    seen: dict[str, str] = {k: "[fixed]" for k in fixed}
    if budget is not None:
        seen[BUDGET] = "top-level tokens_per_param"
    for k in list(grid) + [k for g in zip_groups for k in g]:
        if k == PLUGINS:
            raise SweepError(f"{where}: {PLUGINS} is not an axis; set it in [fixed]")
        if k in seen:
            raise SweepError(f"{where}: '{k}' is set in {seen[k]} and again as an axis; give it once")
        seen[k] = "an axis"
    has_budget = BUDGET in seen
    if has_budget and "training.steps" in seen:
        raise SweepError(f"{where}: training.steps is set while '{BUDGET}' also sets it; drop one of them")

    # expand: grid (cartesian) x zip groups (each moves together) x seeds
    factors: list[list[dict[str, Any]]] = [[{k: _unset(v)} for v in vals] for k, vals in grid.items()]
    for g in zip_groups:
        n = len(next(iter(g.values())))
        factors.append([{k: _unset(g[k][i]) for k in g} for i in range(n)])
    if seeds is not None:
        factors.append([{SEED: s} for s in seeds])
    axes = list(grid) + [k for g in zip_groups for k in g] + ([SEED] if seeds is not None else [])
    template = raw.get("name") or _default_template(axes)

    base_cfg_args = ["--config", str(base)]
    sweep = Sweep(path=path.resolve(), base=base, text=path.read_text(), axes=axes, slurm=dict(slurm))
    names: dict[str, int] = {}
    sizes: dict[str, tuple[int, int, float]] = {}
    for index, combo in enumerate(itertools.product(*factors) if factors else [()]):
        values: dict[str, Any] = {}
        for part in combo:
            values.update(part)
        label = ", ".join(f"{k}={v!r}" for k, v in values.items()) or "the only point"
        w = f"{where}: point {index} ({label})"
        try:
            cfg = parse_args(base_cfg_args)
            overrides = {**fixed, **{k: v for k, v in values.items() if k not in (SEED, BUDGET)}}
            overrides.pop(BUDGET, None)
            if SEED in values:
                overrides["training.seed"] = values[SEED]
            set_values(cfg, overrides)
            validate(cfg)
        except ConfigError as e:
            unset = [k for k, v in values.items() if v is None]
            hint = (f" (an axis value {{}} leaves a key unset; only keys whose default is unset, [model]'s, take it: "
                    f"{', '.join(unset)})" if unset and "got None" in str(e) else "")
            raise SweepError(f"{w}: {e}{hint}") from None
        name = point_name(template, values, cfg, index, w)
        if name in names:
            raise SweepError(f"{where}: duplicate point name {name!r} (points {names[name]} and {index}); put the "
                             f"varying axes into the 'name' template")
        names[name] = index
        try:
            params, non_emb, fpt = model_size(cfg, sizes)
        except ConfigError as e:
            raise SweepError(f"{w} '{name}': {e}") from None
        tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
        k = values.get(BUDGET, fixed.get(BUDGET, budget))
        counted = params if budget_params == "total" else non_emb
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, (int, float)) or k <= 0:
                raise SweepError(f"{w}: '{BUDGET}' must be a positive number, got {k!r}")
            steps = max(1, round(k * counted / tokens_per_step))
            try:
                set_values(cfg, {"training.steps": steps})
            except ConfigError as e:
                raise SweepError(f"{w}: {e}") from None
        cfg.job.name = name
        tokens = cfg.training.steps * tokens_per_step
        sweep.points.append(Point(index=index, name=name, axes=values, cfg=cfg, params=params,
                                  flops_per_token=fpt, tokens=tokens, flops=fpt * tokens, budget_params=counted))
    return sweep


def model_size(cfg: JobConfig, cache: dict | None = None) -> tuple[int, int, float]:
    """(parameters, non-embedding parameters, training FLOPs per token) of the config's model, from the meta
    model and the trainer's own ``flops_per_token`` (so the numbers match its MFU)."""
    from outlier_titan.models.registry import build_meta_model, count_params, flops_per_token

    key = (to_toml(cfg).split("[optimizer]")[0], cfg.data.tokenizer, cfg.training.seq_len)
    if cache is not None and key in cache:
        return cache[key]
    vocab = _vocab_size(cfg.data.tokenizer)
    _, _, model = build_meta_model(cfg.model, vocab, cfg.training.seq_len)
    out = (count_params(model), count_params(model, exclude_embeddings=True),
           flops_per_token(model, cfg.training.seq_len))
    if cache is not None:
        cache[key] = out
    return out


_VOCAB: dict[str, int] = {}


def _vocab_size(tokenizer: str) -> int:
    from outlier_titan.data.tokenizer import planning_vocab

    if tokenizer not in _VOCAB:
        _VOCAB[tokenizer] = planning_vocab(tokenizer)[0]  # a named tiktoken encoding plans offline too
    return _VOCAB[tokenizer]
