"""Packing and the data loader: one global token stream, cut the same way at every world size.

Every document is tokenized and followed by EOS; the documents are concatenated into one **global** token stream.
Window ``g`` is the ``seq_len + 1`` tokens starting at token ``g * seq_len`` (consecutive windows share one token,
so every token is predicted once); inputs are ``w[:-1]``, labels ``w[1:]``. Documents cross window boundaries,
nothing is masked.

A global step that starts at window position ``p`` uses windows ``[p, p + G)`` (``G`` = global batch size). DP
rank ``r`` of ``D`` takes the contiguous ``L = G / D`` windows ``[p + r L, p + (r + 1) L)`` and yields them as
``L / M`` micro-batches of ``M`` rows. Hence the rows of a step, concatenated over ranks and micro-batches, are the
same for any ``D`` and ``M``: losses can be compared across world sizes and gradient-accumulation settings.

The loader state is the **global** position (windows consumed by completed steps, plus micro-batches yielded in
the current step), the same on every rank, so a checkpoint taken with ``D`` ranks resumes on ``D'`` ranks (at a
step boundary; mid-step only with the same batch layout). Nothing is shuffled, except that the embedded corpus's
training files are read in an order shuffled by ``seed``. When a split is exhausted it starts over (window
positions continue; window ``g`` of a finite corpus is window ``g mod W``).

Embedded and local-file sources are tokenized once into a flat token array cached as ``.npy`` (uint16, or
uint32 for vocabularies above 65536) under ``data.cache_dir`` / ``$OUTLIER_TITAN_CACHE`` /
``~/.cache/outlier_titan``, keyed by a fingerprint of the files (paths, sizes, mtimes), the tokenizer, the split
and the file order; it is written to a temporary file and renamed into place under a file lock, so ranks
starting together are safe. Windows are then read at random from a memory map.

Hugging Face streaming sources are not cached: every rank reads and tokenizes the same stream and keeps only its
own windows; resuming re-reads the stream up to the saved position (cost grows with the position).

The synthetic source (``bigram_backcopy``, :mod:`outlier_titan.data.synthetic`) generates window ``g`` on demand
from a seed and ``g``: endless, no cache, random access like a cached array.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset
from tqdm import tqdm
from torchdata.stateful_dataloader import StatefulDataLoader

from outlier_titan.data.pretokenized import is_pretokenized, open_split
from outlier_titan.data.sources import FileCorpus, HFCorpus, resolve_source
from outlier_titan.data.synthetic import BigramBackcopyWindows, is_synthetic
from outlier_titan.data.tokenizer import Tokenizer
from outlier_titan.errors import DataError

CACHE_ENV = "OUTLIER_TITAN_CACHE"
_CACHE_VERSION = 1
_ENCODE_CHARS = 8 << 20  # tokenize documents in batches of about this many characters


def cache_root(configured: str = "") -> Path:
    if configured:
        return Path(configured).expanduser()
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "outlier_titan"


def _token_dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)


# --------------------------------------------------------------------------------------------- the token cache
def cache_key(corpus: FileCorpus, tokenizer: Tokenizer) -> str:
    """Fingerprint of everything the cached token array depends on."""
    what = {
        "version": _CACHE_VERSION,
        "kind": corpus.kind,
        "root": str(corpus.root.resolve()),
        "files": corpus.file_stats(),  # in reading order, so the shuffle seed is part of it
        "split": corpus.split,
        "doc_split": corpus.doc_split,
        "val_fraction": corpus.val_fraction if corpus.doc_split != "file" else None,
        "text_field": corpus.text_field,
        "tokenizer": tokenizer.fingerprint,
        "eos_id": tokenizer.eos_id,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # no flock (Windows): rely on the atomic rename alone
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _atomic_json(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)


def _write_tokens(corpus: FileCorpus, tokenizer: Tokenizer, final: Path) -> dict:
    """Tokenizes ``corpus`` into ``final`` (.npy) through temporary files (tqdm progress on stderr); returns the
    summary."""
    dtype = _token_dtype(tokenizer)
    t0 = time.perf_counter()
    n_docs = n_tokens = 0
    fd, raw_path = tempfile.mkstemp(dir=final.parent, prefix=final.stem + ".", suffix=".raw.tmp")
    fd2, npy_path = tempfile.mkstemp(dir=final.parent, prefix=final.stem + ".", suffix=".npy.tmp")
    os.close(fd2)
    try:
        with os.fdopen(fd, "wb") as raw, tqdm(desc=f"tokenizing {corpus.describe()} ({corpus.split})",
                                              unit="doc", unit_scale=True, mininterval=2.0) as bar:
            batch: list[str] = []
            chars = 0

            def flush() -> None:
                nonlocal n_docs, n_tokens
                flat: list[int] = []
                for ids in tokenizer.encode_batch(batch):
                    flat.extend(ids)
                    flat.append(tokenizer.eos_id)
                np.asarray(flat, dtype=dtype).tofile(raw)
                n_docs += len(batch)
                n_tokens += len(flat)
                bar.update(len(batch))
                bar.set_postfix(tokens=f"{n_tokens:,}", refresh=False)
                batch.clear()

            for doc in corpus.documents():
                batch.append(doc)
                chars += len(doc)
                if chars >= _ENCODE_CHARS:
                    flush()
                    chars = 0
            if batch:
                flush()
        if n_tokens == 0:
            raise DataError(f"data.source: {corpus.describe()} has no documents in the '{corpus.split}' split; "
                            "add data or change data.val_fraction")
        header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": (n_tokens,)}
        with open(npy_path, "wb") as out, open(raw_path, "rb") as raw_in:
            np.lib.format.write_array_header_1_0(out, header)
            shutil.copyfileobj(raw_in, out, 16 << 20)
        os.chmod(npy_path, 0o644)
        os.replace(npy_path, final)
    finally:
        for p in (raw_path, npy_path):
            if os.path.exists(p):
                os.unlink(p)
    return {"source": corpus.describe(), "split": corpus.split, "files": len(corpus.files), "documents": n_docs,
            "tokens": n_tokens, "tokenizer": tokenizer.fingerprint, "seconds": round(time.perf_counter() - t0, 3)}


def token_cache(corpus: FileCorpus, tokenizer: Tokenizer, cache_dir: str | Path) -> tuple[Path, dict]:
    """Path of the cached token array of ``corpus`` (built now if missing) and its summary."""
    folder = Path(cache_dir) / "tokens"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DataError(f"data.cache_dir: cannot create {folder} ({e.strerror}); set data.cache_dir or "
                        f"${CACHE_ENV} to a writable folder") from None
    stem = f"{corpus.kind}-{corpus.split}-{cache_key(corpus, tokenizer)}"
    final, meta_path = folder / f"{stem}.npy", folder / f"{stem}.json"
    if not final.exists():
        try:
            with _file_lock(folder / f"{stem}.lock"):
                if not final.exists():  # another rank may have built it while we waited
                    _atomic_json(meta_path, _write_tokens(corpus, tokenizer, final))
        except OSError as e:
            raise DataError(f"data.cache_dir: cannot write the token cache in {folder} ({e.strerror or e}); set "
                            f"data.cache_dir or ${CACHE_ENV} to a writable folder with free space") from None
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, ValueError):
        meta = {}
    return final, meta


# --------------------------------------------------------------------------------------------------- windows
class ArrayWindows:
    """Random access to the windows of a cached token array; window ``g`` wraps to ``g mod num_windows``.

    With ``shuffle_seed`` each pass (epoch) visits the windows in a seeded random order, so a batch mixes
    many documents instead of consecutive pieces of one file; the order depends only on the seed and the
    epoch, never on the number of ranks.
    """

    def __init__(self, path: str | Path, seq_len: int, description: str = "", shuffle_seed: int | None = None,
                 tokens=None) -> None:
        self.path = Path(path)
        self.seq_len = seq_len
        self.shuffle_seed = shuffle_seed
        self._perm_epoch, self._perm = -1, None
        # ``tokens``: any sliceable 1-D token sequence instead of the .npy at ``path`` (pre-tokenized shards)
        self.tokens = np.load(self.path, mmap_mode="r") if tokens is None else tokens
        self.num_windows = (len(self.tokens) - 1) // seq_len
        if self.num_windows < 1:
            raise DataError(f"data.source: {description or self.path} has {len(self.tokens)} tokens, fewer than "
                            f"training.seq_len + 1 = {seq_len + 1}; use more data or a shorter seq_len")

    def rows(self, start: int, count: int) -> np.ndarray:
        t = self.seq_len
        out = np.empty((count, t + 1), dtype=np.int64)
        for j in range(count):
            epoch, p = divmod(start + j, self.num_windows)
            if self.shuffle_seed is not None:
                p = int(self._permutation(epoch)[p])
            out[j] = self.tokens[p * t:p * t + t + 1]
        return out

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            rng = np.random.default_rng([self.shuffle_seed, epoch])
            self._perm, self._perm_epoch = rng.permutation(self.num_windows), epoch
        return self._perm


class StreamWindows:
    """Windows of a streamed corpus, read in order; asking for an earlier window restarts the stream.

    The stream is endless: when a pass over the documents ends, the next pass follows in the same token stream.
    """

    def __init__(self, corpus: HFCorpus, tokenizer: Tokenizer, seq_len: int, docs_per_batch: int = 64) -> None:
        self.corpus, self.tokenizer, self.seq_len = corpus, tokenizer, seq_len
        self.docs_per_batch = docs_per_batch
        self._restart()

    def _restart(self) -> None:
        self._docs: Iterator[str] | None = None
        self._pass_tokens = 0
        self._buf = np.empty(0, dtype=np.int64)
        self._buf_start = 0  # global token index of _buf[0]

    def _next_chunk(self) -> np.ndarray:
        batch: list[str] = []
        while len(batch) < self.docs_per_batch:
            if self._docs is None:
                self._docs = iter(self.corpus.documents())
                self._pass_tokens = 0
            doc = next(self._docs, None)
            if doc is None:
                self._docs = None
                if self._pass_tokens == 0 and not batch:
                    raise DataError(f"data.source: {self.corpus.describe()} has no documents in the "
                                    f"'{self.corpus.split}' split")
                break
            batch.append(doc)
        flat: list[int] = []
        for ids in self.tokenizer.encode_batch(batch):
            flat.extend(ids)
            flat.append(self.tokenizer.eos_id)
        self._pass_tokens += len(flat)
        return np.asarray(flat, dtype=np.int64)

    def rows(self, start: int, count: int) -> np.ndarray:
        t = self.seq_len
        first, end = start * t, (start + count) * t + 1
        if first < self._buf_start:
            self._restart()
        while self._buf_start + len(self._buf) < end:
            drop = min(max(first - self._buf_start, 0), len(self._buf))  # tokens before `first` are not needed
            self._buf = np.concatenate([self._buf[drop:], self._next_chunk()])
            self._buf_start += drop
        off = first - self._buf_start
        out = np.stack([self._buf[off + j * t:off + j * t + t + 1] for j in range(count)])
        keep_from = (start + count) * t - self._buf_start
        self._buf, self._buf_start = self._buf[keep_from:], self._buf_start + keep_from
        return out


# --------------------------------------------------------------------------------------------------- dataset
class PackedWindowDataset(IterableDataset):
    """Endless micro-batches ``(inputs, labels)`` of this DP rank; its own iterator, stateful (plain ints)."""

    def __init__(self, windows: ArrayWindows | StreamWindows | BigramBackcopyWindows, *, seq_len: int,
                 global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_degree: int) -> None:
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
        if global_batch_size % dp_degree:
            raise DataError(f"training.global_batch_size {global_batch_size} is not divisible by the "
                            f"data-parallel degree {dp_degree}; pick a multiple")
        local = global_batch_size // dp_degree
        if micro_batch_size < 1 or local % micro_batch_size:
            raise DataError(f"training.micro_batch_size {micro_batch_size} does not divide the {local} sequences "
                            f"per DP rank (global {global_batch_size} / dp {dp_degree}); pick a divisor")
        self.windows = windows
        self.seq_len, self.global_batch_size, self.micro_batch_size = seq_len, global_batch_size, micro_batch_size
        self.dp_rank, self.dp_degree = dp_rank, dp_degree
        self.local_batch_size = local
        self.micro_batches_per_step = local // micro_batch_size
        self.position = 0    # global windows consumed by completed global steps
        self.micro_batch = 0  # micro-batches this rank has yielded of the current step
        self._peeked: tuple[int, torch.Tensor] | None = None  # (start, rows) read by peek() for the next __next__

    def __iter__(self) -> "PackedWindowDataset":
        return self

    def _rows(self) -> torch.Tensor:
        """The rows of the next micro-batch (read once: a stream cannot re-read them cheaply)."""
        start = self.position + self.dp_rank * self.local_batch_size + self.micro_batch * self.micro_batch_size
        if self._peeked is None or self._peeked[0] != start:
            self._peeked = (start, torch.from_numpy(self.windows.rows(start, self.micro_batch_size)))
        return self._peeked[1]

    def peek(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The micro-batch the next ``__next__`` returns, without consuming it (the state is unchanged)."""
        rows = self._rows()
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self._rows()
        self._peeked = None
        self.micro_batch += 1
        if self.micro_batch == self.micro_batches_per_step:
            self.position += self.global_batch_size
            self.micro_batch = 0
        return rows[:, :-1].contiguous(), rows[:, 1:].contiguous()

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "micro_batch": self.micro_batch, "seq_len": self.seq_len,
                "global_batch_size": self.global_batch_size, "micro_batch_size": self.micro_batch_size,
                "dp_degree": self.dp_degree}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        position, micro_batch = int(state["position"]), int(state.get("micro_batch", 0))
        layout = ("global_batch_size", "micro_batch_size", "dp_degree", "seq_len")
        same_layout = all(int(state.get(k, getattr(self, k))) == getattr(self, k) for k in layout)
        if micro_batch and not same_layout:
            raise DataError("data loader state was saved in the middle of a global step; resume it with the same "
                            "global/micro batch size, DP degree and seq_len, or from a checkpoint at a step end")
        saved_seq_len = int(state.get("seq_len", self.seq_len))
        if saved_seq_len != self.seq_len:  # keep the token position: skip no data, repeat at most one window
            position = math.ceil(position * saved_seq_len / self.seq_len)
        self.position, self.micro_batch = position, micro_batch


