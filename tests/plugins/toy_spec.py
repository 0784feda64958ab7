"""A model spec in one file: ``toy``, a Pre-LN transformer (the ``pre_ln`` spec's blocks) with a learnable
per-channel gain on the token embeddings, its own option. Load it with ``job.plugins`` (or
``outlier_titan.plugins.load_plugin``) and train it with ``--model.name toy``."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import build_norm, init_norms
from outlier_titan.models.pre_ln.model import Block, PreLNArgs, build_rope
from outlier_titan.models.roles import DEFAULT_ROLES
from outlier_titan.models.spec import ModelSpec, TPPlan, register_spec
from outlier_titan.options import opt


@dataclass
class ToyOptions:
    embed_gain: bool = opt(True, "A learnable per-channel gain on the token embeddings (toy spec).")


@dataclass
class ToyArgs(PreLNArgs, ToyOptions):
    """The pre_ln args (its blocks are pre_ln's) and the toy's own option."""


class Gain(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


class ToyTransformer(nn.Module):
    param_roles = DEFAULT_ROLES

    def __init__(self, args: ToyArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.embed_gain = Gain(args.dim) if args.embed_gain else None
        self.rope = build_rope(args.dim // args.n_heads, args.max_seq_len, args.rope_theta, args.rope_fraction)
        self.layers = nn.ModuleDict({str(i): Block(args, self.rope, i) for i in range(args.n_layers)})
        self.norm = build_norm(args.norm, args.dim, args.norm_eps, args.bias)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        if self.embed_gain is not None:
            x = self.embed_gain(x)
        for block in self.layers.values():
            x = block(x)
        return self.output(self.norm(x))

    @torch.no_grad()
    def init_weights(self, init: Initializer) -> None:
        std = self.args.init_std
        init.normal(self.tok_embeddings.weight, std)
        if self.embed_gain is not None:
            init.constant(self.embed_gain.weight, 1.0)
        for block in self.layers.values():
            att, ff = block.attention, block.feed_forward
            # every parameter, the attention variant's included: its input readers like wq, the others their own
            for lin in (att.wq, att.wk, att.wv, *att.input_readers(), att.wo, ff.w1, ff.w3, ff.w2):
                init.linear(lin, std)
            att.init_variant(init)
        init.linear(self.output, std)
        init_norms(self)


def _rotation(args: ToyArgs) -> str | None:
    return "the toy's embedding gain is per channel, which does not commute with a rotation" if args.embed_gain \
        else None


SPEC = register_spec(ModelSpec(
    name="toy",
    model=ToyTransformer,
    args=ToyArgs,
    options=ToyOptions,
    flavors={"debug": dict(dim=32, n_layers=2, n_heads=2, norm="rmsnorm", pos_encoding="rope", bias=False,
                           mlp="swiglu", tie_embeddings=False)},
    # The gain acts on the sequence-sharded stream: replicated over the shards.
    tp_plan=TPPlan(loss_parallel=True, extra={"embed_gain": "replicated_on_shards"}),
    rotation=_rotation,
    description="A Pre-LN transformer with a per-channel embedding gain (a one-file plug-in)",
))
