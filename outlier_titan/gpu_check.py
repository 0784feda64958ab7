"""The GPU check: an environment report, the ``gpu``-marked tests and the GPU benchmarks, in three parts that
each fit one 10-minute device call; ``--dry`` runs the same code paths on tiny shapes on the CPU.

    python -m outlier_titan.gpu_check --part 1|2|3|all [--dry] [--out DIR] [--budget SECONDS] [--only NAMES]
    scripts/gpu_check.sh --part 1 [--dry]                      # the same, $OUT as the output folder

Parts (see docs/gpu.md):

1. environment (nvidia-smi, torch / CUDA / Triton versions, which of the package's imports fail), the
   ``pytest -m gpu`` tests, attention forward + backward per attention variant (the SDPA backend that ran is
   read from the profiler), and the outlier probe's cost at ``observe.every = 100`` on a 130M model;
2. ``llama_1b`` training throughput: bf16, compile off / on, activation checkpointing none / selective;
3. the papers' 60M-130M flavors' training throughput, and each optimizer's step (OrthoAdam, SOAP and any
   optimizer added to ``optimizer.name``'s choices besides the plain torch ones) against AdamW's at the papers'
   batch (512 x 256 tokens).

Every benchmark item runs in a worker process under its own time limit: an item that runs past it is killed
and recorded as ``timeout``, and the next item starts in a fresh worker, so one slow item does not lose the
others' results. The part as a whole stops starting items when its budget (default 560 s) is spent. Each part
writes ``gpu_check_part<N>.json`` (everything) and ``gpu_check_part<N>.md`` (the tables) to the output
folder, with ``gpu_check_part<N>.log`` (the workers' and pytest's output; ``gpu_check_partall.log`` for
``--part all``, whose parts share one chain of workers) and, with part 1, ``pytest_gpu.xml``.

Dry mode: device cpu, float32 (the CPU path of the trainer), the ``debug`` flavor of each model spec, a few
steps; ``torch.compile`` is switched to the ``aot_eager`` backend (Dynamo and AOT autograd trace as on the GPU,
no C++ / Triton code generation), so compile items exercise their tracing in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from outlier_titan.provenance import git_commit

REPO = Path(__file__).resolve().parents[1]
PART_BUDGET_S = 560.0  # a device call may run 600 s; the rest is start-up and writing
PARTS = ("1", "2", "3")

# Plain torch optimizers of optimizer.name; every other choice is benchmarked against AdamW.
TORCH_OPTIMIZERS = ("adam", "sgd", "rmsprop")

# The papers' 60M-130M flavors (spec, flavor): Kaul et al. 2024 (softmax-1 / OrthoAdam, arXiv 2410.17174), the
# GPT+ / anGPT / nGPT sizes of Table F.1 of the anGPT paper, and the Outlier Protected block's (OP) sizes.
PAPER_FLAVORS = (("pre_ln", "seed000_gpt2_60m"), ("pre_ln", "seed000_gpt2_130m"), ("pre_ln", "seed000_llama2_130m"),
                 ("pre_ln", "gptplus_125m"), ("angpt", "125m"), ("ngpt", "125m"), ("op", "languini_100m"),
                 ("op", "codeparrot_130m"))


class GpuCheckError(Exception):
    """A benchmark item could not run (reported in its row; the part goes on)."""


# ------------------------------------------------------------------------------------------------ the plan

def attention_variants() -> tuple[str, list[str]]:
    """(config key, choices) of the attention variant: ``model.attention`` where it exists, else
    ``model.softmax``; new variants added to the choices are picked up here."""
    from outlier_titan.config.job_config import Model

    fields = {f.name: f for f in dataclasses.fields(Model)}
    for key in ("attention", "softmax"):
        if key in fields and fields[key].metadata.get("choices"):
            return key, list(fields[key].metadata["choices"])
    raise GpuCheckError("the Model config has neither an 'attention' nor a 'softmax' field with choices")


def bench_optimizer_names() -> list[str]:
    """AdamW first (the ratios' reference), then every registered optimizer that is not a plain torch one."""
    from outlier_titan.optim.builder import optimizer_names

    return ["adamw"] + [c for c in optimizer_names() if c != "adamw" and c not in TORCH_OPTIMIZERS]


def plan(part: str, dry: bool) -> list[dict]:
    """The benchmark items of a part; each a dict with name, kind, limit_s and the kind's settings."""
    items: list[dict] = []
    if part == "1":
        key, variants = attention_variants()
        for v in variants:
            shape = dict(batch=2, seq_len=32, flavor="debug") if dry else dict(batch=4, seq_len=2048, flavor="llama_1b")
            items.append(dict(name=f"attention {key}={v}", kind="attention", key=key, variant=v, limit_s=60,
                              steps=2 if dry else 10, **shape))
        probe = dict(kind="probe", every=100, limit_s=120,
                     **(dict(model="pre_ln", flavor="debug", seq_len=32, batch=4, micro=4, steps=2, probes=1)
                        if dry else dict(model="pre_ln", flavor="seed000_gpt2_130m", seq_len=1024, batch=32,
                                         micro=32, steps=12, probes=4, vocab_size=50304)))
        items.append(dict(probe, name="probe every 100, compile off", compile=False))
        items.append(dict(probe, name="probe every 100, compile on", compile=True, limit_s=240))
    elif part == "2":
        for compile_ in (False, True):
            for ac in ("none", "selective"):
                items.append(dict(
                    name=f"llama_1b bf16 compile {'on' if compile_ else 'off'} AC {ac}", kind="train",
                    model="pre_ln", compile=compile_, ac=ac, limit_s=240 if compile_ else 150,
                    **(dict(flavor="debug_llama", seq_len=32, batch=4, micro=2, steps=2, warmup=1)
                       if dry else dict(flavor="llama_1b", seq_len=2048, batch=4, micro=2, steps=10, warmup=3,
                                        vocab_size=128256))))
    elif part == "3":
        seen = set()
        for model, flavor in PAPER_FLAVORS:
            if dry and model in seen:  # one debug run per model spec
                continue
            seen.add(model)
            items.append(dict(name=f"{model}/{flavor} bf16 compile off", kind="train", model=model, compile=False,
                              ac="none", limit_s=90,
                              **(dict(flavor="debug", seq_len=32, batch=4, micro=4, steps=2, warmup=1) if dry else
                                 dict(flavor=flavor, seq_len=1024, batch=32, micro=32, steps=10, warmup=3,
                                      vocab_size=50304))))
        for name in bench_optimizer_names():
            items.append(dict(name=f"optimizer {name}", kind="optim", optimizer=name, model="pre_ln", limit_s=120,
                              **(dict(flavor="debug", seq_len=32, batch=8, micro=4, steps=2, warmup=1,
                                      tile_size=32) if dry else
                                 dict(flavor="seed000_gpt2_130m", seq_len=256, batch=512, micro=128, steps=10,
                                      warmup=3, tile_size=256, vocab_size=50304))))
    else:
        raise GpuCheckError(f"unknown part {part!r}; use 1, 2, 3 or all")
    prec = "fp32 CPU (dry)" if dry else "bf16"
    for it in items:  # names carry what actually runs (dry mode swaps in the debug flavors)
        if it["kind"] == "train":
            it["name"] = (f"{it['model']}/{it['flavor']} {prec} compile {'on' if it['compile'] else 'off'} "
                          f"AC {it['ac']}")
        elif it["kind"] == "optim":
            it["name"] = f"{it['optimizer']} on {it['model']}/{it['flavor']} {prec}"
        elif it["kind"] == "probe":
            it["name"] = (f"probe every {it['every']} on {it['model']}/{it['flavor']} {prec} "
                          f"compile {'on' if it['compile'] else 'off'}")
    return items


# --------------------------------------------------------------------------------------------- environment

def environment() -> dict:
    """Versions, the GPU(s) and nvidia-smi, and which of the package's modules fail to import."""
    import torch

    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_available": torch.cuda.is_available(), "hostname": platform.node(),
           "cpus": os.cpu_count(), "commit": git_commit()}
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if torch.cuda.is_available():
        env["devices"] = [{"name": torch.cuda.get_device_name(i),
                           "capability": ".".join(map(str, torch.cuda.get_device_capability(i))),
                           "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
                          for i in range(torch.cuda.device_count())]
        env["cudnn"] = torch.backends.cudnn.version()
        env["bf16_supported"] = torch.cuda.is_bf16_supported()
        env["flash_sdp_enabled"] = torch.backends.cuda.flash_sdp_enabled()
    try:
        smi = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=30)
        env["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except (OSError, subprocess.TimeoutExpired) as e:
        env["nvidia_smi"] = f"not available ({type(e).__name__})"
    env["required_torch"] = _required_torch()
    env["torch_meets_requirement"] = _meets(torch.__version__, env["required_torch"])
    env["missing_modules"] = _missing_dependencies()
    env["import_failures"] = _import_failures()
    return env


def _required_torch() -> str | None:
    pyproject = REPO / "pyproject.toml"
    if not pyproject.is_file():
        return None
    from outlier_titan.config.manager import tomllib  # tomli before Python 3.11

    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    return next((d for d in deps if d.replace(" ", "").startswith("torch>") or d.startswith("torch=")), None)


def _meets(version: str, requirement: str | None) -> bool | None:
    """Whether ``version`` satisfies a ``torch>=X.Y`` requirement (None when there is none to check)."""
    import re

    m = re.fullmatch(r"torch>=([0-9.]+)", (requirement or "").replace(" ", ""))
    if not m:
        return None
    have = tuple(int(x) for x in re.findall(r"\d+", version.split("+")[0])[:3])
    want = tuple(int(x) for x in m.group(1).split("."))
    return have[:len(want)] >= want


# import name of each runtime dependency in pyproject
DEPENDENCY_MODULES = ("torch", "torchdata", "tiktoken", "tensorboard", "numpy", "safetensors", "tqdm", "matplotlib")


def _missing_dependencies() -> list[str]:
    missing = []
    for name in DEPENDENCY_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def _import_failures() -> dict[str, str]:
    """module -> error for every ``outlier_titan`` module that does not import (an older torch, a missing
    wheel)."""
    failures = {}
    for path in sorted((REPO / "outlier_titan").rglob("*.py")):
        mod = ".".join(path.relative_to(REPO).with_suffix("").parts)
        if mod.endswith("__init__") or mod == __name__ or mod == "outlier_titan.gpu_check":
            continue
        try:
            importlib.import_module(mod)
        except Exception as e:  # noqa: BLE001 - the report lists whatever breaks
            failures[mod] = f"{type(e).__name__}: {e}"[:300]
    return failures


# -------------------------------------------------------------------------------------------- the benchmarks

def _device(dry: bool):
    import torch

    if dry:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise GpuCheckError("no CUDA device is visible; run with --dry on a CPU machine")
    return torch.device("cuda", 0)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, n: int, device) -> list[float]:
    """Seconds of each of ``n`` calls of ``fn``, the device synchronised around each."""
    times = []
    for _ in range(n):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return times


