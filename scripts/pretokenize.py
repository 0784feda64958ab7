#!/usr/bin/env python
"""``python scripts/pretokenize.py ARGS``: the same as ``python -m outlier_titan.tools.pretokenize ARGS`` (see that module)."""

import sys

from outlier_titan.tools.pretokenize import main

if __name__ == "__main__":
    sys.exit(main())
