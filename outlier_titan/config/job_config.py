"""The job configuration: one dataclass per section, each field with a default and a one-line help.

Fields are declared with :func:`opt`; the manager reads the help text and the allowed choices from the
field metadata to build ``--help``, convert CLI strings and validate values. ``None`` defaults on model
fields mean "take the value from the model spec's flavor".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field with a help line and optional allowed values."""
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


class RegisteredChoices:
    """Allowed values that a registry fills at import time (``optimizer.name``: ``outlier_titan.optim.registry``).
    Reads like a tuple; while empty (no registry imported) the config does not restrict the value, and the
    registry's lookup names the registered ones."""

    def __init__(self) -> None:
        self._names: list[str] = []

    def add(self, name: str) -> None:
        self._names.append(name)

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __repr__(self) -> str:
        return repr(tuple(self._names))


OPTIMIZER_NAMES = RegisteredChoices()


@dataclass
class Job:
    name: str = opt("debug", "Run name; the run folder is <dump_folder>/<name>.")
    dump_folder: str = opt("./outputs", "Folder that holds run folders.")
    description: str = opt("", "Free text saved with the run.")
    dry_run: bool = opt(False, "Plan only: build on the meta device, print params/FLOPs/memory per rank, exit.")


@dataclass
class Model:
    name: str = opt("pre_ln", "Model spec (see the registry: pre_ln, op, angpt, ngpt).")
    flavor: str = opt("debug", "Named size of the spec (e.g. debug, gpt2_124m, llama_1b).")
    norm: str | None = opt(None, "pre_ln: norm type (rmsnorm_single: one scalar gain, Kaul et al. 2024's "
                                 "RMSNormSingle; rmsnorm_nogain: no gain).",
                           ("layernorm", "rmsnorm", "rmsnorm_single", "rmsnorm_nogain"))
    softmax: str | None = opt(None, "Old spelling of model.attention (softmax or softmax1 only).",
                              ("softmax", "softmax1"))
    # --- attention variants (pre_ln, op; see docs/attention.md) ---
    attention: str | None = opt(None, "Attention variant: softmax, softmax1 (exact zero sink), sink_logit (learned "
                                      "per-head sink logit), gated_head / gated_elementwise (sigmoid output gate), "
                                      "softpick, sigmoid, relu, clipped_softmax.",
                                ("softmax", "softmax1", "sink_logit", "gated_head", "gated_elementwise", "softpick",
                                 "sigmoid", "relu", "clipped_softmax"))
    attention_layers: str | None = opt(None, "Comma list of attention variants, one per block (cycled); overrides "
                                             "model.attention per block (default: none).")
    attention_sink_init: float | None = opt(None, "sink_logit: initial sink logit of every head (default 0: "
                                                  "softmax-1 at init).")
    attention_softpick_eps: float | None = opt(None, "softpick: epsilon of the denominator (default 1e-6).")
    attention_sigmoid_bias: float | None = opt(None, "sigmoid: the logit bias b (default -log(sequence length)).")
    attention_relu_norm: str | None = opt(None, "relu: divide the weights by the keys each query sees (prefix, "
                                                "default), the sequence length (seq_len) or nothing (none).",
                                          ("prefix", "seq_len", "none"))
    attention_clip_zeta: float | None = opt(None, "clipped_softmax: stretch zeta >= 1 (default 1).")
    attention_clip_gamma: float | None = opt(None, "clipped_softmax: stretch gamma <= 0 (default -0.03).")
    # --- end of attention variants ---
    pos_encoding: str | None = opt(None, "Position encoding.", ("learned", "rope", "none"))
    bias: bool | None = opt(None, "Biases in linear layers and norms.")
    qk_norm: bool | None = opt(None, "Per-head RMSNorm on queries and keys (GPT+).")
    mlp: str | None = opt(None, "MLP type.", ("gelu", "swiglu", "relu"))
    tie_embeddings: bool | None = opt(None, "Share input embedding and output head weights.")
    embed_proj: bool | None = opt(None, "pre_ln: a learnable d x d projection after the token embedding, identity "
                                        "at init (Outlier-Safe Pre-Training); merged into the embedding on export.")
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
    block: str | None = opt(None, "op: block variant: the Outlier Protected block or a baseline of He et al. 2024.",
                            ("op", "pre_ln", "pre_rms", "pre_srms", "post_ln"))
    final_norm: bool | None = opt(None, "op: a final norm before the head (OP: none).")
    residual_scale: float | None = opt(None, "op: beta, the residual-branch scale (its init when trainable).")
    residual_scale_mode: str | None = opt(None, "op: beta as a fixed scalar, trainable scalar, trainable "
                                                "LayerScale vector, or none (beta = 1).",
                                          ("none", "fixed", "scalar", "vector"))
    mlp_alpha: str | None = opt(None, "op: alpha on the MLP input: none, analytic (fixed, from the init signal "
                                      "propagation), trainable (scalar, init analytic).",
                                ("none", "analytic", "trainable"))
    embed_scale: float | None = opt(None, "op: multiplier of the token embeddings (default 1/init std: mean "
                                          "square 1 at init).")
    input_norm: bool | None = opt(None, "op: LayerNorm on block 0's attention input (the authors' code).")
    logit_softcap: float | None = opt(None, "op: tanh soft-cap c*tanh(s/c) of attention logits (0 = off).")
    lerp_form: str | None = opt(None, "angpt: LERP factor nu(alpha): corrected (1-2a+2a^2)^-1/2 or the "
                                      "paper's printed 1-2a+2a^2.", ("corrected", "printed"))
    lerp_factor: str | None = opt(None, "angpt: nu(alpha) per dimension, or one scalar from the mean over dims.",
                                  ("elementwise", "mean"))
    alpha_init: float | None = opt(None, "angpt/ngpt: effective initial LERP step alpha.")
    alpha_abs: bool | None = opt(None, "angpt/ngpt: LERP with |alpha| (nGPT code) instead of signed alpha.")
    param_scale: float | None = opt(None, "angpt/ngpt: stored init s_scale of scaling vectors (effective value "
                                          "= param * s_init / s_scale); default anGPT 0.01, nGPT 1/sqrt(dim).")
    logit_scale_init: float | None = opt(None, "angpt/ngpt: effective initial per-vocab logit scale s_z.")
    attn_scale_init: float | None = opt(None, "angpt: initial learnable attention temperature g per head.")