def item_argv(item: dict, dry: bool, workdir: Path | str) -> list[str]:
    """The trainer's command-line settings of a train / optim / probe item (world size 1, embedded corpus,
    nothing logged to disk)."""
    argv = ["--job.dump_folder", str(workdir), "--job.name", "run",
            "--model.name", item["model"], "--model.flavor", item["flavor"],
            "--training.seq_len", str(item["seq_len"]), "--training.global_batch_size", str(item["batch"]),
            "--training.micro_batch_size", str(item["micro"]), "--training.steps", "1000000",
            "--training.device", "cpu" if dry else "cuda", "--metrics.tensorboard", "false",
            "--eval.every", "0", "--observe.every", "0", "--checkpoint.enable", "false",
            "--compile.enable", str(bool(item.get("compile"))).lower(),
            "--activation_checkpoint.mode", item.get("ac", "none"), "--lr_scheduler.warmup_steps", "10"]
    if item.get("vocab_size"):
        argv += ["--model.vocab_size", str(item["vocab_size"])]
    if item["kind"] == "optim":
        argv += ["--optimizer.name", item["optimizer"], "--optimizer.tile_size", str(item["tile_size"]),
                 "--optimizer.max_shards", "1"]
    if item["kind"] == "probe":
        argv += ["--observe.every", str(item["every"]), "--observe.batch_size", "4", "--observe.mode", "full"]
    return argv


