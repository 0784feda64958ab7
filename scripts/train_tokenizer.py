#!/usr/bin/env python
"""``python scripts/train_tokenizer.py ARGS``: the same as ``python -m outlier_titan.tools.train_tokenizer ARGS`` (see that module)."""

import sys

from outlier_titan.tools.train_tokenizer import main

if __name__ == "__main__":
    sys.exit(main())
