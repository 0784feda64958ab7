"""Tokenizer: a thin wrapper over a ``tiktoken.Encoding``.

Three ways to get one (``data.tokenizer``):

* ``"embedded"``: the byte-level BPE trained by ``outlier_titan.tools.train_tokenizer`` on this Python's standard
  library, shipped as package data ``outlier_titan/assets/tokenizer/stdlib_bpe.tiktoken`` (no network needed);
* a path to a tiktoken BPE rank file: one ``<base64 token> <rank>`` per line, ranks 0..n-1 (the format of
  ``tiktoken.load.load_tiktoken_bpe``; Llama-3's ``tokenizer.model`` is such a file);
* ``"bytes"``: the 256 single-byte tokens and no merges (vocabulary 257 with ``<|endoftext|>`` = 256); for the
  synthetic Bigram-Backcopy task (``data.source = "bigram_backcopy"``), which uses only token ids below the
  end-of-text id, so the model's vocabulary axis stays small (Guo et al. 2024 train on a small vocabulary too);
* ``"tiktoken:<name>"``: a named tiktoken encoding (e.g. ``cl100k_base``); tiktoken downloads it once, so this works
  offline only when tiktoken's cache already has it.

Rank files get the GPT-4 split regex below and one special token, ``<|endoftext|>``, with id = number of ranks
(so the vocabulary size is ranks + 1). Named encodings keep their own regex and special tokens.

``encode`` never produces special tokens: a literal ``<|endoftext|>`` inside a document is encoded as ordinary text.
The only way an EOS id enters the token stream is the packer appending ``eos_id`` after each document.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from pathlib import Path

import tiktoken

from outlier_titan.errors import DataError
from outlier_titan.packaged import embedded_bpe

EOS_TOKEN = "<|endoftext|>"

# GPT-4 (cl100k) style pre-split, in order of the alternatives:
#   English contractions ('s 't 'll ...), case-insensitive;
#   a run of letters, optionally preceded by one non-letter/non-digit that is not a newline (" foo", "_bar");
#   1 to 3 digits;
#   punctuation/symbol runs with an optional leading space, swallowing trailing newlines;
#   trailing whitespace at the end of the text; whitespace up to and including newlines;
#   whitespace not followed by a non-space (so " foo" keeps its space); any remaining whitespace.
# Possessive quantifiers (?+, ++, *+) keep the regex linear; both tiktoken and the ``regex`` module support them.
SPLIT_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)"""
    r"""|[^\r\n\p{L}\p{N}]?+\p{L}++"""
    r"""|\p{N}{1,3}+"""
    r"""| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$"""
    r"""|\s*[\r\n]"""
    r"""|\s+(?!\S)"""
    r"""|\s"""
)

EMBEDDED_BPE = embedded_bpe()


class Tokenizer:
    """Text <-> token ids. ``vocab_size`` counts the special tokens; ``fingerprint`` identifies the vocabulary."""

    def __init__(self, encoding: tiktoken.Encoding, *, fingerprint: str, eos_token: str = EOS_TOKEN) -> None:
        self.encoding = encoding
        self.fingerprint = fingerprint
        self.eos_token = eos_token
        self.eos_id: int = encoding.encode_single_token(eos_token)

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    @property
    def name(self) -> str:
        return self.encoding.name

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str], num_threads: int = 2) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=num_threads)

    def decode(self, ids) -> str:
        return self.encoding.decode([int(i) for i in ids])

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