def _trainer(item: dict, dry: bool, workdir: Path):
    from outlier_titan.config.manager import parse_args
    from outlier_titan.trainer import Trainer

    return Trainer(parse_args(item_argv(item, dry, workdir)))


def check_plan(part: str) -> list[str]:
    """Problems of a part's device plan found without a device: every item's settings parse, its model builds on
    the meta device, the tile optimizers' plans fit and every attention variant builds. Dry mode runs this for
    the real (not the dry) plan, so a typo in a GPU item is caught on the CPU."""
    from outlier_titan.config.manager import parse_args
    from outlier_titan.data import build_tokenizer
    from outlier_titan.models.registry import build_meta_model
    from outlier_titan.models.roles import roles_of
    from outlier_titan.optim.builder import build_param_groups
    from outlier_titan.optim.tile_optimizers import check_tile_plans

    problems = []
    for item in plan(part, dry=False):
        try:
            if item["kind"] == "attention":
                from outlier_titan.config.job_config import Model

                cfg = Model(name="pre_ln", flavor=item["flavor"])
                setattr(cfg, item["key"], item["variant"])
                build_meta_model(cfg, 4096, item["seq_len"])
                continue
            if item["kind"] == "sleep":
                continue
            cfg = parse_args(item_argv(item, False, "unused"))
            vocab = build_tokenizer(cfg.data.tokenizer).vocab_size
            _, _, model = build_meta_model(cfg.model, vocab, cfg.training.seq_len)
            if item["kind"] == "optim":
                check_tile_plans(build_param_groups(model, cfg.optimizer), cfg.optimizer, roles_of(model))
        except Exception as e:  # noqa: BLE001 - every problem is listed
            problems.append(f"{item['name']}: {type(e).__name__}: {e}")
    return problems


