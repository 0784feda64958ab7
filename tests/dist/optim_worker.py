"""Multi-process worker for tests/test_optim_dist.py: the tile optimizers under real FSDP2 / FSDP2 x TP2 on gloo.

Launched once per rank with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set:
    python tests/dist/optim_worker.py {fsdp2xtp2|fsdp2} OUT_DIR
A tiny module with the model's parameter names is sharded with ``fully_shard`` (placement rule of
``parallel/fsdp.py``: wo/w2 on dim 1, the rest on dim 0) and, for fsdp2xtp2, first ``parallelize_module``
(colwise wq/wk/wv/w1, rowwise wo/w2). Identical synthetic full gradients are injected each step (no forward:
the optimizer alone is under test). Rank 0 writes the gathered full parameters and optimizer state.

fsdp2xtp2 (4 ranks): STEPS steps, a DCP checkpoint after RESUME_AT; also the strict-alignment failure.
fsdp2 (2 ranks): STEPS steps uninterrupted, and a resume from the 4-rank checkpoint.
OrthoAdam runs its factored Hadamard path (permutation, signs, Kronecker factors in the shard's layout).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import outlier_titan.components  # noqa: E402,F401  (a worker process: no conftest)
from outlier_titan.optim.orthoadam import OrthoAdam  # noqa: E402
from outlier_titan.optim.soap import SOAP  # noqa: E402
from outlier_titan.optim.tiles.options import EngineOptions  # noqa: E402
from tests.launch import end_worker  # noqa: E402

D, F, V, LAYERS = 16, 32, 32, 2
STEPS, RESUME_AT = 6, 3
DTYPE = torch.float64
KINDS = ("orthoadam", "soap")


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(D, D, bias=False) for _ in range(4))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(D, F, bias=False), nn.Linear(F, D, bias=False)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.attention, self.feed_forward = Attention(), FeedForward()


class Tiny(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.tok_embeddings = nn.Embedding(V, D)
        self.layers = nn.ModuleDict({str(i): Block() for i in range(LAYERS)})
        self.norm = nn.RMSNorm(D)
        self.output = nn.Linear(D, V, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn_like(p))
        self.to(DTYPE)


def build_optimizer(kind: str, model: nn.Module, seed: int = 7):
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named], "names": [n for n, _ in named], "weight_decay": 0.1}]
    opts = EngineOptions(tile_size=4, shard_tile_size=4,
                         tile_size_overrides=("layers.*.attention.wq.weight:1=16",))
    if kind == "orthoadam":
        return OrthoAdam(groups, lr=1e-2, betas=(0.9, 0.95), seed=seed, basis="hadamard", options=opts,
                         factored_min_tile=2)  # the factored Hadamard path at every layout
    return SOAP(groups, lr=1e-2, precondition_frequency=2, options=opts)


def full_grad(step: int, name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + sum(map(ord, name)) * 7 + len(name))
    return torch.randn(*shape, generator=g, dtype=DTYPE)


def run_steps(model, opt, first: int, last: int) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    for step in range(first, last + 1):
        for name, p in model.named_parameters():
            g = full_grad(step, name, p.shape)
            p.grad = distribute_tensor(g, p.device_mesh, p.placements, src_data_rank=None) \
                if isinstance(p, DTensor) else g
        opt.step()
        opt.zero_grad()


def gather(model, opt) -> dict:
    """Full parameters and optimizer state (collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    full = lambda t: t.full_tensor() if isinstance(t, DTensor) else t.clone()  # noqa: E731
    out = {"params": {n: full(p.detach()) for n, p in model.named_parameters()}, "state": {}}
    for n, p in model.named_parameters():
        out["state"][n] = {k: full(v) for k, v in opt.state[p].items()}
    out["skipped"] = opt.skipped_steps
    return out


def _placement_fn(model):
    from torch.distributed.tensor import Shard

    dims = {p: (1 if n.split(".")[-2] in ("wo", "w2") and p.ndim == 2 else 0) for n, p in model.named_parameters()}
    return lambda p: Shard(dims.get(p, 0))


def shard(model: nn.Module, layout: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = int(os.environ["WORLD_SIZE"])
    if layout == "fsdp2xtp2":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        plan = {f"attention.{w}": ColwiseParallel() for w in ("wq", "wk", "wv")}
        plan.update({"attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
                     "feed_forward.w2": RowwiseParallel()})
        for block in model.layers.values():
            parallelize_module(block, mesh["tp"], plan)
        dp = mesh["dp_shard"]
    else:
        dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    placement = _placement_fn(model)
    for block in model.layers.values():
        fully_shard(block, mesh=dp, shard_placement_fn=placement)
    fully_shard(model, mesh=dp, shard_placement_fn=placement)
    return model


def dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    opts = StateDictOptions(flatten_optimizer_state_dict=True)
    return {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt, options=opts)}


def dcp_load(model, opt, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    state = dcp_state(model, opt)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"], options=StateDictOptions(flatten_optimizer_state_dict=True))


def main(layout: str, out: Path) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for kind in KINDS:
        if layout == "fsdp2xtp2":
            model = shard(Tiny(), layout)
            opt = build_optimizer(kind, model)
            run_steps(model, opt, 1, RESUME_AT)
            dcp.save(dcp_state(model, opt), checkpoint_id=str(out / f"ckpt_{kind}"))
            run_steps(model, opt, RESUME_AT + 1, STEPS)
            result = gather(model, opt)
            result["placements"] = {n: str(p.placements) for n, p in model.named_parameters()}
            if rank == 0:
                torch.save(result, out / f"{layout}_{kind}.pt")
        else:
            model = shard(Tiny(), layout)
            opt = build_optimizer(kind, model)
            run_steps(model, opt, 1, STEPS)
            result = gather(model, opt)
            if rank == 0:
                torch.save(result, out / f"{layout}_{kind}.pt")
            resumed = shard(Tiny(seed=123), layout)
            ropt = build_optimizer(kind, resumed)
            dcp_load(resumed, ropt, str(out / f"ckpt_{kind}"))
            run_steps(resumed, ropt, RESUME_AT + 1, STEPS)
            result = gather(resumed, ropt)
            if rank == 0:
                torch.save(result, out / f"{layout}_resumed_{kind}.pt")
    if layout == "fsdp2xtp2":
        from outlier_titan.optim.tiles.plan import TileAlignmentError

        model = shard(Tiny(), layout)
        named = list(model.named_parameters())
        groups = [{"params": [p for _, p in named], "names": [n for n, _ in named], "weight_decay": 0.0}]
        try:
            OrthoAdam(groups, basis="haar", options=EngineOptions(tile_size=8, shard_tile_size=8))
            msg = "no error"
        except TileAlignmentError as err:
            msg = str(err)
        if rank == 0:
            (out / "strict_message.txt").write_text(msg)
    end_worker()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