def read_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """Parses a tiktoken BPE rank file; every problem is a DataError naming the file (and line)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise DataError(f"data.tokenizer: cannot read BPE file {path} ({e.strerror or e}); pass 'embedded', "
                        "a tiktoken BPE rank file or tiktoken:<encoding>") from None
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            token = base64.b64decode(parts[0], validate=True)
            rank = int(parts[1])
        except (ValueError, binascii.Error):
            raise DataError(f"data.tokenizer: {path} line {lineno} is not '<base64 token> <rank>'; "
                            "the file is not a tiktoken BPE rank file") from None
        if token in ranks:
            raise DataError(f"data.tokenizer: {path} line {lineno} repeats a token; the BPE file is corrupt")
        ranks[token] = rank
    if not ranks:
        raise DataError(f"data.tokenizer: {path} has no tokens; the file is not a tiktoken BPE rank file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise DataError(f"data.tokenizer: ranks in {path} are not 0..{len(ranks) - 1} without gaps or repeats; "
                        "the BPE file is corrupt")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise DataError(f"data.tokenizer: {path} lacks {len(missing)} of the 256 single-byte tokens; "
                        "a byte-level BPE rank file must contain all of them")
    return ranks


def tokenizer_from_ranks(ranks: dict[bytes, int], *, name: str, fingerprint: str) -> Tokenizer:
    """A tokenizer with the GPT-4 split regex and ``<|endoftext|>`` = len(ranks)."""
    enc = tiktoken.Encoding(name, pat_str=SPLIT_PATTERN, mergeable_ranks=ranks,
                            special_tokens={EOS_TOKEN: len(ranks)})
    return Tokenizer(enc, fingerprint=fingerprint)


def load_bpe_file(path: str | Path) -> Tokenizer:
    path = Path(path)
    ranks = read_bpe_ranks(path)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return tokenizer_from_ranks(ranks, name=path.stem, fingerprint=f"bpe:{digest}")


def _named_encoding(name: str) -> Tokenizer:
    try:
        enc = tiktoken.get_encoding(name)
    except Exception as e:  # unknown name, or the download failed (offline / no cache)
        raise DataError(f"data.tokenizer: tiktoken encoding '{name}' is not available ({type(e).__name__}); it is "
                        "either unknown or not cached and cannot be downloaded: pass a BPE rank file path "
                        "instead") from None
    if EOS_TOKEN not in enc.special_tokens_set:
        enc = tiktoken.Encoding(f"{enc.name}_eos", pat_str=enc._pat_str, mergeable_ranks=enc._mergeable_ranks,
                                special_tokens={**enc._special_tokens, EOS_TOKEN: enc.n_vocab})
    return Tokenizer(enc, fingerprint=f"tiktoken:{name}:{enc.n_vocab}")


# Vocabulary sizes (n_vocab, <|endoftext|> included) of tiktoken's named encodings, so that a dry run can plan
# a model for one that is not cached on an offline machine.
NAMED_VOCAB_SIZES = {"gpt2": 50257, "r50k_base": 50257, "p50k_base": 50281, "cl100k_base": 100277,
                     "o200k_base": 200019}


def planning_vocab(spec: str) -> tuple[int, str]:
    """(vocabulary size, description) of ``data.tokenizer`` for planning: the loaded tokenizer's, or for a named
    tiktoken encoding that cannot be loaded here (offline, not cached) its published size."""
    try:
        tok = build_tokenizer(spec)
        return tok.vocab_size, tok.name
    except DataError:
        name = spec.split(":", 1)[1] if spec.startswith("tiktoken:") else None
        if name not in NAMED_VOCAB_SIZES:
            raise
        return NAMED_VOCAB_SIZES[name], f"{name}, not cached here: its published vocabulary"


def byte_tokenizer() -> Tokenizer:
    """The 256 single-byte tokens without merges and ``<|endoftext|>`` = 256."""
    return tokenizer_from_ranks({bytes([b]): b for b in range(256)}, name="bytes", fingerprint="bytes:256")


def build_tokenizer(spec: str) -> Tokenizer:
    """``"embedded"``, ``"bytes"``, a BPE rank file path, or ``"tiktoken:<name>"`` (see the module docstring)."""
    if spec == "bytes":
        return byte_tokenizer()
    if spec == "embedded":
        if not EMBEDDED_BPE.is_file():
            raise DataError(f"data.tokenizer: the shipped BPE file {EMBEDDED_BPE} is missing; reinstall the package "
                            "or rebuild it with python -m outlier_titan.tools.train_tokenizer")
        return load_bpe_file(EMBEDDED_BPE)
    if spec.startswith("tiktoken:"):
        return _named_encoding(spec.split(":", 1)[1])
    path = Path(spec).expanduser()
    if not path.is_file():
        raise DataError(f"data.tokenizer: {spec!r} is not a file; pass 'embedded', 'bytes', a tiktoken BPE rank "
                        "file or tiktoken:<encoding>")
    return load_bpe_file(path)
