"""World-size invariance and alignment of the tile engine over DTensor layouts, in one process.

Each rank of a 2- or 4-rank mesh is simulated in turn with torch's fake process group (no communication
happens: the optimizer needs none besides its non-finite flag, which the fake group passes through).
Parameters and gradients are distributed with ``distribute_tensor(src_data_rank=None)`` for the placements
FSDP2, FSDP2 x TP2 and HSDP give the model; the shards are put back together from every rank and compared
with a world-size-1 run on plain tensors. The multi-process test (test_optim_dist.py) does the same with
real ``fully_shard`` / ``parallelize_module`` on gloo.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.distributed.fake_pg import FakeStore

from outlier_titan.optim.orthoadam import OrthoAdam
from outlier_titan.optim.soap import SOAP
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.optim.tiles.plan import TileAlignmentError
from outlier_titan.optim.tiles.shards import local_indices

D, F, V = 16, 32, 32
SPEC = [("tok_embeddings.weight", (V, D)), ("layers.0.attention_norm.weight", (D,)),
        ("layers.0.attention.wq.weight", (D, D)), ("layers.0.attention.wo.weight", (D, D)),
        ("layers.0.feed_forward.w1.weight", (F, D)), ("layers.0.feed_forward.w2.weight", (D, F)),
        ("norm.weight", (D,)), ("output.weight", (V, D))]
COL, ROW = ("wq", "wk", "wv", "w1", "w3"), ("wo", "w2")


def fsdp_dim(name):
    return 1 if name.split(".")[-2] in ROW else 0


def placements(layout, name, ndim):
    kind = name.split(".")[-2] if ndim == 2 else ""
    if layout in ("fsdp2", "fsdp4"):
        return (Shard(fsdp_dim(name)),)
    if layout == "hsdp":
        return (Replicate(), Shard(fsdp_dim(name)))
    if layout == "fsdp2xtp2":
        if kind in COL:
            return (_StridedShard(0, split_factor=2), Shard(0))
        if kind in ROW:
            return (_StridedShard(1, split_factor=2), Shard(1))
        return (Shard(0), Replicate())
    raise ValueError(layout)


MESHES = {"fsdp2": (2,), "fsdp4": (4,), "hsdp": (2, 2), "fsdp2xtp2": (2, 2)}


@contextlib.contextmanager
def fake_rank(rank, world):
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def full_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in SPEC}


def full_grads(steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{n: torch.randn(*s, generator=g, dtype=torch.float64) for n, s in SPEC} for _ in range(steps)]


def make_opt(kind, params, opts, compiled=False):
    names = [n for n, _ in SPEC]
    groups = [{"params": [params[n] for n in names], "names": names, "weight_decay": 0.1}]
    if kind == "orthoadam":
        opt = OrthoAdam(groups, lr=1e-2, betas=(0.9, 0.95), seed=3, basis="haar", options=opts)
    else:
        opt = SOAP(groups, lr=1e-2, precondition_frequency=3, options=opts)
    if compiled:
        opt.compile_math()
    return opt


OPTS = EngineOptions(tile_size=4, shard_tile_size=4,
                     tile_size_overrides=("layers.*.attention.wq.weight:1=16",))


def run_single(kind, steps, opts=OPTS, compiled=False):
    params = {n: torch.nn.Parameter(t.clone()) for n, t in full_params().items()}
    opt = make_opt(kind, params, opts, compiled)
    for grads in full_grads(steps):
        for n, p in params.items():
            p.grad = grads[n].clone()
        opt.step()
    return {n: p.detach() for n, p in params.items()}, {n: dict(opt.state[p]) for n, p in params.items()}


def _put(full, local, idx0, idx1):
    if full.dim() == 1:
        full[idx0] = local
    else:
        full[idx0[:, None], idx1[None, :]] = local


def run_sharded(kind, layout, steps, opts=OPTS, compiled=False):
    """Runs every rank of ``layout``; returns the reassembled full params and state."""
    mesh_shape = MESHES[layout]
    world = 1
    for s in mesh_shape:
        world *= s
    out_p = {n: torch.full(s, float("nan"), dtype=torch.float64) for n, s in SPEC}
    out_s = {}
    for rank in range(world):
        with fake_rank(rank, world):
            # Distinct dim names per simulated rank: DTensor interns equal meshes, and in one process the
            # mesh of the previous simulated rank would otherwise come back with its coordinate.
            mesh = init_device_mesh("cpu", mesh_shape,
                                    mesh_dim_names=tuple(f"r{rank}d{i}" for i in range(len(mesh_shape))))
            coord = mesh.get_coordinate()
            params, place = {}, {}
            for n, t in full_params().items():
                place[n] = placements(layout, n, t.dim())
                params[n] = torch.nn.Parameter(distribute_tensor(t, mesh, place[n], src_data_rank=None))
            opt = make_opt(kind, params, opts, compiled)
            for grads in full_grads(steps):
                for n, p in params.items():
                    p.grad = distribute_tensor(grads[n], mesh, place[n], src_data_rank=None)
                opt.step()
            for n, shape in SPEC:
                shape2 = shape if len(shape) == 2 else (shape[0], 1)
                idx = [local_indices(shape2[a], a, mesh_shape, place[n], coord) for a in range(2)]
                full = full_params()[n]
                # our index sets are DTensor's own shards
                assert params[n].device_mesh.get_coordinate() == coord
                assert torch.equal(distribute_tensor(full, mesh, place[n], src_data_rank=None).to_local(),
                                   full[idx[0]] if full.dim() == 1 else full[idx[0][:, None], idx[1][None, :]])
                _put(out_p[n], params[n].to_local(), *idx)
                st = out_s.setdefault(n, {})
                for k, v in opt.state[params[n]].items():
                    if isinstance(v, DTensor):
                        if k not in st:
                            st[k] = torch.full(tuple(v.shape), float("nan"), dtype=v.dtype)
                        plan = opt.plans[params[n]]
                        if v.dim() == 4:  # stacked per-tile state: index by tiles
                            tidx = [torch.tensor(plan.axes[a].local_tiles, dtype=torch.long) for a in range(2)]
                            st[k][tidx[0][:, None], tidx[1][None, :]] = v.to_local()
                        else:
                            _put(st[k], v.to_local(), *idx)
                    else:
                        st[k] = v.clone()
    return out_p, out_s


@pytest.mark.parametrize("kind", ["orthoadam", "soap"])
@pytest.mark.parametrize("layout", ["fsdp2xtp2", "hsdp", "fsdp4"])  # plain FSDP 2: test_optim_dist.py
def test_sharded_equals_single_process(kind, layout):
    steps = 5
    ref_p, ref_s = run_single(kind, steps)
    got_p, got_s = run_sharded(kind, layout, steps)
    for n, _ in SPEC:
        assert torch.equal(got_p[n], ref_p[n]), (n, (got_p[n] - ref_p[n]).abs().max())
        assert set(got_s[n]) == set(ref_s[n])
        for k, v in ref_s[n].items():
            assert torch.equal(got_s[n][k], v), (n, k)


@pytest.mark.parametrize("kind", ["orthoadam", "soap"])
def test_compiled_math_is_layout_independent_and_equals_eager_to_rounding(kind):
    """compile.enable's fused element-wise math: bitwise the same under FSDP 2 x TP 2 as in one process (each
    element's update depends on that element alone), and equal to the eager foreach reference to float64
    rounding."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    steps = 5
    eager_p, eager_s = run_single(kind, steps)
    graphs = counters["stats"]["unique_graphs"]
    ref_p, ref_s = run_single(kind, steps, compiled=True)
    got_p, got_s = run_sharded(kind, "fsdp2xtp2", steps, compiled=True)
    assert counters["stats"]["unique_graphs"] > graphs  # the compiled path ran
    for n, _ in SPEC:
        assert torch.equal(got_p[n], ref_p[n]), (n, (got_p[n] - ref_p[n]).abs().max())
        for k, v in ref_s[n].items():
            assert torch.equal(got_s[n][k], v), (n, k)
        torch.testing.assert_close(ref_p[n], eager_p[n], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ref_s[n]["exp_avg_sq"], eager_s[n]["exp_avg_sq"], rtol=1e-12, atol=1e-14)
        assert not torch.equal(ref_p[n], full_params()[n])


