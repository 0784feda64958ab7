"""How far a run got: ``python -m outlier_titan.progress --config FILE [--section.key value ...]`` prints
``<steps done> <steps total>`` for the run those arguments name (the same arguments as ``train.py``).

Steps done: the newest complete checkpoint's step (what a restart resumes from), or with checkpointing off the
last step in ``metrics.jsonl``. ``scripts/multinode.slurm`` reads it with the exit code to decide between
COMPLETED, requeue and FAILED, so a job never ends COMPLETED with an unfinished run.
"""

from __future__ import annotations

import sys
from pathlib import Path


def progress(argv: list[str]) -> tuple[int, int]:
    import outlier_titan.components  # noqa: F401
    from outlier_titan.checkpoint.manager import list_checkpoints
    from outlier_titan.config.manager import parse_args
    from outlier_titan.observe.logger import read_metrics

    cfg = parse_args(argv)
    run_dir = Path(cfg.job.dump_folder) / cfg.job.name
    if cfg.checkpoint.enable:
        steps = list_checkpoints(run_dir / "checkpoints")
        done = steps[-1] if steps else 0
    else:
        metrics = run_dir / "metrics.jsonl"
        done = max(read_metrics(metrics), default=0) if metrics.is_file() else 0
    return done, cfg.training.steps


def main(argv: list[str] | None = None) -> int:
    from outlier_titan.cli import report_user_errors

    def run() -> int:
        done, total = progress(list(sys.argv[1:] if argv is None else argv))
        print(done, total)
        return 0

    return report_user_errors(run)


if __name__ == "__main__":
    sys.exit(main())
