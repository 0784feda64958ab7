"""Synthetic data: the Bigram-Backcopy task (Guo et al. 2024, "Active-Dormant Attention Heads", arXiv 2410.13835).

``data.source = "bigram_backcopy"``, optionally with parameters: ``"bigram_backcopy:states=64,triggers=3,alpha=0.2,
seed=0"`` (these are the defaults; any subset, in any order).

* Tokens: ``states`` token ids ``0 .. states-1`` of the configured tokenizer; BOS is the tokenizer's end-of-text id.
  The model keeps the tokenizer's vocabulary.
* The chain: row ``i`` of the transition matrix is drawn from a symmetric Dirichlet(``alpha``) (small ``alpha``:
  a few likely successors per state), from a generator seeded by the task ``seed`` alone, so the training seed,
  both splits and every rank share it.
* Triggers: the ``triggers`` states of largest stationary probability (ties to the lower id).
* A window of ``seq_len + 1`` tokens is BOS, then a first state drawn from the stationary distribution, then for
  each next token: if the previous token is a trigger and the one before it is a state that is not a trigger,
  the next token copies that state (the backcopy); otherwise it is drawn from the chain's row of the previous
  token. So a trigger right after BOS, or right after another trigger, does not copy; a copied token is never a
  trigger, and the chain continues from it.

Predicting a copy needs attention (to the token two back); every other prediction needs only the current token,
so trained heads that have nothing to do park on BOS (the attention sink of the paper).

Window ``g`` is generated from ``np.random.default_rng([seed, split, data_seed, g])`` (``split`` 0 for train, 1 for
validation; ``data_seed`` the training seed for train, 0 for validation): random access, the same window at any
world size and on resume, endless. Every window starts with its own BOS (windows do not overlap).
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, fields

import numpy as np

from outlier_titan.data.tokenizer import Tokenizer
from outlier_titan.errors import DataError

NAME = "bigram_backcopy"
_SPLIT_INDEX = {"train": 0, "validation": 1}
_EXAMPLE = f"{NAME}:states=64,triggers=3,alpha=0.2,seed=0"


def is_synthetic(source: str) -> bool:
    """Whether ``data.source`` names the synthetic task (it takes precedence over a path of the same name)."""
    return source == NAME or source.startswith(NAME + ":")


@dataclass(frozen=True)
class BigramBackcopy:
    """The task's parameters; :meth:`parse` reads them from ``data.source``."""

    states: int = 64
    triggers: int = 3
    alpha: float = 0.2
    seed: int = 0

    @classmethod
    def parse(cls, source: str) -> "BigramBackcopy":
        """The task of ``"bigram_backcopy"`` or ``"bigram_backcopy:key=value,..."``; DataError for anything else."""
        if not is_synthetic(source):
            raise DataError(f"data.source: {source!r} is not {NAME} or {NAME}:key=value,...; e.g. {_EXAMPLE}")
        params = source[len(NAME) + 1:]
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, int | float] = {}
        for part in params.split(",") if params else []:
            key, eq, text = (s.strip() for s in part.partition("="))
            if not eq:
                raise DataError(f"data.source: {NAME} parameter {part.strip()!r} is not key=value; e.g. {_EXAMPLE}")
            if key not in types:
                raise DataError(f"data.source: unknown {NAME} parameter {key!r}; use {', '.join(types)} "
                                f"(e.g. {_EXAMPLE})")
            if key in values:
                raise DataError(f"data.source: {NAME} parameter {key!r} is given twice; give it once")
            try:
                values[key] = float(text) if types[key] == "float" else int(text)
            except ValueError:
                kind = "a number" if types[key] == "float" else "an integer"
                raise DataError(f"data.source: {NAME} {key}={text!r} is not {kind}; e.g. {_EXAMPLE}") from None
        task = cls(**values)
        if task.states < 2:
            raise DataError(f"data.source: {NAME} states={task.states} must be at least 2")
        if not 0 <= task.triggers < task.states:
            raise DataError(f"data.source: {NAME} triggers={task.triggers} must be in [0, states={task.states})")
        if not (math.isfinite(task.alpha) and task.alpha > 0):
            raise DataError(f"data.source: {NAME} alpha={task.alpha} must be a positive number")
        if task.seed < 0:
            raise DataError(f"data.source: {NAME} seed={task.seed} must be non-negative")
        return task

    def describe(self) -> str:
        return f"{NAME} ({self.states} states, {self.triggers} triggers, alpha {self.alpha:g}, seed {self.seed})"

    def transition(self) -> np.ndarray:
        """The chain's row-stochastic transition matrix, float64 ``[states, states]``."""
        rng = np.random.default_rng([self.seed])
        return rng.dirichlet(np.full(self.states, self.alpha), size=self.states)


def stationary_distribution(transition: np.ndarray) -> np.ndarray:
    """The stationary distribution of an ergodic row-stochastic matrix: the mean row of its 2^40-th power."""
    power = transition
    for _ in range(40):
        power = power @ power
    pi = power.mean(axis=0)
    return pi / pi.sum()


class BigramBackcopyWindows:
    """Random access to the endless windows of one split (see the module docstring); same interface as
    :class:`~outlier_titan.data.loader.ArrayWindows`."""

    num_windows = None

    def __init__(self, source: str, tokenizer: Tokenizer, seq_len: int, split: str = "train", seed: int = 0) -> None:
        if split not in _SPLIT_INDEX:
            raise ValueError(f"split must be one of {tuple(_SPLIT_INDEX)}, got {split!r}")
        self.task = BigramBackcopy.parse(source)
        n = self.task.states
        if n > tokenizer.eos_id:
            raise DataError(f"data.source: {NAME} states={n} needs token ids 0..{n - 1} below the tokenizer's "
                            f"end-of-text id {tokenizer.eos_id} (the BOS token); use states <= {tokenizer.eos_id}")
        self.seq_len, self.bos = seq_len, tokenizer.eos_id
        self.key = [self.task.seed, _SPLIT_INDEX[split], seed if split == "train" else 0]
        self.transition = self.task.transition()
        self.stationary = stationary_distribution(self.transition)
        self.triggers = np.sort(np.argsort(-self.stationary, kind="stable")[:self.task.triggers])
        # inverse-CDF sampling with bisect on plain lists (fast per token); the last entry is exactly 1
        cdf = np.cumsum(self.transition, axis=1)
        self._row_cdfs = (cdf / cdf[:, -1:]).tolist()
        first = np.cumsum(self.stationary)
        self._first_cdf = (first / first[-1]).tolist()
        self._is_trigger = np.isin(np.arange(n), self.triggers).tolist()

    def window(self, g: int) -> np.ndarray:
        """Window ``g``: ``seq_len + 1`` int64 token ids, BOS first."""
        u = np.random.default_rng([*self.key, g]).random(self.seq_len).tolist()
        tokens = [self.bos, bisect_right(self._first_cdf, u[0])]
        is_trigger, cdfs = self._is_trigger, self._row_cdfs
        for t in range(1, self.seq_len):
            prev, before = tokens[t], tokens[t - 1]
            if t >= 2 and is_trigger[prev] and not is_trigger[before]:
                tokens.append(before)
            else:
                tokens.append(bisect_right(cdfs[prev], u[t]))
        return np.asarray(tokens, dtype=np.int64)

    def rows(self, start: int, count: int) -> np.ndarray:
        return np.stack([self.window(g) for g in range(start, start + count)])