def test_strict_misalignment_names_parameter_placements_and_a_tile_that_works():
    with fake_rank(1, 4):
        mesh = init_device_mesh("cpu", (4,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(16, 16), mesh, (Shard(0),), src_data_rank=None))
        groups = [{"params": [p], "names": ["layers.0.attention.wq.weight"], "weight_decay": 0.0}]
        with pytest.raises(TileAlignmentError) as err:
            OrthoAdam(groups, basis="haar", options=EngineOptions(tile_size=8, shard_tile_size=8))
        msg = str(err.value)
        assert "layers.0.attention.wq.weight" in msg and "Shard(dim=0)" in msg
        assert "layers.0.attention.wq.weight:0=4" in msg and "adapt" in msg
        opt = OrthoAdam(groups, basis="haar",
                        options=EngineOptions(tile_size=8, shard_tile_size=8, tile_alignment="adapt"))
        spec = opt.state[p]["tile_spec"].tolist()
        assert spec[2:4] == [4, 8] and spec[6:8] == [1, 0]  # tiles (4, 8), axis 0 adapted


def test_strided_shards_non_contiguous_in_global_index_space():
    # FSDP-style strided split alone (no inner TP shard): rank 0 holds rows [0, 8) and [16, 24).
    idx = local_indices(32, 0, (2,), (_StridedShard(0, split_factor=2),), (0,))
    assert idx.tolist() == list(range(0, 8)) + list(range(16, 24))
    with fake_rank(0, 2):
        mesh = init_device_mesh("cpu", (2,))
        pl = (_StridedShard(0, split_factor=2),)
        full = torch.randn(32, 8, dtype=torch.float64)
        p = torch.nn.Parameter(distribute_tensor(full, mesh, pl, src_data_rank=None))
        assert torch.equal(p.to_local(), full[idx])
        opt = SOAP([{"params": [p], "names": ["layers.0.feed_forward.w1.weight"], "weight_decay": 0.0}],
                   options=EngineOptions(tile_size=8, shard_tile_size=8))
        assert opt.plans[p].axes[0].local_tiles == [0, 2]
        assert tuple(opt.state[p]["L"].shape) == (4, 1, 8, 8)
        assert tuple(opt.state[p]["L"].to_local().shape) == (2, 1, 8, 8)
        with pytest.raises(TileAlignmentError):
            SOAP([{"params": [p], "names": ["layers.0.feed_forward.w1.weight"], "weight_decay": 0.0}],
                 options=EngineOptions(tile_size=16, shard_tile_size=16))


def test_empty_local_shard():
    # 6 rows over 4 ranks: torch.chunk gives 2, 2, 2, 0 rows; the last rank holds nothing and still steps.
    with fake_rank(3, 4):
        mesh = init_device_mesh("cpu", (4,))
        p = torch.nn.Parameter(distribute_tensor(torch.randn(6, 4), mesh, (Shard(0),), src_data_rank=None))
        assert p.to_local().shape[0] == 0
        opt = SOAP([{"params": [p], "names": ["layers.0.attention.wq.weight"], "weight_decay": 0.0}],
                   options=EngineOptions(tile_size=2))
        p.grad = distribute_tensor(torch.randn(6, 4), mesh, (Shard(0),), src_data_rank=None)
        opt.step()
        opt.step()
        assert set(opt.state[p]) >= {"L", "R", "QL", "QR", "exp_avg"}
