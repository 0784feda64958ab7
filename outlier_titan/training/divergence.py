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

import torch
import torch.distributed as dist

from outlier_titan.errors import DivergedError
from outlier_titan.parallel.grads import param_norm
from outlier_titan.training.step import loss_context, replicated_value

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


class DivergenceGuard:
    """The trainer's divergence checks (mixed into ``outlier_titan.trainer.Trainer``): unhealthy steps counted and
    stopped after ``training.max_skipped_steps``, and no checkpoint of ruined weights."""

    def _step_problem(self, step: int, loss: float, norm: torch.Tensor) -> str | None:
        """Why this step is unhealthy (a non-finite gradient norm: its update was skipped; a diverged loss), or
        None; counts consecutive unhealthy steps. Every rank gets the same answer (loss and norm are reduced)."""
        problem = None if torch.isfinite(norm) else "non-finite gradient norm"
        problem = problem or self.health.loss_problem(loss)
        if problem is None:
            self.health.add_loss(loss)
            self.state.unhealthy_steps = 0
            return None
        if not self.state.unhealthy_steps:
            self.state.unhealthy_since = step
        self.state.unhealthy_steps += 1
        return problem

    @torch.no_grad()
    def _weights_problem(self, norm_before: float | None) -> str | None:
        """Divergence guard, before every save: why the weights this step's update produced are ruined, or None.
        The next step's first micro-batch, read ahead, gives the updated weights' loss as that step will see it
        (checked against the recent losses), and their parameter norm must be finite and not a multiple of
        ``norm_before`` (when known), so no checkpoint ever holds weights whose loss exploded while the gradients
        were still finite. Gradients, data position and RNG are left as a run without the check has them."""
        inputs, labels = (t.to(self.device) for t in self.train_loader.dataset.peek())
        rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state() if self.device.type == "cuda" else None
        logits = self.model(inputs)
        with loss_context(logits):
            total = torch.stack([replicated_value(self.loss_sum(logits, labels)).float(),
                                 torch.tensor(float(labels.numel()), device=self.device)])
        dist.all_reduce(total, group=self.dims.dp_mesh.get_group())
        torch.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state(cuda_rng)
        return self.health.weights_problem(float(total[0] / total[1]), float(param_norm(self.model.parameters())),
                                           norm_before)

    def _check_divergence(self, step: int, problem: str, last: bool) -> None:
        """Stops the run after ``training.max_skipped_steps`` consecutive unhealthy steps, or at an unhealthy
        last step (a run never reports ruined weights as finished)."""
        n, limit = self.state.unhealthy_steps, self.cfg.training.max_skipped_steps
        if limit and (n >= limit or last):
            first = self.state.unhealthy_since
            steps = f"steps {first}-{step} were all" if first < step else f"step {step} was"
            raise self._diverged(f"{steps} unhealthy (step {step}: {problem}; training.max_skipped_steps = {limit})")

    def _diverged(self, what: str) -> DivergedError:
        """The one line of a divergence: what happened and the newest checkpoint of this run's own path (the
        one it resumed from or saved since; never a newer folder of another try) to resume from."""
        folder = self.checkpointer.folder
        own = [s for s in ([self.resumed_step] if self.resumed_step is not None else []) + self.saved_steps
               if (folder / f"step-{s}" / ".metadata").is_file()]
        lr = f"a lower optimizer.lr (now {self.cfg.optimizer.lr:g})"
        advice = (f"this run's newest checkpoint step-{own[-1]} precedes the divergence (no checkpoint of diverged "
                  f"weights is saved): resume from it (--checkpoint.load_step {own[-1]}) with {lr}" if own else
                  f"no checkpoint of this run precedes it: start afresh (another job.name, or "
                  f"--checkpoint.load_step 0) with {lr}")
        return DivergedError(f"training diverged: {what}; {advice}, or check the data")
