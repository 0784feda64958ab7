"""Entry point: ``python train.py --config FILE.toml [--section.key value ...]``, or the same under torchrun."""

import sys

from outlier_titan.trainer import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
