"""``muon``: the Muon step against AdamW's per ``muon_layout``, on 1 and 2 gloo ranks."""

from __future__ import annotations

import datetime
import platform
import statistics
import time

import torch

from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.tools.benchmarks.shapes import gpt2_124m_shapes, seeded_params


def _muon_worker(rank: int, world: int, port: int, args, out: dict) -> None:
    """One rank of the ``muon`` benchmark: FSDP-style Shard placements on a 1-D mesh (world > 1) or plain
    tensors (world 1); AdamW and Muon (per layout) step the same parameters, interleaved; medians in ``out``."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from outlier_titan.models.roles import DEFAULT_ROLES
    from outlier_titan.optim.muon import MuonAdamW
    from outlier_titan.models.roles import shard_dim_for

    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        shapes = gpt2_124m_shapes(layers=args.layers)
        full = seeded_params(shapes)
        gen = torch.Generator().manual_seed(0)
        grads = {n: torch.randn(p.shape, generator=gen) * 1e-3 for n, p in full.items()}
        params = {}
        for n, p in full.items():
            if world > 1:
                pl = (Shard(shard_dim_for(n, p, DEFAULT_ROLES)),)  # the built-in specs' names
                params[n] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, pl, src_data_rank=None))
                params[n].grad = distribute_tensor(grads[n], mesh, pl, src_data_rank=None)
            else:
                params[n] = p
                p.grad = grads[n]
        names = list(params)
        hidden = [n for n in names if params[n].ndim == 2 and n.startswith("layers.")]
        rest = [n for n in names if n not in hidden]
        muon_group = lambda: {"params": [params[n] for n in hidden], "names": hidden, "algorithm": "muon",  # noqa
                              "lr": 1e-3, "weight_decay": 0.1, "momentum": 0.95, "nesterov": True,
                              "ns_coefficients": (3.4445, -4.775, 2.0315), "ns_steps": 5, "eps": 1e-7,
                              "adjust_lr_fn": "original"}
        adamw_group = lambda: {"params": [params[n] for n in rest], "names": rest, "algorithm": "adamw",  # noqa
                               "lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.0}
        opts = {"adamw": torch.optim.AdamW([params[n] for n in names], lr=1e-3, betas=(0.9, 0.95), foreach=True)}
        for layout in args.layouts.split(","):
            opts[layout] = MuonAdamW([muon_group(), adamw_group()], layout=layout, full_every=args.full_every,
                                     ns_dtype=args.ns_dtype, options=EngineOptions(tile_size=args.tile_size))
        keys = list(opts)
        for k in keys:  # warm-up, untimed
            opts[k].step()
        # block_periodic: time whole periods (one full step + k-1 block steps) and report the mean step
        steps = {k: (args.full_every if k == "block_periodic" else 1) for k in keys}
        times = {k: [] for k in keys}
        for rep in range(args.reps):
            for k in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                if k == "block_periodic":  # start each timed period on its full step
                    st = opts[k].state[params[hidden[0]]]["step"]
                    st.fill_(st.item() + (-(st.item()) % args.full_every))
                    for n in hidden[1:]:
                        opts[k].state[params[n]]["step"].copy_(st)
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(steps[k]):
                    opts[k].step()
                dist.barrier()
                times[k].append((time.perf_counter() - t0) / steps[k])
        if rank == 0:
            out[world] = {k: statistics.median(v) for k, v in times.items()}
            if "full" in opts:
                full_steps = 1 + args.reps
                out[f"bytes{world}"] = opts["full"].bytes_sent / full_steps
            out[f"params{world}"] = sum(p.numel() for p in full.values())
    finally:
        dist.destroy_process_group()


def run_muon(args, command: str) -> None:
    import torch.multiprocessing as mp

    from outlier_titan.parallel.dims import free_port

    manager = mp.Manager()
    out = manager.dict()
    for world in [int(w) for w in args.ranks.split(",")]:
        mp.spawn(_muon_worker, args=(world, free_port(), args, out), nprocs=world, join=True)
    layouts = args.layouts.split(",")
    n_params = out[f"params{int(args.ranks.split(',')[0])}"]
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    lines = [f"Machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s) per rank, "
             f"torch {torch.__version__}, {date}. Command: `{command}`.", "",
             f"GPT-2 small shapes, {args.layers} layer(s) ({n_params / 1e6:.2f}M "
             f"params); Muon on the hidden matrices, AdamW on the rest; Newton-Schulz in {args.ns_dtype}; block tile "
             f"{args.tile_size}; block_periodic k = {args.full_every} (mean step over a period).", "",
             "| ranks | AdamW step | " + " | ".join(f"Muon {lay}" for lay in layouts) + " | "
             + " | ".join(f"{lay} / AdamW" for lay in layouts) + " | full: all-to-all bytes sent per rank per step |",
             "|---" * (3 + 2 * len(layouts)) + "|"]
    for world in [int(w) for w in args.ranks.split(",")]:
        r = out[world]
        sent = out.get(f"bytes{world}", 0.0)
        lines.append(f"| {world} | {r['adamw'] * 1e3:.1f} ms | "
                     + " | ".join(f"{r[lay] * 1e3:.1f} ms" for lay in layouts) + " | "
                     + " | ".join(f"{r[lay] / r['adamw']:.2f}x" for lay in layouts)
                     + f" | {sent / 2**20:.1f} MiB |")
    print("\n".join(lines))

