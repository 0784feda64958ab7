"""QK-Clip (Kimi Team 2025, Kimi K2, arXiv 2507.20534, section 2.1; with Muon it is their MuonClip): after every
optimizer step, each attention head h whose MaxLogit on that step's training batch,
``S_max^h = max_{X in batch} max_{j <= i} scale * q_i^h . k_j^h``, exceeded tau has its query and key projections
rescaled by ``gamma_h = tau / S_max^h``: ``W_q^h <- sqrt(gamma_h) W_q^h``, ``W_k^h <- sqrt(gamma_h) W_k^h``, so that
the logits of that batch would peak at exactly tau. Heads at or below tau are untouched.

Where the paper leaves us a choice (docs/remedies.md):

* **GQA** (a key head shared by a group of query heads; the paper's MLA shares only its rotary key, which it
  leaves alone and scales that head's rotary query by gamma instead): the shared key head g is scaled by
  ``sqrt(min_{h in g} gamma_h)`` and each query head by ``gamma_h / sqrt(min_{h in g} gamma_h)``, so that every
  head's logits are scaled by exactly its own gamma_h (1 for the unclipped heads of the group), and the clip is
  the paper's sqrt / sqrt split when the heads are not shared.
* **biases**: q and k are affine in x; their biases are rows of the same heads and are scaled with the weights,
  so q^h (and k) scale exactly.
* **QK-norm** (``model.qk_norm``) and normalised models (nGPT, anGPT): the logits do not depend on the scale of W_q
  and W_k, so QK-Clip cannot act and is refused.
* **RoPE** rotates each (q, k) pair by an orthogonal map, linear in q and k: it commutes with the rescale.
* **soft-capping** (``op``'s ``logit_softcap``): S_max is measured before the cap (the paper's logits).

The MaxLogit is measured during the training forward by each Attention's ``logit_hook``
(``models.attention.max_logits``: no gradient, one block of query rows at a time, no [T, T] tensor on the fused
paths), kept as a running maximum over the step's micro-batches (an activation-checkpointing recompute gives the
same values), then laid out at the global head positions and all-reduced (max) over the data-parallel and
tensor-parallel ranks, so every rank applies the same factors. The factors multiply the rows of the FSDP2 / TP
shards in place (the factor vector is sliced like the weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from outlier_titan.errors import ConfigError
from outlier_titan.models.layers import Attention
from outlier_titan.options import opt
from outlier_titan.remedies.registry import RemedyContext, RemedyHooks, register_remedy

TAU_KIMI_K2 = 100.0  # Kimi K2's threshold (arXiv 2507.20534, section 2.1)


@dataclass
class QKClipOptions:
    qk_clip: bool = opt(False, "QK-Clip (Kimi Team 2025, Kimi K2, arXiv 2507.20534; MuonClip with "
                               "optimizer.name = muon): after every optimizer step, rescale W_q and W_k of each "
                               "head whose MaxLogit on the step's training batch exceeded remedies.qk_clip_tau by "
                               "sqrt(tau / S_max) (GQA: the shared key head by the group's smallest factor, the "
                               "query heads by the rest; biases with their rows; refused with QK-norm / nGPT).")
    qk_clip_tau: float = opt(TAU_KIMI_K2, "QK-Clip's threshold tau on the MaxLogit (the paper's K2 run: 100).")


def clip_factors(s_max: torch.Tensor, tau: float, n_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(query-head factors [H], key-head factors [H_kv]) for one layer's MaxLogits ``s_max`` [H]: the logits of
    head h scale by ``q[h] * k[h // (H / H_kv)] = min(1, tau / s_max[h])``."""
    gamma = torch.where(s_max > tau, tau / s_max, torch.ones_like(s_max))
    group = gamma.view(n_kv_heads, -1)  # the query heads of each key head, contiguous (repeat_interleave)
    k = group.amin(1).sqrt()
    return (group / k[:, None]).reshape(-1), k


