"""The gradient-side probe metrics (``observe.gradients``) under FSDP2 (2 and 4 ranks), HSDP 2 x 2 and FSDP2 x TP2
(sequence parallel, vocab-sharded loss) equal the 1-rank metrics on the same model and probe batch (gloo, CPU), and no rank
gets a parameter ``.grad``; the gradient-sink ratio's batch sums of the attention-norm gradient (a DTensor under
sequence parallel; a local sequence shard in the op spec's Pre-RMSNorm block) included."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import outlier_titan.components  # noqa: F401  (spawned ranks import this file without conftest)
from outlier_titan.config.job_config import Observe
from outlier_titan.models.init import Initializer
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.parallel.dims import free_port
from outlier_titan.parallel.tensor_parallel import apply_tp_plan
from outlier_titan.config.job_config import Model
from outlier_titan.models.registry import model_args
from tests.test_probe_dist import BATCH, SEED, SEQ, VOCAB, assert_same, build as build_pre_ln, probe_tokens
from tests.launch import gloo_group

FLAVORS = ("llama", "gpt2_s1")
OP_PRE_RMS = "op_pre_rms"  # the op spec's Pre-RMSNorm block: its norms keep local sequence shards under TP
OBSERVE = Observe(mode="full", gradients=True, map_tokens=16)


def build(flavor: str, device: str = "cpu"):
    if flavor != OP_PRE_RMS:
        return build_pre_ln(flavor, device)
    spec, args = model_args(Model(name="op", flavor="debug", block="pre_rms"), vocab_size=VOCAB, seq_len=SEQ)
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
        for dp_replicate, dp_shard, tp, flavors in layouts:
            mesh = ParallelDims(dp_replicate, dp_shard, tp, world).build_mesh("cpu")
            dp_mesh = mesh["dp_replicate", "dp_shard"] if dp_replicate > 1 else mesh["dp_shard"]
            for flavor in flavors:
                spec, args, model = build(flavor, "meta")
                if tp > 1:
                    apply_tp_plan(model, mesh["tp"], args, spec.tp_plan)
                apply_fsdp(model, dp_mesh, torch.float32, torch.float32)
                model.to_empty(device="cpu")
                model.init_weights(Initializer(SEED, "cpu"))
                dp_rank, per = mesh["dp"].get_local_rank(), BATCH // (dp_replicate * dp_shard)
                share = probe_tokens()[dp_rank * per:(dp_rank + 1) * per]
                probe = OutlierProbe(model, OBSERVE, mesh)
                key = (dp_replicate, dp_shard, tp, flavor)
                results[key] = probe.run(share)
                results[key + ("grads",)] = sum(p.grad is not None for p in model.parameters())
                results[key + ("again",)] = probe.run(share)[0]  # FSDP state intact after it
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()


@pytest.mark.dist
@pytest.mark.parametrize("world,layouts", [(2, [(1, 2, 1, ("llama",))]),
                                           pytest.param(4, [(1, 4, 1, FLAVORS), (2, 2, 1, ("llama",)),
                                                            (1, 2, 2, FLAVORS + (OP_PRE_RMS,))],
                                                        marks=pytest.mark.extended)],
                         ids=["fsdp2", "fsdp4-hsdp2x2-fsdp2xtp2"])
def test_distributed_gradient_metrics_equal_one_rank(world, layouts, tmp_path):
    refs = {flavor: reference(flavor) for flavor in FLAVORS + (OP_PRE_RMS,)
            if any(flavor in layout[3] for layout in layouts)}
    for name in ("grad_sink_share", "grad_sink_rgs", "massive_t0_early"):  # Chen, Lin, Yao 2026's measures too
        assert f"outliers/layer_0/{name}" in refs["llama"][0] and f"outliers/{name}" in refs["llama"][0], name
    mp.start_processes(_worker, args=(world, free_port(), layouts, str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for dp_replicate, dp_shard, tp, flavors in layouts:
        for flavor in flavors:
            key = (dp_replicate, dp_shard, tp, flavor)
            assert_same(per_rank[0][key], refs[flavor], f"{key} rank 0")
            for r in range(world):
                assert per_rank[r][key][0] == per_rank[0][key][0], (key, r)
                assert per_rank[r][key + ("grads",)] == 0, (key, r)
                assert per_rank[r][key + ("again",)] == per_rank[0][key][0], (key, r)
