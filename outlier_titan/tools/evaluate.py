#!/usr/bin/env python
"""Evaluate a checkpoint: validation perplexity, post-training fake quantisation per scheme, probe metrics.

    outlier-titan-evaluate --checkpoint outputs/debug/checkpoints/step-200 [--tokens 65536] [--out FILE]
    outlier-titan-evaluate --hf PATH [--tokenizer T] [--data SOURCE]   # an HF folder or an export

The run folder is the checkpoint's grandparent (``<run>/checkpoints/step-<N>``); its ``config.toml`` gives the
model, data and tokenizer. A run folder or its ``checkpoints`` folder selects the newest checkpoint. The model is
built at world size 1 and loaded from a DCP checkpoint of any world size.

Writes ``FILE`` (JSON; default ``<run>/eval/step-<N>.json``), the markdown table next to it (``.md``) and the
probe pictures (``.<name>.png``: the attention map on a fixed log scale, the hidden-state magnitudes with their
colour range, the per-layer sinks-vs-massive-activations panel; the same labelled pictures as TensorBoard's), and
prints the table. The probe runs with ``observe.gradients`` (the gradient-side metrics and the gradient sink).
``--update --schemes S`` re-runs only the schemes ``S`` into an existing report (same model and evaluation
settings, checked), keeping the others.

Schemes: int8_fine, int8_fine_token, int8_moderate, int8_coarse (Kaul et al. 2024 absmax int8), int4_zeropoint (Kaul
et al. 2024), w8a8_static (He et al. 2024: calibrated on ``--calib-batches`` training batches per seed, ``--calib-seeds``
seeds, reported as mean ± std); w8a8_dynamic, w4a16_rtn, w4a4kv4_rtn, w4a16_gptq, w4a4kv4_gptq and their
``_hadamard`` (QuaRot-rotated) variants: GPTQ calibrates on the same batches per seed, a rotation draws its
random signs from the seed; superweight_zero, superweight_random, superweight_topk (Yu et al. 2024): no quantisation,
the detected super weights, or as many random or largest other down-projection weights, zeroed (each seed detects
on its first calibration batch). See ``outlier_titan/quant/ptq.py`` and ``docs/quantisation.md``.

``--hf PATH`` evaluates an imported model: a Hugging Face GPT-2 / Llama folder or an export of
``outlier-titan-export`` (report default ``PATH/eval/model.json``). Its tokenizer is the folder's
``tokenizer.tiktoken`` (or a tiktoken ``tokenizer.model``) unless ``--tokenizer`` names one; the data is
``data.source`` of the export's config, else the embedded corpus, unless ``--data`` names one.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

from outlier_titan import cli
from outlier_titan.errors import UserError
from outlier_titan.plugins import take_plugins
from outlier_titan.provenance import code_version, runtime_versions
from outlier_titan.quant.ptq import SCHEMES, check_schemes, scheme_help


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = take_plugins(argv)
    p = cli.parser(__doc__, plugins=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="<run>/checkpoints/step-<N> (or a run folder: newest)")
    src.add_argument("--hf", help="a Hugging Face model folder (GPT-2 / Llama) or an export of outlier-titan-export")
    p.add_argument("--tokenizer", default=None, help="data.tokenizer for the model (default: the folder's / run's)")
    p.add_argument("--data", default=None, help="data.source to evaluate on (default: the run's / embedded)")
    p.add_argument("--tokens", type=int, default=65536,
                   help="validation tokens for each perplexity; a smaller validation split is scored once, "
                        "whole, with a warning")
    p.add_argument("--out", default=None, help="JSON report path (default <run>/eval/step-<N>.json)")
    p.add_argument("--schemes", default=None,
                   help="comma-separated registered schemes (default: all of them, a run's plug-ins' included): "
                        + scheme_help())
    p.add_argument("--batch-size", type=int, default=8, help="sequences per forward pass")
    p.add_argument("--seq-len", type=int, default=None, help="sequence length (default: training.seq_len)")
    p.add_argument("--calib-batches", type=int, default=4, help="w8a8_static and GPTQ: calibration batches per seed")
    p.add_argument("--calib-seeds", type=int, default=3,
                   help="w8a8_static, GPTQ and rotated schemes: seeds (mean ± std)")
    p.add_argument("--probe-sequences", type=int, default=None,
                   help="validation sequences for the probe metrics (default: observe.batch_size x 4)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available, else cpu")
    p.add_argument("--update", action="store_true",
                   help="re-evaluate only --schemes into the existing report at --out (default path), keeping its "
                        "other schemes: for a scheme added or changed since; refused when that report was made "
                        "with other evaluation settings or on another model")
    return p.parse_args(argv)


def check_update(old: dict, settings: dict, where: Path) -> None:
    """Refuses ``--update`` of a report made with other evaluation settings (before any evaluation runs)."""
    if diff := [f"{k} {old.get(k)!r} -> {v!r}" for k, v in settings.items() if old.get(k) != v]:
        raise UserError(f"--update: the report at {where} was made with other evaluation settings ("
                        f"{'; '.join(diff)}); rerun with the same --tokens / --seq-len / --calib-* or without --update")


def merge_update(old: dict, new: dict, schemes: list[str], where: Path) -> dict:
    """``old`` with the scheme rows of ``new`` put in (a scheme already there is replaced in place), after
    checking that both scored the same model (the full-precision PPL); the report's ``updated`` list records
    which schemes were re-evaluated, when and at which code (``code`` stays the first evaluation's)."""
    fp_old, fp_new = old["full_precision"]["ppl"], new["full_precision"]["ppl"]
    if not math.isclose(fp_old, fp_new, rel_tol=1e-6):
        raise UserError(f"--update: full-precision PPL {fp_new:.6g} differs from the report's {fp_old:.6g} at "
                        f"{where}: another model or data; write a new report (--out) instead")
    rows = {e["scheme"]: e for e in new["schemes"]}
    merged = [rows.pop(e["scheme"], e) for e in old["schemes"]] + list(rows.values())
    stamp = {"schemes": schemes, "at": time.strftime("%Y-%m-%d %H:%M:%S"), "code": new.get("code"),
             "python": new.get("python"), "torch": new.get("torch")}
    return {**old, "schemes": merged, "updated": [*old.get("updated", []), stamp]}


def _loader_fn():
    from outlier_titan.checkpoint import load_model_for_eval

    return load_model_for_eval


def main(argv: list[str] | None = None) -> int:
    import outlier_titan.components  # noqa: F401  (the built-ins, before any config or registry is read)
    args = parse(argv)
    return cli.report_user_errors(run, args)


def run(args: argparse.Namespace) -> int:
    from outlier_titan.checkpoint.manager import resolve_checkpoint_dir, run_config_file
    from outlier_titan.config.manager import parse_args
    from outlier_titan.data import build_dataloader
    from outlier_titan.eval.perplexity import take_batches, validation_budget
    from outlier_titan.eval.report import markdown
    from outlier_titan.eval.runner import evaluate_model

    run_config = run_config_file(Path(args.checkpoint)) if args.checkpoint else None
    if run_config is not None:  # reading it imports its job.plugins, which may register schemes
        parse_args(["--config", str(run_config)])
    schemes = check_schemes([s.strip() for s in args.schemes.split(",") if s.strip()] if args.schemes
                            else list(SCHEMES), "--schemes")
    for flag in ("tokens", "batch_size", "calib_batches", "calib_seeds"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag.replace('_', '-')} must be at least 1")
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    if args.hf:
        from outlier_titan.hf.load import load_pretrained

        ckpt = run_dir = Path(args.hf)
        model, cfg, tokenizer = load_pretrained(ckpt, device, tokenizer=args.tokenizer)
        default_out = run_dir / "eval" / "model.json"
    else:
        ckpt = resolve_checkpoint_dir(args.checkpoint)
        run_dir = ckpt.parent.parent
        model, cfg, tokenizer = _loader_fn()(ckpt, device)
        default_out = run_dir / "eval" / f"{ckpt.name}.json"
        if args.tokenizer:
            raise UserError("--tokenizer applies to --hf only; a run's checkpoint uses the run's tokenizer")
    if args.data:
        cfg.data.source = args.data
    seq_len = args.seq_len or cfg.training.seq_len
    bs = args.batch_size

    def loader(split: str, seed: int):
        return build_dataloader(cfg.data, tokenizer, seq_len=seq_len, global_batch_size=bs, micro_batch_size=bs,
                                dp_rank=0, dp_degree=1, split=split, seed=seed)

    val = loader("validation", cfg.training.seed)
    budget = validation_budget(val, seq_len, args.tokens, "--tokens")
    eval_batches = take_batches(val, budget)
    n_probe = args.probe_sequences or cfg.observe.batch_size * 4
    probe_rows = torch.cat([inputs for inputs, _ in eval_batches])[:n_probe]
    probe_tokens = list(probe_rows.split(max(1, cfg.observe.batch_size)))

    def calib(seed: int) -> list[torch.Tensor]:
        batches = []
        for inputs, _ in loader("train", 1000 + seed):
            batches.append(inputs)
            if len(batches) == args.calib_batches:
                break
        return batches

    calibration = {"batches": args.calib_batches, "seeds": args.calib_seeds, "split": "train"}
    out = Path(args.out) if args.out else default_out
    previous = None
    if args.update:
        if not out.is_file():
            raise UserError(f"--update: no report at {out} to update; run without --update (or name it with --out)")
        previous = json.loads(out.read_text())
        check_update(previous, {"tokens": sum(labels.numel() for _, labels in eval_batches), "seq_len": seq_len,
                                "tokens_requested": args.tokens, "calibration": calibration}, out)
    report, images = evaluate_model(model, eval_batches=eval_batches, probe_tokens=probe_tokens,
                                    calib_batches=calib, schemes=schemes, calib_seeds=range(args.calib_seeds),
                                    device=device, probe=previous is None)  # --update keeps the old probe
    report = {"checkpoint": str(ckpt), "run": str(run_dir), **report, "tokens_requested": args.tokens,
              "calibration": calibration, "code": code_version(), **runtime_versions()}
    m = re.match(r"step-(\d+)$", ckpt.name)
    if m:
        report["step"] = int(m.group(1))
    if previous is not None:
        report = merge_update(previous, report, schemes, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    out.with_suffix(".md").write_text(table)
    written = [out, out.with_suffix(".md")]
    written += save_images(images, out)
    print(table)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def save_images(images: dict, out: Path) -> list[Path]:
    """Writes the probe's pictures (HWC uint8, already labelled) next to ``out`` as PNG files."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, img in images.items():
        path = out.with_suffix(f".{name.split('/')[-1]}.png")
        plt.imsave(path, img)
        paths.append(path)
    return paths


if __name__ == "__main__":
    sys.exit(main())
