"""Document sources: iterators of text documents for one split.

``data.source`` is resolved by :func:`resolve_source`:

* ``"embedded"``: the ``.py`` files of the running interpreter's standard library (``site-packages`` and
  ``dist-packages`` excluded), in sorted relative-path order; the file order is then shuffled with ``seed``
  (same on every rank), so short runs see varied files.
* a path: a ``.txt`` (one document per file), ``.jsonl`` (one JSON object per line, text in ``text_field``) or
  ``.parquet`` file (column ``text_field``), or a folder searched recursively for these, in sorted order.
* ``"c4"`` / ``"fineweb"``: Hugging Face ``datasets`` streaming (optional extra). Only these touch the network.

``"bigram_backcopy"`` (optionally ``"bigram_backcopy:key=value,..."``) is not a document source: it names the
synthetic Bigram-Backcopy task, whose token windows :mod:`outlier_titan.data.synthetic` generates directly (the
loader routes it there before reaching :func:`resolve_source`).

Train/validation split, deterministic and independent of the number of ranks: a key is validation when
``stable_fraction(key) < val_fraction``.

* several files: the key is the file's relative path (split by file); if that leaves one side empty, the file
  with the smallest (or largest) fraction is moved over, so each side has at least one file;
* a single ``.jsonl``/``.parquet`` file: the key is the document index;
* a single ``.txt`` file (one document): its last ``val_fraction`` of lines (at least one) is validation;
* fineweb has no validation split: documents of its train stream are split by the hash of their index;
  c4 uses its own ``validation`` split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from outlier_titan.data.synthetic import NAME as SYNTHETIC_NAME
from outlier_titan.errors import DataError
from outlier_titan.options import DATA_SOURCE_NAMES

SPLITS = ("train", "validation")
FILE_SUFFIXES = (".txt", ".jsonl", ".parquet")
_EXCLUDED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass(frozen=True)
class HFDataset:
    path: str
    config: str
    validation_split: str | None  # None: hash-split the train stream


# ------------------------------------------------------------------------------------ the named sources' registry


@dataclass(frozen=True)
class NamedSource:
    """A ``data.source`` given by name rather than by path: ``embedded``, a Hugging Face dataset, the synthetic task.

    ``open(name, split, text_field, val_fraction, seed)`` returns the corpus; a synthetic source (token windows made
    on demand by :mod:`outlier_titan.data.synthetic`, routed there by the loader) has none. ``parameters``: the
    name may carry them, ``name:key=value,...``."""

    name: str
    help: str
    open: Callable[..., Any] | None
    hf: HFDataset | None = None
    parameters: bool = False

    def matches(self, source: str) -> bool:
        return source == self.name or (self.parameters and source.startswith(self.name + ":"))


_SOURCES: dict[str, NamedSource] = {}
HF_DATASETS: dict[str, HFDataset] = {}
"""The registered Hugging Face datasets by name (derived from the registry)."""


def register_source(source: NamedSource) -> NamedSource:
    """Makes ``source.name`` a valid ``data.source`` (the config's ``--help`` lists it; a local path of the same
    name is then shadowed)."""
    if source.name in _SOURCES:
        raise DataError(f"data source {source.name!r} is already registered; pick another name")
    _SOURCES[source.name] = source
    if source.hf is not None:
        HF_DATASETS[source.name] = source.hf
    DATA_SOURCE_NAMES.add(source.name)
    return source


def named_source(source: str) -> NamedSource | None:
    """The registered source that ``data.source`` names, or None (a path)."""
    return next((s for s in _SOURCES.values() if s.matches(source)), None)


def tokenizer_mismatch(source: str, spec: str) -> str | None:
    """A one-line warning when the embedded BPE (4,096 tokens of Python source) is paired with a web-text
    source; None otherwise."""
    if spec != "embedded" or source not in HF_DATASETS:
        return None
    return (f"data.tokenizer 'embedded' is a 4,096-token BPE trained on Python source, a poor fit for "
            f"data.source '{source}' (English web text); set data.tokenizer to 'tiktoken:gpt2', "
            f"'tiktoken:cl100k_base' or the path of a Llama-3 tokenizer.model")


def stable_fraction(key: str) -> float:
    """A number in [0, 1) from a hash of ``key``: the same in every process, Python version and machine."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") / 2.0**64


