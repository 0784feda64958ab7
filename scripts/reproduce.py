#!/usr/bin/env python
"""``python scripts/reproduce.py ARGS``: the same as ``python -m outlier_titan.tools.reproduce ARGS`` (see that module)."""

import sys

from outlier_titan.tools.reproduce import main

if __name__ == "__main__":
    sys.exit(main())
