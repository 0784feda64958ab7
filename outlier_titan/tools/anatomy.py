#!/usr/bin/env python
"""Where a run's large activations sit, and when they appear: the residual stream's large entries per block,
attributed to positions, tokens and channels, at one checkpoint or at every checkpoint of a run.

    outlier-titan-anatomy RUN                       # every checkpoint the run kept (checkpoint.keep_latest_k = 0
                                                    # and a checkpoint.interval below the run's length keep several)
    outlier-titan-anatomy RUN/checkpoints/step-400  # one checkpoint
    outlier-titan-anatomy RUN --steps 100,400 --tokens 16384 --factor 100 --out anatomy.md

Large = |x| above ``--factor`` times the median |x| of its sequence at that block (Sun et al. 2024; the probe's
``massive_count``). Each checkpoint is evaluated at world size 1 on the same validation sequences (the run's data,
``--tokens`` tokens). Writes the markdown (default ``<run>/anatomy.md``) and the numbers beside it (``.json``), and
prints the markdown. See ``outlier_titan/observe/anatomy.py`` and ``docs/observatory.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from outlier_titan import cli
from outlier_titan.errors import UserError
from outlier_titan.plugins import take_plugins


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = take_plugins(argv)
    p = cli.parser(__doc__, plugins=True)
    p.add_argument("path", help="a run folder (every checkpoint it kept) or one <run>/checkpoints/step-<N>")
    p.add_argument("--steps", default=None, help="comma-separated checkpoint steps of the run (default: all)")
    p.add_argument("--tokens", type=int, default=16384, help="validation tokens analysed per checkpoint")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--factor", type=float, default=None, help="large = above this x the median |x| (default 100)")
    p.add_argument("--top-k", type=int, default=10, help="largest entries listed per block")
    p.add_argument("--min-share", type=float, default=0.05,
                   help="a channel is followed over the checkpoints once it carries this share of a block's large "
                        "entries")
    p.add_argument("--out", default=None, help="markdown path (default <run>/anatomy.md; JSON beside it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    return cli.report_user_errors(run, parse(argv))


def checkpoints_of(path: Path, steps: str | None) -> tuple[Path, list[Path]]:
    """(run folder, the checkpoint folders to analyse, ascending)."""
    from outlier_titan.checkpoint.manager import list_checkpoints, resolve_checkpoint_dir

    if (path / ".metadata").is_file():
        if steps:
            raise UserError("--steps selects among a run's checkpoints; pass the run folder, not one checkpoint")
        return path.parent.parent, [path]
    run_dir = path.parent if path.name == "checkpoints" else path
    have = list_checkpoints(run_dir / "checkpoints")
    if not have:
        resolve_checkpoint_dir(path)  # raises the usual one-line error
    wanted = have
    if steps:
        try:
            wanted = [int(s) for s in steps.split(",") if s.strip()]
        except ValueError:
            raise UserError(f"--steps {steps!r}: expected comma-separated integers, e.g. --steps 100,400") from None
        missing = [s for s in wanted if s not in have]
        if missing:
            raise UserError(f"--steps: no checkpoint at step {', '.join(map(str, missing))} in {run_dir}; it has "
                            f"{', '.join(map(str, have))}")
    return run_dir, [run_dir / "checkpoints" / f"step-{s}" for s in sorted(wanted)]


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from outlier_titan.checkpoint import load_model_for_eval
    from outlier_titan.data import build_dataloader
    from outlier_titan.eval.perplexity import take_batches, validation_budget
    from outlier_titan.observe.anatomy import markdown, residual_anatomy
    from outlier_titan.observe.sinks import MASSIVE_FACTOR

    for flag in ("tokens", "batch_size", "top_k"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    factor = MASSIVE_FACTOR if args.factor is None else args.factor
    if factor <= 0:
        raise UserError("--factor must be positive")
    run_dir, ckpts = checkpoints_of(Path(args.path), args.steps)
    by_step: dict[int, dict] = {}
    batches = None
    for ckpt in tqdm(ckpts, desc="anatomy", unit="checkpoint", file=sys.stderr, disable=len(ckpts) < 2):
        model, cfg, tokenizer = load_model_for_eval(ckpt, "cpu")
        if batches is None:  # the same validation sequences for every checkpoint
            seq_len, bs = cfg.training.seq_len, args.batch_size
            val = build_dataloader(cfg.data, tokenizer, seq_len=seq_len, global_batch_size=bs, micro_batch_size=bs,
                                   dp_rank=0, dp_degree=1, split="validation", seed=cfg.training.seed)
            batches = [inputs for inputs, _ in take_batches(val, validation_budget(val, seq_len, args.tokens,
                                                                                   "--tokens"))]

        def decode(i: int, tok=tokenizer) -> str:
            return tok.decode([i])

        with torch.no_grad():
            by_step[int(ckpt.name.split("-")[1])] = residual_anatomy(model, batches, tokenizer.vocab_size,
                                                                    factor=factor, top_k=args.top_k, decode=decode)
    text = f"# Activation anatomy of {run_dir}\n\n" + markdown(by_step, factor, args.min_share)
    out = Path(args.out) if args.out else run_dir / "anatomy.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    out.with_suffix(".json").write_text(json.dumps({"run": str(run_dir), "factor": factor,
                                                    "steps": {str(s): a for s, a in by_step.items()}}, indent=1)
                                        + "\n")
    print(text)
    print(f"wrote {out}, {out.with_suffix('.json')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
