"""Validation perplexity of a language model on a fixed token budget, with a stderr progress line."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from typing import Iterable, TextIO

import torch
import torch.nn as nn
import torch.nn.functional as F


class Progress:
    """A one-line progress indicator on stderr: ``label [#####.....] 52% 34,816/65,536 2.1s``.

    On a terminal the line is redrawn in place; otherwise (logs, CI) a line is written at every 25 %.
    """

    def __init__(self, label: str, total: int, stream: TextIO | None = None, width: int = 24):
        self.label, self.total, self.width = label, max(1, int(total)), width
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.t0 = time.perf_counter()
        self.done = 0
        self._next_quarter = 0.25

    def _line(self) -> str:
        frac = min(1.0, self.done / self.total)
        bar = "#" * int(round(frac * self.width))
        return (f"{self.label} [{bar:<{self.width}}] {frac * 100:3.0f}% {self.done:,}/{self.total:,} "
                f"{time.perf_counter() - self.t0:.1f}s")

    def update(self, n: int) -> None:
        self.done += int(n)
        if self.tty:
            self.stream.write("\r" + self._line())
            self.stream.flush()
        elif self.done / self.total >= self._next_quarter:
            while self.done / self.total >= self._next_quarter:
                self._next_quarter += 0.25
            self.stream.write(self._line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\r" + self._line() + "\n")
            self.stream.flush()


@dataclass
class PerplexityResult:
    nll_sum: float
    tokens: int

    @property
    def loss(self) -> float:
        return self.nll_sum / self.tokens

    @property
    def ppl(self) -> float:
        return math.exp(self.loss)


def take_batches(batches: Iterable[tuple[torch.Tensor, torch.Tensor]], max_tokens: int
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The first (inputs, labels) batches holding ``max_tokens`` predicted tokens; the last batch is cut to the
    fewest whole rows that reach the budget (so the set is the same for every scheme and run)."""
    if max_tokens <= 0:
        raise ValueError(f"the token budget must be positive, got {max_tokens}")
    out, n = [], 0
    for inputs, labels in batches:
        rows_needed = -(-(max_tokens - n) // inputs.shape[1])
        inputs, labels = inputs[:rows_needed], labels[:rows_needed]
        out.append((inputs, labels))
        n += labels.numel()
        if n >= max_tokens:
            break
    if n == 0:
        raise ValueError("no validation batches")
    return out


@torch.no_grad()
def perplexity(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device | str,
               progress: Progress | None = None) -> PerplexityResult:
    """exp(mean token cross-entropy) over ``batches`` (float32 log-softmax, summed in float64)."""
    tokens = 0
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, labels in batches:
        logits = model(inputs.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten(), reduction="none")
        total += loss.double().sum()
        tokens += labels.numel()
        if progress is not None:
            progress.update(labels.numel())
    nll = float(total)
    if progress is not None:
        progress.close()
    return PerplexityResult(nll, tokens)
