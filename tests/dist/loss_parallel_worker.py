"""2 gloo ranks, TP 2: the pre_ln (untied head) logits stay vocab-sharded and the loss-parallel cross entropy
equals the cross entropy of the gathered logits. Prints OK on success."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import outlier_titan.components  # noqa: E402,F401  (a worker process: no conftest)
from outlier_titan.config.job_config import Model  # noqa: E402
from outlier_titan.models.init import Initializer  # noqa: E402
from outlier_titan.models.registry import build_meta_model  # noqa: E402
from outlier_titan.parallel.dims import ParallelDims  # noqa: E402
from outlier_titan.parallel.fsdp import apply_fsdp  # noqa: E402
from outlier_titan.parallel.tensor_parallel import apply_tp_plan  # noqa: E402
from outlier_titan.training.step import cross_entropy_sum, loss_context, replicated_value  # noqa: E402
from tests.launch import end_worker  # noqa: E402

dist.init_process_group("gloo")
dims = ParallelDims(1, 1, 2, 2)
mesh = dims.build_mesh("cpu")
spec, args, model = build_meta_model(Model(name="pre_ln", flavor="debug_llama"), 4096, 32)
apply_tp_plan(model, mesh["tp"], args, spec.tp_plan)
apply_fsdp(model, mesh["dp_shard"], torch.float32, torch.float32)
model.to_empty(device="cpu")
model.init_weights(Initializer(0, "cpu"))
tokens = torch.randint(0, 4096, (2, 32), generator=torch.Generator().manual_seed(0))
logits = model(tokens)
assert isinstance(logits, DTensor) and logits.placements == (Shard(2),), logits
assert logits.to_local().shape == (2, 32, 2048)
with loss_context(logits):
    loss = replicated_value(cross_entropy_sum(logits, tokens))
reference = cross_entropy_sum(logits.full_tensor(), tokens)
torch.testing.assert_close(loss, reference, rtol=1e-6, atol=0)
dist.barrier()
if dist.get_rank() == 0:
    print("OK", float(loss))
end_worker()
