#!/usr/bin/env python
"""``python scripts/analyze.py ARGS``: the same as ``python -m outlier_titan.tools.analyze ARGS`` (see that module)."""

import sys

from outlier_titan.tools.analyze import main

if __name__ == "__main__":
    sys.exit(main())
