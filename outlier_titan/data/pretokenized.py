"""Pre-tokenized corpora: token shards on disk plus a manifest, written once by ``scripts/pretokenize.py``.

Layout of ``DIR``::

    manifest.json                     format, tokenizer fingerprint, per split: shards, documents, tokens
    train-00000.npy, train-00001.npy  flat token arrays (uint16, uint32 above 65,536 tokens), EOS after each doc
    validation-00000.npy

The documents of each split are exactly those the raw source gives for that split (same order, same
train/validation rule with the manifest's ``val_fraction``), so the concatenated shards of a split equal the
token cache the raw source would build, and ``data.source = DIR`` trains on the same windows: the loader reads
the shards as one memory-mapped global token stream (resumable and reshardable like every file source).
Sources: whatever ``data.source`` reads, and a folder saved by ``datasets``' ``save_to_disk`` (its own
validation split if it has one, else split by document-index hash). Tokenisation runs on ``workers`` processes
over chunks of documents, results kept in order.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np

from outlier_titan.data.sources import SPLITS, resolve_source
from outlier_titan.data.tokenizer import Tokenizer, build_tokenizer
from outlier_titan.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "outlier_titan.pretokenized"
VERSION = 1
_CHUNK_CHARS = 1 << 20  # a work item sent to a worker: this many characters or _CHUNK_DOCS documents
_CHUNK_DOCS = 64


def is_pretokenized(source: str) -> bool:
    return (Path(source).expanduser() / MANIFEST).is_file()


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder).expanduser() / MANIFEST
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"data.source: cannot read {path} ({e}); re-run scripts/pretokenize.py") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataError(f"data.source: {path} is not a version-{VERSION} {FORMAT} manifest; re-run "
                        "scripts/pretokenize.py")
    return manifest


class ShardedTokens:
    """The shards of one split as one read-only 1-D token sequence (slices may span shards)."""

    def __init__(self, paths: list[Path]):
        self.arrays = [np.load(p, mmap_mode="r") for p in paths]
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, s: slice) -> np.ndarray:
        start, stop, _ = s.indices(len(self))
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        parts = []
        while start < stop:
            a, base = self.arrays[first], int(self.offsets[first])
            end = min(stop, base + len(a))
            parts.append(a[start - base:end - base])
            start, first = end, first + 1
        if not parts:
            return np.empty(0, dtype=self.arrays[0].dtype)
        return np.concatenate(parts) if len(parts) > 1 else np.asarray(parts[0])


def open_split(folder: str | Path, split: str, tokenizer: Tokenizer,
               val_fraction: float | None = None) -> tuple[ShardedTokens, str]:
    """The tokens of ``split`` in a pre-tokenized folder, after checking they were made with ``tokenizer``
    (and, if given, split with ``val_fraction``)."""
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder)
    if manifest["tokenizer"] != tokenizer.fingerprint or manifest["eos_id"] != tokenizer.eos_id:
        raise DataError(f"data.source: {folder} was tokenized with {manifest['tokenizer_spec']!r} "
                        f"(fingerprint {manifest['tokenizer'][:24]}), not this run's data.tokenizer "
                        f"({tokenizer.fingerprint[:24]}); set data.tokenizer to the shards' tokenizer or re-run "
                        f"scripts/pretokenize.py with this one")
    if val_fraction is not None and val_fraction != manifest["val_fraction"]:
        raise DataError(f"data.val_fraction = {val_fraction} but {folder} was split with {manifest['val_fraction']}; "
                        f"set data.val_fraction = {manifest['val_fraction']} or re-run scripts/pretokenize.py with "
                        f"--val-fraction {val_fraction}")
    entry = manifest["splits"].get(split)
    if not entry or not entry["tokens"]:
        raise DataError(f"data.source: {folder} has no '{split}' tokens; re-run scripts/pretokenize.py with a "
                        f"corpus that has a {split} split")
    paths = [folder / s["file"] for s in entry["shards"]]
    missing = [p.name for p in paths if not p.is_file()]
    if missing:
        raise DataError(f"data.source: {folder} lacks shard {missing[0]} listed in {MANIFEST}; copy it or re-run "
                        f"scripts/pretokenize.py")
    return ShardedTokens(paths), f"{folder} (pre-tokenized)"


# --------------------------------------------------------------------------------------------- writing
_WORKER_TOKENIZER: Tokenizer | None = None


def _init_worker(spec: str) -> None:
    global _WORKER_TOKENIZER
    _WORKER_TOKENIZER = build_tokenizer(spec)


def _encode_chunk(docs: list[str]) -> np.ndarray:
    tok = _WORKER_TOKENIZER
    flat: list[int] = []
    for ids in tok.encode_batch(docs, num_threads=1):
        flat.extend(ids)
        flat.append(tok.eos_id)
    return np.asarray(flat, dtype=np.uint32)


def _chunks(docs: Iterator[str]) -> Iterator[list[str]]:
    chunk, chars = [], 0
    for d in docs:
        chunk.append(d)
        chars += len(d)
        if chars >= _CHUNK_CHARS or len(chunk) >= _CHUNK_DOCS:
            yield chunk
            chunk, chars = [], 0
    if chunk:
        yield chunk


def _is_disk_dataset(source: str) -> bool:
    """A folder written by ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    p = Path(source).expanduser()
    return (p / "dataset_dict.json").is_file() or (p / "state.json").is_file()


