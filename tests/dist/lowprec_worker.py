"""Multi-process worker for tests/test_lowprec_dist.py: a converted MLP (w1 column-parallel, w2 row-parallel, as
the blocks' feed-forward under TP) on 2 gloo ranks against the same MLP unsharded, for every recipe, in float64.

Launched once per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set:
    python tests/dist/lowprec_worker.py OUT_FILE
Rank 0 saves {recipe: {what: (unsharded, tensor-parallel)}} for the output, the input's gradient and both weights'
gradients.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: E402

from outlier_titan.lowprec.recipes import RECIPES  # noqa: E402
from outlier_titan.lowprec.training import convert_model, set_rng_position  # noqa: E402
from tests.launch import end_worker  # noqa: E402

D, F, TOKENS = 64, 128, 64


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, F, bias=True), nn.Linear(F, D, bias=False)

    def forward(self, x):
        return self.w2(torch.relu(self.w1(x)))


def heavy(shape, seed):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    t[..., ::5] *= 30.0  # outlier channels: scales differ between rows, blocks and shards
    return t


def run(model, x, g):
    x = x.clone().requires_grad_()
    set_rng_position(seed=1, step=2, micro=3)
    y = model(x)
    y.backward(g)
    out = [y.detach(), x.grad, model.w1.weight.grad, model.w1.bias.grad, model.w2.weight.grad]
    return [(t.full_tensor() if isinstance(t, DTensor) else t).detach().clone() for t in out]


def main(out: str) -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    results = {}
    for name in RECIPES:
        torch.manual_seed(0)
        base = MLP().double()
        with torch.no_grad():
            base.w1.weight.mul_(heavy((F, D), 1).sign().abs() + heavy((F, D), 2).abs().clamp(max=3))
        cfg = SimpleNamespace(recipe=name, emulate="always", skip_first_blocks=0, skip_last_blocks=0,
                              skip_output=True, skip_attention=False, min_dim=0)
        assert convert_model(base, cfg, "cpu") == ["w1", "w2"]
        tp = copy.deepcopy(base)
        parallelize_module(tp, mesh, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
        x, g = heavy((2, TOKENS // 2, D), 3), heavy((2, TOKENS // 2, D), 4) * 1e-2
        results[name] = dict(zip(("y", "x.grad", "w1.grad", "b1.grad", "w2.grad"),
                                 zip(run(base, x, g), run(tp, x, g))))
    if dist.get_rank() == 0:
        torch.save(results, out)
    end_worker()


if __name__ == "__main__":
    main(sys.argv[1])
