"""Which code produced a result: the git commit of the package's checkout (with ``+dirty`` when tracked files
differ from it), or the package version when it is not a git checkout (an installed wheel).

Sweeps record it per point and attempt (``sweep_state.json``), reports state it, so a number can be traced to the
code that made it even when the sweep ran from another clone or worktree.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
UNCOMMITTED = "+dirty"  # what code_version appends when tracked files differ from the commit


def uncommitted(code: str | None) -> bool:
    """Whether a recorded code version (:func:`code_version`'s) was uncommitted code."""
    return str(code or "").endswith(UNCOMMITTED)


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=PACKAGE_ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit() -> str | None:
    """The full commit hash of the package's checkout, or None outside a git checkout."""
    if not (PACKAGE_ROOT / ".git").exists():  # a file in a worktree, a folder in a clone
        return None
    return _git("rev-parse", "HEAD") or None


def code_version() -> str:
    """``<12-hex commit>`` or ``<commit>+dirty`` (tracked files changed; untracked ones are ignored, and so are the
    committed reports under ``reports/``: results the tools write, not code, so re-rendering one report does not
    mark the next as made by uncommitted code), else ``outlier_titan <version>``. Not cached: a checkout may change
    under a long sweep, and each attempt records what its trainer ran."""
    commit = git_commit()
    if commit is None:
        from outlier_titan import __version__

        return f"outlier_titan {__version__}"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)reports")
    return commit[:12] + (UNCOMMITTED if dirty else "")


def runtime_versions() -> dict[str, str]:
    """The interpreter's and torch's versions (the embedded corpus *is* the interpreter's standard library, so
    the Python version names the training data too)."""
    import platform

    import torch

    return {"python": platform.python_version(), "torch": torch.__version__}
