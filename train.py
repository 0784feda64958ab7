"""Entry point: ``python train.py --config FILE.toml [--section.key value ...]``, or the same under torchrun."""

import os
import sys

if __name__ == "__main__":
    from outlier_titan import preempt

    preempt.install_early()  # before the seconds-long torch import: an early stop signal must not kill the rank
    from outlier_titan.trainer import main

    code = main(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    # The process groups are already destroyed; leave without running C++ static destructors, where gloo's
    # communication threads can still abort the interpreter's finalisation ("terminate called without an
    # active exception", pytorch/pytorch#179291) after a successful run.
    os._exit(code)
