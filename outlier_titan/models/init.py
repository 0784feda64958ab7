"""Layout-independent weight initialisation.

Each parameter's *full* value is drawn from one generator in module order, then each rank keeps its own
shard (``distribute_tensor(..., src_data_rank=None)`` splits locally, no communication). So a model
initialised on 1 rank, FSDP 2 or FSDP 2 x TP 2 has the same weights: no seed checkpoint is needed for
loss-parity runs. Peak extra memory is one full parameter.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from outlier_titan.linalg import haar_from_gaussian


class Initializer:
    """Draws full-size initial values from a seeded generator and writes each rank's shard."""

    def __init__(self, seed: int, device: torch.device):
        self.device = torch.device(device)
        self.gen = torch.Generator(self.device).manual_seed(seed)

    def _write(self, param: torch.Tensor, fill: Callable[[torch.Tensor], None]) -> None:
        full = torch.empty(param.shape, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            fill(full)
            if isinstance(param, DTensor):
                local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(local)
            else:
                param.copy_(full)

    def normal(self, param: torch.Tensor | None, std: float, trunc: float | None = 3.0) -> None:
        """N(0, std), truncated at ``trunc`` standard deviations (None: not truncated)."""
        if param is None:
            return

        def fill(t: torch.Tensor) -> None:
            t.normal_(0.0, std, generator=self.gen)
            if trunc is None:
                return
            bad = t.abs() > trunc * std
            while bad.any():  # resample out-of-range draws: a true truncated normal
                t[bad] = torch.empty(int(bad.sum()), device=t.device).normal_(0.0, std, generator=self.gen)
                bad = t.abs() > trunc * std

        self._write(param, fill)

    def constant(self, param: torch.Tensor | None, value: float) -> None:
        if param is not None:
            self._write(param, lambda t: t.fill_(value))

    def orthogonal(self, param: torch.Tensor) -> None:
        """A random (Haar) orthogonal matrix from a float64 Gaussian drawn with this initializer's generator."""
        def fill(t: torch.Tensor) -> None:
            g = torch.empty(t.shape, dtype=torch.float64, device=t.device).normal_(generator=self.gen)
            t.copy_(haar_from_gaussian(g))
        self._write(param, fill)

    def value(self, param: torch.Tensor, full: torch.Tensor) -> None:
        """Sets the parameter to a given full tensor (e.g. an explicitly normalised matrix)."""
        self._write(param, lambda t: t.copy_(full))

    def linear(self, layer: torch.nn.Linear | None, std: float) -> None:
        """Normal weights, zero bias."""
        if layer is None:
            return
        self.normal(layer.weight, std)
        if layer.bias is not None:
            self.constant(layer.bias, 0.0)
