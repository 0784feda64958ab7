#!/usr/bin/env python
"""``python scripts/benchmark.py ARGS``: the same as ``python -m outlier_titan.tools.benchmark ARGS`` (see that module)."""

import sys

from outlier_titan.tools.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
