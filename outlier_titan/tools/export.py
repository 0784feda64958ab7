#!/usr/bin/env python
"""Export a model: a run's checkpoint (any layout), our export or an HF folder -> an HF folder or safetensors.

    outlier-titan-export RUN_OR_CHECKPOINT --out DIR [--format auto|hf|safetensors]

``hf`` writes ``config.json`` + ``model.safetensors`` that ``transformers`` loads (``pre_ln`` models shaped
like GPT-2 or Llama); ``safetensors`` writes our parameter names + the run's ``config.toml`` (every spec:
OP, anGPT, nGPT too), which ``outlier-titan-evaluate --hf`` and ``checkpoint.initial_load_path`` read back.
``auto`` (default) picks hf where possible. The run's BPE file is copied as ``tokenizer.tiktoken``.
"""

from __future__ import annotations

import sys

from outlier_titan import cli
from outlier_titan.errors import UserError


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    p = cli.parser(__doc__)
    p.add_argument("source", help="run folder, <run>/checkpoints/step-<N>, an export or an HF folder")
    p.add_argument("--out", required=True, help="new folder to write")
    p.add_argument("--format", default="auto", choices=("auto", "hf", "safetensors"),
                   help="hf for GPT-2/Llama-shaped models, safetensors + config.toml for the others; auto picks")
    p.add_argument("--max-shard-gb", type=float, default=5.0, help="hf: split weights into files of this size")
    args = p.parse_args(argv)
    from outlier_titan.hf.export import export_model

    try:
        fmt, files = export_model(args.source, args.out, args.format, int(args.max_shard_gb * 2**30))
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.source} as {fmt}: " + ", ".join(str(f) for f in files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
