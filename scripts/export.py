#!/usr/bin/env python
"""``python scripts/export.py ARGS``: the same as ``python -m outlier_titan.tools.export ARGS`` (see that module)."""

import sys

from outlier_titan.tools.export import main

if __name__ == "__main__":
    sys.exit(main())
