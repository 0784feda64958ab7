"""Weights & Biases beside TensorBoard (``metrics.wandb = true``; the ``wandb`` extra), written by rank 0.

The run logs the same scalars as TensorBoard, the probe's pictures as images and the resolved config. Each row
carries the training step as ``step``, W&B's x axis for every metric (its own ``_step`` only counts rows), so a
resumed run may re-log the steps after its checkpoint. The W&B run id is kept in ``<run>/wandb_run_id``; a
resumed training run continues that W&B run. W&B's files go to ``<run>/wandb/`` (with ``WANDB_MODE=offline``:
``wandb sync <run>/wandb/offline-run-*`` uploads them later).

A missing package, no login in online mode or a failing ``wandb.init`` is one warning line; training goes on
without W&B (TensorBoard and ``metrics.jsonl`` as usual).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

RUN_ID_FILE = "wandb_run_id"


class WandbLogger:
    """An open W&B run that takes the trainer's logged steps."""

    def __init__(self, run):
        self.run = run
        run.define_metric("*", step_metric="step")

    def log(self, step: int, scalars: dict[str, float], images: dict[str, np.ndarray]) -> None:
        import wandb

        row = {k: v for k, v in scalars.items() if v is not None and math.isfinite(v)}
        row.update({k: wandb.Image(img) for k, img in images.items()})
        self.run.log({**row, "step": step})

    def close(self, exit_code: int = 0) -> None:
        self.run.finish(exit_code=exit_code)


def start_wandb(run_dir: Path, metrics, run_name: str, config: dict, resuming: bool) -> WandbLogger | None:
    """Opens the W&B run of ``run_dir`` (continues the saved one when ``resuming``), or warns in one line and
    returns None. ``metrics`` is the ``[metrics]`` config section; ``config`` the resolved config."""
    try:
        import wandb
    except ImportError:
        return _warn("the wandb package is not installed (pip install 'outlier_titan[wandb]')")
    if wandb.setup().settings.mode == "online" and not wandb.login(prompt=False, verify=False):
        return _warn("not logged in to W&B (run 'wandb login', or set WANDB_MODE=offline to sync later)")
    id_file = run_dir / RUN_ID_FILE
    run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
    try:
        run = wandb.init(project=metrics.wandb_project, entity=metrics.wandb_entity or None,
                         name=metrics.wandb_run_name or run_name, group=metrics.wandb_group or None,
                         id=run_id, resume="allow", dir=str(run_dir), config=config)
    except Exception as e:  # wandb raises its own errors (network, permissions, bad entity)
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return _warn(f"wandb.init failed: {first}")
    id_file.write_text(run.id + "\n")
    return WandbLogger(run)


def _warn(reason: str) -> None:
    print(f"warning: metrics.wandb = true but {reason}; training goes on without W&B", file=sys.stderr, flush=True)
