"""Sources, packing and the stateful loader, on real files and the real tokenizer."""

from __future__ import annotations

import json
import os
import sys
import threading

import numpy as np
import pytest
import torch

from outlier_titan.config.job_config import Data
from outlier_titan.data import build_dataloader
from outlier_titan.data.loader import ArrayWindows, PackedWindowDataset, StreamWindows, token_cache
from outlier_titan.data.sources import embedded_corpus, embedded_files, local_corpus, resolve_source
from outlier_titan.errors import DataError
from tests.loaders import step_rows

SEQ = 16


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("cache"))


def _docs(n: int, tag: str) -> list[str]:
    return [f"doc {tag}{i}: " + " ".join(f"word{(i * 7 + j) % 23}" for j in range(5 + i % 9)) + "\n"
            for i in range(n)]


@pytest.fixture(scope="module")
def corpus_dir(tmp_path_factory):
    """A folder of 6 jsonl shards and 2 txt files."""
    root = tmp_path_factory.mktemp("corpus")
    for s in range(6):
        with open(root / f"shard{s}.jsonl", "w") as f:
            for d in _docs(12, f"s{s}-"):
                f.write(json.dumps({"text": d, "id": 1}) + "\n\n")
    (root / "sub").mkdir()
    (root / "sub" / "a.txt").write_text("plain text document A\n" * 5)
    (root / "sub" / "b.txt").write_text("plain text document B\n" * 5)
    return root


def _loader(cfg, tok, *, g=8, m=2, rank=0, dp=1, split="train", seed=0):
    return build_dataloader(cfg, tok, seq_len=SEQ, global_batch_size=g, micro_batch_size=m, dp_rank=rank,
                            dp_degree=dp, split=split, seed=seed)


def _stream(corpus, tok) -> np.ndarray:
    ids = []
    for d in corpus.documents():
        ids += tok.encode(d) + [tok.eos_id]
    return np.array(ids)


