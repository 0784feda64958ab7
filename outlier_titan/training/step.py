"""The step's pieces the trainer and the tests share: the checkpointed step state, the (loss-parallel) cross entropy,
and the per-rank batch and probe layouts."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from outlier_titan.config.job_config import JobConfig
from outlier_titan.errors import ConfigError


class TrainState:
    """Step counter, skipped-step counts and RNG, checkpointed with the run."""

    def __init__(self):
        self.step = 0
        self.skipped_steps = 0
        self.unhealthy_steps = 0  # consecutive skipped or diverged steps; not checkpointed: none is saved after one
        self.unhealthy_since = 0  # the first of them

    def state_dict(self):
        return {"step": self.step, "skipped_steps": self.skipped_steps, "rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        torch.set_rng_state(state["rng"])


def loss_context(logits: torch.Tensor):
    """``loss_parallel`` when the logits are vocab-sharded over TP (the cross entropy then reduces across the
    TP ranks instead of gathering [B, T, V]); a no-op otherwise."""
    if isinstance(logits, DTensor):
        return loss_parallel()
    return nullcontext()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over tokens, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a scalar that may be a (replicated) DTensor from the parallel loss."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch_layout(cfg: JobConfig, dp: int) -> tuple[int, int, int]:
    """(local batch, micro batch, accumulation steps) per DP rank, validated."""
    t = cfg.training
    if t.global_batch_size % dp:
        raise ConfigError(f"training.global_batch_size = {t.global_batch_size} is not divisible by the "
                          f"data-parallel degree {dp}")
    local = t.global_batch_size // dp
    micro = t.micro_batch_size or local
    if local % micro:
        raise ConfigError(f"training.micro_batch_size = {micro} does not divide the per-rank batch {local} "
                          f"(global_batch_size {t.global_batch_size} / dp {dp})")
    return local, micro, local // micro


def probe_layout(cfg: JobConfig, dp: int) -> int:
    """Probe sequences per DP rank: ``observe.batch_size`` is global, so every layout reads the same rows."""
    b = cfg.observe.batch_size
    if cfg.observe.every and (b < 1 or b % dp):
        raise ConfigError(f"observe.batch_size = {b} (the global probe batch) is not a positive multiple of the "
                          f"data-parallel degree {dp}; set it to a multiple of {dp}")
    return b // dp
