"""Pre-LN transformer: GPT-2 style (LayerNorm, learned positions, GELU, biases, tied embeddings) and Llama style
(RMSNorm, RoPE, SwiGLU, no bias, GQA), chosen by options; plus seed 000's softmax-1 and single-scale RMSNorm
and anGPT's GPT+ (QK-norm).

    x = embed(tokens) [+ pos]
    for each block:  x = x + attn(norm1(x));  x = x + mlp(norm2(x))
    logits = head(norm_f(x))
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from outlier_titan.config.manager import ConfigError
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import MLP, Attention, RotaryEmbedding, build_norm, init_norms
from outlier_titan.models.registry import ModelSpec, register_spec


@dataclass
class PreLNArgs:
    dim: int = 128
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int | None = None
    ffn_hidden: int | None = None  # default: 4*dim (gelu/relu) or 8/3*dim rounded up to 64 (swiglu)
    vocab_size: int = 4096
    max_seq_len: int = 1024
    norm: str = "layernorm"
    softmax: str = "softmax"
    pos_encoding: str = "learned"
    bias: bool = True
    qk_norm: bool = False
    mlp: str = "gelu"
    tie_embeddings: bool = True
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    init_std: float = 0.02

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        if self.ffn_hidden is None:
            self.ffn_hidden = 4 * self.dim if self.mlp != "swiglu" else (8 * self.dim // 3 + 63) // 64 * 64

    def validate(self) -> None:
        if self.dim % self.n_heads:
            raise ConfigError(f"model: dim {self.dim} is not divisible by n_heads {self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"model: n_heads {self.n_heads} is not divisible by n_kv_heads {self.n_kv_heads}")
        if self.pos_encoding == "rope" and (self.dim // self.n_heads) % 2:
            raise ConfigError("model.pos_encoding = 'rope' needs an even head dimension")


class Block(nn.Module):
    def __init__(self, args: PreLNArgs, rope: RotaryEmbedding | None):
        super().__init__()
        self.attention_norm = build_norm(args.norm, args.dim, args.norm_eps, args.bias)
        self.attention = Attention(args.dim, args.n_heads, args.n_kv_heads, args.bias, args.softmax,
                                   qk_norm=args.qk_norm, rope=rope, norm_eps=args.norm_eps)
        self.ffn_norm = build_norm(args.norm, args.dim, args.norm_eps, args.bias)
        self.feed_forward = MLP(args.dim, args.ffn_hidden, args.mlp, args.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class PreLNTransformer(nn.Module):
    def __init__(self, args: PreLNArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim) if args.pos_encoding == "learned" else None
        # One rotary table shared by all blocks (a non-persistent buffer, not a parameter).
        self.rope = (RotaryEmbedding(args.dim // args.n_heads, args.max_seq_len, args.rope_theta)
                     if args.pos_encoding == "rope" else None)
        self.layers = nn.ModuleDict({str(i): Block(args, self.rope) for i in range(args.n_layers)})
        self.norm = build_norm(args.norm, args.dim, args.norm_eps, args.bias)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.pos_embeddings is not None:
            x = x + self.pos_embeddings(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.layers.values():
            x = block(x)
        x = self.norm(x)
        if self.output is None:
            return x @ self.tok_embeddings.weight.t()
        return self.output(x)

    @torch.no_grad()
    def init_weights(self, init: Initializer) -> None:
        """GPT-2 init: N(0, std) everywhere, residual output projections N(0, std / sqrt(2 L))."""
        a = self.args
        init.normal(self.tok_embeddings.weight, a.init_std)
        if self.pos_embeddings is not None:
            init.normal(self.pos_embeddings.weight, a.init_std)
        for block in self.layers.values():
            att, ff = block.attention, block.feed_forward
            for lin in (att.wq, att.wk, att.wv, ff.w1, ff.w3):
                init.linear(lin, a.init_std)
            for lin in (att.wo, ff.w2):
                init.linear(lin, a.init_std / (2 * a.n_layers) ** 0.5)
        init.linear(self.output, a.init_std)
        init_norms(self)


GPT2 = dict(norm="layernorm", pos_encoding="learned", bias=True, mlp="gelu", tie_embeddings=True)
LLAMA = dict(norm="rmsnorm", pos_encoding="rope", bias=False, mlp="swiglu", tie_embeddings=False,
             norm_eps=1e-5, rope_theta=500000.0)

FLAVORS = {
    "debug": dict(GPT2, dim=128, n_layers=4, n_heads=4),
    "debug_llama": dict(LLAMA, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, rope_theta=10000.0),
    # GPT-2 family (Radford et al. 2019 shapes; vocab follows the tokenizer unless model.vocab_size is set)
    "gpt2_124m": dict(GPT2, dim=768, n_layers=12, n_heads=12),
    "gpt2_350m": dict(GPT2, dim=1024, n_layers=24, n_heads=16),
    "gpt2_774m": dict(GPT2, dim=1280, n_layers=36, n_heads=20),
    "gpt2_1.4b": dict(GPT2, dim=1600, n_layers=48, n_heads=25),
    # Llama 3.2 1B shape
    "llama_1b": dict(LLAMA, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192),
}


def _tp_plan(model, tp_mesh, args):
    from outlier_titan.parallel.tensor_parallel import apply_standard_tp
    apply_standard_tp(model, tp_mesh, args)


register_spec(ModelSpec(
    name="pre_ln",
    args_cls=PreLNArgs,
    flavors=FLAVORS,
    build=PreLNTransformer,
    tp_plan=_tp_plan,
    description="Pre-LN GPT-2 / Llama with softmax-1, single-scale RMSNorm and QK-norm options",
))
