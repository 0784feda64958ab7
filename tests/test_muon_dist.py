"""muon_layout = "full" on real gloo ranks, bitwise against one process: 4 processes run FSDP 4, FSDP 2 x TP 2
(``_StridedShard``) and HSDP 2 x 2 placements of the same parameters and gradients (the default bfloat16
Newton-Schulz, per-head wq), and block_periodic (k = 2) at FSDP 2 x TP 2; the full matrices are put back
together and compared with a one-process run. Equal gradients give equal numbers: the owner rank's
Newton-Schulz sees exactly the one-process matrix."""


import pytest
import torch
import torch.multiprocessing as mp

import outlier_titan.components  # noqa: F401  (spawned ranks import this file without conftest)
from outlier_titan.parallel.dims import free_port
from tests.launch import gloo_group

pytestmark = [pytest.mark.dist, pytest.mark.slow]

STEPS = 3
PER_HEAD = {"layers.0.attention.wq.weight": 4}
CASES = [("fsdp4", "full"), ("fsdp2xtp2", "full"), ("hsdp", "full"), ("fsdp2xtp2", "block_periodic")]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from outlier_titan.optim.muon import MuonAdamW
    from outlier_titan.optim.tiles.options import EngineOptions
    from tests.test_muon import _groups
    from tests.test_optim_layouts import MESHES, SPEC, full_grads, full_params, placements

    results = {}
    with gloo_group(rank, world, port):
        for layout, mode in CASES:
            mesh = init_device_mesh("cpu", MESHES[layout], mesh_dim_names=tuple(f"{layout}{i}" for i in range(2))
                                    [:len(MESHES[layout])])
            names = [n for n, _ in SPEC]
            place = {n: placements(layout, n, t.dim()) for n, t in full_params().items()}
            params = {n: torch.nn.Parameter(distribute_tensor(t, mesh, place[n], src_data_rank=None))
                      for n, t in full_params().items()}
            opt = MuonAdamW(_groups(params, names), layout=mode, full_every=2, ns_dtype="bfloat16",
                            per_head=PER_HEAD, options=EngineOptions(tile_size=4, shard_tile_size=4))
            for grads in full_grads(STEPS):
                for n, p in params.items():
                    p.grad = distribute_tensor(grads[n], mesh, place[n], src_data_rank=None)
                opt.step()
            sent = [None] * world
            dist.all_gather_object(sent, opt.bytes_sent)
            results[(layout, mode)] = ({n: p.full_tensor() for n, p in params.items()}, sent)
    if rank == 0:
        torch.save(results, out)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("muon_dist") / "results.pt")
    mp.spawn(_worker, args=(4, free_port(), out), nprocs=4, join=True)
    return torch.load(out)


@pytest.mark.parametrize("layout,mode", CASES)
def test_full_layout_is_bitwise_one_process_muon_at_every_layout(sharded, layout, mode):
    from tests.test_muon import _run_plain

    ref = _run_plain(mode, STEPS, full_every=2, ns_dtype="bfloat16", per_head=PER_HEAD)
    got, sent = sharded[(layout, mode)]
    for n, want in ref.items():
        assert torch.equal(got[n], want), (n, (got[n] - want).abs().max().item())
    assert min(sent) > 0  # the full steps moved shards through the all-to-all


def test_hsdp_sends_one_replica_of_each_shard(sharded):
    """HSDP 2 x 2, 3 full steps, bfloat16 on the wire. Hidden matrices wq, wo (16 x 16), w1 (32 x 16), w2 (16 x 32)
    are owned by ranks 0, 1, 2, 3; each rank holds half of each; only replica group 0 (ranks 0 and 1) sends.
    To the owners: 128 (wq, from rank 1) + 128 (wo, from 0) + 2 x 256 (w1) + 2 x 256 (w2) = 1280 elements;
    back: each owner to its 3 peers, 3 x (128 + 128 + 256 + 256) = 2304. (Every replica sending would add 1024.)"""
    _, sent = sharded[("hsdp", "full")]
    assert sum(sent) == 3 * (1280 + 2304) * 2
