"""Probe metrics under FSDP2 (2 and 4 ranks), HSDP 2 x 2 and FSDP 2 x TP 2 (sequence parallel) equal the
1-rank metrics on the same model and probe batch (gloo, CPU)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import outlier_titan.components  # noqa: F401  (spawned ranks import this file without conftest)
from outlier_titan.config.job_config import Model, Observe
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.parallel.dims import free_port
from outlier_titan.parallel.tensor_parallel import apply_tp_plan
from tests.launch import gloo_group

SEED, VOCAB, SEQ, BATCH = 7, 4096, 32, 4
FLAVORS = {"gpt2_s1": dict(flavor="debug", softmax="softmax1"), "llama": dict(flavor="debug_llama"),
           # attention variants (their own weights in the probe), sink logits and gates sharded with the heads
           "variants": dict(flavor="debug_llama", attention_layers="sink_logit,gated_elementwise,softpick,relu")}
OBSERVE = Observe(mode="full", kurtosis_centered=True, map_tokens=16)


def probe_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(11))


def build(flavor: str, device: str = "cpu"):
    spec, args = model_args(Model(name="pre_ln", **FLAVORS[flavor]), vocab_size=VOCAB, seq_len=SEQ)
    with torch.device(device):
        model = spec.build(args)
    return spec, args, model


def reference(flavor: str):
    _, _, model = build(flavor)
    model.init_weights(Initializer(SEED, "cpu"))
    return OutlierProbe(model, OBSERVE).run(probe_tokens())


def _worker(rank: int, world: int, port: int, layouts: list, out_dir: str) -> None:
    from outlier_titan.parallel.dims import ParallelDims
    from outlier_titan.parallel.fsdp import apply_fsdp

    results = {}
    with gloo_group(rank, world, port):
        for dp_replicate, dp_shard, tp in layouts:
            mesh = ParallelDims(dp_replicate, dp_shard, tp, world).build_mesh("cpu")
            dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
            for flavor in FLAVORS:
                spec, args, model = build(flavor, "meta")
                if tp > 1:
                    apply_tp_plan(model, mesh["tp"], args, spec.tp_plan)
                apply_fsdp(model, dp_mesh, torch.float32, torch.float32)
                model.to_empty(device="cpu")
                model.init_weights(Initializer(SEED, "cpu"))
                dp_rank, per = mesh["dp"].get_local_rank(), BATCH // (dp_replicate * dp_shard)
                share = probe_tokens()[dp_rank * per:(dp_rank + 1) * per]
                results[(dp_replicate, dp_shard, tp, flavor)] = OutlierProbe(model, OBSERVE, mesh).run(share)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # a rank that exits while a peer's gloo threads still talk to it can abort the peer


def run_ranks(world: int, layouts: list, tmp_path) -> list[dict]:
    mp.start_processes(_worker, args=(world, free_port(), layouts, str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def assert_same(got: tuple, ref: tuple, what: str) -> None:
    (gs, gi), (rs, ri) = got, ref
    assert gs.keys() == rs.keys(), (what, sorted(set(gs) ^ set(rs)))
    for k in rs:
        assert gs[k] == pytest.approx(rs[k], rel=1e-5, abs=1e-7), (what, k, gs[k], rs[k])
    assert gi.keys() == ri.keys(), what
    for k in ri:
        assert gi[k].shape == ri[k].shape, (what, k)
        diff = np.abs(gi[k].astype(np.int16) - ri[k].astype(np.int16))
        assert diff.max() <= 2 and (diff > 0).mean() < 0.01, (what, k)


@pytest.mark.dist
@pytest.mark.parametrize("world,layouts", [(2, [(1, 2, 1)]), pytest.param(4, [(1, 4, 1), (2, 2, 1), (1, 2, 2)],
                                                                        marks=pytest.mark.extended)],
                         ids=["fsdp2", "fsdp4-hsdp2x2-fsdp2xtp2"])
def test_distributed_probe_equals_one_rank(world, layouts, tmp_path):
    refs = {flavor: reference(flavor) for flavor in FLAVORS}
    per_rank = run_ranks(world, layouts, tmp_path)
    for key, ref in ((k, refs[k[-1]]) for k in per_rank[0]):
        assert_same(per_rank[0][key], ref, f"{key} rank 0")
        for r in range(1, world):  # identical on every rank, not only close
            assert per_rank[r][key][0] == per_rank[0][key][0], (key, r)
    assert len(per_rank[0]) == len(layouts) * len(FLAVORS)
