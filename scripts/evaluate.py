#!/usr/bin/env python
"""``python scripts/evaluate.py ARGS``: the same as ``python -m outlier_titan.tools.evaluate ARGS`` (see that module)."""

import sys

from outlier_titan.tools.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