def is_validation(key: str, val_fraction: float) -> bool:
    return stable_fraction(key) < val_fraction


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


# ----------------------------------------------------------------------------------------------- file sources
@dataclass
class FileCorpus:
    """A finite, re-iterable set of documents from files (the embedded corpus or local files)."""

    kind: str                      # "embedded" or "files"
    root: Path                     # folder the relative paths are taken from
    files: list[str]               # relative posix paths of this split, in reading order
    split: str
    text_field: str = "text"
    val_fraction: float = 0.02
    doc_split: str = "file"        # "file", "index" (single jsonl/parquet) or "lines" (single txt)
    shuffled_with: int | None = None
    source: str = ""               # what data.source named (a single file is named, not its folder)

    def describe(self) -> str:
        return "embedded stdlib corpus" if self.kind == "embedded" else (self.source or str(self.root))

    def file_stats(self) -> list[tuple[str, int, int]]:
        """(relative path, size, mtime_ns) of every file, for cache fingerprints."""
        out = []
        for rel in self.files:
            st = (self.root / rel).stat()
            out.append((rel, st.st_size, st.st_mtime_ns))
        return out

    def documents(self) -> Iterator[str]:
        for rel in self.files:
            path = self.root / rel
            if self.doc_split == "lines":
                yield from self._line_split(path)
                continue
            for index, text in enumerate(_read_documents(path, self.text_field)):
                if self.doc_split == "index" and is_validation(f"doc:{index}", self.val_fraction) != (
                        self.split == "validation"):
                    continue
                yield text

    def _line_split(self, path: Path) -> Iterator[str]:
        text = next(iter(_read_documents(path, self.text_field)), "")
        lines = text.splitlines(keepends=True)
        n_val = max(1, round(len(lines) * self.val_fraction)) if len(lines) > 1 else 0
        part = lines[len(lines) - n_val:] if self.split == "validation" else lines[:len(lines) - n_val]
        if part:
            yield "".join(part)


def _read_documents(path: Path, text_field: str) -> Iterator[str]:
    suffix = path.suffix.lower()
    if suffix in (".txt", ".py"):
        try:
            yield path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            if suffix == ".txt":
                raise DataError(f"data.source: cannot read {path} as UTF-8 text; convert or remove it") from None
        return
    if suffix == ".jsonl":
        yield from _read_jsonl(path, text_field)
    elif suffix == ".parquet":
        yield from _read_parquet(path, text_field)
    else:
        raise DataError(f"data.source: {path} has an unsupported type; use .txt, .jsonl or .parquet files")


def _read_jsonl(path: Path, text_field: str) -> Iterator[str]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"data.source: cannot read {path} ({e.strerror or e}); check the path and permissions") \
            from None
    with f:
        yield from _jsonl_records(f, path, text_field)


def _jsonl_records(f, path: Path, text_field: str) -> Iterator[str]:
    lineno = 0
    try:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise DataError(f"data.source: {path} line {lineno} is not valid JSON; fix or remove the line") \
                    from None
            if not isinstance(record, dict) or not isinstance(record.get(text_field), str):
                raise DataError(f"data.source: {path} line {lineno} has no string field '{text_field}'; "
                                "set data.text_field to the field holding the text")
            yield record[text_field]
    except UnicodeDecodeError:
        raise DataError(f"data.source: {path} near line {lineno + 1} is not UTF-8; convert the file") from None


def _read_parquet(path: Path, text_field: str) -> Iterator[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"data.source: reading {path} needs pyarrow; pip install pyarrow "
                        "(or pip install 'outlier_titan[parquet]')") from None
    try:
        pfile = pq.ParquetFile(path)
    except Exception as e:
        raise DataError(f"data.source: cannot read {path} as parquet ({type(e).__name__}); check the file") \
            from None
    if text_field not in pfile.schema_arrow.names:
        raise DataError(f"data.source: {path} has no column '{text_field}' (columns: "
                        f"{', '.join(pfile.schema_arrow.names)}); set data.text_field")
    for batch in pfile.iter_batches(columns=[text_field], batch_size=1024):
        for text in batch.column(0).to_pylist():
            if text is not None:
                yield text


