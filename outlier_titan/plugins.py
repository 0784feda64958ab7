"""Plug-ins: code outside the package that registers components (an optimizer, an attention variant, a metric, a
PTQ scheme, a model spec) at import time. ``job.plugins`` names them, as module names or ``.py`` paths; every
entry point imports them on every rank before the rest of the config is read, so their options exist there."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import zlib
from pathlib import Path

from outlier_titan.errors import UserError

_LOADED: dict[str, object] = {}


def load_plugin(spec: str):
    """Imports a plug-in once: ``spec`` is a module name (``my_pkg.my_variant``) or a path to a ``.py`` file."""
    spec = spec.strip()
    if spec.endswith(".py"):  # one file is one plug-in, however its path is written
        spec = str(Path(spec).expanduser().resolve())
    if spec in _LOADED:
        return _LOADED[spec]
    if spec.endswith(".py"):
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"job.plugins: {spec} is not a file; give a path to a .py file or a module name")
        name = f"outlier_titan_plugin_{path.stem}_{zlib.crc32(str(path).encode()):08x}"
        module_spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module
        try:
            module_spec.loader.exec_module(module)
        except Exception:
            del sys.modules[name]
            raise
    else:
        try:
            module = importlib.import_module(spec)
        except ModuleNotFoundError as e:
            raise UserError(f"job.plugins: cannot import {spec!r} ({e}); give an importable module name or a "
                            f"path to a .py file") from None
    _LOADED[spec] = module
    return module


def absolute(entries, folder: Path) -> list[str]:
    """``job.plugins`` entries with ``.py`` paths made absolute (relative to ``folder``); module names as they are."""
    return [str((Path(folder) / e).resolve()) if e.endswith(".py") else e for e in entries]


def load_plugins(specs) -> list:
    """Imports each of ``specs`` (a list, or one comma-separated string)."""
    if isinstance(specs, str):
        specs = [s for s in specs.split(",") if s.strip()]
    return [load_plugin(s) for s in specs or ()]


PLUGINS_HELP = ("your components (modules or .py files, comma list) to import first: registered metrics, PTQ "
                "schemes, attention variants, ... (a run's own job.plugins are imported from its config)")


def take_plugins(argv: list[str] | None) -> list[str]:
    """A tool's command line without its ``--plugins A,B`` (imported here, before the tool's parser reads the
    registries for its choices and help)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    rest, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--plugins" and i + 1 < len(argv):
            load_plugins(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--plugins="):
            load_plugins(arg.partition("=")[2])
        else:
            rest.append(arg)
        i += 1
    return rest
