"""Tokenizer and BPE trainer: round trips, the trainer against a brute-force reference, the shipped asset."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
import tiktoken.load

from outlier_titan.data import Tokenizer, build_tokenizer
from outlier_titan.data.bpe_train import count_words, train_bpe, train_bpe_from_texts, write_bpe_file
from outlier_titan.data.sources import stdlib_root
from outlier_titan.data.tokenizer import EMBEDDED_BPE, EOS_TOKEN, read_bpe_ranks
from outlier_titan.errors import DataError

TEXT = (
    "the quick brown fox jumps over the lazy dog. the dog sleeps; the fox runs.\n"
    "def hello(name):\n    return 'hello ' + name\n\n"
    "hello world, hello there, hello again. Numbers 12345 and 2024 stay digits.\n"
)


def _reference_bpe(word_counts: dict[bytes, int], num_ranks: int, min_pair_count: int = 2) -> list[bytes]:
    """Textbook BPE: recount every pair after every merge (slow, obviously right)."""
    vocab = [bytes([i]) for i in range(256)]
    words = {tuple(w): n for w, n in word_counts.items()}
    while len(vocab) < num_ranks:
        pairs: Counter = Counter()
        for w, n in words.items():
            for p in zip(w, w[1:]):
                pairs[p] += n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < min_pair_count:
            break
        merged = vocab[best[0]] + vocab[best[1]]
        new_id = vocab.index(merged) if merged in vocab else len(vocab)
        if new_id == len(vocab):
            vocab.append(merged)
        new_words: Counter = Counter()
        for w, n in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(new_id)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] += n
        words = new_words
    return vocab


def test_trainer_matches_bruteforce_reference():
    rng = random.Random(0)
    syllables = ["ab", "ba", "abc", "cab", "aa", "b", "c", "ca", "bb"]
    texts = [" ".join("".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
                      for _ in range(60)) for _ in range(5)]
    counts = count_words(texts)
    fast = train_bpe(counts, 256 + 60)
    assert len(fast) > 256 + 20
    assert fast == _reference_bpe(dict(counts), 256 + 60)


def test_trainer_hand_example():
    # (a,b)=8 first; after it (b,c) drops from 4 to 1, so the second merge is "ab"+"c" (3), then nothing >= 2.
    assert train_bpe({b"ab": 5, b"abc": 3, b"bc": 1}, 300)[256:] == [b"ab", b"abc"]


def test_tiny_bpe_round_trip_and_frequent_words(tmp_path):
    tokens = train_bpe_from_texts([TEXT * 20], 256 + 120)
    path = tmp_path / "tiny.tiktoken"
    write_bpe_file(tokens, path)
    tok = build_tokenizer(str(path))
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == len(tokens) + 1 and tok.eos_id == len(tokens)
    for word in (" hello", "the", " fox", " dog"):
        assert len(tok.encode(word)) == 1, word
    for text in (TEXT, "unseen: Zürich ∑ 日本語 \t\r\n  trailing  ", ""):
        assert tok.decode(tok.encode(text)) == text
    # the file is plain tiktoken format
    assert tiktoken.load.load_tiktoken_bpe(str(path)) == {t: i for i, t in enumerate(tokens)}


def test_literal_eos_is_encoded_as_text():
    tok = build_tokenizer("embedded")
    text = f"x = '{EOS_TOKEN}'\n"
    ids = tok.encode(text)
    assert tok.eos_id not in ids
    assert tok.decode(ids) == text
    assert tok.decode(ids + [tok.eos_id]) == text + EOS_TOKEN


def test_shipped_asset_loads_round_trips_and_compresses():
    assert EMBEDDED_BPE.is_file() and EMBEDDED_BPE.stat().st_size < 200_000
    tok = build_tokenizer("embedded")
    assert tok.vocab_size == 4096 and tok.eos_id == 4095
    assert read_bpe_ranks(EMBEDDED_BPE) == tiktoken.load.load_tiktoken_bpe(str(EMBEDDED_BPE))
    source = (stdlib_root() / "argparse.py").read_text(encoding="utf-8")
    ids = tok.encode(source)
    assert tok.decode(ids) == source
    assert max(ids) < tok.eos_id
    assert len(source.encode("utf-8")) / len(ids) > 3.0  # measured ~3.4-3.6 on stdlib code


@pytest.mark.parametrize("content, needle", [
    (b"this is not base64 at all\n", "line 1"),
    (b"\x00\xff\xfe garbage \x01\n", "line 1"),
    (b"", "no tokens"),
    (b"YQ== 0\nYg== 2\n", "gaps"),
    (b"YQ== 0\nYg== 1\n", "single-byte"),
])
def test_bad_tokenizer_file_raises_data_error(tmp_path, content, needle):
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        build_tokenizer(str(path))
    assert str(path) in str(e.value) and needle in str(e.value)


def test_missing_tokenizer_file_and_unknown_encoding(tmp_path):
    with pytest.raises(DataError, match="is not a file; pass 'embedded'"):
        build_tokenizer(str(tmp_path / "nope.tiktoken"))
    with pytest.raises(DataError, match="tiktoken encoding 'no_such_encoding' is not available.*BPE rank file"):
        build_tokenizer("tiktoken:no_such_encoding")


def test_asset_is_reproducible_from_the_trainer_format(tmp_path):
    """Rewriting the shipped ranks gives the identical file (format: base64 token, space, rank, newline)."""
    ranks = read_bpe_ranks(EMBEDDED_BPE)
    out = tmp_path / "copy.tiktoken"
    write_bpe_file(sorted(ranks, key=ranks.__getitem__), out)
    assert out.read_bytes() == Path(EMBEDDED_BPE).read_bytes()


def test_bytes_tokenizer_is_the_256_bytes_without_merges_and_eos_256():
    tok = build_tokenizer("bytes")
    assert (tok.vocab_size, tok.eos_id, tok.name) == (257, 256, "bytes")
    text = "a\u00e9 <|endoftext|>"
    assert tok.encode(text) == list(text.encode("utf-8"))  # one id per byte, the literal EOS as text
    assert tok.decode(tok.encode(text)) == text