def _close(trainer) -> None:
    """``trainer.close()``; a failure there (after an out-of-memory error, say) is printed to the log and does not
    hide the item's own error or result."""
    try:
        trainer.close()
    except Exception:  # noqa: BLE001
        traceback.print_exc()


def _peak_memory_gib(device) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


def bench_train(item: dict, dry: bool, workdir: Path) -> dict:
    """Tokens/s, MFU and peak memory of whole training steps (loader, forward, backward, clip, optimizer)."""
    import torch

    from outlier_titan.observe.logger import peak_flops

    device = _device(dry)
    trainer = _trainer(item, dry, workdir)
    try:
        t0 = time.perf_counter()
        losses = [float(trainer.train_step()[0]) for _ in range(item["warmup"])]
        warmup_s = time.perf_counter() - t0
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        step_losses = []
        times = _timed(lambda: step_losses.append(trainer.train_step()[0]), item["steps"], device)
        losses += [float(x) for x in step_losses]
        tokens = item["batch"] * item["seq_len"]
        step_s = statistics.median(times)
        tps = tokens / step_s
        peak = peak_flops(device)
        return {"params": trainer.n_params, "flops_per_token": trainer.flops_per_token, "tokens_per_step": tokens,
                "step_s": step_s, "tokens_per_s": tps,
                "mfu_pct": 100.0 * trainer.flops_per_token * tps / peak if peak else None,
                "peak_memory_gib": _peak_memory_gib(device), "warmup_s": warmup_s,
                "loss_first": losses[0], "loss_last": losses[-1],
                "finite": all(math.isfinite(x) for x in losses),
                "dtype": "float32 (CPU)" if dry else trainer.cfg.training.mixed_precision_param}
    finally:
        _close(trainer)


def bench_optim(item: dict, dry: bool, workdir: Path) -> dict:
    """The whole training step and the optimizer step alone (on the last step's gradients), medians."""
    device = _device(dry)
    trainer = _trainer(item, dry, workdir)
    try:
        for _ in range(item["warmup"]):
            trainer.train_step()
        step = _timed(trainer.train_step, item["steps"], device)
        opt = _timed(trainer.optimizer.step, item["steps"], device)
        return {"params": trainer.n_params, "tokens_per_step": item["batch"] * item["seq_len"],
                "step_s": statistics.median(step), "optimizer_step_s": statistics.median(opt),
                "optimizer_share": statistics.median(opt) / statistics.median(step)}
    finally:
        _close(trainer)