def _split_files(files: list[str], split: str, val_fraction: float) -> list[str]:
    """Split by relative path; with two or more files, each side keeps at least one."""
    frac = {rel: stable_fraction(rel) for rel in files}
    val = {rel for rel in files if frac[rel] < val_fraction}
    if len(files) >= 2:
        if not val:
            val = {min(files, key=frac.__getitem__)}
        elif len(val) == len(files):
            val.discard(max(files, key=frac.__getitem__))
    return [rel for rel in files if (rel in val) == (split == "validation")]


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def embedded_files(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the standard library's ``.py`` files (no site-/dist-packages)."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
        rel_dir = Path(dirpath).relative_to(root)
        out.extend((rel_dir / f).as_posix() for f in filenames if f.endswith(".py"))
    return sorted(out)


def embedded_corpus(split: str, val_fraction: float = 0.02, seed: int | None = 0) -> FileCorpus:
    """The stdlib corpus of ``split``; file order shuffled by ``seed`` (``None``: sorted order)."""
    _check_split(split)
    root = stdlib_root()
    files = _split_files(embedded_files(root), split, val_fraction)
    if seed is not None:
        random.Random(seed).shuffle(files)
    return FileCorpus("embedded", root, files, split, val_fraction=val_fraction, shuffled_with=seed)


def local_corpus(source: str, split: str, text_field: str = "text", val_fraction: float = 0.02) -> FileCorpus:
    _check_split(split)
    path = Path(source).expanduser()
    if not path.exists():
        raise DataError(f"data.source: path {source} does not exist; pass an existing .txt/.jsonl/.parquet file "
                        "or folder, or a named source: " + ", ".join(_SOURCES))
    if path.is_file():
        if path.suffix.lower() not in FILE_SUFFIXES:
            raise DataError(f"data.source: {source} is not a .txt, .jsonl or .parquet file; convert it or "
                            "point data.source at a folder of such files")
        if path.stat().st_size == 0:
            raise DataError(f"data.source: {source} is empty; put text in it or point data.source at another file")
        root, files = path.parent, [path.name]
    else:
        root = path
        files = sorted(p.relative_to(path).as_posix() for p in path.rglob("*")
                       if p.is_file() and p.suffix.lower() in FILE_SUFFIXES)
        if not files:
            raise DataError(f"data.source: folder {source} has no .txt, .jsonl or .parquet files; "
                            "point data.source at a folder that has")
    if len(files) == 1:
        doc_split = "lines" if files[0].lower().endswith(".txt") else "index"
        return FileCorpus("files", root, files, split, text_field, val_fraction, doc_split, source=str(path))
    return FileCorpus("files", root, _split_files(files, split, val_fraction), split, text_field, val_fraction,
                      source=str(path))


# ----------------------------------------------------------------------------------------------- HF streaming
@dataclass
class HFCorpus:
    """A Hugging Face streaming dataset; :meth:`documents` is one pass over the split (opened anew each call)."""

    name: str
    spec: HFDataset
    split: str
    text_field: str = "text"
    val_fraction: float = 0.02
    _stream: Any = field(default=None, repr=False, compare=False)

    def describe(self) -> str:
        return f"{self.name} ({self.spec.path}/{self.spec.config})"

    def open(self):
        """The streaming dataset (opened once; iterating it again restarts the stream)."""
        if self._stream is not None:
            return self._stream
        import datasets  # checked by hf_corpus

        hf_split = self.spec.validation_split if self.split == "validation" and self.spec.validation_split \
            else "train"
        try:
            self._stream = datasets.load_dataset(self.spec.path, self.spec.config, split=hf_split, streaming=True)
            return self._stream
        except Exception as e:  # offline, hub errors, missing auth
            raise DataError(f"data.source: cannot open {self.describe()} from the Hugging Face hub "
                            f"({type(e).__name__}); check the network/HF_HUB_OFFLINE, or use a local copy "
                            "(data.source=PATH to jsonl/parquet)") from None

    def documents(self) -> Iterator[str]:
        hash_split = self.spec.validation_split is None
        want_val = self.split == "validation"
        try:
            for index, record in enumerate(self.open()):
                if hash_split and is_validation(f"doc:{index}", self.val_fraction) != want_val:
                    continue
                text = record.get(self.text_field)
                if not isinstance(text, str):
                    raise DataError(f"data.source: records of {self.describe()} have no string field "
                                    f"'{self.text_field}'; set data.text_field")
                yield text
        except (OSError, ConnectionError) as e:
            raise DataError(f"data.source: streaming {self.describe()} failed ({type(e).__name__}); check the "
                            "network, or use a local copy (data.source=PATH)") from None


def hf_corpus(name: str, split: str, text_field: str = "text", val_fraction: float = 0.02) -> HFCorpus:
    _check_split(split)
    try:
        import datasets  # noqa: F401
    except ImportError:
        raise DataError(f"data.source '{name}' needs the Hugging Face 'datasets' package; "
                        "pip install 'outlier_titan[hf]' (or use 'embedded' or a local path)") from None
    return HFCorpus(name, HF_DATASETS[name], split, text_field, val_fraction)


def resolve_source(source: str, split: str, *, text_field: str = "text", val_fraction: float = 0.02,
                   seed: int | None = 0) -> FileCorpus | HFCorpus:
    """The corpus named by ``data.source`` for ``split``; DataError for anything unusable.

    ``seed`` shuffles the embedded corpus's file order (None: sorted); other sources are read in order."""
    named = named_source(source)
    if named is not None and named.open is None:
        raise DataError(f"data.source: '{source}' is a synthetic task without documents (nothing to read or "
                        "pretokenize); use it as data.source of a training run directly")
    if named is not None and not (named.hf is not None and Path(source).exists()):
        return named.open(source, split, text_field=text_field, val_fraction=val_fraction, seed=seed)
    looks_like_path = any(c in source for c in "/\\.~") or Path(source).exists()
    if not looks_like_path:
        raise DataError(f"data.source: unknown dataset '{source}'; use a path to .txt/.jsonl/.parquet data or one "
                        "of " + ", ".join(_SOURCES))
    return local_corpus(source, split, text_field, val_fraction)


def _open_embedded(name: str, split: str, *, text_field: str, val_fraction: float, seed: int | None) -> FileCorpus:
    return embedded_corpus(split, val_fraction, seed)


def _open_hf(name: str, split: str, *, text_field: str, val_fraction: float, seed: int | None) -> HFCorpus:
    return hf_corpus(name, split, text_field, val_fraction)


register_source(NamedSource("embedded", "this Python's stdlib source", _open_embedded))
register_source(NamedSource("c4", "Hugging Face allenai/c4 (en), streamed", _open_hf,
                            hf=HFDataset("allenai/c4", "en", "validation")))
register_source(NamedSource("fineweb", "Hugging Face HuggingFaceFW/fineweb (sample-10BT), streamed", _open_hf,
                            hf=HFDataset("HuggingFaceFW/fineweb", "sample-10BT", None)))
register_source(NamedSource(SYNTHETIC_NAME, f"the synthetic Bigram-Backcopy task, "
                            f"'{SYNTHETIC_NAME}[:states=64,triggers=3,alpha=0.2,seed=0]'", None, parameters=True))


@functools.lru_cache(maxsize=None)
def embedded_fingerprint() -> dict[str, object]:
    """What the embedded corpus is on this interpreter: its ``.py`` files, their bytes and a SHA-256 over (path,
    content) in sorted order (16 hex digits), so reports can say which standard library a run trained on."""
    root = stdlib_root()
    digest, size = hashlib.sha256(), 0
    files = embedded_files(root)
    for rel in files:
        data = (root / rel).read_bytes()
        size += len(data)
        digest.update(rel.encode() + b"\0" + data)
    return {"source": "embedded", "python": platform.python_version(), "files": len(files), "bytes": size,
            "sha256": digest.hexdigest()[:16]}
