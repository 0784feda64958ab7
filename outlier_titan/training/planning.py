"""``--dry_run``: plan a run without allocating it.

Builds the model on the meta device, applies the real parallel plan (TP -> AC -> FSDP2) on a fake process
group of the requested world size (rank 0's view), and prints parameter count, FLOPs per token and per-rank
memory for parameters, gradients, optimizer state and an activation estimate. A 7B model on 32 ranks plans
in seconds on a laptop CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from outlier_titan import tensors
from outlier_titan.config.job_config import JobConfig
from outlier_titan.data.sources import tokenizer_mismatch
from outlier_titan.data.tokenizer import planning_vocab
from outlier_titan.errors import ConfigError
from outlier_titan.lowprec.recipes import RECIPES
from outlier_titan.lowprec.training import cast_bytes, fp8_all_gather
from outlier_titan.models.registry import count_params, flops_per_token, model_args
from outlier_titan.optim.builder import checked_optimizer
from outlier_titan.remedies import validate_remedies
from outlier_titan.parallel.dims import ParallelDims, init_fake_world
from outlier_titan.parallel.parallelize import parallelize

GiB = 2**30

@dataclass
class Plan:
    world_size: int
    n_params: int
    flops_per_token: float
    local_params: int
    param_bytes: float
    grad_bytes: float
    optimizer_bytes: float
    activation_bytes: float
    gather_bytes: float
    tokenizer: str = ""
    vocab_size: int = 0
    optimizer_split: str = ""  # an optimizer that plans its own state: its summary line (Muon: its split)
    lowprec: str = ""  # [low_precision]: the converted Linears and the bytes their weights take in the GEMMs

    @property
    def total_bytes(self) -> float:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes
                + self.gather_bytes)


def rank_params(model: torch.nn.Module) -> int:
    """The parameters this rank holds: its shards of DTensor parameters, the rest whole (tied weights once:
    ``parameters()`` yields a shared tensor once)."""
    return sum(tensors.local(p).numel() for p in model.parameters())


def activation_bytes(cfg: JobConfig, dims: ParallelDims, n_layers: int, dim: int, n_heads: int,
                     vocab: int, micro_batch: int, compute_bytes: int) -> float:
    """Per-rank activation memory of one micro-batch (Korthikanti et al. 2022 with sequence parallel).

    Per layer, 16-bit: s*b*h*(34 + 5*a*s/h) / tp without recomputation; full AC keeps only the block input
    (2*s*b*h / tp); selective AC every k-th block mixes the two. Plus fp32 logits for the loss.
    """
    s, b, h, a, t = cfg.training.seq_len, micro_batch, dim, n_heads, dims.tp
    scale = compute_bytes / 2
    per_layer = s * b * h * (34 + 5 * a * s / h) / t * scale
    kept = 2 * s * b * h / t * scale
    mode, every = cfg.activation_checkpoint.mode, cfg.activation_checkpoint.selective_every
    if mode == "full":
        layers = n_layers * kept + per_layer  # one block is recomputed at a time
    elif mode == "selective" and every > 0:
        n_ckpt = math.ceil(n_layers / every)
        layers = n_ckpt * kept + (n_layers - n_ckpt) * per_layer + per_layer
    elif mode == "selective":  # op-level: keeps matmul/attention outputs, about half of the per-layer total
        layers = n_layers * per_layer * 0.5
    else:
        layers = n_layers * per_layer
    logits = s * b * vocab * 4 * 2  # fp32 logits and their gradient
    return layers + logits


def plan(cfg: JobConfig) -> Plan:
    p = cfg.parallelism
    if p.dp_shard == -1:
        raise ConfigError("--dry_run needs an explicit parallelism.dp_shard (the world size comes from the degrees)")
    optim_spec = checked_optimizer(cfg.optimizer)
    validate_remedies(cfg.remedies)
    world = p.dp_replicate * p.dp_shard * p.tp
    dims = ParallelDims.from_config(p, world)
    init_fake_world(world)
    try:
        mesh = dims.build_mesh("cpu")
        vocab_size, tokenizer_name = planning_vocab(cfg.data.tokenizer)
        spec, args = model_args(cfg.model, vocab_size, cfg.training.seq_len)
        with torch.device("meta"):
            model = spec.build(args)
        n_params = count_params(model)
        n_layers, dim = len(model.layers), model.tok_embeddings.weight.shape[1]
        n_heads = getattr(args, "n_heads", 1)
        vocab = model.tok_embeddings.weight.shape[0]
        fpt = flops_per_token(model, cfg.training.seq_len)
        cuda_like = cfg.training.device != "cpu"
        compute_bytes = 2 if (cuda_like and cfg.training.mixed_precision_param == "bfloat16") else 4
        device_type = "cuda" if cuda_like else "cpu"
        lowprec_lines: list[str] = []
        converted = parallelize(model, spec, args, cfg, dims, mesh, device_type, log=lowprec_lines.append)
        local, largest_block = rank_params(model), 0
        lowprec, gathered_fp8 = "", set()
        if converted:
            recipe = RECIPES[cfg.low_precision.recipe]
            weights = [model.get_submodule(n).weight for n in converted]
            shapes = [tuple(w.shape) for w in weights]  # the full weights (DTensor shapes are global)
            cast = sum(cast_bytes(s, recipe.weight) for s in shapes) / dims.tp
            high = sum(a * b for a, b in shapes) * compute_bytes / dims.tp
            lowprec = (f"low precision     {recipe.name} on {len(converted)} Linears; their weights as the "
                       f"forward GEMMs read them: {cast / GiB:.4f} GiB per TP rank ({high / GiB:.4f} GiB in the "
                       f"compute dtype)" + "".join(f"\n  {line}" for line in lowprec_lines[:-1]))
            if fp8_all_gather(recipe, cfg.low_precision.emulate, device_type, dims.tp):
                gathered_fp8 = {id(w) for w in weights}
                lowprec += "\n  FSDP all-gathers the converted weights in FP8 (1 byte per element)"
        for block in model.layers.values():
            # bytes of one block's all-gather: FP8 weights 1 byte, the rest in the compute dtype
            largest_block = max(largest_block, sum(q.numel() * (1 if id(q) in gathered_fp8 else compute_bytes)
                                                   for q in block.parameters()))
        if optim_spec.plan_state is not None:
            split, optimizer_bytes = optim_spec.plan_state(model, cfg.optimizer)
        else:
            split, optimizer_bytes = "", optim_spec.bytes_per_element(cfg.optimizer) * local
    finally:
        dist.destroy_process_group()
    micro = cfg.training.micro_batch_size or cfg.training.global_batch_size // dims.dp
    return Plan(
        world_size=world, n_params=n_params, flops_per_token=fpt, local_params=local,
        param_bytes=4 * local, grad_bytes=4 * local, optimizer_bytes=optimizer_bytes, optimizer_split=split,
        activation_bytes=activation_bytes(cfg, dims, n_layers, dim, n_heads, vocab, micro, compute_bytes),
        # FSDP all-gathers one block at a time (plus one prefetched) in the compute dtype (FP8 all-gather: the
        # converted weights in one byte), TP-sharded.
        gather_bytes=2 * largest_block / dims.tp, lowprec=lowprec,
        tokenizer=f"{cfg.data.tokenizer} ({tokenizer_name})", vocab_size=vocab,
    )


def dry_run(cfg: JobConfig) -> Plan:
    """Prints the plan (rank 0's view; FSDP ranks differ by at most one shard row)."""
    pl = plan(cfg)
    p = cfg.parallelism
    print(f"dry run: {cfg.model.name}/{cfg.model.flavor} on {pl.world_size} ranks "
          f"(dp_replicate {p.dp_replicate} x dp_shard {p.dp_shard} x tp {p.tp})")
    print(f"  tokenizer         {pl.tokenizer}, vocabulary {pl.vocab_size:,} | data.source {cfg.data.source}")
    warning = tokenizer_mismatch(cfg.data.source, cfg.data.tokenizer)
    if warning:
        print(f"  warning: {warning}")
    print(f"  parameters        {pl.n_params:,} ({pl.n_params / 1e9:.3f} B)")
    print(f"  FLOPs per token   {pl.flops_per_token:.4g} (6N + causal attention, seq_len {cfg.training.seq_len})")
    print(f"  per-rank params   {pl.local_params:,}")
    if pl.optimizer_split:
        print(f"  {pl.optimizer_split}")
    if pl.lowprec:
        print(f"  {pl.lowprec}")
    rows = [("parameters (fp32)", pl.param_bytes), ("gradients (fp32)", pl.grad_bytes),
            (f"optimizer state ({cfg.optimizer.name})", pl.optimizer_bytes),
            (f"activations (estimate, AC {cfg.activation_checkpoint.mode})", pl.activation_bytes),
            ("FSDP all-gather buffers", pl.gather_bytes), ("total", pl.total_bytes)]
    for name, b in rows:
        print(f"  {name:<40} {b / GiB:10.2f} GiB")
    return pl
