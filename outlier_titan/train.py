"""Training entry point: ``python -m outlier_titan.train --config FILE.toml [--section.key value ...]``, the
console script ``outlier-titan-train``, or the same under torchrun (``torchrun ... -m outlier_titan.train ...``,
``python -m outlier_titan.launch ... -m outlier_titan.train ...``). ``--config`` also takes a packaged config by
name (``debug``, see :mod:`outlier_titan.packaged`). The repository's ``train.py`` calls :func:`main`.

Nothing here imports torch at module level: the preemption handlers go in before the seconds-long torch import.
"""

import os
import sys
from typing import NoReturn


def main() -> None:
    from outlier_titan import preempt

    preempt.install_early()  # before the seconds-long torch import: an early stop signal must not kill the rank
    from outlier_titan.trainer import main as train_main

    leave(train_main(sys.argv[1:]))  # the trainer has destroyed its process groups


def leave(code: int) -> NoReturn:
    """Exits with ``code`` after flushing stdout and stderr, without running C++ static destructors: once the process
    groups are destroyed, gloo's communication threads can still abort the interpreter's finalisation after a
    successful run ("terminate called without an active exception", exit -6; pytorch/pytorch#179291)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
