"""``probe`` and ``step``: the outlier probe's cost against training steps, and the trainer's whole step against a
plain PyTorch loop."""

from __future__ import annotations

import dataclasses
import datetime
import platform
import statistics
import time

import torch
from tqdm import tqdm

from outlier_titan.packaged import configs_dir


def run_probe(args, command: str) -> dict:
    """Median training-step time vs median probe time on the debug run, measured interleaved in one process (with
    ``--gradients`` also the probe with ``observe.gradients``, with ``--lowprec-recipe R`` also the probe measuring
    the casts of recipe R, ``observe.lowprec_recipe``; each interleaved with the plain one)."""
    import tempfile

    from outlier_titan.config.manager import parse_args
    from outlier_titan.observe.probe import OutlierProbe
    from outlier_titan.trainer import Trainer

    lowprec = getattr(args, "lowprec_recipe", "")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_args(["--config", str(configs_dir() / "debug.toml"), "--job.dump_folder", tmp,
                          "--checkpoint.enable", "false", "--eval.every", "0", "--metrics.tensorboard", "false",
                          "--observe.every", str(args.every), "--observe.mode", args.mode,
                          "--training.steps", "1000000"])
        trainer = Trainer(cfg)
        trainer._build_probe()
        variants = {"": {}}  # name -> the [observe] changes of a probe timed beside the plain one
        if args.gradients:
            variants["gradients"] = {"gradients": True}
        if lowprec:
            variants["lowprec"] = {"lowprec_recipe": lowprec}
            if args.gradients:  # the casts' gradient class needs the backward
                variants["lowprec_gradients"] = {"lowprec_recipe": lowprec, "gradients": True}
        probes = {name: OutlierProbe(trainer.model, dataclasses.replace(cfg.observe, **changes), trainer.mesh)
                  if changes else trainer.probe for name, changes in variants.items()}
        probe_every = max(1, args.steps // args.probes)
        step_times, probe_times = [], {g: [] for g in probes}
        for i in tqdm(range(args.warmup + args.steps), desc="probe benchmark", unit="step"):
            t0 = time.perf_counter()
            trainer.train_step()
            if i >= args.warmup:
                step_times.append(time.perf_counter() - t0)
            if i % probe_every == 0:
                for g in (list(probes) if i % 2 else list(probes)[::-1]):  # alternate which runs first
                    t0 = time.perf_counter()
                    probes[g].run(trainer.probe_tokens)
                    if i >= args.warmup:
                        probe_times[g].append(time.perf_counter() - t0)
        trainer.close()
    step = statistics.median(step_times)
    print(f"date {datetime.date.today()}  machine {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}\ncommand: {command}")
    print("| model | probe mode | observe.gradients | observe.lowprec_recipe | observe.every | train step (median) | "
          "probe (median) | probe / step | throughput drop |")
    print("|---|---|---|---|---|---|---|---|---|")
    result = {"step_ms": 1e3 * step}
    for g, times in probe_times.items():
        probe = statistics.median(times)
        tag = f"_{g}" if g else ""
        result.update({f"probe{tag}_ms": 1e3 * probe, f"drop{tag}": probe / (args.every * step + probe)})
        print(f"| debug (pre_ln, 16 x 256 tokens) | {args.mode} | {str('gradients' in g).lower()} | "
              f"{lowprec if 'lowprec' in g else ''} | {args.every} | {1e3 * step:.1f} ms | {1e3 * probe:.1f} ms | "
              f"{probe / step:.3f} | {100 * result[f'drop{tag}']:.2f}% |")
    for g in probe_times:
        if g:  # each variant against the plain probe
            result[f"{g}_over_probe"] = result[f"probe_{g}_ms"] / result["probe_ms"]
            print(f"probe with {g.replace('_', ' + ')} / probe without: {result[f'{g}_over_probe']:.2f}")
    if lowprec:  # the casts' own share of a step, as observe.every = N costs it
        added = result["probe_lowprec_ms"] - result["probe_ms"]
        result["lowprec_drop"] = added / (args.every * 1e3 * step)
        print(f"the casts' statistics alone: {added:.1f} ms a probe, {100 * result['lowprec_drop']:.2f}% of the "
              f"steps at observe.every = {args.every}")
    return result


def run_step(args, command: str) -> dict:
    """Median whole-step times: trainer (per optimizer) vs a plain loop (AdamW) on the same model and batch."""
    import tempfile

    from outlier_titan.config.manager import parse_args
    from outlier_titan.models.registry import build_meta_model
    from outlier_titan.trainer import Trainer

    names = args.optimizers.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for name in names:
            cfg = parse_args(["--config", str(configs_dir() / "debug.toml"), "--job.dump_folder", tmp,
                              "--job.name", name, "--checkpoint.enable", "false", "--eval.every", "0",
                              "--metrics.tensorboard", "false", "--observe.every", "0",
                              "--training.steps", "1000000", "--optimizer.name", name])
            trainers[name] = Trainer(cfg)
        first = trainers[names[0]]
        cfg = first.cfg
        _, _, plain = build_meta_model(cfg.model, first.tokenizer.vocab_size, cfg.training.seq_len)
        plain = plain.to_empty(device="cpu")
        with torch.no_grad():
            for (_, q), (_, p) in zip(plain.named_parameters(), first.model.named_parameters()):
                q.copy_(p.full_tensor() if hasattr(p, "full_tensor") else p)
        plain.train()
        opt = torch.optim.AdamW(plain.parameters(), lr=cfg.optimizer.lr, betas=(cfg.optimizer.beta1,
                                cfg.optimizer.beta2), weight_decay=cfg.optimizer.weight_decay, foreach=True)
        batch = [next(first.train_iter) for _ in range(first.accum_steps)]
        inputs = torch.cat([b[0] for b in batch])
        labels = torch.cat([b[1] for b in batch])
        n_tokens = labels.numel()

        def plain_step():
            opt.zero_grad(set_to_none=True)
            logits = plain(inputs)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                     reduction="sum") / n_tokens
            loss.backward()
            opt.step()

        steps = {name: t.train_step for name, t in trainers.items()}
        steps["plain"] = plain_step
        times = {k: [] for k in steps}
        for i in range(args.warmup + args.steps):
            for name, fn in steps.items():
                t0 = time.perf_counter()
                fn()
                if i >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
        for t in trainers.values():
            t.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"date {datetime.date.today()}  machine {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}\ncommand: {command}")
    print(f"debug model, batch {inputs.shape[0]} x {inputs.shape[1]} tokens, {args.steps} interleaved steps, medians")
    print("| loop | step (median) | / plain loop | / trainer AdamW |")
    print("|---|---|---|---|")
    for k, v in med.items():
        label = "plain PyTorch loop (AdamW foreach)" if k == "plain" else f"trainer, {k}"
        rel = f"{v / med['adamw']:.3f}x" if "adamw" in med else "-"
        print(f"| {label} | {v * 1e3:.1f} ms | {v / med['plain']:.3f}x | {rel} |")
    return med