def _keep(batch):
    return batch


class TokenDataLoader:
    """Iterable of ``(inputs, labels)`` int64 tensors ``[micro_batch_size, seq_len]``, endless.

    Wraps a ``torchdata`` :class:`StatefulDataLoader` (``num_workers=0``, ``batch_size=None``) over a
    :class:`PackedWindowDataset`. ``state_dict()`` is a dict of plain ints, identical on every rank.
    """

    def __init__(self, dataset: PackedWindowDataset, *, description: str = "", cache_path: Path | None = None,
                 cache_info: dict | None = None) -> None:
        self.dataset = dataset
        self.description = description
        self.cache_path = cache_path
        self.cache_info = cache_info or {}
        with warnings.catch_warnings():  # torchdata calls a deprecated torch.set_vital on construction
            warnings.filterwarnings("ignore", message=".*set_vital.*")
            self.loader = StatefulDataLoader(dataset, batch_size=None, num_workers=0, collate_fn=_keep)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.loader)

    @property
    def num_windows(self) -> int | None:
        """Windows in one pass over the split (None for streams)."""
        return getattr(self.dataset.windows, "num_windows", None)

    def state_dict(self) -> dict[str, int]:
        return self.dataset.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state)
        self.loader.load_state_dict({})  # drop the torchdata iterator; the next one starts at the loaded position


