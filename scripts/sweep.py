#!/usr/bin/env python
"""``python scripts/sweep.py ARGS``: the same as ``python -m outlier_titan.tools.sweep ARGS`` (see that module)."""

import sys

from outlier_titan.tools.sweep import main

if __name__ == "__main__":
    sys.exit(main())
