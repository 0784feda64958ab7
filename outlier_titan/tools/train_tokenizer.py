"""Trains the byte-level BPE tokenizer and writes a tiktoken rank file.

    outlier-titan-train-tokenizer --vocab_size 4096 --out outlier_titan/assets/tokenizer/stdlib_bpe.tiktoken

``--vocab_size`` counts the EOS special token, so the file gets ``vocab_size - 1`` ranks. The corpus is the train
split of ``--source`` (``embedded`` = this Python's standard library, in sorted file order, or a local
.txt/.jsonl/.parquet file or folder). Prints timings and the bytes/token on the validation split.
"""

from __future__ import annotations

import sys
import time

from outlier_titan import cli
from outlier_titan.data.bpe_train import count_words, train_bpe, write_bpe_file
from outlier_titan.data.sources import embedded_corpus, local_corpus
from outlier_titan.data.tokenizer import build_tokenizer
from outlier_titan.errors import UserError


def _corpus(source: str, split: str, text_field: str, val_fraction: float):
    if source == "embedded":
        return embedded_corpus(split, val_fraction, seed=None)
    return local_corpus(source, split, text_field, val_fraction)


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    ap = cli.parser(__doc__)
    ap.add_argument("--vocab_size", type=int, default=4096, help="total vocabulary including <|endoftext|>")
    ap.add_argument("--out", default="outlier_titan/assets/tokenizer/stdlib_bpe.tiktoken", help="output rank file")
    ap.add_argument("--source", default="embedded", help="'embedded' or a path to .txt/.jsonl/.parquet data")
    ap.add_argument("--text_field", default="text", help="field/column with the text (jsonl/parquet)")
    ap.add_argument("--val_fraction", type=float, default=0.02, help="held-out fraction (same split as training)")
    args = ap.parse_args(argv)
    try:
        if args.vocab_size < 257:
            raise UserError(f"--vocab_size must be at least 257 (256 bytes + EOS), got {args.vocab_size}")
        t0 = time.perf_counter()
        train = _corpus(args.source, "train", args.text_field, args.val_fraction)
        words = count_words(train.documents())
        n_bytes = sum(len(w) * n for w, n in words.items())
        t1 = time.perf_counter()
        print(f"pre-split {len(train.files)} files: {n_bytes / 1e6:.1f} MB, {len(words)} unique pieces "
              f"in {t1 - t0:.1f}s", flush=True)
        tokens = train_bpe(words, args.vocab_size - 1,
                           progress=lambda n, c: print(f"  {n} tokens (last pair count {c})", flush=True))
        t2 = time.perf_counter()
        write_bpe_file(tokens, args.out)
        print(f"merges: {len(tokens) - 256} in {t2 - t1:.1f}s; wrote {len(tokens)} ranks + EOS to {args.out}")

        tok = build_tokenizer(args.out)
        val_texts = list(_corpus(args.source, "validation", args.text_field, args.val_fraction).documents())
        val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
        val_tokens = sum(len(ids) for ids in tok.encode_batch(val_texts))
        print(f"vocab_size {tok.vocab_size} (eos_id {tok.eos_id}); validation: {val_bytes / max(val_tokens, 1):.2f} "
              f"bytes/token over {val_bytes / 1e6:.2f} MB; total {time.perf_counter() - t0:.1f}s")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
