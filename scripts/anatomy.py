#!/usr/bin/env python
"""``python scripts/anatomy.py ARGS``: the same as ``python -m outlier_titan.tools.anatomy ARGS`` (see that module)."""

import sys

from outlier_titan.tools.anatomy import main

if __name__ == "__main__":
    sys.exit(main())
