"""Benchmarks. Sub-benchmark ``optim``: optimizer step time of OrthoAdam and SOAP relative to AdamW;
``probe``: cost of the outlier probe relative to training; ``step``: the trainer's whole training step against
a minimal plain-PyTorch loop, and OrthoAdam's whole step against AdamW's.

    outlier-titan-benchmark optim [--shapes gpt2_124m,debug] [--tile-sizes 256,64] [--reps 5] [--markdown FILE]
    outlier-titan-benchmark probe [--every 100] [--steps 40] [--probes 8] [--mode full]
    outlier-titan-benchmark step [--steps 20] [--optimizers adamw,orthoadam]
    outlier-titan-benchmark soap-ab BEFORE_CHECKOUT [--steps 10]   # SOAP before/after in one process
    outlier-titan-benchmark compile-math [--scale gpt2] [--step-pairs 12]   # eager vs compiled element-wise math
    outlier-titan-benchmark muon [--ranks 1,2] [--layers 12] [--reps 3]   # Muon step / AdamW step per layout
    outlier-titan-benchmark attention [--seq-lens 256,512,1024] [--impls auto,explicit]   # per attention variant

``step`` builds the debug-run trainer (world size 1, default batch) once per optimizer in this process, and a
plain copy of its model (same weights, no parallel wrappers) stepped by a loop written here: forward, summed
cross entropy / tokens, backward, torch AdamW (foreach). Trainer steps (loader, micro-batches, grad norm, clip,
optimizer, LR schedule) and plain steps on the same batch run interleaved; medians and their ratios.

``probe`` builds the debug-run trainer in this process (world size 1), times training steps and probe runs
interleaved in one run, and reports the throughput drop at ``observe.every = N``: probe time / (N x step time).

For each shape set, AdamW (torch, foreach), OrthoAdam and SOAP step the *same* parameter tensors with the
same gradients in one process; repetitions are interleaved (AdamW, OrthoAdam, SOAP, then OrthoAdam, SOAP, AdamW,
...: each rep starts one optimizer later) so that load from other processes on a shared machine hits all alike,
and ratios of medians are reported.
SOAP's time is amortised over its refresh period: with staggered refreshes every step refreshes about
1/f of the tiles, and the reps together cover at least f consecutive steps. The first (warm-up) step of each
optimizer, SOAP's eigh initialisation included, is not timed. Also reported: optimizer state bytes per
parameter (checkpointed state; OrthoAdam's regenerated bases separately) and, for the debug model, the
optimizer step as a share of a whole training step (forward + backward + step).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from outlier_titan import cli
from outlier_titan.optim.orthoadam import OrthoAdam
from outlier_titan.optim.soap import SOAP
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.packaged import configs_dir


def gpt2_124m_shapes(vocab: int = 50304, dim: int = 768, layers: int = 12, ctx: int = 1024) -> list[tuple]:
    """GPT-2 small (Kaul et al. 2024's "130M" class): tied embeddings, learned positions, LayerNorm with bias."""
    shapes = [("tok_embeddings.weight", (vocab, dim)), ("pos_embeddings.weight", (ctx, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        for norm in ("attention_norm", "ffn_norm"):
            shapes += [(p + norm + ".weight", (dim,)), (p + norm + ".bias", (dim,))]
        for w in ("wq", "wk", "wv", "wo"):
            shapes += [(p + f"attention.{w}.weight", (dim, dim)), (p + f"attention.{w}.bias", (dim,))]
        shapes += [(p + "feed_forward.w1.weight", (4 * dim, dim)), (p + "feed_forward.w1.bias", (4 * dim,)),
                   (p + "feed_forward.w2.weight", (dim, 4 * dim)), (p + "feed_forward.w2.bias", (dim,))]
    shapes += [("norm.weight", (dim,)), ("norm.bias", (dim,))]
    return shapes


def debug_model():
    """The debug flavor of the pre_ln model (what train_configs/debug.toml trains), materialised on CPU."""
    from outlier_titan.config.job_config import JobConfig
    from outlier_titan.data import build_tokenizer
    from outlier_titan.models.registry import build_meta_model

    cfg = JobConfig()
    cfg.training.seq_len = 256
    vocab = build_tokenizer(cfg.data.tokenizer).vocab_size
    _, _, model = build_meta_model(cfg.model, vocab, cfg.training.seq_len)
    model = model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model, vocab


def set_grads(params) -> None:
    """Seeded gradients (N(0, 1e-6)) on the parameters, in order: every optimizer under test sees the same ones."""
    gen = torch.Generator().manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3


def seeded_params(shapes) -> dict:
    """{name: parameter} of the given (name, shape) list, seeded N(0, 0.02) weights."""
    gen = torch.Generator().manual_seed(1)
    return {n: torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for n, s in shapes}


def params_with_grads(shapes) -> dict:
    """``seeded_params`` with ``set_grads``."""
    params = seeded_params(shapes)
    set_grads(params.values())
    return params


def make_optimizers(params: dict, args) -> dict:
    names = list(params)
    decay = [n for n in names if params[n].ndim == 2 and "embeddings" not in n]
    rest = [n for n in names if n not in decay]
    groups = lambda: [{"params": [params[n] for n in decay], "names": decay, "weight_decay": 0.1},  # noqa: E731
                      {"params": [params[n] for n in rest], "names": rest, "weight_decay": 0.0}]
    # the current entry of --tile-sizes on both axes (not the automatic per-axis default)
    opts = EngineOptions(tile_size=args.tile_size, shard_tile_size=args.tile_size)
    plain = lambda: [{k: v for k, v in g.items() if k != "names"} for g in groups()]  # noqa: E731
    make = {"adamw": lambda: torch.optim.AdamW(plain(), lr=1e-4, betas=(0.9, 0.95), foreach=True),
            "orthoadam": lambda: OrthoAdam(groups(), lr=1e-4, betas=(0.9, 0.95), basis=args.basis, options=opts),
            "soap": lambda: SOAP(groups(), lr=1e-4, precondition_frequency=args.frequency,
                                 factor_dtype=args.soap_factor_dtype, options=opts)}
    out = {}
    for k in args.optimizers.split(","):
        base = k.removesuffix("+compile")
        if base not in make or (k != base and base == "adamw"):
            raise SystemExit(f"--optimizers: unknown {k!r}; use adamw, orthoadam, soap, orthoadam+compile, "
                             "soap+compile")
        out[k] = make[base]()
        if k != base:
            out[k].compile_math()  # what compile.enable does; compiled at the (untimed) warm-up step
    return out


def state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for v in st.values():
            if torch.is_tensor(v):
                total += v.numel() * v.element_size()
    return total


def bench_optim(label: str, params: dict, args) -> dict:
    n_params = sum(p.numel() for p in params.values())
    set_grads(params.values())
    opts = make_optimizers(params, args)
    for opt in opts.values():
        opt.step()  # warm-up; SOAP's first call initialises its bases
    for name, opt in opts.items():
        if name.startswith("soap") and opt.frequency > 1:
            opt.step()  # then take SOAP into its update regime
    times = {k: [] for k in opts}
    names = list(opts)
    for rep in range(args.reps):
        # each rep starts at the next optimizer, so none always runs right after the same neighbour
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            opt = opts[name]
            t0 = time.perf_counter()
            for _ in range(args.steps_per_rep):
                opt.step()
            times[name].append((time.perf_counter() - t0) / args.steps_per_rep)
    med = {k: statistics.median(v) for k, v in times.items()}
    mean = {k: statistics.fmean(v) for k, v in times.items()}
    return {"label": label, "params": n_params, "median_s": med, "mean_s": mean,
            "ratio_median": {k: med[k] / med["adamw"] for k in med},
            "ratio_mean": {k: mean[k] / mean["adamw"] for k in mean},
            "bytes_per_param": {k: state_bytes(o) / n_params for k, o in opts.items()},
            "basis_bytes_per_param": opts["orthoadam"].resident_basis_bytes() / n_params if "orthoadam" in opts else 0.0,
            "soap_steps_timed": args.reps * args.steps_per_rep, "opts": opts}


def train_step_share(model, vocab: int, result: dict, args) -> dict:
    """Forward + backward time of the debug model on one batch, vs each optimizer's step."""
    tokens = torch.randint(0, vocab, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(args.reps):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        times.append(time.perf_counter() - t0)
    fb = statistics.median(times)
    return {"fwd_bwd_s": fb, "tokens": args.batch * args.seq_len,
            "share": {k: v / (fb + v) for k, v in result["median_s"].items()}}


def _get(d: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """``fmt`` of ``d[key] * scale``, or "-" for an optimizer left out (``--optimizers``)."""
    return fmt.format(d[key] * scale) if key in d else "-"


def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def markdown(results: list[dict], args, command: str) -> str:
    cpu = cpu_name()
    lines = ["## Optimizer step: OrthoAdam and SOAP vs AdamW", "",
             f"- Date: {datetime.date.today().isoformat()}",
             f"- Machine: {cpu}, {torch.get_num_threads()} torch thread(s), torch {torch.__version__}, "
             f"Python {platform.python_version()} (CPU shared with other jobs: ratios, interleaved reps)",
             f"- Command: `{command}`",
             f"- Settings: OrthoAdam basis {args.basis}, SOAP frequency "
             f"{args.frequency} (staggered) with {args.soap_factor_dtype} factors, {args.reps} interleaved reps x "
             f"{args.steps_per_rep} steps, medians", "",
             "| shapes | params | tile | AdamW step | OrthoAdam step | SOAP step (amortised) | OrthoAdam / AdamW | "
             "SOAP / AdamW |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r["median_s"]
        lines.append(f"| {r['label']} | {r['params'] / 1e6:.2f}M | {r['tile']} | {m['adamw'] * 1e3:.1f} ms | "
                     f"{_get(m, 'orthoadam', '{:.1f} ms', 1e3)} | {_get(r['mean_s'], 'soap', '{:.1f} ms', 1e3)} | "
                     f"{_get(r['ratio_median'], 'orthoadam', '{:.2f}x')} | "
                     f"{_get(r['ratio_mean'], 'soap', '{:.2f}x')} |")
    lines += ["", "Targets: OrthoAdam <= 1.15x, SOAP (f = 10, amortised) <= 1.5x AdamW's step."]
    lines += ["", "State bytes per parameter (checkpointed optimizer state; OrthoAdam's bases are regenerated, "
              "not saved, and listed apart):", "",
              "| shapes | tile | AdamW | OrthoAdam | OrthoAdam bases (resident) | SOAP |",
              "|---|---|---|---|---|---|"]
    for r in results:
        b = r["bytes_per_param"]
        lines.append(f"| {r['label']} | {r['tile']} | {b['adamw']:.1f} | {_get(b, 'orthoadam', '{:.1f}')} | "
                     f"{r['basis_bytes_per_param']:.2f} | {_get(b, 'soap', '{:.1f}')} |")
    compiled = [(r, k) for r in results for k in r["median_s"] if k.endswith("+compile")]
    if compiled:
        lines += ["", "Element-wise math compiled (`compile.enable`), against the eager step of the same run:", "",
                  "| shapes | tile | optimizer | step | / AdamW | / eager |", "|---|---|---|---|---|---|"]
        for r, k in compiled:
            base, t = k.removesuffix("+compile"), r["mean_s"] if k.startswith("soap") else r["median_s"]
            eager = f"{t[k] / t[base]:.3f}x" if base in t else "-"
            lines.append(f"| {r['label']} | {r['tile']} | {k} | {t[k] * 1e3:.1f} ms | {t[k] / t['adamw']:.2f}x | "
                         f"{eager} |")
    shares = [r for r in results if "train" in r]
    if shares:
        lines += ["", "Optimizer step as a share of a whole training step (forward + backward + step):", "",
                  "| shapes | tile | batch tokens | fwd+bwd | AdamW | OrthoAdam | SOAP |",
                  "|---|---|---|---|---|---|---|"]
        for r in shares:
            t, s = r["train"], r["train"]["share"]
            lines.append(f"| {r['label']} | {r['tile']} | {t['tokens']} | {t['fwd_bwd_s'] * 1e3:.0f} ms | "
                         f"{s['adamw']:.1%} | "
                         f"{_get(s, 'orthoadam', '{:.1%}')} | {_get(s, 'soap', '{:.1%}')} |")
    return "\n".join(lines) + "\n"


def run_optim(args, command: str) -> list[dict]:
    torch.set_grad_enabled(True)
    results = []
    jobs = [(s, int(t)) for s in args.shapes.split(",") for t in args.tile_sizes.split(",")]
    print(f"optim: {len(jobs)} shape set x tile size combination(s), {args.reps} interleaved reps of AdamW, "
          f"OrthoAdam and SOAP each; a line per combination as it finishes, then the tables", flush=True)
    for shape_set, tile in tqdm(jobs, desc="optim", unit="combination"):
        args.tile_size = tile
        if shape_set == "gpt2_124m":
            params = seeded_params(gpt2_124m_shapes())  # bench_optim sets the gradients
            r = bench_optim("GPT-2 small (130M class), dim 768", params, args)
        elif shape_set == "debug":
            model, vocab = debug_model()
            params = dict(model.named_parameters())
            r = bench_optim("debug model (pre_ln/debug)", params, args)
            r["train"] = train_step_share(model, vocab, r, args)
        else:
            raise SystemExit(f"--shapes: unknown shape set {shape_set!r}; use gpt2_124m and/or debug")
        r.pop("opts")
        r["tile"] = tile
        results.append(r)
        tqdm.write(f"{r['label']} tile {tile}: AdamW {r['median_s']['adamw'] * 1e3:.1f} ms, OrthoAdam x"
                   f"{_get(r['ratio_median'], 'orthoadam', '{:.2f}')}, SOAP x{_get(r['ratio_mean'], 'soap', '{:.2f}')} "
                   f"(amortised); bytes/param {', '.join(f'{k} {v:.1f}' for k, v in r['bytes_per_param'].items())}")
    text = markdown(results, args, command)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return results


def run_probe(args, command: str) -> dict:
    """Median training-step time vs median probe time on the debug run, measured interleaved in one process."""
    import tempfile

    from outlier_titan.config.manager import parse_args
    from outlier_titan.trainer import Trainer

    with tempfile.TemporaryDirectory() as tmp:
        cfg = parse_args(["--config", str(configs_dir() / "debug.toml"), "--job.dump_folder", tmp,
                          "--checkpoint.enable", "false", "--eval.every", "0", "--metrics.tensorboard", "false",
                          "--observe.every", str(args.every), "--observe.mode", args.mode,
                          "--training.steps", "1000000"])
        trainer = Trainer(cfg)
        trainer._build_probe()
        probe_every = max(1, args.steps // args.probes)
        step_times, probe_times = [], []
        for i in tqdm(range(args.warmup + args.steps), desc="probe benchmark", unit="step"):
            t0 = time.perf_counter()
            trainer.train_step()
            if i >= args.warmup:
                step_times.append(time.perf_counter() - t0)
            if i % probe_every == 0:
                t0 = time.perf_counter()
                trainer.probe.run(trainer.probe_tokens)
                if i >= args.warmup:
                    probe_times.append(time.perf_counter() - t0)
        trainer.close()
    step, probe = statistics.median(step_times), statistics.median(probe_times)
    result = {"step_ms": 1e3 * step, "probe_ms": 1e3 * probe, "drop": probe / (args.every * step + probe)}
    print(f"date {datetime.date.today()}  machine {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} thread(s), torch {torch.__version__}\ncommand: {command}")
    print("| model | probe mode | observe.every | train step (median) | probe (median) | throughput drop |")
    print("|---|---|---|---|---|---|")
    print(f"| debug (pre_ln, 16 x 256 tokens) | {args.mode} | {args.every} | {result['step_ms']:.1f} ms | "
          f"{result['probe_ms']:.1f} ms | {100 * result['drop']:.2f}% |")
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


def _one_gpt2_layer() -> list[tuple[str, tuple[int, int]]]:
    dim = 768
    return ([(f"layers.0.attention.{w}.weight", (dim, dim)) for w in ("wq", "wk", "wv", "wo")]
            + [("layers.0.feed_forward.w1.weight", (4 * dim, dim)),
               ("layers.0.feed_forward.w2.weight", (dim, 4 * dim))])


def run_soap_ab(args, command: str) -> float:
    """AdamW, another checkout's SOAP and this checkout's SOAP step one GPT-2-small layer's six matrices (108
    tiles of 256) interleaved in one process; the other ``optim/soap.py`` runs on this checkout's tile engine."""
    import importlib.util

    from outlier_titan.optim import soap as this_soap
    from outlier_titan.optim.tiles.options import EngineOptions

    path = Path(args.before) / "outlier_titan" / "optim" / "soap.py"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist; pass the root of a checkout (e.g. a git worktree)")
    spec = importlib.util.spec_from_file_location("soap_before", str(path))
    before = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(before)
    shapes = _one_gpt2_layer()
    names = [n for n, _ in shapes]

    def params():
        return list(params_with_grads(shapes).values())

    o = EngineOptions(tile_size=256, shard_tile_size=256)
    opts = {"adamw": torch.optim.AdamW(params(), lr=1e-4, betas=(0.9, 0.95), foreach=True),
            "soap before": before.SOAP([{"params": params(), "names": names}], lr=1e-4, options=o),
            "soap after": this_soap.SOAP([{"params": params(), "names": names}], lr=1e-4, options=o)}
    for opt in opts.values():  # first basis (eigh) and warm-up, untimed
        opt.step()
        opt.step()
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in tqdm(range(args.steps), desc="soap-ab", unit="step"):
        for k, opt in opts.items():
            t0 = time.perf_counter()
            opt.step()
            times[k].append(time.perf_counter() - t0)
    print(f"{command}\ndate {datetime.date.today()}, {torch.get_num_threads()} thread(s), {args.steps} steps each "
          "(means cover whole refresh cycles when steps is a multiple of f = 10)")
    adamw = statistics.median(times["adamw"])
    for k, v in times.items():
        print(f"  {k:12s} median {statistics.median(v) * 1e3:8.1f} ms  mean {statistics.fmean(v) * 1e3:8.1f} ms  "
              f"mean / AdamW median {statistics.fmean(v) / adamw:6.2f}x")
    ratio = statistics.fmean(times["soap after"]) / statistics.fmean(times["soap before"])
    print(f"after / before (means): {ratio:.3f}")
    return ratio


def run_compile_math(args, command: str) -> dict:
    """Eager vs compiled (``compile.enable``) element-wise math of the tile optimizers: the shared
    ``adam_directions`` alone on GPT-2 small's rotated matrices (or one layer's) with SOAP's and OrthoAdam's
    coefficients; whether the compiled kernel gives the same bits when its input is cut as a shard boundary would
    cut it; and whole OrthoAdam steps, eager and compiled stepped alternately (ABBA pairs)."""
    from outlier_titan.optim.tiles.adam import adam_directions, compiled_adam_directions

    dim = 768
    shapes = ([(dim, dim)] * 48 + [(4 * dim, dim)] * 12 + [(dim, 4 * dim)] * 12 + [(1024, dim)]
              if args.scale == "gpt2" else [s for _, s in _one_gpt2_layer()])
    gen = torch.Generator().manual_seed(0)
    ms, vs = [torch.zeros(s) for s in shapes], [torch.zeros(s) for s in shapes]
    gs = [torch.randn(s, generator=gen) for s in shapes]
    rows = {"soap": [(0.1, 0.95, 0.05, 1.0, 1e-8, 1.0)] * len(shapes),
            "orthoadam": [(0.1, 0.95, 0.05, 0.3, 1e-8, -1.0)] * len(shapes)}
    compiled = compiled_adam_directions()
    t0 = time.perf_counter()
    for r in rows.values():
        compiled(ms, vs, gs, r)
    compile_s = time.perf_counter() - t0
    m1, v1 = [m.clone() for m in ms], [v.clone() for v in vs]
    m2, v2 = [m.clone() for m in ms], [v.clone() for v in vs]
    err = max(((x - y).abs().max() / y.abs().max().clamp_min(1e-30)).item()
              for x, y in zip(adam_directions(m1, v1, gs, rows["soap"]), compiled(m2, v2, gs, rows["soap"])))
    fns = {f"{k} {mode}": (f, r) for k, r in rows.items() for mode, f in (("eager", adam_directions),
                                                                         ("compiled", compiled))}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(args.reps):
        for k, (f, r) in fns.items():
            t0 = time.perf_counter()
            f(ms, vs, gs, r)
            times[k].append(time.perf_counter() - t0)
    n = sum(m.numel() for m in ms)
    print(f"{command}\ndate {datetime.date.today()}, {args.scale}: {n / 1e6:.1f}M elements, "
          f"{torch.get_num_threads()} thread(s); compile time {compile_s:.1f} s; compiled vs eager max relative "
          f"difference {err:.1e}")
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in med.items():
        print(f"  {k:20s} {v * 1e3:8.1f} ms")

    # The shipped kernel on one long tensor and on two pieces of it, cut where a shard boundary could fall: an
    # element-wise kernel must give the same bits whatever the cut (each piece shape compiles once).
    size = 768 * 3072 + 37
    m, v, g = ([t] for t in (torch.randn(size, generator=gen).abs() * 1e-3 for _ in range(3)))
    one = [rows["soap"][0]]
    with torch._dynamo.config.patch(recompile_limit=32):
        whole = compiled([m[0].clone()], [v[0].clone()], g, one)[0]
        for cut in (768 * 1536, 768 * 1536 + 5, 1000003, 13):
            pieces = [compiled([m[0][s].clone()], [v[0][s].clone()], [g[0][s]], one)[0]
                      for s in (slice(0, cut), slice(cut, size))]
            differ = (~torch.eq(torch.cat(pieces), whole)).sum().item()
            print(f"  cut at {cut}: {differ} elements differ from the whole call")
    eager = adam_directions([m[0].clone()], [v[0].clone()], g, one)[0]
    print(f"  compiled vs eager: {(~torch.eq(eager, whole)).sum().item()} of {size} elements differ")
    if args.step_pairs:
        med.update(_orthoadam_step_pairs(args))
    return med


def _orthoadam_step_pairs(args) -> dict:
    """Whole OrthoAdam steps (hadamard, tile 256) eager and with ``compile_math()``, on the same parameters and
    gradients, stepped alternately in ABBA order; medians and the median of the pairwise ratios."""
    torch._dynamo.reset()  # a fresh compile cache, as a training process has (the cut check above filled it)
    params = params_with_grads(gpt2_124m_shapes() if args.scale == "gpt2" else _one_gpt2_layer())
    names = list(params)
    opts = EngineOptions(tile_size=256, shard_tile_size=256)
    make = lambda: OrthoAdam([{"params": [params[n] for n in names], "names": names, "weight_decay": 0.1}],  # noqa: E731
                             lr=1e-4, options=opts)
    eager, comp = make(), make()
    comp.compile_math()
    eager.step()
    comp.step()  # compiles
    t = {"eager": [], "compiled": []}
    for i in range(args.step_pairs):
        order = (("eager", eager), ("compiled", comp)) if i % 2 == 0 else (("compiled", comp), ("eager", eager))
        for k, opt in order:
            t0 = time.perf_counter()
            opt.step()
            t[k].append(time.perf_counter() - t0)
    med = {f"orthoadam step {k}": statistics.median(v) for k, v in t.items()}
    pair = statistics.median(c / e for c, e in zip(t["compiled"], t["eager"]))
    print(f"  OrthoAdam step ({len(t['eager'])} ABBA pairs): eager {med['orthoadam step eager'] * 1e3:.1f} ms, "
          f"compiled {med['orthoadam step compiled'] * 1e3:.1f} ms; compiled / eager, median of pairs {pair:.3f}x")
    return med


def _muon_worker(rank: int, world: int, port: int, args, out: dict) -> None:
    """One rank of the ``muon`` benchmark: FSDP-style Shard placements on a 1-D mesh (world > 1) or plain
    tensors (world 1); AdamW and Muon (per layout) step the same parameters, interleaved; medians in ``out``."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from outlier_titan.models.roles import DEFAULT_ROLES
    from outlier_titan.optim.muon import MuonAdamW
    from outlier_titan.models.roles import shard_dim_for

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        shapes = gpt2_124m_shapes(layers=args.layers)
        full = seeded_params(shapes)
        gen = torch.Generator().manual_seed(0)
        grads = {n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in full.items()}
        params = {}
        for n, p in full.items():
            if world > 1:
                pl = (Shard(shard_dim_for(n, p, DEFAULT_ROLES)),)  # the built-in specs' names
                params[n] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, pl, src_data_rank=None))
                params[n].grad = distribute_tensor(grads[n], mesh, pl, src_data_rank=None)
            else:
                params[n] = p
                p.grad = grads[n]
        names = list(params)
        hidden = [n for n in names if params[n].ndim == 2 and n.startswith("layers.")]
        rest = [n for n in names if n not in hidden]
        muon_group = lambda: {"params": [params[n] for n in hidden], "names": hidden, "algorithm": "muon",  # noqa
                              "lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                              "ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "eps": 1e-7,
                              "adjust_lr_fn": "original"}
        adamw_group = lambda: {"params": [params[n] for n in rest], "names": rest, "algorithm": "adamw",  # noqa
                               "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
        opts = {"adamw": torch.optim.AdamW([params[n] for n in names], lr=1e-3, betas=(0.9, 0.95), foreach=True)}
        for layout in args.layouts.split(","):
            opts[layout] = MuonAdamW([muon_group(), adamw_group()], layout=layout, full_every=args.full_every,
                                     ns_dtype=args.ns_dtype, options=EngineOptions(tile_size=args.tile_size))
        keys = list(opts)
        for k in keys:  # warm-up, untimed
            opts[k].step()
        # block_periodic: time whole periods (one full step + k-1 block steps) and report the mean step
        steps = {k: (args.full_every if k == "block_periodic" else 1) for k in keys}
        times = {k: [] for k in keys}
        for rep in range(args.reps):
            for k in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                if k == "block_periodic":  # start each timed period on its full step
                    st = opts[k].state[params[hidden[0]]]["step"]
                    st.fill_(st.item() + (-(st.item()) % args.full_every))
                    for n in hidden[1:]:
                        opts[k].state[params[n]]["step"].copy_(st)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps[k]):
                    opts[k].step()
                dist.barrier()
                times[k].append((time.perf_counter() - t0) / steps[k])
        if rank == 0:
            out[world] = {k: statistics.median(v) for k, v in times.items()}
            if "full" in opts:
                full_steps = 1 + args.reps
                out[f"bytes{world}"] = opts["full"].bytes_sent / full_steps
            out[f"params{world}"] = sum(p.numel() for p in full.values())
    finally:
        dist.destroy_process_group()


def run_muon(args, command: str) -> None:
    import torch.multiprocessing as mp

    from outlier_titan.parallel.dims import free_port

    manager = mp.Manager()
    out = manager.dict()
    for world in [int(w) for w in args.ranks.split(",")]:
        mp.spawn(_muon_worker, args=(world, free_port(), args, out), nprocs=world, join=True)
    layouts = args.layouts.split(",")
    n_params = out[f"params{int(args.ranks.split(',')[0])}"]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s) per rank, "
             f"torch {torch.__version__}, {date}. Command: `{command}`.", "",
             f"GPT-2 small shapes, {args.layers} layer(s) ({n_params / 1e6:.2f}M "
             f"params); Muon on the hidden matrices, AdamW on the rest; Newton-Schulz in {args.ns_dtype}; block tile "
             f"{args.tile_size}; block_periodic k = {args.full_every} (mean step over a period).", "",
             "| ranks | AdamW step | " + " | ".join(f"Muon {lay}" for lay in layouts) + " | "
             + " | ".join(f"{lay} / AdamW" for lay in layouts) + " | full: all-to-all bytes sent per rank per step |",
             "|---" * (3 + 2 * len(layouts)) + "|"]
    for world in [int(w) for w in args.ranks.split(",")]:
        r = out[world]
        sent = out.get(f"bytes{world}", 0.0)
        lines.append(f"| {world} | {r['adamw'] * 1e3:.1f} ms | "
                     + " | ".join(f"{r[lay] * 1e3:.1f} ms" for lay in layouts) + " | "
                     + " | ".join(f"{r[lay] / r['adamw']:.2f}x" for lay in layouts)
                     + f" | {sent / 2**20:.1f} MiB |")
    print("\n".join(lines))


def peak_bytes(fn, device: torch.device) -> int:
    """Peak bytes of the tensors ``fn()`` allocates and holds at once (on a GPU the caching allocator's peak; on the
    CPU torch's MemTracker, which follows every tensor's storage from allocation to release)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    with tracker:
        fn()
    return tracker.get_tracker_snapshot("peak")[device]["Total"]


def attention_step(variant: str, impl: str, batch: int, heads: int, seq_len: int, head_dim: int, dtype, device):
    """A closure running one forward + backward of ``variant``'s causal attention on fixed random inputs."""
    from outlier_titan.models.attention import run_attention
    from outlier_titan.models.attention_variants import AttentionOptions

    g = torch.Generator(device).manual_seed(seq_len)
    q, k, v = (torch.randn(batch, heads, seq_len, head_dim, generator=g, device=device, dtype=dtype)
               .requires_grad_() for _ in range(3))
    sink = torch.zeros(heads, device=device, requires_grad=True) if variant == "sink_logit" else None
    opts = AttentionOptions(variant=variant, impl=impl)

    def step():
        run_attention(q, k, v, opts, head_dim ** -0.5, state=sink).float().square().sum().backward()
    return step


def _attention_ops(step, device: torch.device) -> str:
    """The attention operators the profiler saw in one call of ``step`` (SDPA, FlexAttention or bmm)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        step()
    names = {e.key for e in prof.key_averages()}
    fused = sorted(n for n in names
                   if ("aten::_scaled_dot_product" in n or "flex" in n.lower()) and "backward" not in n)
    return ", ".join(f"`{n.removeprefix('aten::')}`" for n in fused) or ("`bmm`" if "aten::bmm" in names else "-")


def run_attention_bench(args, command: str) -> list[dict]:
    """Per variant and sequence length: forward + backward time (median of interleaved reps), peak memory, the path
    and the operators the profiler saw, for each ``--impls`` entry; the ratio to softmax on the same path."""
    from outlier_titan.models.attention import attention_path
    from outlier_titan.models.attention_variants import variants as registered

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    variants = args.variants.split(",") if args.variants else [v.name for v in registered()]
    if "softmax" not in variants:
        variants.insert(0, "softmax")
    impls = args.impls.split(",")
    rows = []
    for t in [int(x) for x in args.seq_lens.split(",")]:
        cases = [(v, impl) for impl in impls for v in variants]
        steps = {c: attention_step(*c, args.batch, args.heads, t, args.head_dim, dtype, device) for c in cases}
        for step in steps.values():
            step()  # warm-up (and compilation on a GPU)
        times = {c: [] for c in cases}
        for rep in range(args.reps):
            for i in range(len(cases)):
                c = cases[(i + rep) % len(cases)]
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                steps[c]()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times[c].append(time.perf_counter() - t0)
        for v, impl in cases:
            med = statistics.median(times[(v, impl)])
            rows.append({"variant": v, "impl": impl, "seq_len": t, "s": med,
                         "ratio": med / statistics.median(times[("softmax", impl)]),
                         "path": attention_path(v, impl, device), "ops": _attention_ops(steps[(v, impl)], device),
                         "peak": peak_bytes(steps[(v, impl)], device)})
    machine = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name()
    lines = [f"date {datetime.date.today()}  machine {machine}, {torch.get_num_threads()} thread(s), "
             f"torch {torch.__version__}", f"command: `{command}`",
             f"B {args.batch} x H {args.heads} x d_h {args.head_dim}, {args.dtype}, causal, forward + backward "
             f"(attention core only), median of {args.reps} interleaved reps", "",
             "| T | variant | model.attention_impl | path | operators seen | fwd+bwd | / softmax | peak memory |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['seq_len']} | {r['variant']} | {r['impl']} | {r['path']} | {r['ops']} | "
                     f"{r['s'] * 1e3:.1f} ms | {r['ratio']:.2f}x | {r['peak'] / 2**20:.1f} MiB |")
    print("\n".join(lines))
    return rows


def main(argv=None) -> int:
    parser = cli.parser(__doc__)
    sub = parser.add_subparsers(dest="bench", required=True)
    o = sub.add_parser("optim", help="optimizer step time of OrthoAdam and SOAP relative to AdamW",
                       formatter_class=cli.HelpFormatter)
    o.add_argument("--shapes", default="gpt2_124m,debug", help="comma list of: gpt2_124m, debug")
    o.add_argument("--tile-sizes", default="256,64", help="comma list of optimizer.tile_size values")
    o.add_argument("--basis", default="hadamard", choices=("hadamard", "haar", "haar_kron"), help="OrthoAdam basis")
    o.add_argument("--optimizers", default="adamw,orthoadam,soap",
                   help="comma list (adamw first: the ratios' reference) of adamw, orthoadam, soap, "
                        "orthoadam+compile, soap+compile (element-wise math compiled, as compile.enable does)")
    o.add_argument("--frequency", type=int, default=10, help="SOAP precondition_frequency")
    o.add_argument("--soap-factor-dtype", default="float64", choices=("float64", "float32"),
                   help="dtype of SOAP's factor EMAs")
    o.add_argument("--reps", type=int, default=5, help="interleaved repetitions")
    o.add_argument("--steps-per-rep", type=int, default=2, help="timed optimizer steps per repetition")
    o.add_argument("--batch", type=int, default=8, help="debug train-step share: sequences")
    o.add_argument("--seq-len", type=int, default=256, help="debug train-step share: tokens per sequence")
    o.add_argument("--threads", type=int, default=1,
                   help="torch threads (1: stable timings on a shared machine; OpenMP spin-waits under load)")
    o.add_argument("--markdown", default="", help="also write the markdown tables to this file")
    p = sub.add_parser("probe", help="outlier-probe cost relative to training steps (debug model)",
                       formatter_class=cli.HelpFormatter)
    p.add_argument("--every", type=int, default=100, help="observe.every the drop is reported for")
    p.add_argument("--steps", type=int, default=40, help="timed training steps")
    p.add_argument("--probes", type=int, default=8, help="timed probe runs, interleaved with the steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed training steps first")
    p.add_argument("--mode", default="full", choices=("full", "cheap"), help="observe.mode")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    st = sub.add_parser("step", help="trainer step vs a plain PyTorch loop; OrthoAdam vs AdamW whole steps",
                        formatter_class=cli.HelpFormatter)
    st.add_argument("--steps", type=int, default=20, help="timed steps per loop (interleaved)")
    st.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    st.add_argument("--optimizers", default="adamw,orthoadam", help="comma list of trainer optimizer.name values")
    st.add_argument("--threads", type=int, default=1, help="torch threads")
    ab = sub.add_parser("soap-ab", help="SOAP of another checkout vs this one, with AdamW, in one process",
                        formatter_class=cli.HelpFormatter)
    ab.add_argument("before", help="root of the other checkout (e.g. a git worktree of the base commit)")
    ab.add_argument("--steps", type=int, default=10, help="timed steps per optimizer (interleaved)")
    ab.add_argument("--threads", type=int, default=1, help="torch threads")
    cm = sub.add_parser("compile-math", help="eager vs torch.compile of the optimizers' element-wise math",
                        formatter_class=cli.HelpFormatter)
    cm.add_argument("--scale", default="gpt2", choices=("gpt2", "layer"),
                    help="GPT-2 small's rotated matrices, or one layer's")
    cm.add_argument("--reps", type=int, default=7, help="interleaved timed calls")
    cm.add_argument("--threads", type=int, default=1, help="torch threads")
    cm.add_argument("--step-pairs", type=int, default=12,
                    help="ABBA pairs of whole OrthoAdam steps, eager and compiled (0: skip)")
    mu = sub.add_parser("muon", help="Muon step / AdamW step at GPT-2 small shapes per muon_layout, 1 and 2 ranks",
                        formatter_class=cli.HelpFormatter)
    mu.add_argument("--ranks", default="1,2", help="comma list of gloo world sizes (FSDP-style Shard placements)")
    mu.add_argument("--layers", type=int, default=12, help="GPT-2 small blocks (12: the whole model)")
    mu.add_argument("--layouts", default="full,block,block_periodic", help="comma list of muon_layout values")
    mu.add_argument("--full-every", type=int, default=5, help="block_periodic: muon_full_every")
    mu.add_argument("--tile-size", type=int, default=256, help="block: optimizer.tile_size")
    mu.add_argument("--ns-dtype", default="bfloat16", choices=("bfloat16", "float32", "float64"),
                    help="optimizer.muon_ns_dtype")
    mu.add_argument("--reps", type=int, default=3, help="interleaved timed repetitions")
    mu.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    at = sub.add_parser("attention", help="attention fwd+bwd time, peak memory and kernel per variant and length",
                        formatter_class=cli.HelpFormatter)
    at.add_argument("--variants", default="", help="comma list (default: every registered variant; softmax always)")
    at.add_argument("--impls", default="auto,explicit", help="comma list of model.attention_impl values")
    at.add_argument("--seq-lens", default="256,512,1024", help="comma list of sequence lengths (GPU: 512,...,4096)")
    at.add_argument("--batch", type=int, default=2, help="sequences")
    at.add_argument("--heads", type=int, default=4, help="attention heads")
    at.add_argument("--head-dim", type=int, default=64, help="head dimension")
    at.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float64"), help="q, k, v dtype")
    at.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cpu or cuda")
    at.add_argument("--reps", type=int, default=5, help="interleaved timed repetitions")
    at.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    command = "outlier-titan-benchmark " + " ".join(sys.argv[1:] if argv is None else argv)
    torch.set_num_threads(args.threads)
    runs = {"optim": run_optim, "probe": run_probe, "step": run_step, "soap-ab": run_soap_ab,
            "compile-math": run_compile_math, "muon": run_muon, "attention": run_attention_bench}
    runs[args.bench](args, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
