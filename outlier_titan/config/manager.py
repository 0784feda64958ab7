"""TOML + ``--section.key value`` loading, type conversion, validation and ``--help``.

Precedence: CLI > TOML file > dataclass defaults. Every error is a :class:`ConfigError` whose message is
one line naming the key and what is allowed; ``train.py`` prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import types
import typing
from pathlib import Path
from typing import Any

from outlier_titan.config.job_config import JobConfig
from outlier_titan.errors import ConfigError
from outlier_titan.lowprec.recipes import PRECISIONS
from outlier_titan.options import NO_DECAY_CLASSES, owned_by
from outlier_titan.packaged import resolve_config
from outlier_titan.plugins import absolute, load_plugins

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _sections(cfg: JobConfig) -> dict[str, Any]:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def _field_map(section: Any) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section)}


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid: {', '.join(sorted(options))}"


def _suggest_key(cfg: JobConfig, sec_name: str, key: str) -> str:
    """A hint naming full keys (``training.steps``): a close key of the same section, else the same or a close
    key in another section, else the section's keys."""
    sections = _sections(cfg)
    own = list(_field_map(sections[sec_name]))
    close = difflib.get_close_matches(key, own, n=1, cutoff=0.6)
    if close:
        return f"; did you mean '{sec_name}.{close[0]}'?"
    others: dict[str, str] = {}  # key -> its first section's full key
    for s, section in sections.items():
        for k in _field_map(section):
            if s != sec_name:
                others.setdefault(k, f"{s}.{k}")
    close = difflib.get_close_matches(key, list(others), n=1, cutoff=0.75)
    if close:
        return f"; did you mean '{others[close[0]]}'?"
    return f"; valid: {', '.join(f'{sec_name}.{k}' for k in sorted(own))}"


def _hint_type(section: Any, key: str) -> tuple[type, bool]:
    """The base type of a field and whether it accepts None."""
    hint = typing.get_type_hints(type(section))[key]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        return non_none[0], len(non_none) != len(args)
    origin = typing.get_origin(hint)
    return (origin or hint), False


def _convert(value: Any, key: str, base: type, optional: bool, from_cli: bool) -> Any:
    """Converts a TOML value or CLI string to the field's type; raises ConfigError on mismatch."""
    if optional and (value is None or (from_cli and isinstance(value, str) and value.lower() in ("none", "null"))):
        return None
    want = base.__name__
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str) and value.lower() in ("true", "false", "1", "0", "yes", "no"):
            return value.lower() in ("true", "1", "yes")
    elif base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_cli and isinstance(value, str):
            try:
                return int(value)
            except ValueError:
                pass
    elif base is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if from_cli and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
    elif base is str:
        if isinstance(value, str):
            return value
    elif base is list:
        if isinstance(value, list):
            return [str(v) for v in value]
        if from_cli and isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
    raise ConfigError(f"{key}: expected {want}{' or none' if optional else ''}, got {value!r}")


def _set(cfg: JobConfig, dotted: str, value: Any, from_cli: bool) -> None:
    if "." not in dotted:
        raise ConfigError(f"'{dotted}': keys are written section.key (e.g. training.steps)")
    sec_name, key = dotted.split(".", 1)
    sections = _sections(cfg)
    if sec_name not in sections:
        close = difflib.get_close_matches(sec_name, list(sections), n=1, cutoff=0.5)
        if close and key in _field_map(sections[close[0]]):
            raise ConfigError(f"unknown section '{sec_name}'; did you mean '{close[0]}.{key}'?")
        raise ConfigError(f"unknown section '{sec_name}'{_suggest(sec_name, list(sections))}")
    section = sections[sec_name]
    fields = _field_map(section)
    if key not in fields:
        raise ConfigError(f"unknown key '{dotted}'{_suggest_key(cfg, sec_name, key)}")
    base, optional = _hint_type(section, key)
    converted = _convert(value, dotted, base, optional, from_cli)
    choices = fields[key].metadata.get("choices")
    if choices and converted is not None and converted not in choices:
        raise ConfigError(f"{dotted} = {converted!r} is not allowed; choose one of: {', '.join(choices)}")
    setattr(section, key, converted)


def set_values(cfg: JobConfig, values: dict[str, Any]) -> None:
    """Sets typed ``section.key`` values (TOML types) with the checks a config file gets; call
    :func:`validate` afterwards."""
    for dotted, value in values.items():
        _set(cfg, dotted, value, from_cli=False)


