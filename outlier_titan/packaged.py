"""Files shipped inside the package, found with ``importlib.resources`` (no path relative to a checkout).

* ``assets/tokenizer/stdlib_bpe.tiktoken``: the embedded byte-level BPE (``data.tokenizer = "embedded"``).
* ``configs/``: the train configs, sweep files and reproduction suites. In the repository this is a link to
  ``train_configs/`` (the one copy of each file); wheels and sdists carry the files themselves.

A config argument (``--config``, a sweep file) that is not an existing file is looked up among the packaged
configs by name: ``debug``, ``debug.toml``, ``suites/kaul2024/smoke`` or ``train_configs/debug.toml`` all name
``configs/debug.toml``, so the README's commands work from any directory after a non-editable install. The
papers' recipes' old numbered names (``seed000_*`` and so on, :data:`RENAMED_CONFIG_PREFIXES`) still resolve, with a
deprecation note.
"""

from __future__ import annotations

import os
import sys
from importlib.resources import files
from pathlib import Path, PurePosixPath

from outlier_titan.errors import UserError

CONFIG_PREFIX = "train_configs"  # the repository's folder that configs/ mirrors; dropped from packaged names
RENAMED_CONFIG_PREFIXES = {"seed000_": "kaul2024_", "seed001_": "franke2025_", "seed002_": "he2024_"}
"""The papers' recipe configs' old numbered names -> their names by paper (Kaul et al. 2024, Franke et al. 2025,
He et al. 2024)."""


def package_path(*parts: str) -> Path:
    """A file or folder inside the installed package, as a path on disk."""
    root = files("outlier_titan")
    if not isinstance(root, Path):  # a zip import: torch cannot run from one either
        raise UserError(f"outlier_titan is installed without files on disk ({root}); install it with pip from the "
                        "repository or a wheel")
    return root.joinpath(*parts)


def child_environment(environ: dict[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default ``os.environ``) with the folder this package was imported from first on PYTHONPATH:
    the processes a sweep, a reproduction or an evaluation starts (``python -m outlier_titan...``) then run this
    very code, whatever their working directory and whatever else is installed (a sweep started from a
    ``git worktree`` keeps running that commit's code)."""
    env = dict(os.environ if environ is None else environ)
    here = str(Path(__file__).resolve().parent.parent)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != here]
    env["PYTHONPATH"] = os.pathsep.join([here, *rest])
    return env


def embedded_bpe() -> Path:
    """The shipped BPE rank file of ``data.tokenizer = "embedded"``."""
    return package_path("assets", "tokenizer", "stdlib_bpe.tiktoken")


def configs_dir() -> Path:
    """The packaged configs folder (resolved: in a checkout, the repository's ``train_configs/``)."""
    return package_path("configs").resolve()


def packaged_config_names() -> list[str]:
    """Every packaged config by name (relative to the configs folder, without ``.toml``), sorted."""
    root = configs_dir()
    return sorted(p.relative_to(root).with_suffix("").as_posix() for p in root.rglob("*.toml"))


def packaged_config(name: str) -> Path | None:
    """The packaged config a name designates (see the module docstring), or None."""
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if parts and parts[0] == CONFIG_PREFIX:
        parts = parts[1:]
    if not parts or any(p in ("..", ".") for p in parts) or PurePosixPath(name).is_absolute():
        return None
    rel = PurePosixPath(*parts)
    if rel.suffix != ".toml":
        rel = rel.with_name(rel.name + ".toml")
    path = configs_dir() / rel
    return path if path.is_file() else renamed_config(path)


def renamed_config(path: Path) -> Path | None:
    """The file an old numbered config name now has (:data:`RENAMED_CONFIG_PREFIXES`), saying so on stderr, or
    None."""
    for old, new in RENAMED_CONFIG_PREFIXES.items():
        if path.name.startswith(old) and (renamed := path.with_name(new + path.name[len(old):])).is_file():
            print(f"note: config {path.name} is now {renamed.name}; the old name is deprecated", file=sys.stderr)
            return renamed
    return None


def resolve_config(arg: str | Path) -> Path | None:
    """An existing file as given, else the packaged config of that name, else None (an old numbered name
    resolves to its renamed file)."""
    path = Path(arg)
    if path.is_file():
        return path
    return renamed_config(path) or packaged_config(str(arg))
