"""The parameter sets the benchmarks step: GPT-2 small's shapes, one of its layers, the debug model; and the
machine's name for their reports."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


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



def one_gpt2_layer() -> list[tuple[str, tuple[int, int]]]:
    """(name, shape) of GPT-2 small's first block's six matrices."""
    dim = 768
    return ([(f"layers.0.attention.{w}.weight", (dim, dim)) for w in ("wq", "wk", "wv", "wo")]
            + [("layers.0.feed_forward.w1.weight", (4 * dim, dim)),
               ("layers.0.feed_forward.w2.weight", (dim, 4 * dim))])



def cpu_name() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
