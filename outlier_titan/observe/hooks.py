"""Forward hooks for a measurement pass: the model in eval mode with the hooks on, both undone afterwards."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch.nn as nn
from torch.utils.hooks import RemovableHandle


@contextlib.contextmanager
def measuring(model: nn.Module, handles: Iterable[RemovableHandle]) -> Iterator[None]:
    """``model`` in eval mode while the block runs; on exit the hook ``handles`` are removed and the model's
    train / eval mode restored (also when the block raises)."""
    handles = list(handles)
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
