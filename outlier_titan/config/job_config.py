"""The job configuration: one dataclass per section, each field with a default and a one-line help.

Fields are declared with :func:`opt`; the manager reads the help text and the allowed choices from the
field metadata to build ``--help``, convert CLI strings and validate values. ``[model]`` and ``[optimizer]`` are
composed: their common fields are declared here, every other field by its owner (a model spec, an attention variant,
an optimizer) in a light module of that component (``outlier_titan.options``; docs/configuration.md, "Who owns an
option"). ``None`` defaults on model fields mean "take the value from the model spec's flavor" (or the owner's
default).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from outlier_titan.errors import UserError
from outlier_titan.lowprec.recipes import PRECISIONS, RECIPES
from outlier_titan.options import (ATTENTION_IMPLS, ATTENTION_NAMES, DATA_SOURCE_NAMES, OPTIMIZER_NAMES, OptionGroup,
                                   compose_section, opt)


@dataclass
class Job:
    name: str = opt("debug", "Run name; the run folder is <dump_folder>/<name>.")
    dump_folder: str = opt("./outputs", "Folder that holds run folders.")
    description: str = opt("", "Free text saved with the run.")
    dry_run: bool = opt(False, "Plan only: build on the meta device, print params/FLOPs/memory per rank, exit.")
    plugins: list = opt([], "Your components: modules or .py files (comma list) imported on every rank before the "
                            "config is read, registering optimizers, attention variants, metrics, PTQ schemes or "
                            "model specs (docs/extending.md). A TOML file's paths are relative to its folder.")


@dataclass
class ModelCommon:
    """The ``[model]`` options read by every spec (or several); the options owned by one component (a model spec,
    an attention variant) are composed in below (:data:`Model`)."""

    name: str = opt("pre_ln", "Model spec (see the registry: pre_ln, op, angpt, ngpt).")
    flavor: str = opt("debug", "Named size of the spec (e.g. debug, gpt2_124m, llama_1b).")
    softmax: str | None = opt(None, "Old spelling of model.attention (softmax or softmax1 only).",
                              ("softmax", "softmax1"))
    # --- attention variants (pre_ln, op; docs/attention.md): the variants and their own options
    # (model.attention_sink_init, ...) are registered by the variants (outlier_titan.models.attention_variants)
    attention: str | None = opt(None, lambda: f"Attention variant: {ATTENTION_NAMES.described()}.", ATTENTION_NAMES)
    attention_layers: str | None = opt(None, "Comma list of attention variants, one per block (cycled); overrides "
                                             "model.attention per block (default: none).")
    attention_impl: str | None = opt(None, "How attention runs: auto (default: the fused kernels on a GPU, SDPA or "
                                           "query-chunked elsewhere), fused (SDPA / FlexAttention), chunked (query "
                                           "blocks recomputed in the backward) or explicit (the T x T weights).",
                                     ATTENTION_IMPLS)
    pos_encoding: str | None = opt(None, "Position encoding.", ("learned", "rope", "none"))
    bias: bool | None = opt(None, "Biases in linear layers and norms.")
    qk_norm: bool | None = opt(None, "Per-head RMSNorm on queries and keys (GPT+).")
    mlp: str | None = opt(None, "MLP type.", ("gelu", "swiglu", "relu"))
    tie_embeddings: bool | None = opt(None, "Share input embedding and output head weights.")
    dim: int | None = opt(None, "Residual width (overrides the flavor; set by sweeps and Hugging Face imports).")
    n_layers: int | None = opt(None, "Number of blocks (overrides the flavor).")
    n_heads: int | None = opt(None, "Attention heads (overrides the flavor).")
    n_kv_heads: int | None = opt(None, "Key/value heads for grouped-query attention (overrides the flavor).")
    ffn_hidden: int | None = opt(None, "MLP hidden units (per branch for SwiGLU; overrides the flavor).")
    norm_eps: float | None = opt(None, "Epsilon of the norms (overrides the flavor).")
    rope_theta: float | None = opt(None, "RoPE base (overrides the flavor).")
    vocab_size: int | None = opt(None, "Vocabulary size; default: the tokenizer's, padded to a multiple of 64.")
    max_seq_len: int | None = opt(None, "Longest sequence for learned positions / RoPE; default training.seq_len.")
    rope_fraction: float | None = opt(None, "Share of each head's dims rotated by RoPE (GPT+/anGPT: 0.5).")


@dataclass
class OptimizerCommon:
    """The ``[optimizer]`` options every optimizer reads; an optimizer's own options (the tile engine's, Muon's, a
    registered optimizer's) are composed in below (:data:`Optimizer`)."""

    name: str = opt("adamw", "Optimizer, one of the registered ones (outlier_titan.optim.registry).", OPTIMIZER_NAMES)
    lr: float = opt(3e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1 (SGD/RMSProp: momentum).")
    beta2: float = opt(0.95, "Adam beta2 (RMSProp: alpha).")
    eps: float = opt(1e-8, "Adam/RMSProp epsilon.")
    weight_decay: float = opt(0.1, "Decoupled weight decay (AdamW-style) for decayed parameters.")
    momentum: bool = opt(True, "SGD: use momentum beta1 (false = plain SGD).")
    implementation: str = opt("auto", "torch's AdamW / Adam kernels: fused (one kernel per step; torchtitan's "
                              "default), foreach (multi-tensor), or auto = fused on a GPU, foreach on the CPU.",
                              ["auto", "fused", "foreach"])
    no_decay: list = opt(["norm", "bias", "embedding"],
                         "Parameter classes without weight decay: any of norm, bias, embedding, gain, sink "
                         "(learned attention sink logits), v_scale, head_norm (pre_ln's value-path steps).")


@dataclass
class RemediesCommon:
    """The ``[remedies]`` section: no common option; each training remedy (``outlier_titan.remedies``: a loss term,
    an after-step hook) composes in its own, prefixed with its name, and is on when they say so."""


_COMMON = {"model": ModelCommon, "optimizer": OptimizerCommon, "remedies": RemediesCommon}
_OPTIONAL = {"model": True, "optimizer": False, "remedies": False}
"""[model] fields hold None for "the owner's default (or the flavor's)"; [optimizer] and [remedies] fields hold the
default."""
_GROUPS: dict[str, list[OptionGroup]] = {"model": [], "optimizer": [], "remedies": []}
_SECTIONS: dict[str, type] = {}


def section_class(name: str) -> type:
    """The ``[model]``, ``[optimizer]`` or ``[remedies]`` section as composed now: the common options, then every
    registered component's own (model specs', attention variants', optimizers', training remedies'), in registration
    order. ``Model``, ``Optimizer`` and ``Remedies`` of this module are this (composed when first read)."""
    if not len(ATTENTION_NAMES) or not len(OPTIMIZER_NAMES):
        raise UserError("no model components are registered: import outlier_titan.components first (every entry "
                        "point does; it registers the built-in specs, attention variants and optimizers)")
    if name not in _SECTIONS:
        _SECTIONS[name] = compose_section(name.capitalize(), _COMMON[name], _GROUPS[name], optional=_OPTIONAL[name],
                                          module=__name__)
    return _SECTIONS[name]


def __getattr__(name: str) -> type:
    if name in ("Model", "Optimizer", "Remedies"):
        return section_class(name.lower())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def add_option_group(group: OptionGroup) -> None:
    """Composes ``group`` (a component's own options) into its section (``[model]``, ``[optimizer]`` or
    ``[remedies]``): configs
    made from now on have its keys, with their defaults, and ``--help`` lists them under their owner. Registering
    the same options again is a no-op; a key another owner declares with the same type (and, in ``[optimizer]``,
    the same default) is shared (its metadata names both owners); otherwise a key that exists is a UserError."""
    if group.section not in _GROUPS:
        raise UserError(f"options of {group.label()}: a component may add options to [model], [optimizer] or "
                        f"[remedies], not [{group.section}]")
    groups = _GROUPS[group.section]
    if any(g.owner == group.owner and g.kind == group.kind and g.cls is group.cls for g in groups):
        return
    try:
        cls = compose_section(group.section.capitalize(), _COMMON[group.section], groups + [group],
                              optional=_OPTIONAL[group.section], module=__name__)
    except TypeError as e:
        have = {f.name for g in groups for f in dataclasses.fields(g.cls)} | {f.name for f in dataclasses.fields(
            _COMMON[group.section])}
        taken = [f.name for f in dataclasses.fields(group.cls) if f.name in have]
        if not taken:
            raise UserError(f"options of {group.label()}: {e}") from None
        raise UserError(f"options of {group.label()}: {group.section}.{taken[0]} already exists; give the option "
                        f"a name with the owner's prefix (e.g. {group.owner}_{taken[0]}), or the same type and "
                        f"default to share it") from None
    groups.append(group)
    _SECTIONS[group.section] = cls


@dataclass
class LRScheduler:
    warmup_steps: int = opt(10, "Linear warm-up steps (from lr/warmup_steps to lr).")
    decay: str = opt("cosine", "Shape after warm-up.", ("cosine", "linear", "constant", "wsd"))
    decay_ratio: float = opt(0.2, "wsd: fraction of total steps spent in the final linear decay.")
    min_lr_ratio: float = opt(0.1, "Floor of the schedule as a fraction of lr.")
    total_steps: int | None = opt(None, "Length of the schedule; default training.steps.")


@dataclass
class Training:
    steps: int = opt(200, "Optimizer steps to train.")
    global_batch_size: int = opt(16, "Sequences per optimizer step over all data-parallel ranks.")
    micro_batch_size: int | None = opt(
        None, "Sequences per forward pass per DP rank; default global/dp (no accumulation).")
    seq_len: int = opt(256, "Tokens per sequence.")
    seed: int = opt(0, "Seed for init and data order.")
    max_norm: float = opt(1.0, "Gradient clipping norm (0 = off).")
    mixed_precision_param: str = opt("bfloat16", "Compute dtype of parameters on GPU (CPU always float32).",
                                     ("bfloat16", "float32"))
    mixed_precision_reduce: str = opt("float32", "Gradient reduce dtype.", ("bfloat16", "float32"))
    device: str = opt("auto", "Device type: auto (cuda if available), cuda or cpu.", ("auto", "cuda", "cpu"))
    max_skipped_steps: int = opt(5, "Abort after this many consecutive unhealthy steps (a non-finite gradient "
                                    "norm: update skipped; a diverged loss); 0 = never abort.")


@dataclass
class Data:
    source: str = opt("embedded", "Corpus: a file/folder of .txt/.jsonl/.parquet, or a named source registered in "
                                  "outlier_titan.data.sources (embedded: this Python's stdlib source; HF datasets; "
                                  "the synthetic task 'bigram_backcopy[:states=64,triggers=3,alpha=0.2,seed=0]').",
                      names=DATA_SOURCE_NAMES)
    tokenizer: str = opt("embedded", "'embedded' (shipped BPE), 'bytes' (256 byte tokens, no merges; for "
                                     "bigram_backcopy), a tiktoken BPE rank file, or tiktoken:<encoding>.")
    text_field: str = opt("text", "Field with the text in jsonl/parquet/HF records.")
    val_fraction: float = opt(0.02, "Fraction of documents (by file) held out for validation.")
    cache_dir: str = opt("", "Folder for tokenized-corpus caches; empty = $OUTLIER_TITAN_CACHE or "
                             "~/.cache/outlier_titan.")


@dataclass
class Parallelism:
    dp_replicate: int = opt(1, "HSDP replicate degree.")
    dp_shard: int = opt(-1, "FSDP shard degree (-1 = fill the remaining ranks).")
    tp: int = opt(1, "Tensor-parallel degree.")
    fake_world_size: int = opt(0, "Run rank 0 alone of a job of this many ranks on torch's fake process group "
                                  "(collectives do nothing, as torchtitan's COMM_MODE=fake_backend): the memory "
                                  "and step time of one rank of a multi-GPU layout on one device, without a "
                                  "cluster. Its losses are not the real job's. 0 = off; needs checkpoint.enable = "
                                  "false and no launcher (docs/parallelism.md).")
    # --- failure detection (docs/launching.md)
    collective_timeout_s: int = opt(600, "Seconds a collective may wait for a peer before the rank fails (exit 1) "
                                         "instead of hanging: a frozen or unreachable peer then ends the job in "
                                         "minutes. Must exceed the longest gap between collectives (a checkpoint "
                                         "save or load, an evaluation); raise it for huge checkpoints on slow "
                                         "storage.")


@dataclass
class Checkpoint:
    enable: bool = opt(False, "Save DCP checkpoints under <run>/checkpoints/step-<N>.")
    interval: int = opt(100, "Save every N steps (and at the last step).")
    keep_latest_k: int = opt(3, "Keep this many newest checkpoints (0 = keep all).")
    load_step: int = opt(-1, "Resume from this step (-1 = newest complete checkpoint, 0 = do not resume).")
    initial_load_path: str = opt("", "Start from this model instead of a random init: an HF GPT-2/Llama folder or "
                                     "an export of scripts/export.py; its [model] replaces the config's. A "
                                     "checkpoint of the run itself still wins on resume.")
    allow_config_change: bool = opt(False, "Resume even when a setting that breaks the run changed (model, "
                                           "optimizer state layout, tokenizer, data, seq_len, LR schedule).")
    stop_signals: str = opt("SIGTERM,SIGUSR1", "Signals that make every rank finish its step, save a checkpoint "
                                               "and exit 75 (stopped, resumable; comma-separated; from SIGTERM, "
                                               "SIGUSR1, SIGUSR2). Ctrl-C always stops this way.")
    # --- integrity (docs/launching.md)
    verify: bool = opt(True, "Check a checkpoint's files against the checksums saved with it before resuming; "
                             "a damaged one is moved aside (step-N.corrupt) and the previous one is used. False "
                             "skips the check (rank 0 reads the whole checkpoint once: seconds per GiB).")


@dataclass
class ActivationCheckpoint:
    mode: str = opt("none", "Activation checkpointing.", ("none", "full", "selective"))
    selective_every: int = opt(2, "selective: checkpoint every k-th block (0 = op-level: save matmul outputs).")


@dataclass
class Compile:
    enable: bool = opt(False, "torch.compile each transformer block, the loss and the element-wise math of "
                                "orthoadam / soap.")


@dataclass
class Metrics:
    log_every: int = opt(10, "Log loss/lr/grad norm/throughput every N steps.")
    tensorboard: bool = opt(True, "Write TensorBoard events under <run>/tb.")
    wandb: bool = opt(False, "Also log to Weights & Biases (pip install 'outlier_titan[wandb]'; rank 0): the same "
                             "scalars, the probe's pictures and the config; a resumed run continues its W&B run "
                             "(id in <run>/wandb_run_id). WANDB_MODE=offline writes <run>/wandb/ for 'wandb sync'.")
    wandb_project: str = opt("outlier_titan", "W&B project.")
    wandb_entity: str = opt("", "W&B entity (team or user); empty: your default entity.")
    wandb_run_name: str = opt("", "W&B run name; empty: job.name.")
    wandb_group: str = opt("", "W&B group of the run (e.g. a sweep's name); empty: none.")


@dataclass
class Eval:
    every: int = opt(0, "Validation loss every N steps (0 = off).")
    steps: int = opt(4, "Validation batches per evaluation.")


@dataclass
class Observe:
    every: int = opt(0, "Outlier probe every N steps (0 = off).")
    batch_size: int = opt(4, "Sequences in the fixed held-out probe batch, over all ranks (global, like "
                             "training.global_batch_size; a multiple of the data-parallel degree), so every "
                             "layout probes the same sequences.")
    mode: str = opt("full", "cheap: residual-stream metrics only; full: also attention and pictures.",
                    ("cheap", "full"))
    kurtosis_centered: bool = opt(False, "Also log He et al.'s centred neuron-RMS kurtosis (~ Kurt - 1).")
    map_tokens: int = opt(64, "Attention-map picture: the first N query/key positions.")
    gradients: bool = opt(False, "Also backpropagate the probe batch's mean next-token cross entropy (targets "
                                 "inside each window) to the residual stream after every block "
                                 "(torch.autograd.grad: parameters' .grad and the optimizer untouched) and log its "
                                 "kurtosis, max |g| and the gradient sink (Chen, Lin, Yao 2026, arXiv 2603.17771): "
                                 "the paper's R_GS (Eq. 3: at each block's pre-attention norm output, the gradient "
                                 "summed over the probe batch, ||G_0|| / mean_{t=1..31} ||G_t||; we read 'aggregated "
                                 "over the full batch' as that sum, so it can depend on observe.batch_size) and our two "
                                 "per-sequence readings on the residual stream, the first token's share of ||g||^2 "
                                 "and ||g_0|| / mean_t>0 ||g_t||. Off by default: it costs a backward.")
    lowprec_recipe: str = opt("", "The low-precision recipe whose casts the probe measures (per block, attention / "
                                  "MLP modules, activation / weight / output gradient: amax, scales, underflow and "
                                  "saturation shares, SNR dB, block dynamic range; docs/low_precision.md). Empty: "
                                  "the run's own [low_precision] recipe (nothing in a bf16 run); 'bf16': off; a "
                                  "recipe name (fp8_rowwise, mxfp4, ...): the cast modules, or in a bf16 run every "
                                  "linear map of the blocks, measured as that recipe would cast them: whether a "
                                  "run's tensors would survive a format, which FOG (Hernandez-Cano et al. 2025, "
                                  "arXiv 2505.20524) watches through the activations' kurtosis; we measure the cast "
                                  "itself. Tensor-level scales are taken per probe sequence (the same at any "
                                  "layout). The gradient class needs observe.gradients.")


def _recipes_help() -> str:
    listed = ", ".join(f"{n} ({r.help})" if r.help else n for n, r in RECIPES.items())
    return (f"Number formats of the Linear layers' GEMMs: bf16 (none: the compute dtype) or a recipe: {listed}. "
            "Each GEMM operand is cast along the axis its GEMM contracts (docs/low_precision.md).")


@dataclass
class LowPrecision:
    """``[low_precision]``: which Linear layers train in which formats (outlier_titan.lowprec.training)."""

    recipe: str = opt("bf16", _recipes_help, PRECISIONS)
    emulate: str = opt("auto", "auto: real kernels where the hardware has them (the FP8 recipes on CUDA SM 8.9+ "
                               "through torchao's Float8Linear, without TP), the emulation elsewhere; always: the "
                               "emulation (quantise-dequantise operands, high-precision GEMMs) everywhere.",
                       ("auto", "always"))
    skip_first_blocks: int = opt(0, "Keep the first N blocks' Linears in high precision.")
    skip_last_blocks: int = opt(-1, "Keep the last N blocks' Linears in high precision; -1 = the recipe's share "
                                    "(keep_last_fraction of the blocks, rounded up): nvfp4 the last 15% (NVIDIA "
                                    "2025, arXiv 2509.25149, keeps the last blocks in BF16), 0 for the others "
                                    "(torchtitan converts every block).")
    skip_output: bool = opt(True, "Keep the LM head (output) in high precision, as torchtitan and NVIDIA 2025 (arXiv "
                                  "2509.25149) do.")
    skip_attention: bool = opt(False, "Keep the attention projections (wq, wk, wv, wo) in high precision.")
    min_dim: int = opt(0, "Keep a Linear whose in- or out-features are below this in high precision (torchtitan's "
                          "auto_filter_small_kn: small GEMMs gain nothing from FP8 kernels); 0 = none skipped.")


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: ModelCommon = field(default_factory=lambda: section_class("model")())  # the composed [model]
    optimizer: OptimizerCommon = field(default_factory=lambda: section_class("optimizer")())
    remedies: RemediesCommon = field(default_factory=lambda: section_class("remedies")())  # the composed [remedies]
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    data: Data = field(default_factory=Data)
    parallelism: Parallelism = field(default_factory=Parallelism)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    compile: Compile = field(default_factory=Compile)
    metrics: Metrics = field(default_factory=Metrics)
    eval: Eval = field(default_factory=Eval)
    observe: Observe = field(default_factory=Observe)
    low_precision: LowPrecision = field(default_factory=LowPrecision)
