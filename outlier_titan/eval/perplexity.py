"""Validation perplexity of a language model on a fixed token budget (each validation token scored once)."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn as nn
import torch.nn.functional as F


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


def validation_budget(loader, seq_len: int, wanted_tokens: int, asked_by: str, warn: bool = True) -> int:
    """Predicted tokens to score: ``wanted_tokens``, or the whole validation split of ``loader`` when it is
    smaller (with a warning on stderr), so that no validation token is scored twice. Streams have no known
    length and get ``wanted_tokens``."""
    windows = loader.num_windows
    if windows is None or windows * seq_len >= wanted_tokens:
        return wanted_tokens
    if warn:
        print(f"warning: the validation split has only {windows * seq_len:,} tokens to predict ({windows:,} sequences "
              f"of {seq_len}), fewer than the {wanted_tokens:,} asked by {asked_by}; each is scored once",
              file=sys.stderr, flush=True)
    return windows * seq_len


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
               progress=None) -> PerplexityResult:
    """exp(mean token cross-entropy) over ``batches`` (float32 log-softmax, summed in float64); ``progress``
    (a tqdm bar) is advanced by the tokens of each batch."""
    tokens = 0
    total = torch.zeros((), dtype=torch.float64, device=device)
    for inputs, labels in batches:
        logits = model(inputs.to(device))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.to(device).flatten(), reduction="none")
        total += loss.double().sum()
        tokens += labels.numel()
        if progress is not None:
            progress.update(labels.numel())
    return PerplexityResult(float(total), tokens)
