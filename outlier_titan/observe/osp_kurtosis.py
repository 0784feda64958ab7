"""Excess kurtosis as Outlier-Safe Pre-Training's released script computes it (Park et al. 2025, arXiv 2506.19697).

The number the paper reports (0.04 for the OSP model, 1818.56 for Adam) comes from ``evaluate_kurtosis.py`` of
the authors' repository (dmis-lab/Outlier-Safe-Pre-Training). Read there, it does:

1. cut the validation text into ``num_samples`` sequences of ``max_length`` tokens;
2. feed each sequence as a batch of ``max_length`` sequences of **length 1** (``seq.unsqueeze(1)``): every token
   is its own sequence at position 0 and attends only to itself, so no token sees any context;
3. take every hidden state Hugging Face returns: the input of each decoder layer (the first one is the embedding
   output) and the final norm's output, L + 1 of them;
4. per token vector ``x`` (the D channels, float32 of a bfloat16 model):
   ``relu(mean_d(x^4) / std_d(x)^4 - 3)`` with an **uncentred** fourth moment, the **unbiased** (n - 1)
   standard deviation, and negative values clipped to 0; the mean over the tokens of the sequence;
5. the mean of those values over every (sequence, hidden state) pair.

This stack's kurtosis metrics (:mod:`outlier_titan.observe.outliers`) differ: they run whole sequences (every
token in its context), measure each block's output and the head input, and are either He et al. 2024's
neuron-RMS kurtosis (a kurtosis over channels of per-channel RMS pooled over tokens, non-excess, uncentred, 1 for
equal channels) or Kaul et al. 2024's per-token Pearson kurtosis (centred, population moments, non-excess, no
clipping). :func:`osp_excess_kurtosis` is the released script's number for a model of this stack, computed in
float64; :func:`osp_token_excess_kurtosis` is its per-token formula.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from outlier_titan.observe.hooks import measuring
from outlier_titan.observe.metrics import register_evaluation

F64 = torch.float64


def osp_token_excess_kurtosis(x: torch.Tensor) -> torch.Tensor:
    """Per vector over the last dim: ``max(0, mean(x^4) / std(x)^4 - 3)``, std unbiased, fourth moment uncentred
    (the OSP script's formula), in float64."""
    x = x.to(F64)
    return (x.pow(4).mean(-1) / x.std(-1).pow(4) - 3).clamp_min(0)


def hidden_states_hooks(model: nn.Module, store: list[torch.Tensor]) -> list:
    """Hooks that append Hugging Face's ``output_hidden_states`` to ``store``: each block's input (the first is the
    embedding output), then the final norm's output."""
    handles = [block.register_forward_pre_hook(lambda _m, args: store.append(args[0].detach()))
               for block in model.layers.values()]
    handles.append(model.norm.register_forward_hook(lambda _m, _a, out: store.append(out.detach())))
    return handles


@torch.no_grad()
def osp_excess_kurtosis(model: nn.Module, sequences: Iterable[torch.Tensor]) -> dict[str, float]:
    """The OSP script's excess kurtosis of ``model`` (a spec with ``layers`` and ``norm``) over ``sequences``
    (token tensors [T] or batches [B, T], each row one sequence): each sequence's tokens are fed as T separate
    length-1 sequences. Returns ``{"osp_kurtosis": mean over (sequence, hidden state), "osp_kurtosis_layer_<i>":
    the mean over sequences of hidden state i}`` (i = 0: the embedding output; L: the final norm's output)."""
    per_state: list[list[float]] = []
    states: list[torch.Tensor] = []
    with measuring(model, hidden_states_hooks(model, states)):  # hooked once: each forward fills ``states`` afresh
        for batch in sequences:
            for seq in batch.reshape(-1, batch.shape[-1]):
                states.clear()
                model(seq.unsqueeze(1))
                per_state.append([float(osp_token_excess_kurtosis(s.reshape(-1, s.shape[-1])).mean())
                                  for s in states])
    if not per_state:
        raise ValueError("osp_excess_kurtosis needs at least one sequence")
    table = torch.tensor(per_state, dtype=F64)
    out = {"osp_kurtosis": float(table.mean())}
    out.update({f"osp_kurtosis_layer_{i}": float(v) for i, v in enumerate(table.mean(0))})
    return out


register_evaluation("osp_kurtosis", osp_excess_kurtosis,
                    "Excess kurtosis as Park et al. 2025's script computes it (each probe token alone, every hidden "
                    "state; observe/osp_kurtosis.py): {value:.4g}")
