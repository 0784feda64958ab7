"""GPTQ weight quantisation (Frantar et al. 2023, arXiv 2210.17323), fake-quant, float64 arithmetic.

Per linear layer with weight ``W [out, in]`` and calibration inputs ``X [n, in]``: ``H = 2 X^T X / n``, dampened by
``damp * mean(diag H)`` on the diagonal (dead inputs, ``H_jj = 0``, get ``H_jj = 1`` and zero weights). The grid is
fixed before the sweep: int ``bits`` symmetric absmax per output channel of the original ``W`` (the RTN grid of the
4-bit schemes, codes in ``[-(2^(b-1)-1), 2^(b-1)-1]``). Columns are quantised left to right; after column ``j`` the
not yet quantised columns absorb its error, ``W[:, j+1:] -= (w_j - q_j) / U_jj * U_j,j+1:`` with ``U`` the upper
Cholesky factor of ``H^-1`` (the paper's Algorithm 1), in lazy blocks of ``block`` columns (identical numbers).

:func:`gptq_model` runs block by block (the paper's sequential protocol): the Hessians of a transformer block's
linear layers are collected from one pass of the calibration batches through the model whose earlier blocks are
already quantised (within a block the layers are quantised from the same pass), then the block is quantised.
Activations stay in full precision during calibration; a scheme adds its activation quantisers afterwards.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn


def rtn_grid_quantize(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric round-to-nearest onto ``scale * [-(2^(b-1)-1), 2^(b-1)-1]`` (``scale`` broadcasts)."""
    qmax = 2 ** (bits - 1) - 1
    return torch.clamp(torch.round(w / scale), -qmax, qmax) * scale


def channel_scales(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per output channel absmax scale ``max_j |W_ij| / (2^(b-1)-1)`` as a column; zero rows get 1."""
    s = w.abs().amax(1, keepdim=True) / (2 ** (bits - 1) - 1)
    return torch.where(s > 0, s, torch.ones_like(s))


def gptq_quantize(w: torch.Tensor, h: torch.Tensor, bits: int = 4, damp: float = 0.01,
                  block: int = 128) -> torch.Tensor:
    """The GPTQ-quantised (dequantised) ``w`` for Hessian ``h`` (both any float dtype; float64 inside)."""
    w = w.detach().to(torch.float64).clone()
    h = h.detach().to(torch.float64).clone()
    n = w.shape[1]
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    scale = channel_scales(w, bits)
    h += damp * torch.diagonal(h).mean() * torch.eye(n, dtype=h.dtype, device=h.device)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.zeros_like(w)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        w1 = w[:, i1:i2].clone()
        err = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = w1[:, i]
            qc = rtn_grid_quantize(col[:, None], scale, bits)[:, 0]
            q[:, i1 + i] = qc
            e = (col - qc) / u[i1 + i, i1 + i]
            w1[:, i:] -= e[:, None] * u[i1 + i, i1 + i:i2][None, :]
            err[:, i] = e
        w[:, i2:] -= err @ u[i1:i2, i2:]
    return q


class _Stop(Exception):
    pass


@torch.no_grad()
def gptq_model(model: nn.Module, targets: dict[str, nn.Linear], batches: Iterable[torch.Tensor],
               bits: int = 4, damp: float = 0.01) -> None:
    """Replaces the weights of ``targets`` (linears of ``model.layers`` blocks; others are quantised after
    the blocks from one more pass) by their GPTQ values, block by block (see the module docstring)."""
    batches = list(batches)
    if not batches:
        raise ValueError("GPTQ needs at least one calibration batch")
    blocks = list(getattr(model, "layers", {}).values())
    groups: list[tuple[nn.Module | None, dict[str, nn.Linear]]] = []
    claimed: set[str] = set()
    for b in blocks:
        mine = {n: lin for n, lin in targets.items() if any(lin is m for m in b.modules())}
        claimed.update(mine)
        if mine:
            groups.append((b, mine))
    rest = {n: lin for n, lin in targets.items() if n not in claimed}
    if rest:
        groups.append((None, rest))
    for stop_at, group in groups:
        hess = {n: torch.zeros(lin.in_features, lin.in_features, dtype=torch.float64, device=lin.weight.device)
                for n, lin in group.items()}
        count = {n: 0 for n in group}
        handles = []
        for n, lin in group.items():
            def hook(_m, args, _out, n=n):
                x = args[0].detach().reshape(-1, args[0].shape[-1]).to(torch.float64)
                hess[n] += 2.0 * x.t() @ x
                count[n] += x.shape[0]
            handles.append(lin.register_forward_hook(hook))
        if stop_at is not None:
            def stop(_m, _a, _o):
                raise _Stop
            handles.append(stop_at.register_forward_hook(stop))
        try:
            for tokens in batches:
                try:
                    model(tokens)
                except _Stop:
                    pass
        finally:
            for hd in handles:
                hd.remove()
        for n, lin in group.items():
            lin.weight.copy_(gptq_quantize(lin.weight, hess[n] / max(count[n], 1), bits, damp).to(lin.weight.dtype))
