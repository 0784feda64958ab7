"""Puts the checkout these scripts belong to first on ``sys.path``.

``python scripts/X.py`` puts ``scripts/`` on the path, not the checkout, so without this the package came from
wherever it was installed (an editable install of another clone): a sweep started from a ``git worktree`` of one
commit then ran the main checkout's code as it changed. With it, a clone's or worktree's scripts run that clone's
package (and the processes they start inherit it: ``packaged.child_environment``).
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / "outlier_titan" / "__init__.py").is_file() and (not sys.path or sys.path[0] != str(ROOT)):
    sys.path.insert(0, str(ROOT))
