"""Learning-rate schedules: linear warm-up, then cosine / linear / constant / warmup-stable-decay, with a floor."""

from __future__ import annotations

import math

import torch

from outlier_titan.config.job_config import LRScheduler


def lr_factor(step: int, cfg: LRScheduler, total_steps: int) -> float:
    """Multiplier of the peak lr for the update of optimizer step ``step`` (1-based)."""
    warmup = cfg.warmup_steps
    if warmup > 0 and step <= warmup:
        return step / warmup
    floor = cfg.min_lr_ratio
    if cfg.decay == "constant":
        return 1.0
    if cfg.decay == "wsd":
        decay_steps = max(1, round(cfg.decay_ratio * total_steps))
        decay_start = total_steps - decay_steps
        if step <= decay_start:
            return 1.0
        progress = min(1.0, (step - decay_start) / decay_steps)
        return floor + (1.0 - floor) * (1.0 - progress)
    span = max(1, total_steps - warmup)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    if cfg.decay == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: LRScheduler, training_steps: int):
    """A LambdaLR whose state (last_epoch) is layout independent, so it reshards trivially."""
    total = cfg.total_steps or training_steps
    # LambdaLR calls the lambda with 0 at construction and with k after the k-th scheduler.step();
    # the update of optimizer step s (1-based) uses lr_lambda(s - 1), so shift by one.
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda k: lr_factor(k + 1, cfg, total))
