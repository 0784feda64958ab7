"""What counts as diverged: a loss against its recent history and the size of the weights.

A finite gradient is not enough: a too-large update can leave weights whose loss is 10^5 while every gradient stays
finite for a few more steps. The trainer asks :class:`Health` about every step's loss (an unhealthy step counts
towards ``training.max_skipped_steps`` like a skipped one) and about the weights an update produced before it
saves them, so no checkpoint holds weights that a following forward shows to be ruined.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

# A loss is diverged above max(LOSS_FACTOR x the reference, the reference + LOSS_MARGIN nats): a doubled loss at
# 7 nats, a loss up 2 nats at 0.5 (a real loss spike at either stays below). The reference is the best level of
# the last WINDOW healthy steps: the lowest median of LEVEL consecutive losses (robust to an easy batch, and it
# does not climb with a slow blow-up whose rising losses pass one by one). Once the run predicts better than
# uniform guessing (ln vocab), a loss CHANCE_MARGIN nats above that is diverged too: such weights know nothing.
LOSS_FACTOR = 2.0
LOSS_MARGIN = 2.0
CHANCE_MARGIN = 1.0
WINDOW = 100
LEVEL = 3
# An update that multiplies the weights' global L2 norm by more than this in one step exploded (lr 50 on weights
# of size 0.02: x2500); an ordinary step changes it by a fraction of a percent.
PARAM_NORM_FACTOR = 2.0


class Health:
    """The recent healthy losses of one training session (not checkpointed: the history starts afresh at a
    resume, from the first step's loss)."""

    def __init__(self, vocab_size: int):
        self.losses: deque[float] = deque(maxlen=WINDOW)
        self.chance = math.log(vocab_size)  # the loss of a uniform prediction

    def reference(self) -> float | None:
        """The best recent loss level (None before any healthy step)."""
        if not self.losses:
            return None
        losses = list(self.losses)
        n = min(LEVEL, len(losses))
        return min(statistics.median(losses[i:i + n]) for i in range(len(losses) - n + 1))

    def loss_problem(self, loss: float) -> str | None:
        """Why ``loss`` is diverged, or None."""
        if not math.isfinite(loss):
            return f"loss {loss}"
        ref = self.reference()
        if ref is None:
            return None
        limit = max(LOSS_FACTOR * ref, ref + LOSS_MARGIN)
        if ref < self.chance:
            limit = min(limit, self.chance + CHANCE_MARGIN)
        if loss > limit:
            return f"loss {loss:.6g}, {ref:.4g} at best recently, uniform guessing {self.chance:.4g}"
        return None

    def add_loss(self, loss: float) -> None:
        """Records a healthy step's loss."""
        self.losses.append(loss)

    def weights_problem(self, loss: float, norm: float, norm_before: float | None) -> str | None:
        """Why the weights an update produced are ruined, or None: their loss (a forward after the update), their
        parameter norm and, when known, the norm before the update."""
        if (problem := self.loss_problem(loss)) is not None:
            return problem
        if not math.isfinite(norm):
            return f"parameter norm {norm}"
        if norm_before and norm > PARAM_NORM_FACTOR * norm_before:
            return f"the update took the parameter norm from {norm_before:.4g} to {norm:.4g}"
        return None