@dataclass
class Optimizer:
    name: str = opt("adamw", "Optimizer, one of the registered ones (outlier_titan.optim.registry).", OPTIMIZER_NAMES)
    lr: float = opt(3e-4, "Peak learning rate.")
    beta1: float = opt(0.9, "Adam beta1 (SGD/RMSProp: momentum).")
    beta2: float = opt(0.95, "Adam beta2 (RMSProp: alpha).")
    eps: float = opt(1e-8, "Adam/RMSProp epsilon.")
    weight_decay: float = opt(0.1, "Decoupled weight decay (AdamW-style) for decayed parameters.")
    momentum: bool = opt(True, "SGD: use momentum beta1 (false = plain SGD).")
    no_decay: list = opt(["norm", "bias", "embedding"],
                         "Parameter classes without weight decay: any of norm, bias, embedding, gain, sink "
                         "(learned attention sink logits).")
    tile_size: int = opt(0, "orthoadam/soap: 0 rotates every axis whole (one basis per axis up to max_precond_dim: "
                            "the published methods; a sharded axis then needs tiles). N > 0: the shard-local tile "
                            "variant, tiles of edge N on each parameter's global grid along the residual (never "
                            "sharded) axis, and at most N along the sharded axis.")
    shard_tile_size: int = opt(0, "orthoadam/soap: tile edge along the axis FSDP/TP shard (0: automatic, the "
                                  "largest power of two <= tile_size such that max_shards tiles divide the axis).")
    max_shards: int = opt(8, "orthoadam/soap: automatic shard_tile_size stays aligned for up to this many "
                             "(power-of-two) shards of an axis (FSDP x TP degree); numbers equal at every such layout.")
    tile_size_overrides: list = opt([], "orthoadam/soap: per-parameter tile edges, 'FQN_GLOB=SIZE' or "
                                        "'FQN_GLOB:AXIS=SIZE' (last match wins), e.g. 'layers.*.wo.weight:1=64'.")
    tile_alignment: str = opt("strict", "orthoadam/soap: a shard boundary off the tile grid fails at start-up "
                                        "(strict) or shrinks that tile and records it in the checkpoint (adapt).",
                              ("strict", "adapt"))
    basis: str = opt("haar", "orthoadam: fixed bases: Haar (a random orthogonal matrix, as Kaul et al. sample "
                             "one per parameter), randomized Hadamard (cheaper; power-of-two axes or tiles), "
                             "Kronecker-factored Haar (haar_kron: cheaper, structured mixing), or identity "
                             "(= AdamW; tests and ablations).", ("haar", "hadamard", "haar_kron", "identity"))
    precondition_frequency: int = opt(10, "soap: eigenbasis refresh period (steps); with tiles staggered over "
                                                "them (whole axes: every parameter at t % f == 0, as published).")
    shampoo_beta: float = opt(-1.0, "soap: EMA factor of the Shampoo factors (< 0: beta2).")
    refresh_stagger: bool = opt(True, "soap: spread refreshes over tiles (tile k when (t + k) % f == 0).")
    soap_factor_dtype: str = opt("float64", "soap: dtype of the L/R factors (float64 keeps small-eigenvalue "
                                            "directions above rounding noise; moments and bases stay fp32).",
                                 ("float64", "float32"))
    max_precond_dim: int = opt(10000, "orthoadam/soap: an axis longer than this is not rotated.")
    vocab_axis: str = opt("tile", "orthoadam/soap: the vocabulary axis of tok_embeddings/output: rotated like "
                                  "the other axes (tile: whole or in tiles, as tile_size says; the published "
                                  "SOAP rotates it up to max_precond_dim) or not rotated (identity).",
                          ("tile", "identity"))
    one_d: str = opt("adamw", "orthoadam/soap: 1-D parameters (gains, biases): unrotated Adam, or rotated in "
                              "tiles.", ("adamw", "rotate"))
    # --- muon (optimizer.name = "muon"; docs/muon.md). optimizer.lr / weight_decay are Muon's; the embeddings,
    # the output head and 1-D parameters go to AdamW with the muon_adamw_* settings below.
    muon_momentum: float = opt(0.95, "muon: momentum of the momentum buffer.")
    muon_nesterov: bool = opt(True, "muon: Nesterov momentum (the orthogonalised matrix is g + mu * buf).")
    muon_ns_steps: int = opt(5, "muon: Newton-Schulz iterations.")
    muon_ns_coefficients: list = opt(["3.4445", "-4.775", "2.0315"], "muon: quintic Newton-Schulz coefficients "
                                                                     "(a, b, c).")
    muon_eps: float = opt(1e-7, "muon: the Frobenius norm is clamped to at least eps before Newton-Schulz.")
    muon_adjust_lr_fn: str = opt("original", "muon: per-matrix lr scale: sqrt(max(1, rows/cols)) (original) or "
                                             "0.2 * sqrt(max(rows, cols)) (match_rms_adamw).",
                                 ("original", "match_rms_adamw"))
    muon_ns_dtype: str = opt("bfloat16", "muon: dtype of the Newton-Schulz iteration (torch.optim.Muon: bfloat16).",
                             ("bfloat16", "float32", "float64"))
    muon_layout: str = opt("full", "muon: a sharded matrix is orthogonalised whole (full: all-to-all to an owner "
                                   "rank and back), in shard-local tiles of the global tile grid (block), or in "
                                   "tiles with a full step every muon_full_every steps (block_periodic, MuonBP).",
                           ("full", "block", "block_periodic"))
    muon_full_every: int = opt(5, "muon: block_periodic: a full step on steps 1, 1 + k, 1 + 2k, ... (k >= 1).")
    muon_per_head: bool = opt(False, "muon: orthogonalise each head's rows of wq/wk/wv separately.")
    muon_adamw_lr: float = opt(3e-3, "muon: AdamW lr of the embeddings, the output head and 1-D parameters.")
    muon_adamw_beta1: float = opt(0.9, "muon: AdamW beta1 of the non-Muon parameters.")
    muon_adamw_beta2: float = opt(0.95, "muon: AdamW beta2 of the non-Muon parameters.")
    muon_adamw_weight_decay: float = opt(0.1, "muon: AdamW decoupled weight decay of the non-Muon parameters "
                                              "outside optimizer.no_decay.")
    # --- end muon


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
    max_skipped_steps: int = opt(5, "Abort after this many consecutive steps with a non-finite gradient norm "
                                    "(skipped updates); 0 = never abort.")


@dataclass
class Data:
    source: str = opt("embedded", "Corpus: 'embedded' (this Python's stdlib source), a file/folder of "
                                  ".txt/.jsonl/.parquet, an HF dataset name (c4, fineweb), or the synthetic "
                                  "Bigram-Backcopy task 'bigram_backcopy[:states=64,triggers=3,alpha=0.2,seed=0]'.")
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


@dataclass
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
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