def build_dataloader(data_cfg, tokenizer: Tokenizer, *, seq_len: int, global_batch_size: int,
                     micro_batch_size: int, dp_rank: int, dp_degree: int, split: str = "train",
                     seed: int = 0) -> TokenDataLoader:
    """The loader of ``split`` for DP rank ``dp_rank`` of ``dp_degree`` (see the module docstring).

    ``data_cfg`` is the ``data`` config section (source, tokenizer, text_field, val_fraction, cache_dir).
    ``seed`` orders the embedded corpus's training files and the training windows (draws the synthetic task's
    training windows); validation is never shuffled, so it is the same for every seed.
    """
    if seq_len < 1:
        raise DataError(f"training.seq_len must be positive, got {seq_len}")
    layout = dict(seq_len=seq_len, global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                  dp_rank=dp_rank, dp_degree=dp_degree)
    if is_synthetic(data_cfg.source):
        windows = BigramBackcopyWindows(data_cfg.source, tokenizer, seq_len, split, seed)
        return TokenDataLoader(PackedWindowDataset(windows, **layout), description=windows.task.describe())
    if is_pretokenized(data_cfg.source):
        tokens, description = open_split(data_cfg.source, split, tokenizer, data_cfg.val_fraction)
        windows = ArrayWindows(data_cfg.source, seq_len, description, tokens=tokens,
                               shuffle_seed=seed if split == "train" else None)
        return TokenDataLoader(PackedWindowDataset(windows, **layout), description=description)
    corpus = resolve_source(data_cfg.source, split, text_field=data_cfg.text_field,
                            val_fraction=data_cfg.val_fraction, seed=seed if split == "train" else None)
    if isinstance(corpus, HFCorpus):
        corpus.open()  # fail now, not at the first step, when the hub cannot be reached
        dataset = PackedWindowDataset(StreamWindows(corpus, tokenizer, seq_len), **layout)
        return TokenDataLoader(dataset, description=corpus.describe())
    path, info = token_cache(corpus, tokenizer, cache_root(getattr(data_cfg, "cache_dir", "")))
    windows = ArrayWindows(path, seq_len, corpus.describe(), shuffle_seed=seed if split == "train" else None)
    dataset = PackedWindowDataset(windows, **layout)
    return TokenDataLoader(dataset, description=corpus.describe(), cache_path=path, cache_info=info)
