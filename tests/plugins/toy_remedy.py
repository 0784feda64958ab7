"""A training remedy in one file: ``toy_hidden_l2`` adds ``weight x`` the mean square of the final norm's output
(the head's input) over the step's tokens to the loss, and logs it. Load it with ``job.plugins`` and turn it on
with ``--remedies.toy_hidden_l2 0.1``."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from outlier_titan.errors import ConfigError
from outlier_titan.options import opt
from outlier_titan.remedies import RemedyHooks, register_remedy


@dataclasses.dataclass
class ToyOptions:
    toy_hidden_l2: float = opt(0.0, "toy_hidden_l2: weight of the mean square of the head's input added to the "
                                    "loss (0 = off; a toy plug-in).")


class HiddenL2(RemedyHooks):
    def __init__(self, model, cfg, ctx):
        self.weight, self.ctx = cfg.remedies.toy_hidden_l2, ctx
        self.captured = None
        self.step_total = self.last = None
        self.handle = model.norm.register_forward_hook(self._keep)

    def _keep(self, module, inputs, output):
        if torch.is_grad_enabled():  # training forwards only (not validation or the probe)
            self.captured = output

    def loss_term(self):
        x, self.captured = self.captured, None
        # this rank's share: its tokens' sum over the step's tokens on all ranks (DP ranks add up to the mean)
        term = self.weight * x.float().square().sum() / (self.ctx.tokens_per_step * x.shape[-1])
        self.step_total = term.detach() if self.step_total is None else self.step_total + term.detach()
        return term

    def after_step(self):
        self.last, self.step_total = self.step_total, None

    def scalars(self):
        if self.last is None:  # no step applied yet
            return {}
        total = self.last.clone()
        if self.ctx.dp_group is not None:
            dist.all_reduce(total, group=self.ctx.dp_group)
        return {"remedies/toy_hidden_l2": float(total)}

    def close(self):
        self.handle.remove()


def _validate(cfg):
    if cfg.toy_hidden_l2 < 0:
        raise ConfigError(f"remedies.toy_hidden_l2 must be >= 0, got {cfg.toy_hidden_l2}")


def _check(model, cfg):
    if cfg.parallelism.tp > 1:  # the head's input is sequence-sharded there: this toy does not gather it
        raise ConfigError("remedies.toy_hidden_l2 needs parallelism.tp = 1")


register_remedy("toy_hidden_l2", "mean square of the head's input (toy plug-in)", lambda cfg: cfg.toy_hidden_l2 > 0,
                HiddenL2, options=ToyOptions, validate=_validate, check=_check)
