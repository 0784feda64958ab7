"""``optim``: the optimizer step time of OrthoAdam and SOAP against AdamW's, their state bytes and the step's share of a
training step."""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

from outlier_titan.optim.orthoadam import OrthoAdam
from outlier_titan.optim.soap import SOAP
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.tools.benchmarks.shapes import cpu_name, debug_model, gpt2_124m_shapes, seeded_params, set_grads


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


def _cell(d: dict, key: str, fmt: str, scale: float = 1.0) -> str:
    """``fmt`` of ``d[key] * scale``, or "-" for an optimizer left out (``--optimizers``)."""
    return fmt.format(d[key] * scale) if key in d else "-"



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
                     f"{_cell(m, 'orthoadam', '{:.1f} ms', 1e3)} | {_cell(r['mean_s'], 'soap', '{:.1f} ms', 1e3)} | "
                     f"{_cell(r['ratio_median'], 'orthoadam', '{:.2f}x')} | "
                     f"{_cell(r['ratio_mean'], 'soap', '{:.2f}x')} |")
    lines += ["", "Targets: OrthoAdam <= 1.15x, SOAP (f = 10, amortised) <= 1.5x AdamW's step."]
    lines += ["", "State bytes per parameter (checkpointed optimizer state; OrthoAdam's bases are regenerated, "
              "not saved, and listed apart):", "",
              "| shapes | tile | AdamW | OrthoAdam | OrthoAdam bases (resident) | SOAP |",
              "|---|---|---|---|---|---|"]
    for r in results:
        b = r["bytes_per_param"]
        lines.append(f"| {r['label']} | {r['tile']} | {b['adamw']:.1f} | {_cell(b, 'orthoadam', '{:.1f}')} | "
                     f"{r['basis_bytes_per_param']:.2f} | {_cell(b, 'soap', '{:.1f}')} |")
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
                         f"{_cell(s, 'orthoadam', '{:.1%}')} | {_cell(s, 'soap', '{:.1%}')} |")
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
                   f"{_cell(r['ratio_median'], 'orthoadam', '{:.2f}')}, SOAP x{_cell(r['ratio_mean'], 'soap', '{:.2f}')} "
                   f"(amortised); bytes/param {', '.join(f'{k} {v:.1f}' for k, v in r['bytes_per_param'].items())}")
    text = markdown(results, args, command)
    print(text)
    if args.markdown:
        Path(args.markdown).write_text(text)
    return results