def load_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file, or the packaged config of that name (``debug``, ``train_configs/debug.toml``: see
    :mod:`outlier_titan.packaged`) where no such file exists."""
    p = resolve_config(path)
    if p is None:
        raise ConfigError(f"config file not found: {path} (pass an existing TOML file or a packaged config name, "
                          f"e.g. train_configs/debug.toml or debug)")
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML ({e})") from None


def parse_args(argv: list[str]) -> JobConfig:
    """Builds a validated JobConfig from ``--config FILE`` and ``--section.key value`` arguments, after importing
    the ``job.plugins`` they name (so the plug-ins' options and choices exist)."""
    config_file, overrides, wants_help = _split_argv(argv)
    tables = load_toml(config_file) if config_file is not None else {}
    for sec_name, table in tables.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{config_file}: top-level key '{sec_name}' must be a [section] table")
    plugins = _plugin_paths(tables.get("job", {}).get("plugins", []), config_file, overrides)
    load_plugins(plugins)
    if wants_help:
        print(help_text())
        raise SystemExit(0)
    cfg = JobConfig()
    for sec_name, table in tables.items():
        for key, value in table.items():
            _set(cfg, f"{sec_name}.{key}", value, from_cli=False)
    for name, val in overrides:
        _set(cfg, name, val, from_cli=True)
    cfg.job.plugins = plugins
    validate(cfg)
    return cfg


def _split_argv(argv: list[str]) -> tuple[str | None, list[tuple[str, str]], bool]:
    """(``--config`` file, ``(section.key, value)`` overrides in order, whether help was asked)."""
    config_file, overrides, wants_help = None, [], False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in ("-h", "--help"):
            wants_help = True
            i += 1
            continue
        if not arg.startswith("--"):
            raise ConfigError(f"unexpected argument '{arg}' (options are --config FILE and --section.key value)")
        name, eq, val = arg[2:].partition("=")
        if not eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                val = argv[i + 1]
                i += 1
            elif name == "job.dry_run" or name == "dry_run":
                val = "true"
            else:
                raise ConfigError(f"--{name} needs a value")
        if name == "config":
            config_file = val
        elif name == "dry_run":
            overrides.append(("job.dry_run", val))
        else:
            overrides.append((name, val))
        i += 1
    return config_file, overrides, wants_help


def _plugin_paths(from_toml: Any, config_file: str | None, overrides: list[tuple[str, str]]) -> list[str]:
    """``job.plugins`` (the command line's, else the TOML file's) with ``.py`` paths made absolute: a TOML file's
    relative to its folder, the command line's relative to the working directory, so a resume from elsewhere
    imports the same files."""
    cli = [v for k, v in overrides if k == "job.plugins"]
    if cli:
        entries, folder = _convert(cli[-1], "job.plugins", list, False, from_cli=True), Path.cwd()
    else:
        entries = _convert(from_toml, "job.plugins", list, False, from_cli=False)
        folder = resolve_config(config_file).parent if config_file is not None else Path.cwd()
    return absolute(entries, folder)


def check_lowprec_recipe(name: str) -> None:
    """``observe.lowprec_recipe``: empty (the run's own) or a precision; one-line ConfigError otherwise (also for an
    ``Observe`` built without the config reader, as the probe checks it)."""
    if name and name not in PRECISIONS:
        raise ConfigError(f"observe.lowprec_recipe = {name!r} is not a recipe; choose one of: {', '.join(PRECISIONS)} "
                          "(or leave it empty for the run's own)")


def validate(cfg: JobConfig) -> None:
    """Checks values and combinations that the types alone do not catch."""
    t, p = cfg.training, cfg.parallelism

    def positive(key: str, v: float, allow_zero: bool = False) -> None:
        if v < 0 or (v == 0 and not allow_zero) or (isinstance(v, float) and not math.isfinite(v)):
            raise ConfigError(f"{key} must be {'>= 0' if allow_zero else '> 0'}, got {v}")

    for sec_name, section in _sections(cfg).items():
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if isinstance(v, float):
                _representable(f"{sec_name}.{f.name}", v)
    positive("training.steps", t.steps)
    positive("training.global_batch_size", t.global_batch_size)
    positive("training.seq_len", t.seq_len)
    positive("training.max_norm", t.max_norm, allow_zero=True)
    positive("optimizer.lr", cfg.optimizer.lr)
    positive("optimizer.eps", cfg.optimizer.eps)
    positive("optimizer.weight_decay", cfg.optimizer.weight_decay, allow_zero=True)
    positive("metrics.log_every", cfg.metrics.log_every)
    positive("checkpoint.interval", cfg.checkpoint.interval)
    positive("training.max_skipped_steps", t.max_skipped_steps, allow_zero=True)
    positive("checkpoint.keep_latest_k", cfg.checkpoint.keep_latest_k, allow_zero=True)
    positive("lr_scheduler.warmup_steps", cfg.lr_scheduler.warmup_steps, allow_zero=True)
    positive("eval.every", cfg.eval.every, allow_zero=True)
    positive("observe.every", cfg.observe.every, allow_zero=True)
    check_lowprec_recipe(cfg.observe.lowprec_recipe)
    for name in ("beta1", "beta2"):
        b = getattr(cfg.optimizer, name)
        if not 0 <= b < 1:
            raise ConfigError(f"optimizer.{name} must be in [0, 1), got {b}")
    if not 0 <= cfg.lr_scheduler.min_lr_ratio <= 1:
        raise ConfigError(f"lr_scheduler.min_lr_ratio must be in [0, 1], got {cfg.lr_scheduler.min_lr_ratio}")
    if not 0 < cfg.lr_scheduler.decay_ratio <= 1:
        raise ConfigError(f"lr_scheduler.decay_ratio must be in (0, 1], got {cfg.lr_scheduler.decay_ratio}")
    if not 0 < cfg.data.val_fraction < 1:
        raise ConfigError(f"data.val_fraction must be in (0, 1), got {cfg.data.val_fraction}")
    for name in ("dp_replicate", "tp"):
        positive(f"parallelism.{name}", getattr(p, name))
    if p.dp_shard == 0 or p.dp_shard < -1:
        raise ConfigError(f"parallelism.dp_shard must be -1 (fill) or >= 1, got {p.dp_shard}")
    if t.micro_batch_size is not None:
        positive("training.micro_batch_size", t.micro_batch_size)
    bad = set(cfg.optimizer.no_decay) - set(NO_DECAY_CLASSES)
    if bad:
        raise ConfigError(f"optimizer.no_decay: unknown class {sorted(bad)}; allowed: {', '.join(NO_DECAY_CLASSES)}")


_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.401298464324817e-45  # smallest positive (subnormal) float32


def _representable(key: str, v: float) -> None:
    """Float settings reach fp32 tensors: they must be finite and neither overflow nor flush to zero there."""
    if not math.isfinite(v):
        raise ConfigError(f"{key} must be a finite number, got {v}")
    if abs(v) > _FLOAT32_MAX or (v != 0 and abs(v) < _FLOAT32_TINY):
        raise ConfigError(f"{key} = {v:g} is not representable in float32 (magnitude between {_FLOAT32_TINY:.1e} "
                          f"and {_FLOAT32_MAX:.1e}); use a realistic value")


def help_text() -> str:
    lines = ["usage: train.py --config FILE.toml [--section.key value ...] [--dry_run]", "",
             "--config also takes a packaged config by name: debug, suites/kaul2024/smoke (outlier_titan.packaged).",
             "Every key below can be set in the TOML file ([section] key = value) or on the command line."]
    for sec_name, section in _sections(JobConfig()).items():
        lines.append(f"\n[{sec_name}]")
        heading = None
        for f in sorted(dataclasses.fields(section), key=lambda f: owned_by(f) is not None):
            owner = owned_by(f)
            if owner is not None and owner != heading:
                heading = owner
                lines.append(f"  -- options of {owner[0]} {', '.join(repr(o) for o in owner[1].split(', '))}:")
            default = f.metadata["default"] if owner is not None else getattr(section, f.name)
            defaults = f.metadata.get("defaults", {})
            if len(set(map(repr, defaults.values()))) > 1:
                default = ", ".join(f"{o}: {d!r}" for o, d in defaults.items())
                default = f"({default})"
            else:
                default = repr(default)
            choices = f.metadata.get("choices")
            extra = f" {{{'|'.join(choices)}}}" if choices else ""
            if f.metadata.get("names"):
                extra += f" (named: {', '.join(f.metadata['names'])}; or a path)"
            lines.append(f"  --{sec_name}.{f.name:<24} default {default}{extra}")
            text = f.metadata.get("help", "")
            lines.append(f"      {text() if callable(text) else text}")
    return "\n".join(lines)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    return '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'


def to_toml(cfg: JobConfig) -> str:
    """Serialises the resolved config (None values are omitted: they mean 'spec default')."""
    out = []
    for sec_name, section in _sections(cfg).items():
        out.append(f"[{sec_name}]")
        for f in dataclasses.fields(section):
            v = getattr(section, f.name)
            if v is not None:
                out.append(f"{f.name} = {_toml_value(v)}")
        out.append("")
    return "\n".join(out)


def to_dict(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    return dataclasses.asdict(cfg)
