"""``python -m outlier_titan.tools.gpu_check ARGS``: see :mod:`outlier_titan.tools.gpu_check`."""

import sys

from outlier_titan.tools.gpu_check.cli import main


if __name__ == "__main__":
    sys.exit(main())