def _disk_dataset_documents(source: str, split: str, text_field: str, val_fraction: float) -> Iterator[str]:
    """Documents of an HF dataset saved to disk: its own split when a DatasetDict has it, else the train (or
    only) split cut by the hash of the document index, the rule of a single jsonl file."""
    from outlier_titan.data.sources import is_validation

    try:
        import datasets
    except ImportError:
        raise DataError(f"{source} is a Hugging Face dataset saved to disk; reading it needs the 'datasets' "
                        "package: pip install 'outlier_titan[hf]'") from None
    ds = datasets.load_from_disk(str(Path(source).expanduser()))
    hash_split = True
    if isinstance(ds, datasets.DatasetDict):
        if split in ds and (split == "validation" or "validation" in ds):
            ds, hash_split = ds[split], False
        elif "train" in ds:
            ds = ds["train"]
        else:
            raise DataError(f"{source}: the saved DatasetDict has no 'train' split (has {', '.join(ds)})")
    if text_field not in ds.column_names:
        raise DataError(f"{source}: the dataset has no column '{text_field}' (has {', '.join(ds.column_names)}); "
                        "pass --text-field")

    def docs() -> Iterator[str]:
        for index, record in enumerate(ds):
            if hash_split and is_validation(f"doc:{index}", val_fraction) != (split == "validation"):
                continue
            if isinstance(record[text_field], str):
                yield record[text_field]
    return docs()


def _documents(source: str, split: str, text_field: str, val_fraction: float, seed: int) -> Iterator[str]:
    """The documents of ``split``: a ``data.source`` value or an HF dataset saved to disk (checked now)."""
    if _is_disk_dataset(source):
        return _disk_dataset_documents(source, split, text_field, val_fraction)
    corpus = resolve_source(source, split, text_field=text_field, val_fraction=val_fraction, seed=seed)
    return corpus.documents()


class _ShardWriter:
    """Appends token arrays to ``<split>-NNNNN.npy`` files of at most ``shard_tokens`` tokens."""

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int):
        self.folder, self.split, self.dtype, self.limit = folder, split, dtype, shard_tokens
        self.shards: list[dict] = []
        self._parts: list[np.ndarray] = []
        self._n = self._docs = 0

    def add(self, tokens: np.ndarray, docs: int) -> None:
        self._parts.append(tokens.astype(self.dtype))
        self._n += len(tokens)
        self._docs += docs
        if self._n >= self.limit:
            self.flush()

    def flush(self) -> None:
        if not self._n:
            return
        name = f"{self.split}-{len(self.shards):05d}.npy"
        np.save(self.folder / name, np.concatenate(self._parts))
        self.shards.append({"file": name, "tokens": self._n, "documents": self._docs})
        self._parts, self._n, self._docs = [], 0, 0


def pretokenize(source: str, tokenizer_spec: str, out: str | Path, *, workers: int = 1, text_field: str = "text",
                val_fraction: float = 0.02, seed: int = 0, shard_tokens: int = 1 << 28,
                progress: bool = True) -> dict:
    """Tokenizes both splits of ``source`` into shards under ``out`` (a new folder) and returns the manifest.

    ``seed`` orders the embedded corpus's training files as a run with ``training.seed = seed`` would.
    The folder appears complete or not at all (written beside it, then renamed).
    """
    from tqdm import tqdm

    out = Path(out).expanduser()
    if out.exists():
        raise DataError(f"--out {out} already exists; pass a new folder (nothing was written)")
    if workers < 1:
        raise DataError(f"--workers must be at least 1, got {workers}")
    tokenizer = build_tokenizer(tokenizer_spec)
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    for split in SPLITS:  # fail on a bad source before starting workers
        _documents(source, split, text_field, val_fraction, seed)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.tmp-"))
    t0 = time.perf_counter()
    manifest = {"format": FORMAT, "version": VERSION, "source": str(source), "tokenizer": tokenizer.fingerprint,
                "tokenizer_spec": tokenizer_spec, "eos_id": tokenizer.eos_id, "vocab_size": tokenizer.vocab_size,
                "dtype": dtype.name, "text_field": text_field, "val_fraction": val_fraction, "seed": seed,
                "splits": {}}
    ctx = mp.get_context("spawn")  # no fork of a process that may hold threads (tiktoken, torch)
    try:
        with ctx.Pool(workers, initializer=_init_worker, initargs=(tokenizer_spec,)) as pool:
            for split in SPLITS:
                writer = _ShardWriter(tmp, split, dtype, shard_tokens)
                chunks = _chunks(_documents(source, split, text_field, val_fraction, seed))
                sizes: list[int] = []

                def counted(it=chunks, sizes=sizes):
                    for c in it:
                        sizes.append(len(c))
                        yield c

                bar = tqdm(desc=f"pretokenize {split}", unit="doc", disable=not progress)
                for i, tokens in enumerate(pool.imap(_encode_chunk, counted(), chunksize=1)):
                    writer.add(tokens, sizes[i])
                    bar.update(sizes[i])
                    bar.set_postfix(tokens=sum(s["tokens"] for s in writer.shards) + writer._n)
                bar.close()
                writer.flush()
                manifest["splits"][split] = {"shards": writer.shards,
                                             "documents": sum(s["documents"] for s in writer.shards),
                                             "tokens": sum(s["tokens"] for s in writer.shards)}
        manifest["seconds"] = round(time.perf_counter() - t0, 3)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return manifest