def bench_probe(item: dict, dry: bool, workdir: Path) -> dict:
    """Training steps and probe runs interleaved; the throughput drop at observe.every = N is
    probe time / (N x step time). The first probe (hooks installed, with compile: the recompile of the blocks
    for the explicit attention path) is timed apart."""
    device = _device(dry)
    trainer = _trainer(item, dry, workdir)
    try:
        trainer._build_probe()
        trainer.train_step()
        first = _timed(lambda: trainer.probe.run(trainer.probe_tokens), 1, device)[0]
        after = _timed(trainer.train_step, 1, device)[0]  # the training graph again after the probe's
        steps, probes = [], []
        per = max(1, item["steps"] // item["probes"])
        for _ in range(item["probes"]):
            steps += _timed(trainer.train_step, per, device)
            probes += _timed(lambda: trainer.probe.run(trainer.probe_tokens), 1, device)
        step_s, probe_s = statistics.median(steps), statistics.median(probes)
        return {"params": trainer.n_params, "step_s": step_s, "probe_s": probe_s, "first_probe_s": first,
                "every": item["every"], "overhead_pct": 100.0 * probe_s / (item["every"] * step_s),
                "first_step_after_probe_s": after}
    finally:
        _close(trainer)


def _attention_module(item: dict, device):
    """Block 0's attention module of the item's flavor with the variant set, materialised on ``device``."""
    import torch

    from outlier_titan.config.job_config import Model
    from outlier_titan.models.layers import Attention, init_norms
    from outlier_titan.models.registry import build_meta_model

    cfg = Model(name="pre_ln", flavor=item["flavor"])
    setattr(cfg, item["key"], item["variant"])
    _, args, model = build_meta_model(cfg, 4096, item["seq_len"])
    attn = next(m for m in next(iter(model.layers.values())).modules() if isinstance(m, Attention))
    attn.to_empty(device=device)
    gen = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    init_norms(attn)
    return attn, args.dim


SDPA_OPS = ("_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_attention_math",
            "_scaled_dot_product_flash_attention_for_cpu", "_efficient_attention_forward", "_flash_attention_forward")


def sdpa_kernels(fn) -> list[str]:
    """The aten SDPA kernels (flash / efficient / cudnn / math) that ran in ``fn()``, from the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.name.removeprefix("aten::") for e in prof.events()}
    return sorted(n for n in names if n in SDPA_OPS)


def bench_attention(item: dict, dry: bool, workdir: Path) -> dict:
    """Forward + backward of one attention module (projections included) in bf16 on the fused path."""
    import torch

    from outlier_titan.models.attention import attention_path

    device = _device(dry)
    dtype = torch.float32 if dry else torch.bfloat16
    attn, dim = _attention_module(item, device)
    for p in attn.parameters():  # parameters in the compute dtype; RoPE tables stay float32, as under FSDP
        p.data = p.data.to(dtype)
    gen = torch.Generator(device="cpu").manual_seed(1)
    x = (torch.randn(item["batch"], item["seq_len"], dim, generator=gen)).to(device, dtype).requires_grad_()
    up = torch.randn(x.shape, generator=gen).to(device, dtype)

    def fwd_bwd():
        attn(x).backward(up)

    fwd_bwd()
    kernels = sdpa_kernels(fwd_bwd)
    times = _timed(fwd_bwd, item["steps"], device)
    t = statistics.median(times)
    heads = dim // attn.head_dim
    # causal QK^T and PV: 2 matmuls x 2 FLOP x B H T^2 d_h / 2, backward twice the forward (+ recompute: 2.5x)
    core = 2 * 2 * item["batch"] * heads * item["seq_len"] ** 2 * attn.head_dim / 2 * 3.5
    return {"fwd_bwd_s": t, "tokens_per_s": item["batch"] * item["seq_len"] / t, "sdpa_kernels": kernels,
            "path": attention_path(attn.opts.variant, attn.opts.impl, device) + (": " + ", ".join(kernels)
                                                                                   if kernels else ""),
            "attention_core_tflops": core / t / 1e12, "dtype": str(dtype).removeprefix("torch."),
            "shape": f"B {item['batch']} x T {item['seq_len']} x D {dim}, {heads} heads of {attn.head_dim}"}


def bench_sleep(item: dict, dry: bool, workdir: Path) -> dict:
    """The runner's own check (tests): sleeps ``seconds``; ``fail`` raises instead; ``exit`` kills the worker."""
    if item.get("exit") is not None:
        os._exit(item["exit"])
    if item.get("fail"):
        raise GpuCheckError(item["fail"])
    time.sleep(item["seconds"])
    return {"slept_s": item["seconds"]}


KINDS = {"train": bench_train, "optim": bench_optim, "probe": bench_probe, "attention": bench_attention,
         "sleep": bench_sleep}


# ------------------------------------------------------------------------------------------------ worker

def _cleanup() -> None:
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)  # set by the trainer's world-size-1 start-up: the next item takes a fresh port
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def dry_compile_backend() -> None:
    """In dry mode every torch.compile (the trainer's blocks and loss, the optimizers' math) defaults to the
    ``aot_eager`` backend: Dynamo and AOT autograd trace the graphs as on the GPU, without code generation."""
    import torch

    real = torch.compile

    def compile_aot_eager(model=None, **kwargs):
        kwargs.setdefault("backend", "aot_eager")
        return real(model, **kwargs) if model is not None else real(**kwargs)

    torch.compile = compile_aot_eager


