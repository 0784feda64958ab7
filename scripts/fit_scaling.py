#!/usr/bin/env python
"""``python scripts/fit_scaling.py ARGS``: the same as ``python -m outlier_titan.tools.fit_scaling ARGS`` (see that module)."""

import sys

from outlier_titan.tools.fit_scaling import main

if __name__ == "__main__":
    sys.exit(main())