@torch.no_grad()
def scale_rows_(w: torch.Tensor, factors: torch.Tensor) -> None:
    """``w[r] *= factors[r]`` over the first (global) dim of a weight or bias, plain or a DTensor of any FSDP2 / TP
    placement (the factors are sliced the way ``w`` is: no communication)."""
    f = factors.to(w.dtype).view(-1, *([1] * (w.dim() - 1)))
    if isinstance(w, DTensor):
        f = distribute_tensor(f.expand(w.shape[0], *([1] * (w.dim() - 1))).contiguous(), w.device_mesh,
                              w.placements, src_data_rank=None).to_local()
        w.to_local().mul_(f)
    else:
        w.mul_(f)


def _check(model, cfg) -> None:
    for name, m in model.named_modules():
        if isinstance(m, Attention) and (m.q_norm is not None or not m.logits_bilinear_in_wq_wk):
            raise ConfigError(f"remedies.qk_clip: the queries and keys of {name} are normalised (model.qk_norm or a "
                              f"normalised model), so rescaling W_q / W_k cannot lower its logits; turn one off")


def _validate(cfg) -> None:
    if cfg.qk_clip and not cfg.qk_clip_tau > 0:
        raise ConfigError(f"remedies.qk_clip_tau must be > 0, got {cfg.qk_clip_tau} (the paper's is 100)")


class QKClip(RemedyHooks):
    def __init__(self, model, cfg, ctx: RemedyContext):
        self.tau = cfg.remedies.qk_clip_tau
        self.groups = [g for g in (ctx.dp_group, ctx.tp_group) if g is not None]
        self.tp_rank = dist.get_rank(ctx.tp_group) if ctx.tp_group is not None else 0
        self.layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.running: list[torch.Tensor | None] = [None] * len(self.layers)
        self.last = {"remedies/qk_clip_max_logit": float("nan"), "remedies/qk_clip_heads": 0.0}
        for i, m in enumerate(self.layers):
            m.logit_hook = self._keeper(i)

    def _keeper(self, i: int):
        def keep(m: torch.Tensor) -> None:  # [B, H_local]: this micro-batch's rows
            if not torch.is_grad_enabled():
                return  # a validation or probe forward, not the step's training batch
            top = m.amax(0)  # float32 (float64 for a float64 model): causal_logits promotes
            self.running[i] = top if self.running[i] is None else torch.maximum(self.running[i], top)
        return keep

    def global_max_logits(self) -> torch.Tensor:
        """[L, H] MaxLogit of the step's batch (over micro-batches and ranks), every head at its global position."""
        rows = []
        for m, local in zip(self.layers, self.running):
            n = m.wq.weight.shape[0] // m.head_dim  # DTensor weights report global shapes
            row = local.new_full((n,), float("-inf"))
            h = local.shape[0]
            row[self.tp_rank * h:(self.tp_rank + 1) * h] = local  # TP gives each rank a contiguous block of heads
            rows.append(row)
        s = torch.stack(rows)
        for group in self.groups:
            dist.all_reduce(s, op=dist.ReduceOp.MAX, group=group)
        return s

    @torch.no_grad()
    def after_step(self) -> None:
        if any(r is None for r in self.running):
            return  # no forward since the last step
        s = self.global_max_logits()
        self.running = [None] * len(self.layers)
        clipped = s > self.tau
        self.last = {"remedies/qk_clip_max_logit": float(s.max()), "remedies/qk_clip_heads": float(clipped.sum())}
        for m, s_layer, hit in zip(self.layers, s, clipped):
            if not bool(hit.any()):
                continue
            n_kv = m.wk.weight.shape[0] // m.head_dim
            fq, fk = clip_factors(s_layer.double(), self.tau, n_kv)
            rows_q, rows_k = fq.repeat_interleave(m.head_dim), fk.repeat_interleave(m.head_dim)
            for lin, rows in ((m.wq, rows_q), (m.wk, rows_k)):
                scale_rows_(lin.weight, rows)
                if lin.bias is not None:
                    scale_rows_(lin.bias, rows)

    def scalars(self) -> dict[str, float]:
        return dict(self.last)

    def close(self) -> None:
        for m in self.layers:
            m.logit_hook = None


QK_CLIP = register_remedy("qk_clip", "QK-Clip / MuonClip (Kimi Team 2025)", lambda cfg: cfg.qk_clip, QKClip,
                          options=QKClipOptions, validate=_validate, check=_check)
