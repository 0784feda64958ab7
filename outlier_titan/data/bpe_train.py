"""A byte-level BPE trainer in pure Python, writing tiktoken's rank-file format.

1. Pre-split every text with the tokenizer's split regex (:data:`~outlier_titan.data.tokenizer.SPLIT_PATTERN`) and
   count the unique pieces ("words"); merges never cross a piece boundary, as at encoding time.
2. Start from the 256 single bytes (rank = byte value). Count every adjacent pair of tokens over the unique words,
   weighted by the word's count, and remember which words contain each pair.
3. Repeatedly take the most frequent pair (ties: smallest token ids), give the concatenated bytes the next rank,
   and rewrite only the words that contain the pair, updating the pair counts of just those words. A max-heap
   with lazy deletion (stale entries are skipped when popped) finds the best pair without rescanning all pairs.

The result is the list of tokens in rank order; :func:`write_bpe_file` stores it as ``<base64 token> <rank>``
lines, loadable with :func:`outlier_titan.data.tokenizer.build_tokenizer`.
"""

from __future__ import annotations

import base64
import heapq
import os
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Callable, Iterable, Mapping

import regex

from outlier_titan.data.tokenizer import SPLIT_PATTERN


def count_words(texts: Iterable[str], pattern: str = SPLIT_PATTERN) -> Counter:
    """Counts of the regex pieces of ``texts``, keyed by their UTF-8 bytes."""
    rx = regex.compile(pattern)
    counts: Counter = Counter()
    for text in texts:
        counts.update(rx.findall(text))
    return Counter({piece.encode("utf-8", "surrogatepass"): n for piece, n in counts.items()})


def _merge_word(word: list[int], a: int, b: int, new_id: int) -> list[int] | None:
    """``word`` with every (a, b), left to right, replaced by ``new_id``; None if it has no such pair."""
    out: list[int] = []
    i, n, changed = 0, len(word), False
    while i < n:
        if i + 1 < n and word[i] == a and word[i + 1] == b:
            out.append(new_id)
            i += 2
            changed = True
        else:
            out.append(word[i])
            i += 1
    return out if changed else None


def train_bpe(word_counts: Mapping[bytes, int], num_ranks: int, *, min_pair_count: int = 2,
              progress: Callable[[int, int], None] | None = None) -> list[bytes]:
    """Tokens in rank order: the 256 bytes, then merges, until ``num_ranks`` tokens or no pair occurs
    ``min_pair_count`` times. ``progress(n_tokens, best_count)`` is called every 256 merges."""
    if num_ranks < 256:
        raise ValueError(f"a byte-level BPE needs at least 256 ranks, got {num_ranks}")
    vocab = [bytes([i]) for i in range(256)]
    id_of = {tok: i for i, tok in enumerate(vocab)}
    words = [list(w) for w in word_counts]
    freqs = list(word_counts.values())

    pair_counts: dict[tuple[int, int], int] = defaultdict(int)
    where: dict[tuple[int, int], set[int]] = defaultdict(set)
    for wi, word in enumerate(words):
        f = freqs[wi]
        for pair in zip(word, word[1:]):
            pair_counts[pair] += f
            where[pair].add(wi)
    heap = [(-c, pair) for pair, c in pair_counts.items()]
    heapq.heapify(heap)

    while len(vocab) < num_ranks and heap:
        neg, pair = heapq.heappop(heap)
        count = pair_counts.get(pair, 0)
        if count != -neg:
            continue  # stale entry; the current count has its own entry
        if count < min_pair_count:
            break
        a, b = pair
        merged = vocab[a] + vocab[b]
        new_id = id_of.get(merged)
        if new_id is None:  # the same bytes can rarely arise from two different pairs: keep one rank
            new_id = len(vocab)
            vocab.append(merged)
            id_of[merged] = new_id
        delta: dict[tuple[int, int], int] = defaultdict(int)
        for wi in where.pop(pair):
            word = words[wi]
            new_word = _merge_word(word, a, b, new_id)
            if new_word is None:
                continue
            f = freqs[wi]
            for p in zip(word, word[1:]):
                delta[p] -= f
            for p in zip(new_word, new_word[1:]):
                delta[p] += f
                where[p].add(wi)
            words[wi] = new_word
        for p, d in delta.items():
            if d == 0:
                continue
            c = pair_counts[p] + d
            if c > 0:
                pair_counts[p] = c
                heapq.heappush(heap, (-c, p))
            else:
                del pair_counts[p]
                where.pop(p, None)
        if progress is not None and len(vocab) % 256 == 0:
            progress(len(vocab), count)
    return vocab


def write_bpe_file(tokens: list[bytes], path: str | Path) -> None:
    """Writes ``<base64 token> <rank>`` lines atomically (temporary file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(f"{base64.b64encode(tok).decode('ascii')} {rank}\n" for rank, tok in enumerate(tokens))
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="ascii") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def train_bpe_from_texts(texts: Iterable[str], num_ranks: int, **kwargs) -> list[bytes]:
    return train_bpe(count_words(texts), num_ranks, **kwargs)
