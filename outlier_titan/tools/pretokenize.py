#!/usr/bin/env python
"""Tokenize a corpus once into memory-mapped token shards that ``data.source = DIR`` trains from.

    outlier-titan-pretokenize SOURCE --tokenizer T --out DIR [--workers K] [--text-field text]
                                  [--val-fraction 0.02] [--shard-tokens N]

SOURCE is what ``data.source`` accepts (a .txt/.jsonl/.parquet file or folder, or 'embedded') or a folder
written by ``datasets``' ``save_to_disk`` (needs the ``hf`` extra); T what
``data.tokenizer`` accepts. Both splits are written with the train/validation rule of the raw source, so a run
on DIR sees the same batches as a run on SOURCE with the same ``data.val_fraction``. DIR/manifest.json records
the tokenizer fingerprint (a run with another tokenizer is refused), document and token counts per shard.
"""

from __future__ import annotations

import sys

from outlier_titan import cli
from outlier_titan.errors import UserError


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    p = cli.parser(__doc__)
    p.add_argument("source", help="a .txt/.jsonl/.parquet file or folder, 'embedded', or an HF save_to_disk folder")
    p.add_argument("--tokenizer", required=True, help="'embedded', a tiktoken BPE rank file or tiktoken:<name>")
    p.add_argument("--out", required=True, help="new folder for the shards and manifest.json")
    p.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--text-field", default="text", help="field with the text in jsonl/parquet records")
    p.add_argument("--val-fraction", type=float, default=0.02, help="as data.val_fraction of the runs")
    p.add_argument("--seed", type=int, default=0, help="embedded corpus: file order of training.seed")
    p.add_argument("--shard-tokens", type=int, default=1 << 28, help="tokens per shard file at most (about)")
    args = p.parse_args(argv)
    from outlier_titan.data.pretokenized import pretokenize

    try:
        m = pretokenize(args.source, args.tokenizer, args.out, workers=args.workers, text_field=args.text_field,
                        val_fraction=args.val_fraction, seed=args.seed, shard_tokens=args.shard_tokens)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, e in m["splits"].items():
        print(f"{split}: {e['documents']:,} documents, {e['tokens']:,} tokens in {len(e['shards'])} shard(s)")
    print(f"wrote {args.out} in {m['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
