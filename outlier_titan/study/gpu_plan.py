"""The gpu scale's plan (``scripts/reproduce.py --scale gpu --dry-run``): per run, parameters, tokens, FLOPs,
memory per rank and an assumed wall time on 1 and 8 GPUs."""

from __future__ import annotations

import re
from pathlib import Path

from outlier_titan.errors import UserError
from outlier_titan.study.suite_files import suite_file


def gpu_dry_run(suite: str, tokenizer: str | None, mfu: float, peak_tflops: float, gpu_gib: float = 80.0,
                layouts: tuple[int, ...] = (1, 8)) -> str:
    """The suite's gpu-scale runs: parameters, tokens, FLOPs, per-rank memory at the largest micro-batch that
    fits ``gpu_gib`` (the trainer's ``--dry_run`` planner, :func:`outlier_titan.training.planning.plan`) and the
    estimated wall time on 1 and 8 GPUs at ``mfu`` of ``peak_tflops`` per GPU."""
    import copy
    import tempfile

    from outlier_titan.config.manager import tomllib
    from outlier_titan.errors import ConfigError
    from outlier_titan.errors import DataError
    from outlier_titan.training.planning import GiB, plan
    from outlier_titan.study.spec import load_sweep

    path = suite_file(suite, "gpu")
    with tempfile.TemporaryDirectory() as tmp:
        if tokenizer:
            # the same sweep with data.tokenizer replaced (its base made absolute so the copy resolves it)
            text = path.read_text()
            base = (path.parent / tomllib.loads(text)["base"]).resolve()
            lines = [f'base = "{base}"' if ln.startswith("base =") else ln for ln in text.splitlines()]
            fixed = [i for i, ln in enumerate(lines) if ln.strip() == "[fixed]"]
            if any(re.match(r'^\s*"?data\.tokenizer"?\s*=', ln) for ln in lines):
                raise UserError(f"{path} sets data.tokenizer itself; drop --tokenizer")
            if fixed:  # into the file's own [fixed] table
                lines.insert(fixed[0] + 1, f'"data.tokenizer" = "{tokenizer}"')
            else:
                lines += ["[fixed]", f'"data.tokenizer" = "{tokenizer}"']
            path = Path(tmp) / path.name
            path.write_text("\n".join(lines) + "\n")
        try:
            sweep = load_sweep(path)
        except DataError as e:
            raise UserError(f"{e}; pass --tokenizer with a local BPE file to plan offline (parameters then follow "
                            f"its vocabulary)") from None
    header = (f"{'point':<34} {'params':>9} {'tokens':>9} {'FLOPs':>9}  " + "  ".join(
        f"{f'{n}GPU:micro':>10} {'GiB/rank':>9} {'wall h':>8}" for n in layouts))
    out = [f"{suite} at gpu scale: {len(sweep.points)} runs of {path.name}"
           + (f" with data.tokenizer = {tokenizer} (not the recipe's vocabulary)" if tokenizer else ""),
           f"micro = largest micro-batch per rank whose planned memory fits {gpu_gib:g} GiB (! = none fits); "
           f"wall h = FLOPs / (GPUs x {peak_tflops:g} TFLOP/s bf16 peak x MFU {mfu:g}), an assumption, not a "
           f"measurement", header]
    from outlier_titan.study.plan import fmt_count

    total = 0.0
    for p in sweep.points:
        cells = []
        for n in layouts:
            cfg = copy.deepcopy(p.cfg)
            cfg.parallelism.dp_shard, cfg.parallelism.dp_replicate, cfg.parallelism.tp = n, 1, 1
            cfg.training.device = "cuda"
            # the largest micro-batch (halving from the whole per-rank batch) whose plan fits the GPU
            micro = max(1, cfg.training.global_batch_size // n)
            while True:
                cfg.training.micro_batch_size = micro
                try:
                    pl = plan(cfg)
                except ConfigError as e:
                    raise UserError(f"point {p.name} on {n} GPU(s): {e}") from None
                if pl.total_bytes <= gpu_gib * GiB or micro == 1:
                    break
                micro //= 2
            hours = p.flops / (n * peak_tflops * 1e12 * mfu) / 3600
            fits = "" if pl.total_bytes <= gpu_gib * GiB else "!"
            cells.append(f"{micro:>10} {pl.total_bytes / GiB:>8.1f}{fits:1} {hours:>8.1f}")
        total += p.flops
        out.append(f"{p.name:<34} {fmt_count(p.params):>9} {fmt_count(p.tokens):>9} {p.flops:>9.3g}  "
                   + "  ".join(cells))
    out.append(f"total {total:.3g} FLOPs: {total / (peak_tflops * 1e12 * mfu) / 3600:.1f} GPU-hours")
    return "\n".join(out)
