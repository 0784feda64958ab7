"""Multi-process worker for tests/test_smooth_swiglu.py: the Smooth-SwiGLU MLP (``layers.MLP``, smooth) under the
blocks' TP plan (w1, w3 column-parallel, w2 row-parallel onto sequence shards, the scale's ``MaxOverShards``) on 2
gloo ranks against the same MLP unsharded, in float64, in full precision and with w1 / w2 / w3 emulating
``fp8_tensorwise``; and, as the control, the same TP layout in full precision with each rank's own max (the
authors' code's choice), which is not the same function.

Launched once per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set:
    python tests/dist/smooth_swiglu_worker.py OUT_FILE
Rank 0 saves {case: {what: (unsharded, tensor-parallel)}} for the output (rank 0's sequence chunk), the input's
gradient and the three weights' gradients.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402
from torch.distributed.tensor.parallel.style import ParallelStyle  # noqa: E402

from outlier_titan.lowprec.training import convert_model, set_rng_position  # noqa: E402
from outlier_titan.models.layers import MLP  # noqa: E402
from outlier_titan.parallel.tensor_parallel import MaxOverShards  # noqa: E402
from tests.launch import end_worker  # noqa: E402

D, F, B, T = 64, 128, 2, 32


class OwnShardMax(ParallelStyle):
    """The control: each rank keeps its own hidden units' max (no all-reduce)."""

    def _apply(self, module, device_mesh):
        module.sequence_shard = (device_mesh.get_local_rank(), device_mesh.size())
        return module


def run(model, x, g, rank, size):
    """Output (the tokens of rank 0's sequence chunk), input gradient and weight gradients of one forward and
    backward; the TP model's output holds this rank's sequence chunk."""
    x = x.clone().requires_grad_()
    set_rng_position(seed=1, step=2, micro=3)
    y = model(x)
    sharded = y.shape[1] != T
    y.backward(g.chunk(size, dim=1)[rank] if sharded else g)
    y0 = y if sharded else y.chunk(size, dim=1)[0]
    grads = [x.grad, model.w1.weight.grad, model.w3.weight.grad, model.w2.weight.grad]
    return [y0.detach().clone()] + [(t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
                                    for t in grads]


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,), mesh_dim_names=("tp",))
    results = {}
    cases = (("full", "bf16", MaxOverShards), ("fp8_tensorwise", "fp8_tensorwise", MaxOverShards),
             ("own_shard_max", "bf16", OwnShardMax))
    for case, recipe, scale_style in cases:
        torch.manual_seed(0)
        base = MLP(D, F, "swiglu", bias=False, smooth=True).double()
        cfg = SimpleNamespace(recipe=recipe, emulate="always", skip_first_blocks=0, skip_last_blocks=0,
                              skip_output=True, skip_attention=False, min_dim=0)
        convert_model(base, cfg, "cpu")
        tp = copy.deepcopy(base)
        parallelize_module(tp, mesh, {"w1": ColwiseParallel(), "w3": ColwiseParallel(),
                                      "w2": RowwiseParallel(output_layouts=Shard(1)), "smooth_scale": scale_style()})
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(B, T, D, generator=gen, dtype=torch.float64)
        x[:, 5] *= 40.0  # a token whose SwiGLU product is ~1e3x the others': it sets the FP8 tensor scale
        g = torch.randn(B, T, D, generator=gen, dtype=torch.float64) * 1e-2
        results[case] = dict(zip(("y", "x.grad", "w1.grad", "w3.grad", "w2.grad"),
                                 zip(run(base, x, g, 0, size), run(tp, x, g, rank, size))))
    if rank == 0:
        torch.save(results, out)
    end_worker()


if __name__ == "__main__":
    main(sys.argv[1])
