"""Parameter roles provided by the model (``models/roles.py``): a toy model whose parameters are named otherwise
than the built-in specs' declares its own ``ParamRoles``, and FSDP placement, the tile engine and Muon's split
follow it; the same model without the declaration gets the built-in names' treatment (so each check can fail)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from outlier_titan.config.job_config import Model as ModelConfig
from outlier_titan.config.job_config import Optimizer as OptimizerConfig
from outlier_titan.errors import UserError
from outlier_titan.models.registry import build_meta_model
from outlier_titan.models.roles import DEFAULT_ROLES, ParamRoles, roles_of
from outlier_titan.optim.builder import build_optimizer, build_param_groups
from outlier_titan.optim.muon import head_dims, muon_param_groups
from outlier_titan.optim.tile_optimizers import tile_plans
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.parallel.fsdp import apply_fsdp

V, D, HEADS, HEAD_DIM, HIDDEN = 32, 16, 2, 8, 32

TOY_ROLES = ParamRoles(vocab_axis_params=("embed.weight", "head.weight"),
                       embedding_like_params=("embed.weight", "head.weight"),
                       attention_input_weights=("q", "k", "v"),
                       residual_writers=("out", "down"))


class ToyAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.head_dim = HEAD_DIM
        self.q, self.k, self.v = (nn.Linear(D, HEADS * HEAD_DIM, bias=False) for _ in range(3))
        self.out = nn.Linear(HEADS * HEAD_DIM, D, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, HEADS * HEAD_DIM))


class ToyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = ToyAttention()
        self.up = nn.Linear(D, HIDDEN, bias=False)
        self.down = nn.Linear(HIDDEN, D, bias=False)

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.down(torch.relu(self.up(x)))


class PlainToy(nn.Module):
    """The toy without a ``param_roles`` declaration: it gets ``DEFAULT_ROLES``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({"0": ToyBlock()})
        self.head = nn.Linear(D, V, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.layers.values():
            x = block(x)
        return self.head(x)


class Toy(PlainToy):
    param_roles = TOY_ROLES


def test_roles_of_reads_the_declaration_through_wrappers():
    assert roles_of(Toy()) is TOY_ROLES
    assert roles_of(PlainToy()) is DEFAULT_ROLES
    assert roles_of(torch.compile(Toy())) is TOY_ROLES  # the compile wrapper (compiles nothing until called)
    for spec in ("pre_ln", "op", "ngpt", "angpt"):
        _, _, model = build_meta_model(ModelConfig(name=spec, flavor="debug"), 256, 32)
        assert type(model).__dict__["param_roles"] is DEFAULT_ROLES, spec  # declared by each spec's class
    bad = PlainToy()
    bad.param_roles = {"residual_writers": ("out",)}
    with pytest.raises(UserError, match="declare it as an outlier_titan.models.roles.ParamRoles"):
        roles_of(bad)


def test_roles_methods_match_names_and_suffixes():
    assert TOY_ROLES.has_vocab_axis("head.weight") and TOY_ROLES.has_vocab_axis("_orig_mod.embed.weight")
    assert not TOY_ROLES.has_vocab_axis("layers.0.up.weight") and not DEFAULT_ROLES.has_vocab_axis("head.weight")
    assert TOY_ROLES.writes_residual("layers.0.attn.out.weight", 2)
    assert not TOY_ROLES.writes_residual("layers.0.attn.out.weight", 1)
    assert not TOY_ROLES.writes_residual("layers.0.attn.wo.weight", 2)
    assert DEFAULT_ROLES.writes_residual("layers.0.attention.wo.weight", 2)


def test_tile_plan_keeps_the_declared_vocabulary_axis_unrotated():
    cfg = OptimizerConfig(name="orthoadam", basis="haar", tile_size=8, shard_tile_size=4, vocab_axis="identity")
    for model_cls, vocab_rotates in ((Toy, False), (PlainToy, True)):
        model = model_cls()
        opt = build_optimizer(model, cfg, seed=0)
        for p in (model.embed.weight, model.head.weight):
            axes = opt.plans[p].axes
            assert (axes[0].rotate, axes[1].rotate) == (vocab_rotates, True), model_cls.__name__
        assert all(a.rotate for a in opt.plans[model.layers["0"].attn.q.weight].axes)
        # the pre-check plans as the optimizer does
        planned = {fqn: plan for _, fqn, plan in tile_plans(build_param_groups(model, cfg), cfg, roles_of(model))}
        assert planned["head.weight"].axes[0].rotate == vocab_rotates
    # the sharded (input) axis of a residual writer asks for the shard tile, the residual axis for tile_size
    toy, plain = EngineOptions(tile_size=8, shard_tile_size=4, roles=TOY_ROLES), EngineOptions(tile_size=8,
                                                                                              shard_tile_size=4)
    assert [toy.requested_tile("layers.0.down.weight", a, 32) for a in (0, 1)] == [8, 4]
    assert [plain.requested_tile("layers.0.down.weight", a, 32) for a in (0, 1)] == [4, 8]


def test_muon_leaves_the_declared_embedding_and_head_to_adamw():
    cfg = OptimizerConfig(name="muon", lr=2e-2, muon_per_head=True)
    model = Toy()
    groups = {g["algorithm"] + ("" if g["weight_decay"] or g["algorithm"] == "muon" else "_nd"): g["names"]
              for g in muon_param_groups(model, cfg)}
    hidden = {f"layers.0.attn.{w}.weight" for w in "qkv"} | {"layers.0.attn.out.weight", "layers.0.up.weight",
                                                              "layers.0.down.weight"}
    assert set(groups["muon"]) == hidden
    assert "head.weight" in groups["adamw"] and "embed.weight" in groups["adamw_nd"]
    assert head_dims(model) == {f"layers.0.attn.{w}.weight": HEAD_DIM for w in "qkv"}
    # without the declaration the head is a hidden matrix and no projection is per head
    plain = PlainToy()
    assert "head.weight" in next(g["names"] for g in muon_param_groups(plain, cfg) if g["algorithm"] == "muon")
    assert head_dims(plain) == {}


def test_fsdp_places_the_declared_residual_writers_on_their_input_axis():
    """One simulated rank of 2 (torch's fake process group): ``apply_fsdp`` shards the toy's residual writers
    (``out``, ``down``) along dim 1 and every other matrix along dim 0."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("roles_dp",))
        placements = {}
        for model_cls in (Toy, PlainToy):
            with torch.device("meta"):
                model = model_cls()
            apply_fsdp(model, mesh, torch.float32, torch.float32)
            placements[model_cls] = {n: tuple(p.placements) for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()
    writers = {"layers.0.attn.out.weight", "layers.0.down.weight"}
    for fqn, pl in placements[Toy].items():
        assert pl == ((Shard(1),) if fqn in writers else (Shard(0),)), fqn
    assert all(pl == (Shard(0),) for pl in placements[PlainToy].values())


@pytest.mark.parametrize("spec", ["pre_ln", "op", "ngpt", "angpt"])
def test_tp_plans_agree_with_the_spec_roles(spec):
    """The TP plans name their modules themselves (``parallel/tensor_parallel.tp_block_plan``); for every built-in
    spec their row-wise linears are exactly the spec's residual writers, the per-head inputs are column-wise, and
    each planned weight's TP shard dim is its FSDP shard dim (the residual axis stays whole on both meshes)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from outlier_titan.models.roles import shard_dim_for
    from outlier_titan.parallel.tensor_parallel import tp_block_plan

    _, _, model = build_meta_model(ModelConfig(name=spec, flavor="debug"), 256, 32)
    roles = roles_of(model)
    plan = tp_block_plan(model.layers["0"])
    linears = {k: v for k, v in plan.items() if isinstance(v, (ColwiseParallel, RowwiseParallel))}
    rowwise = {k.rsplit(".", 1)[-1] for k, v in linears.items() if isinstance(v, RowwiseParallel)}
    colwise = {k.rsplit(".", 1)[-1] for k, v in linears.items() if isinstance(v, ColwiseParallel)}
    assert rowwise == set(roles.residual_writers)
    assert set(roles.attention_input_weights) <= colwise
    weights = dict(model.named_parameters())
    for key, style in linears.items():
        fqn = f"layers.0.{key}.weight"
        assert shard_dim_for(fqn, weights[fqn], roles) == (1 if isinstance(style, RowwiseParallel) else 0), fqn
