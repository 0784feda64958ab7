"""A toy optimizer as a plug-in, one file outside the package: signSGD with momentum (Bernstein et al. 2018, arXiv
1802.04434) with an option of its own (``optimizer.signsgd_beta``), a validation, a layout key (``momentum``: the
buffer exists or not) and a config-owned param-group key (``beta``: a resume takes this run's value). Use it with
``--job.plugins tests/plugins/toy_optimizer.py --optimizer.name signsgd``."""

from __future__ import annotations

import dataclasses

import torch

from outlier_titan.errors import UserError
from outlier_titan.optim.registry import register_optimizer
from outlier_titan.options import opt


class SignSGD(torch.optim.Optimizer):
    """p <- p (1 - lr wd) - lr sign(m), m <- beta m + (1 - beta) g (no buffer when momentum is off)."""

    def __init__(self, params, lr: float, beta: float, momentum: bool):
        super().__init__(params, dict(lr=lr, beta=beta, momentum=momentum, weight_decay=0.0))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if group["momentum"]:
                    m = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    g = m.mul_(group["beta"]).add_(p.grad, alpha=1 - group["beta"])
                p.mul_(1 - group["lr"] * group["weight_decay"]).add_(g.sign(), alpha=-group["lr"])


@dataclasses.dataclass
class SignSGDOptions:
    signsgd_beta: float = opt(0.9, "signsgd: decay of the momentum buffer whose sign is the step.")


def _signsgd(groups, cfg, seed):
    return SignSGD(groups, lr=cfg.lr, beta=cfg.signsgd_beta, momentum=cfg.momentum)


def _check(cfg):
    if cfg.lr > 0.1:
        raise UserError(f"signsgd: optimizer.lr must be <= 0.1, got {cfg.lr}")


def register() -> None:
    register_optimizer("signsgd", _signsgd, state_bytes=lambda cfg: 4.0 if cfg.momentum else 0.0,
                       layout_keys=("momentum",), validate=_check, options=SignSGDOptions, hyperparameters=("beta",),
                       replace=True)


register()
