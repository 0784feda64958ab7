"""TWEO (Liang, Shao, Tang, Liu, Wu 2025, "TWEO: Transformers Without Extreme Outliers Enables FP8 Training And
Quantization For Dummies", arXiv 2511.23225, CVPR 2026): one loss term on the magnitude of every block's output,

    L = L_task + lambda * L_TWEO,    L_TWEO = (1 / L_blocks) sum_l mean[ (|A_l| / (tau + eps))^p ],

``A_l`` the output of block l (the residual stream after it: ``x + MLP(norm(x))``), the mean over the batch, the
positions and the channels, ``tau = 3``, ``p = 4``, ``eps = 1e-6``, ``lambda = 0.01`` (the paper's defaults; tau in
its range 2-5). With ``p = 4`` an activation at tau/2 costs 1/16 and one at 10 tau costs 10^4: the term leaves the
bulk alone and presses on the tail. The paper's lambda(t) may be annealed; we keep it constant (their default).

The mean is over the optimizer step's tokens: each micro-batch on each rank adds its own blocks' sum divided by the
step's token count (times the width and the block count), so the term is the same at 1, 2 and 4 ranks. Under
sequence parallelism a rank holds a slice of the positions; its term carries the other TP ranks' sums as a
constant so every TP rank adds the same value while its gradient reaches only its own slice.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from outlier_titan.errors import ConfigError
from outlier_titan.options import opt
from outlier_titan.remedies.registry import RemedyHooks, register_remedy

EPS = 1e-6
"""The paper's numerical constant in the denominator ``tau + eps``."""


@dataclasses.dataclass
class TWEOOptions:
    tweo: bool = opt(False, "TWEO (Liang et al. 2025, arXiv 2511.23225): add lambda * mean((|A| / (tau + 1e-6))^p) "
                            "over every block's output A, averaged over the blocks, to the loss.")
    tweo_weight: float = opt(0.01, "TWEO's lambda (the paper's default 0.01; kept constant over the run).")
    tweo_tau: float = opt(3.0, "TWEO's soft threshold tau (the paper's default 3; it uses 2-5).")
    tweo_p: float = opt(4.0, "TWEO's power p (the paper's 4: negligible below tau, steep above).")


def tweo_sum(x: torch.Tensor, tau: float, p: float) -> torch.Tensor:
    """``sum((|x| / (tau + eps))^p)`` in float32 or wider (a plain tensor)."""
    return (x.abs().to(torch.promote_types(x.dtype, torch.float32)) / (tau + EPS)).pow(p).sum()


class TWEO(RemedyHooks):
    """Keeps each block's output of the training forward and returns this rank's share of the step's term."""

    def __init__(self, model, cfg, ctx):
        r = cfg.remedies
        self.weight, self.tau, self.p = r.tweo_weight, r.tweo_tau, r.tweo_p
        self.ctx, self.seq_len = ctx, cfg.training.seq_len
        self.n_blocks = len(model.layers)
        self.outputs: list[torch.Tensor] = []
        self.step_total = self.last = None
        # on the (checkpoint-wrapped, compiled) block modules: a recompute in the backward does not fire them
        self.handles = [block.register_forward_hook(self._keep) for block in model.layers.values()]
        self.handles.append(model.register_forward_pre_hook(self._clear))

    def _clear(self, module, inputs):
        self.outputs = []  # a forward whose term was never asked for (the probe's, with observe.gradients)

    @torch.compiler.disable
    def _keep(self, module, inputs, output):
        if torch.is_grad_enabled():  # training forwards only (not validation or a no-grad probe)
            self.outputs.append(output[0] if isinstance(output, (tuple, list)) else output)

    def _local_sum(self, a: torch.Tensor) -> tuple[torch.Tensor, bool, object]:
        """This rank's sum over its positions divided by the width, whether the output is sequence-sharded over
        TP, and the TP group."""
        group = self.ctx.tp_group
        if isinstance(a, DTensor):
            sharded = any(isinstance(pl, Shard) and pl.dim == 1 for pl in a.placements)
            group, a = a.device_mesh.get_group(), a.to_local()
        else:
            sharded = group is not None and a.shape[1] != self.seq_len
        return tweo_sum(a, self.tau, self.p) / a.shape[-1], sharded, group

    def loss_term(self) -> torch.Tensor | None:
        outputs, self.outputs = self.outputs, []
        if not outputs:
            return None
        parts = [self._local_sum(a) for a in outputs]
        term = sum(s for s, _, _ in parts)
        sharded = [(s, g) for s, is_sharded, g in parts if is_sharded]
        if sharded:
            # the other TP ranks' sums as a constant (one all-reduce for all blocks): every TP rank adds the same
            # value, and the gradient reaches only this rank's positions
            local = sum(s for s, _ in sharded)
            total = local.detach().clone()
            dist.all_reduce(total, group=sharded[0][1])
            term = term + (total - local.detach())
        term = self.weight * term / (self.ctx.tokens_per_step * self.n_blocks)
        self.step_total = term.detach() if self.step_total is None else self.step_total + term.detach()
        return term

    def after_step(self) -> None:
        self.last, self.step_total = self.step_total, None

    def scalars(self) -> dict[str, float]:
        """``remedies/tweo``: the step's lambda * L_TWEO (summed over the data-parallel ranks)."""
        if self.last is None:
            return {}
        total = self.last.clone()
        if self.ctx.dp_group is not None:
            dist.all_reduce(total, group=self.ctx.dp_group)
        return {"remedies/tweo": float(total)}

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def _validate(cfg) -> None:
    if cfg.tweo_weight < 0:
        raise ConfigError(f"remedies.tweo_weight = {cfg.tweo_weight} must be >= 0 (the paper's 0.01)")
    if cfg.tweo_tau <= 0:
        raise ConfigError(f"remedies.tweo_tau = {cfg.tweo_tau} must be > 0 (the paper's 3)")
    if cfg.tweo_p <= 0:
        raise ConfigError(f"remedies.tweo_p = {cfg.tweo_p} must be > 0 (the paper's 4)")


register_remedy("tweo", "TWEO's loss term on the blocks' output magnitudes (Liang et al. 2025)",
                lambda cfg: cfg.tweo and cfg.tweo_weight > 0, TWEO, options=TWEOOptions, validate=_validate)
