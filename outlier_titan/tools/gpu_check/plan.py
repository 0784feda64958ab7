"""The benchmark items of each part, their trainer settings, and the plan check that needs no device."""

from __future__ import annotations

import dataclasses
from pathlib import Path


PART_BUDGET_S = 560.0  # a device call may run 600 s; the rest is start-up and writing
PARTS = ("1", "2", "3", "4")

# Plain torch optimizers of optimizer.name; every other choice is benchmarked against AdamW.
TORCH_OPTIMIZERS = ("adam", "sgd", "rmsprop")

# The papers' 60M-130M flavors (spec, flavor): Kaul et al. 2024 (softmax-1 / OrthoAdam, arXiv 2410.17174), the
# GPT+ / anGPT / nGPT sizes of Table F.1 of the anGPT paper, and the Outlier Protected block's (OP) sizes.
PAPER_FLAVORS = (("pre_ln", "kaul2024_gpt2_60m"), ("pre_ln", "kaul2024_gpt2_130m"), ("pre_ln", "kaul2024_llama2_130m"),
                 ("pre_ln", "gptplus_125m"), ("angpt", "125m"), ("ngpt", "125m"), ("op", "languini_100m"),
                 ("op", "codeparrot_130m"))


class GpuCheckError(Exception):
    """A benchmark item could not run (reported in its row; the part goes on)."""


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
                        if dry else dict(model="pre_ln", flavor="kaul2024_gpt2_130m", seq_len=1024, batch=32,
                                         micro=32, steps=12, probes=4, vocab_size=50304)))
        items.append(dict(probe, compile=False))
        items.append(dict(probe, compile=True, limit_s=240))
    elif part == "2":
        # the four compile x AC cases in micro-batches of 2 (they fit an 80 GB H100), then the fastest layout
        # measured on the H200: compiled, no AC, the whole batch of 4 in one micro-batch (44 GiB there)
        cases = [(c, ac, 2) for c in (False, True) for ac in ("none", "selective")] + [(True, "none", 4)]
        for compile_, ac, micro in cases:
            items.append(dict(
                kind="train", model="pre_ln", compile=compile_, ac=ac,
                limit_s=240 if compile_ else 150,
                **(dict(flavor="debug_llama", seq_len=32, batch=4, micro=micro, steps=2, warmup=1)
                   if dry else dict(flavor="llama_1b", seq_len=2048, batch=4, micro=micro, steps=10, warmup=3,
                                    vocab_size=128256))))
    elif part == "3":
        seen = set()
        for model, flavor in PAPER_FLAVORS:
            if dry and model in seen:  # one debug run per model spec
                continue
            seen.add(model)
            items.append(dict(kind="train", model=model, compile=False,
                              ac="none", limit_s=90,
                              **(dict(flavor="debug", seq_len=32, batch=4, micro=4, steps=2, warmup=1) if dry else
                                 dict(flavor=flavor, seq_len=1024, batch=32, micro=32, steps=10, warmup=3,
                                      vocab_size=50304))))
        for name in bench_optimizer_names():
            items.append(dict(kind="optim", optimizer=name, model="pre_ln", limit_s=120,
                              **(dict(flavor="debug", seq_len=32, batch=8, micro=4, steps=2, warmup=1,
                                      tile_size=32) if dry else
                                 dict(flavor="kaul2024_gpt2_130m", seq_len=256, batch=512, micro=128, steps=10,
                                      warmup=3, tile_size=256, vocab_size=50304))))
    elif part == "4":
        # llama_7b on one device, and rank 0 of its multi-GPU layouts on the fake process group, each against the
        # dry-run planner's memory for the same settings (full AC, one sequence per rank and micro-step)
        for label, world, layout in (("world 1", 0, dict(dp_shard=1)), ("rank 0 of FSDP 8", 8, dict(dp_shard=8)),
                                     ("rank 0 of FSDP 4 x TP 2", 8, dict(dp_shard=4, tp=2))):
            dp = layout["dp_shard"]
            items.append(dict(name=label, kind="memory", model="pre_ln", compile=False, ac="full",
                              fake_world=world, limit_s=150 if dry else 300, **layout,
                              **(dict(flavor="debug_llama", seq_len=32, batch=2 * dp, micro=1, steps=2, warmup=1)
                                 if dry else dict(flavor="llama_7b", seq_len=2048, batch=2 * dp, micro=1, steps=3,
                                                  warmup=1, vocab_size=32000))))
    else:
        raise GpuCheckError(f"unknown part {part!r}; use 1, 2, 3, 4 or all")
    prec = "fp32 CPU (dry)" if dry else "bf16"
    for it in items:  # named here, by what actually runs (dry mode swaps in the debug flavors)
        if it["kind"] == "train":
            it["name"] = (f"{it['model']}/{it['flavor']} {prec} compile {'on' if it['compile'] else 'off'} "
                          f"AC {it['ac']}" + (f", micro-batches of {it['micro']}" if it["micro"] < it["batch"]
                                              else ""))
        elif it["kind"] == "optim":
            it["name"] = f"{it['optimizer']} on {it['model']}/{it['flavor']} {prec}"
        elif it["kind"] == "probe":
            it["name"] = (f"probe every {it['every']} on {it['model']}/{it['flavor']} {prec} "
                          f"compile {'on' if it['compile'] else 'off'}")
        elif it["kind"] == "memory":
            it["name"] = f"{it['model']}/{it['flavor']} {prec} AC {it['ac']}, {it['name']}"
    return items



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
    if item["kind"] == "memory":
        argv += ["--parallelism.dp_shard", str(item["dp_shard"]), "--parallelism.tp", str(item.get("tp", 1)),
                 "--parallelism.fake_world_size", str(item["fake_world"])]
    return argv



def check_plan(part: str) -> list[str]:
    """Problems of a part's device plan found without a device: every item's settings parse, its model builds on
    the meta device, the tile optimizers' plans fit and every attention variant builds. Dry mode runs this for
    the real (not the dry) plan, so a typo in a GPU item is caught on the CPU."""
    from outlier_titan.config.manager import parse_args
    from outlier_titan.data import build_tokenizer
    from outlier_titan.models.registry import build_meta_model
    from outlier_titan.optim.builder import check_optimizer_layout

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
                check_optimizer_layout(model, cfg.optimizer)
            if item["kind"] == "memory":  # the layout fits its world size and the planner plans it
                from outlier_titan.training.planning import plan as dry_plan

                dry_plan(cfg)
        except Exception as e:  # noqa: BLE001 - every problem is listed
            problems.append(f"{item['name']}: {type(e).__name__}: {e}")
    return problems


def named(item: dict, only: tuple[str, ...]) -> bool:
    """Whether the item's name contains one of the ``--only`` strings."""
    return any(s in item["name"] for s in only)