def worker(items_file: Path, start: int, events: Path, dry: bool) -> int:
    """Runs items ``start..`` in order, appending a start and a done event per item to ``events``."""
    items = json.loads(items_file.read_text())
    if dry:
        dry_compile_backend()

    def emit(rec: dict) -> None:
        with events.open("a") as f:
            f.write(json.dumps(rec) + "\n")

    for i in range(start, len(items)):
        item = items[i]
        emit({"index": i, "event": "start"})
        print(f"=== item {i}: {item['name']}", flush=True)
        t0 = time.perf_counter()
        workdir = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        try:
            result, status = KINDS[item["kind"]](item, dry, workdir), "ok"
        except Exception as e:  # noqa: BLE001 - an item's failure is its row; the others still run
            traceback.print_exc()
            result, status = {"error": f"{type(e).__name__}: {e}"[:1500]}, "error"
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            if item["kind"] != "sleep":
                _cleanup()
        emit({"index": i, "event": "done", "status": status, "seconds": time.perf_counter() - t0, "result": result})
        print(f"=== item {i}: {status} in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


# ------------------------------------------------------------------------------------------------ runner

def _read_events(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line being written
    return out


def run_items(items: list[dict], dry: bool, deadline: float, log, tmp: Path, poll_s: float = 0.2) -> list[dict]:
    """Each item's record: status ok / error / timeout / crashed / skipped, seconds, result."""
    items_file = tmp / "items.json"
    items_file.write_text(json.dumps(items))
    records: list[dict | None] = [None] * len(items)
    start, launch = 0, 0
    while start < len(items):
        if time.monotonic() >= deadline:
            break
        launch += 1
        events = tmp / f"events-{launch}.jsonl"
        cmd = [sys.executable, "-m", "outlier_titan.gpu_check", "--worker", str(items_file), "--start", str(start),
               "--events", str(events)] + (["--dry"] if dry else [])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        current, t_item, killed = None, time.monotonic(), None
        while True:
            rc = proc.poll()
            for e in _read_events(events):
                if e["event"] == "start" and records[e["index"]] is None and e["index"] != current:
                    current, t_item = e["index"], time.monotonic()
                elif e["event"] == "done" and records[e["index"]] is None:
                    records[e["index"]] = {k: e[k] for k in ("status", "seconds", "result")}
                    if current == e["index"]:
                        current = None
            if rc is not None:
                break
            now = time.monotonic()
            if current is not None and now - t_item > items[current]["limit_s"]:
                killed = f"ran past its {items[current]['limit_s']} s limit"
            elif now >= deadline:
                killed = "ran past the part's time budget"
            if killed:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(poll_s)
        if current is not None and records[current] is None:
            status = "timeout" if killed else "crashed"
            why = killed or f"the worker exited with code {proc.returncode} during this item"
            records[current] = {"status": status, "seconds": time.monotonic() - t_item, "result": {"error": why}}
            print(f"=== item {current}: {status}: {why}", file=log, flush=True)
        elif current is None and proc.returncode not in (0, None) and not killed:
            # the worker died before it started an item (e.g. an import error): that item is lost, go on
            first = next(i for i in range(start, len(items)) if records[i] is None)
            records[first] = {"status": "crashed", "seconds": 0.0,
                              "result": {"error": f"the worker exited with code {proc.returncode} before the item"}}
        nxt = next((i for i in range(len(items)) if records[i] is None), len(items))
        if nxt == start and not killed and nxt < len(items):  # the worker made no progress: give up on this item
            records[nxt] = {"status": "crashed", "seconds": 0.0,
                            "result": {"error": f"the worker exited with code {proc.returncode} without running it"}}
            nxt += 1
        start = nxt
    for i, r in enumerate(records):
        if r is None:
            records[i] = {"status": "skipped", "seconds": 0.0,
                          "result": {"error": "not started: the part's time budget was spent"}}
    return [{"name": it["name"], "kind": it["kind"], "item": it, **r} for it, r in zip(items, records)]


def run_tests(out: Path, log, limit_s: float) -> dict:
    """``pytest -m gpu`` on the tests/test_gpu*.py files; counts from the junit XML."""
    import xml.etree.ElementTree as ET

    files = sorted(str(p.relative_to(REPO)) for p in (REPO / "tests").glob("test_gpu*.py"))
    xml = out / "pytest_gpu.xml"
    xml.unlink(missing_ok=True)  # no counts from an earlier run
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rs", f"--junitxml={xml}",
           *files]
    t0 = time.monotonic()
    log.write(f"=== {' '.join(cmd)}\n")
    log.flush()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:  # pytest and the train.py runs it started: none may hold the GPU after
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        rc = "timeout"
        log.write(f"=== pytest ran past its {limit_s:.0f} s limit and was killed\n")
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.is_file():
        root = ET.parse(xml).getroot()
        suite = root if root.tag == "testsuite" else root.find("testsuite")
        if suite is not None:
            counts = {k: int(suite.get(k, 0)) for k in counts}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    return {"command": "python -m pytest -m gpu " + " ".join(files), "returncode": rc,
            "seconds": time.monotonic() - t0, **counts}


# ---------------------------------------------------------------------------------------------- reporting

def _fmt(v, spec: str = "{:.3g}") -> str:
    return "-" if v is None else spec.format(v)


def markdown(report: dict) -> str:
    env = report["env"]
    dev = ", ".join(d["name"] for d in env.get("devices", [])) or "CPU (no CUDA device)"
    dry = " (dry run: CPU, tiny shapes; no GPU numbers)" if report["dry"] else ""
    lines = [f"## GPU check, part {report['part']}{dry}",
             "", f"- Date: {env['date']}", f"- Device: {dev}; {env['cpus']} CPUs",
             f"- torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}, Python {env['python']}"
             f" (pyproject asks {env['required_torch']}"
             f"{'' if env.get('torch_meets_requirement') in (True, None) else ': not met, the device torch ran'})",
             f"- Commit: {env['commit']}",
             f"- Command: `{report['command']}`", ""]
    if env["missing_modules"] or env["import_failures"]:
        lines += [f"- Missing modules: {', '.join(env['missing_modules']) or 'none'}; modules that failed to "
                  f"import: {', '.join(env['import_failures']) or 'none'}", ""]
    if report["dry"]:
        problems = report.get("plan_problems") or []
        lines += [f"- The device plan (settings, meta-device models, tile plans): "
                  f"{'; '.join(problems) if problems else 'every item builds'}", ""]
    if report.get("tests"):
        t = report["tests"]
        lines += [f"`pytest -m gpu`: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                  f"{t['skipped']} skipped in {t['seconds']:.0f} s (exit {t['returncode']})", ""]
    items = report["items"]
    by_kind: dict[str, list[dict]] = {}
    for it in items:
        by_kind.setdefault(it["kind"], []).append(it)
    for kind, rows in by_kind.items():
        lines += _table(kind, rows, items) + [""]
    return "\n".join(lines) + "\n"


def _status(it: dict) -> str:
    return "ok" if it["status"] == "ok" else f"{it['status']}: {it['result'].get('error', '')[:200]}"


def _table(kind: str, rows: list[dict], items: list[dict]) -> list[str]:
    if kind == "train":
        out = ["| run | params | tokens/step | step | tokens/s | MFU | peak memory | loss first / last | status |",
               "|---|---|---|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            out.append(f"| {it['name']} | {_fmt(r.get('params'), '{:,}')} | {_fmt(r.get('tokens_per_step'), '{:,}')} | "
                       f"{_fmt(r.get('step_s'), '{:.3f} s')} | {_fmt(r.get('tokens_per_s'), '{:,.0f}')} | "
                       f"{_fmt(r.get('mfu_pct'), '{:.1f} %')} | {_fmt(r.get('peak_memory_gib'), '{:.1f} GiB')} | "
                       f"{_fmt(r.get('loss_first'), '{:.3f}')} / {_fmt(r.get('loss_last'), '{:.3f}')} | "
                       f"{_status(it)} |")
        return out
    if kind == "optim":
        ref = next((it["result"] for it in items if it["kind"] == "optim" and it["item"]["optimizer"] == "adamw"
                    and it["status"] == "ok"), None)
        out = ["| optimizer | optimizer step | / AdamW step | whole step | / AdamW whole step | status |",
               "|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            o, s = r.get("optimizer_step_s"), r.get("step_s")
            out.append(f"| {it['item']['optimizer']} | {_fmt(o and o * 1e3, '{:.1f} ms')} | "
                       f"{_fmt(o / ref['optimizer_step_s'] if o and ref else None, '{:.2f}x')} | "
                       f"{_fmt(s, '{:.3f} s')} | {_fmt(s / ref['step_s'] if s and ref else None, '{:.3f}x')} | "
                       f"{_status(it)} |")
        return out
    if kind == "probe":
        out = ["| run | step | probe | first probe | first step after it | throughput drop at every N | status |",
               "|---|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            out.append(f"| {it['name']} | {_fmt(r.get('step_s'), '{:.3f} s')} | {_fmt(r.get('probe_s'), '{:.3f} s')} | "
                       f"{_fmt(r.get('first_probe_s'), '{:.2f} s')} | "
                       f"{_fmt(r.get('first_step_after_probe_s'), '{:.2f} s')} | "
                       f"{_fmt(r.get('overhead_pct'), '{:.2f} %')} | {_status(it)} |")
        return out
    if kind == "attention":
        out = ["| variant | shape | dtype | path (SDPA kernels) | fwd+bwd | tokens/s | attention core TFLOP/s | "
               "status |", "|---|---|---|---|---|---|---|---|"]
        for it in rows:
            r = it["result"] if it["status"] == "ok" else {}
            out.append(f"| {it['item']['variant']} | {r.get('shape', '-')} | {r.get('dtype', '-')} | "
                       f"{r.get('path', '-')} | "
                       f"{_fmt(r.get('fwd_bwd_s') and r['fwd_bwd_s'] * 1e3, '{:.2f} ms')} | "
                       f"{_fmt(r.get('tokens_per_s'), '{:,.0f}')} | {_fmt(r.get('attention_core_tflops'), '{:.1f}')} | "
                       f"{_status(it)} |")
        return out
    return ["| item | seconds | status |", "|---|---|---|"] + [f"| {it['name']} | {it['seconds']:.1f} | {_status(it)} |"
                                                              for it in rows]


def named(item: dict, only: tuple[str, ...]) -> bool:
    """Whether the item's name contains one of the ``--only`` strings."""
    return any(s in item["name"] for s in only)


def run_parts(parts: tuple[str, ...], dry: bool, out: Path, budget_s: float, command: str,
              tests: bool = True, items: dict[str, list[dict]] | None = None, only: tuple[str, ...] = ()
              ) -> list[dict]:
    """Runs the parts' items in one chain of workers (``budget_s`` per part) and writes each part's JSON and
    markdown; the log is ``gpu_check_part<N>.log`` (``all`` when several parts run). ``only``: just the items
    whose name contains one of these strings."""
    out.mkdir(parents=True, exist_ok=True)
    t_end = time.monotonic() + budget_s * len(parts)
    label = parts[0] if len(parts) == 1 else "all"
    plans = {part: plan(part, dry) if items is None else items[part] for part in parts}
    if only:
        plans = {part: [it for it in chain if named(it, only)] for part, chain in plans.items()}
    with open(out / f"gpu_check_part{label}.log", "w") as log, tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        log.write(f"=== {command}\n")
        env = environment()
        print(f"torch {env['torch']}, CUDA {env['cuda']}, "
              f"{', '.join(d['name'] for d in env.get('devices', [])) or 'no CUDA device'}"
              f"{'; missing: ' + ', '.join(env['missing_modules']) if env['missing_modules'] else ''}", flush=True)
        reports = {part: {"part": part, "dry": dry, "command": command, "env": env, "tests": None, "items": [],
                          "plan_problems": check_plan(part) if dry else []} for part in parts}
        for part in parts:
            for problem in reports[part]["plan_problems"]:
                print(f"part {part}: the device plan does not build: {problem}", flush=True)
        if "1" in parts and tests:
            t = run_tests(out, log, limit_s=max(30.0, min(300.0, t_end - time.monotonic() - 120)))
            reports["1"]["tests"] = t
            print(f"pytest -m gpu: {t['passed']} passed, {t['failures']} failed, {t['errors']} errors, "
                  f"{t['skipped']} skipped", flush=True)
        chain = [it for part in parts for it in plans[part]]
        rows = run_items(chain, dry, t_end, log, Path(tmp))
    for part in parts:
        report = reports[part]
        report["items"], rows = rows[:len(plans[part])], rows[len(plans[part]):]
        for it in report["items"]:
            print(f"part {part}: {it['name']}: {it['status']} ({it['seconds']:.1f} s)", flush=True)
        stem = out / f"gpu_check_part{part}"
        Path(f"{stem}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
        text = markdown(report)
        Path(f"{stem}.md").write_text(text)
        print(text, flush=True)
    return [reports[part] for part in parts]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m outlier_titan.gpu_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="", help="1, 2, 3 or all")
    parser.add_argument("--dry", action="store_true", help="the same code paths on tiny shapes on the CPU")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(Path.cwd() / "gpu_check_out"),
                        help="output folder (default: $OUT, else ./gpu_check_out)")
    parser.add_argument("--budget", type=float, default=PART_BUDGET_S, help="seconds per part")
    parser.add_argument("--no-tests", action="store_true", help="part 1 without the pytest run")
    parser.add_argument("--only", default="", help="comma-separated parts of item names: run just those items "
                        "(e.g. --only 'on pre_ln/seed000_gpt2_130m' for part 3's optimizer steps)")
    parser.add_argument("--worker", default="", help=argparse.SUPPRESS)
    parser.add_argument("--start", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--events", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(Path(args.worker), args.start, Path(args.events), args.dry)
    parts = PARTS if args.part == "all" else (args.part,)
    if not all(p in PARTS for p in parts):
        parser.error(f"--part {args.part!r}: use 1, 2, 3 or all")
    command = "python -m outlier_titan.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    failed = False
    only = tuple(s.strip() for s in args.only.split(",") if s.strip())
    items = [it for part in parts for it in plan(part, args.dry)]
    if only and not any(named(it, only) for it in items):
        parser.error(f"--only {args.only!r} matches no item of part {args.part}; its items: "
                     f"{'; '.join(it['name'] for it in items)}")
    for report in run_parts(parts, args.dry, Path(args.out), args.budget, command, tests=not args.no_tests,
                            only=only):
        failed |= any(it["status"] != "ok" for it in report["items"]) or bool(report["plan_problems"])
        t = report["tests"]
        failed |= bool(t and (t["failures"] or t["errors"] or t["returncode"] not in (0, 5)))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