# ------------------------------------------------------------------------------------------------ packing
def test_windows_are_the_packed_document_stream(corpus_dir, cache, tok):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    stream = _stream(local_corpus(str(corpus_dir), "train"), tok)
    (step0, step1) = step_rows([_loader(cfg, tok)], 2)
    rows = torch.cat([step0, step1]).numpy()
    windows = {tuple(stream[p * SEQ:p * SEQ + SEQ + 1]): p for p in range((len(stream) - 1) // SEQ)}
    picked = [windows[tuple(row)] for row in rows]  # every row is a window of the packed stream ...
    assert len(set(picked)) == len(picked)  # ... each at most once per epoch ...
    assert picked != sorted(picked)  # ... in a seeded shuffled order (training split)
    assert (stream == tok.eos_id).sum() == sum(1 for _ in local_corpus(str(corpus_dir), "train").documents())


def test_training_window_order_depends_on_seed_only(corpus_dir, cache, tok):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    a = step_rows([_loader(cfg, tok)], 2)
    b = step_rows([_loader(cfg, tok, seed=1)], 2)
    assert not all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("split", ["train", "validation"])
def test_windows_independent_of_dp_degree_and_micro_batch(corpus_dir, cache, tok, split):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    ref = step_rows([_loader(cfg, tok, m=8, split=split)], 4)
    for dp in (1, 2, 4):
        for m in sorted({1, 8 // dp // 2 or 1, 8 // dp}):
            got = step_rows([_loader(cfg, tok, m=m, rank=r, dp=dp, split=split) for r in range(dp)], 4)
            for a, b in zip(ref, got):
                assert torch.equal(a, b), (dp, m)


def test_wraps_around_and_keeps_going(corpus_dir, cache, tok):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    dl = _loader(cfg, tok, g=4, m=4, split="validation")
    w = dl.num_windows
    rows = torch.cat(step_rows([dl], (2 * w) // 4 + 2))
    assert len(rows) > 2 * w
    assert torch.equal(rows[:w], rows[w:2 * w])
    assert dl.state_dict()["position"] == len(rows)


def test_bad_batch_layout_is_a_data_error(corpus_dir, cache, tok):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    with pytest.raises(DataError, match="global_batch_size 6 is not divisible .* 4"):
        _loader(cfg, tok, g=6, m=1, dp=4)
    with pytest.raises(DataError, match="micro_batch_size 3 does not divide the 4 sequences"):
        _loader(cfg, tok, g=8, m=3, dp=2)
    with pytest.raises(DataError, match="fewer than training.seq_len"):
        build_dataloader(cfg, tok, seq_len=100_000, global_batch_size=1, micro_batch_size=1, dp_rank=0,
                         dp_degree=1)


# ------------------------------------------------------------------------------------------------ resume
def test_resume_gives_exactly_the_next_batches(corpus_dir, cache, tok):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    full = _loader(cfg, tok, g=8, m=2)
    it = iter(full)
    for _ in range(5):  # 1 step + 1 micro-batch: mid-step
        next(it)
    state = full.state_dict()
    assert state == {"position": 8, "micro_batch": 1, "seq_len": SEQ, "global_batch_size": 8,
                     "micro_batch_size": 2, "dp_degree": 1}
    assert all(type(v) is int for v in state.values())
    expected = [next(it) for _ in range(7)]
    resumed = _loader(cfg, tok, g=8, m=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    it2 = iter(resumed)
    for (x, y), (x2, y2) in zip(expected, (next(it2) for _ in range(7))):
        assert torch.equal(x, x2) and torch.equal(y, y2)
    # loading into a loader that was already iterating moves both a new and the running iterator there
    full.load_state_dict(state)
    assert torch.equal(next(iter(full))[0], expected[0][0])
    full.load_state_dict(state)
    assert torch.equal(next(it)[0], expected[0][0])


@pytest.mark.parametrize("new_dp, new_m", [(1, 8), (4, 1), (2, 4)])
def test_resume_on_a_different_dp_degree(corpus_dir, cache, tok, new_dp, new_m):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    ref = step_rows([_loader(cfg, tok, m=8)], 5)
    old = [_loader(cfg, tok, m=2, rank=r, dp=2) for r in range(2)]
    step_rows(old, 3)
    states = [dl.state_dict() for dl in old]
    assert states[0] == states[1] and states[0]["position"] == 24
    new = [_loader(cfg, tok, m=new_m, rank=r, dp=new_dp) for r in range(new_dp)]
    for dl in new:
        dl.load_state_dict(states[0])
    assert all(torch.equal(a, b) for a, b in zip(step_rows(new, 2), ref[3:]))


def test_mid_step_state_needs_the_same_layout(corpus_dir, cache, tok):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    dl = _loader(cfg, tok, m=2, dp=2)
    next(iter(dl))
    with pytest.raises(DataError, match="middle of a global step"):
        _loader(cfg, tok, m=4, dp=2).load_state_dict(dl.state_dict())


def test_resume_with_other_seq_len_keeps_token_position(corpus_dir, cache, tok):
    cfg = Data(source=str(corpus_dir), cache_dir=cache)
    dl = build_dataloader(cfg, tok, seq_len=SEQ // 2, global_batch_size=4, micro_batch_size=4, dp_rank=0,
                          dp_degree=1)
    next(iter(dl))  # 4 windows of 8 tokens = 2 windows of 16
    resumed = _loader(cfg, tok, g=2, m=2)
    resumed.load_state_dict(dl.state_dict())
    assert resumed.state_dict()["position"] == 2
    assert torch.equal(next(iter(resumed))[0], step_rows([_loader(cfg, tok, g=4, m=4)], 1)[0][2:4, :-1])


# ------------------------------------------------------------------------------------------------ sources
def test_embedded_split_by_file_deterministic_and_disjoint():
    every = embedded_files()
    assert every == sorted(every) and len(every) > 500
    assert not any("site-packages" in f or "dist-packages" in f for f in every)
    train, val = embedded_corpus("train", 0.02, seed=0), embedded_corpus("validation", 0.02, seed=None)
    assert set(train.files).isdisjoint(val.files)
    assert set(train.files) | set(val.files) == set(every)
    assert 0.005 < len(val.files) / len(every) < 0.05
    assert val.files == embedded_corpus("validation", 0.02, seed=None).files == sorted(val.files)
    assert train.files == embedded_corpus("train", 0.02, seed=0).files
    other = embedded_corpus("train", 0.02, seed=1).files
    assert other != train.files and sorted(other) == sorted(train.files)
    assert set(embedded_corpus("validation", 0.1, seed=None).files) > set(val.files)


def test_embedded_validation_loader_equal_across_dp(cache, tok):
    cfg = Data(source="embedded", cache_dir=cache)
    ref = step_rows([_loader(cfg, tok, g=4, m=4, split="validation")], 3)
    got = step_rows([_loader(cfg, tok, g=4, m=1, rank=r, dp=4, split="validation") for r in range(4)], 3)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert "<|endoftext|>" not in tok.decode(ref[0][0][:4].tolist())


def test_local_folder_split_by_file(corpus_dir):
    train, val = local_corpus(str(corpus_dir), "train"), local_corpus(str(corpus_dir), "validation")
    assert train.files and val.files and set(train.files).isdisjoint(val.files)
    assert sorted(train.files + val.files) == sorted(
        [f"shard{s}.jsonl" for s in range(6)] + ["sub/a.txt", "sub/b.txt"])
    assert train.files == sorted(train.files)
    assert local_corpus(str(corpus_dir), "validation").files == val.files
    docs = list(train.documents())
    assert any(d.startswith("plain text document") for d in docs) or any(
        d.startswith("plain text document") for d in val.documents())
    assert all(d.startswith(("doc s", "plain text")) for d in docs)


def test_single_jsonl_split_by_document_index(tmp_path):
    path = tmp_path / "one.jsonl"
    docs = _docs(400, "x")
    path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
    train = list(local_corpus(str(path), "train", text_field="body", val_fraction=0.1).documents())
    val = list(local_corpus(str(path), "validation", text_field="body", val_fraction=0.1).documents())
    assert sorted(train + val) == sorted(docs) and not set(train) & set(val)
    assert 10 < len(val) < 80
    assert val == list(local_corpus(str(path), "validation", text_field="body", val_fraction=0.1).documents())


def test_single_txt_file_splits_by_lines(tmp_path, cache, tok):
    path = tmp_path / "book.txt"
    lines = [f"line {i} of the book\n" for i in range(100)]
    path.write_text("".join(lines))
    train = list(local_corpus(str(path), "train", val_fraction=0.05).documents())
    val = list(local_corpus(str(path), "validation", val_fraction=0.05).documents())
    assert train == ["".join(lines[:95])] and val == ["".join(lines[95:])]
    dl = build_dataloader(Data(source=str(path), cache_dir=cache, val_fraction=0.05), tok, seq_len=8,
                          global_batch_size=2, micro_batch_size=1, dp_rank=0, dp_degree=1, split="validation")
    x, y = next(iter(dl))
    assert tok.decode(x[0].tolist()).startswith("line 95 of the book")


# ------------------------------------------------------------------------------------------------ cache
def test_cache_reused_and_invalidated(tmp_path, tok):
    src = tmp_path / "data"
    src.mkdir()
    for i in range(3):
        (src / f"f{i}.txt").write_text(f"file {i} " * 50)
    cfg = Data(source=str(src), cache_dir=str(tmp_path / "c"))
    first = _loader(cfg, tok, g=1, m=1)
    path, mtime = first.cache_path, first.cache_path.stat().st_mtime_ns
    assert first.cache_info["tokens"] == len(np.load(path)) and path.suffix == ".npy"
    assert _loader(cfg, tok, g=1, m=1).cache_path == path and path.stat().st_mtime_ns == mtime
    train_file = sorted(local_corpus(str(src), "train").files)[0]
    (src / train_file).write_text("changed " * 60)
    assert _loader(cfg, tok, g=1, m=1).cache_path != path
    assert _loader(cfg, tok, g=1, m=1, seed=5).cache_path == _loader(cfg, tok, g=1, m=1).cache_path  # no shuffle
    assert not [p for p in os.listdir(path.parent) if p.endswith(".tmp")]


def test_concurrent_cache_builders_agree(tmp_path, tok):
    corpus = embedded_corpus("validation", 0.02, seed=None)
    results, errors = [], []

    def build():
        try:
            results.append(token_cache(corpus, tok, tmp_path))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len({str(p) for p, _ in results}) == 1
    path = results[0][0]
    np.testing.assert_array_equal(np.load(path), _stream(corpus, tok))
    assert not [p for p in os.listdir(path.parent) if p.endswith(".tmp")]


def test_stream_windows_match_cached_windows(corpus_dir, cache, tok):
    """The streaming reader (used for HF sources) cuts the same windows as the cached array."""
    corpus = local_corpus(str(corpus_dir), "train")
    arr = ArrayWindows(token_cache(corpus, tok, cache)[0], SEQ)
    n = arr.num_windows
    ref = arr.rows(0, n)
    layout = dict(seq_len=SEQ, global_batch_size=4, micro_batch_size=1, dp_degree=2)
    ranks = [PackedWindowDataset(StreamWindows(corpus, tok, SEQ, docs_per_batch=3), dp_rank=r, **layout)
             for r in range(2)]
    rows = []
    for _ in range(n // 4):
        for ds in ranks:
            for _ in range(2):
                x, y = next(ds)
                rows.append(torch.cat([x, y[:, -1:]], 1))
    np.testing.assert_array_equal(torch.cat(rows).numpy(), ref[:len(rows)])
    sw = StreamWindows(corpus, tok, SEQ, docs_per_batch=5)
    np.testing.assert_array_equal(sw.rows(n - 2, 1)[0], ref[n - 2])
    np.testing.assert_array_equal(sw.rows(3, 2), ref[3:5])  # going back restarts the stream
    stream = _stream(corpus, tok)
    far = sw.rows(n + 3, 1)[0]  # second pass continues the same token stream
    twice = np.concatenate([stream, stream])
    np.testing.assert_array_equal(far, twice[(n + 3) * SEQ:(n + 3) * SEQ + SEQ + 1])


# ------------------------------------------------------------------------------------------------ errors
def test_missing_path_and_unknown_name(tmp_path, tok):
    with pytest.raises(DataError, match=r"data.source: path .*nowhere does not exist; pass an existing"):
        _loader(Data(source=str(tmp_path / "nowhere"), cache_dir=str(tmp_path)), tok)
    with pytest.raises(DataError, match="unknown dataset 'pile'.*c4, fineweb"):
        resolve_source("pile", "train")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="not a .txt, .jsonl or .parquet"):
        resolve_source(str(tmp_path / "x.csv"), "train")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="has no .txt, .jsonl or .parquet files"):
        resolve_source(str(tmp_path / "empty"), "train")


def test_bad_jsonl_records(tmp_path, tok):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(DataError, match=r"line 1 has no string field 'text'; set data.text_field"):
        _loader(Data(source=str(path), cache_dir=str(tmp_path)), tok)
    path.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        list(local_corpus(str(path), "train").documents())


def test_empty_split_is_a_data_error(tmp_path, tok):
    path = tmp_path / "tiny.jsonl"
    path.write_text(json.dumps({"text": "only one"}) + "\n")
    split = "validation" if list(local_corpus(str(path), "train").documents()) else "train"
    with pytest.raises(DataError, match=f"no documents in the '{split}' split"):
        _loader(Data(source=str(path), cache_dir=str(tmp_path)), tok, split=split)


def test_empty_txt_source_names_the_file(tmp_path, tok):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(DataError, match=f"data.source: {path} is empty; put text in it"):
        _loader(Data(source=str(path), cache_dir=str(tmp_path)), tok)
    path.write_text("one line only\n")  # all of it lands in one split: the other one names the file too
    with pytest.raises(DataError, match=f"data.source: {path} has no documents in the 'validation' split"):
        _loader(Data(source=str(path), cache_dir=str(tmp_path)), tok, split="validation")


def test_parquet_without_pyarrow(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # the extra not installed: its import fails
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"needs pyarrow; pip install pyarrow"):
        list(local_corpus(str(path), "train").documents())


def test_parquet_source_reads_the_documents_of_the_same_jsonl(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts = [f"document {i}: " + " ".join(f"w{j}" for j in range(i % 11, i % 11 + 25)) for i in range(300)]
    texts[7] = "unicode é ✓ and a\nsecond line"
    (tmp_path / "c.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts))
    pq.write_table(pa.table({"id": list(range(300)), "body": texts}), tmp_path / "c.parquet", row_group_size=64)
    for split in ("train", "validation"):
        want = list(local_corpus(str(tmp_path / "c.jsonl"), split, text_field="body").documents())
        got = list(local_corpus(str(tmp_path / "c.parquet"), split, text_field="body").documents())
        assert got == want and 0 < len(got) < 300
    with pytest.raises(DataError, match=r"has no column 'text' \(columns: id, body\); set data.text_field"):
        list(local_corpus(str(tmp_path / "c.parquet"), "train").documents())
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=r"cannot read .*bad.parquet as parquet"):
        list(local_corpus(str(tmp_path / "bad.parquet"), "train").documents())


def test_hf_source_without_datasets_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    for name in ("c4", "fineweb"):
        with pytest.raises(DataError, match=r"needs the Hugging Face 'datasets' package; pip install "
                                            r"'outlier_titan\[hf\]'"):
            resolve_source(name, "train")


def test_a_registered_named_source_resolves_and_is_listed_by_help(tmp_path):
    from outlier_titan.config.manager import help_text
    from outlier_titan.data import sources
    from outlier_titan.options import DATA_SOURCE_NAMES

    (tmp_path / "a.txt").write_text("alpha beta\n")
    (tmp_path / "b.txt").write_text("gamma delta\n")
    saved, names = dict(sources._SOURCES), list(DATA_SOURCE_NAMES)

    def open_toy(name, split, *, text_field, val_fraction, seed):
        return local_corpus(str(tmp_path), split, text_field, val_fraction=0.5)

    try:
        sources.register_source(sources.NamedSource("toy_corpus", "two tiny files", open_toy))
        with pytest.raises(DataError, match="already registered"):
            sources.register_source(sources.NamedSource("toy_corpus", "again", open_toy))
        docs = [d for split in sources.SPLITS for d in resolve_source("toy_corpus", split).documents()]
        assert sorted(docs) == ["alpha beta\n", "gamma delta\n"]
        assert "(named: embedded, c4, fineweb, bigram_backcopy, toy_corpus; or a path)" in help_text()
        with pytest.raises(DataError, match="or one of embedded, c4, fineweb, bigram_backcopy, toy_corpus$"):
            resolve_source("nope", "train")
        with pytest.raises(DataError, match="synthetic task without documents"):
            resolve_source("bigram_backcopy:states=8", "train")
    finally:
        sources._SOURCES.clear()
        sources._SOURCES.update(saved)
        DATA_SOURCE_NAMES._names[:] = names
