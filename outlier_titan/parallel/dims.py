"""Parallel degrees -> a named DeviceMesh ("dp_replicate", "dp_shard", "tp")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from outlier_titan.config.job_config import Parallelism
from outlier_titan.errors import ConfigError


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    world_size: int

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> "ParallelDims":
        """Resolves dp_shard = -1 and checks that the degrees multiply to the world size."""
        dp_shard = cfg.dp_shard
        other = cfg.dp_replicate * cfg.tp
        if dp_shard == -1:
            if world_size % other:
                raise ConfigError(f"parallelism: dp_replicate x tp = {other} does not divide the world size "
                                  f"{world_size}; choose degrees whose product divides it")
            dp_shard = world_size // other
        if cfg.dp_replicate * dp_shard * cfg.tp != world_size:
            raise ConfigError(f"parallelism: dp_replicate ({cfg.dp_replicate}) x dp_shard ({dp_shard}) x tp "
                              f"({cfg.tp}) = {cfg.dp_replicate * dp_shard * cfg.tp} but the world size is "
                              f"{world_size}; set parallelism.dp_shard = -1 to fill")
        return cls(cfg.dp_replicate, dp_shard, cfg.tp, world_size)

    @property
    def dp(self) -> int:
        """Data-parallel degree: the number of distinct batch shards."""
        return self.dp_replicate * self.dp_shard

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    def build_mesh(self, device_type: str) -> DeviceMesh:
        """The 3-D mesh; also keeps the flattened data-parallel mesh as ``self.dp_mesh``."""
        mesh = init_device_mesh(device_type, (self.dp_replicate, self.dp_shard, self.tp),
                                mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        self.dp_mesh = mesh["dp_replicate", "dp_shard"]._flatten("dp")
        return mesh


def device_type_for(setting: str) -> str:
    if setting == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda" and not torch.cuda.is_available():
        raise ConfigError("training.device = 'cuda' but no CUDA device is visible; use auto or cpu")
    return setting


def fake_world() -> bool:
    """Whether this process is rank 0 of a fake process group (``parallelism.fake_world_size``): collectives do
    nothing, so host-side exchanges between ranks (object gathers, a gloo group) must not be attempted."""
    return dist.is_initialized() and dist.get_backend() == "fake"


def init_fake_world(world_size: int) -> None:
    """Rank 0 of ``world_size`` ranks on torch's fake process group (every collective returns at once)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)


def init_distributed(device_type: str, timeout_s: int = 600, fake_world_size: int = 0) -> tuple[int, int]:
    """Initialises the default process group (NCCL on GPU, gloo on CPU); returns (rank, world_size).

    Every process group (the default one, the DeviceMesh's, the host-side gloo group) waits ``timeout_s``
    for a peer (``parallelism.collective_timeout_s``), not c10d's default of 30 minutes (10 for NCCL).
    A plain ``python train.py`` (no torchrun) runs as world size 1 through the same code path.
    ``fake_world_size`` > 0: rank 0 of that many ranks on the fake process group (:func:`init_fake_world`).
    """
    import datetime
    import os

    from torch.distributed import distributed_c10d

    if timeout_s < 1:
        raise ConfigError(f"parallelism.collective_timeout_s = {timeout_s} must be at least 1 (seconds)")
    if fake_world_size:
        if fake_world_size < 1:
            raise ConfigError(f"parallelism.fake_world_size = {fake_world_size}: give a world size of at least 1, "
                              "or 0 for a real run")
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("parallelism.fake_world_size runs rank 0 alone in one process: start it with python "
                              "train.py, not under torchrun or srun with several ranks")
        if device_type == "cuda":
            torch.cuda.set_device(0)
        init_fake_world(fake_world_size)
        return 0, fake_world_size
    timeout = datetime.timedelta(seconds=timeout_s)
    # The groups that init_device_mesh and new_group create take c10d's module default, read at creation.
    distributed_c10d.default_pg_timeout = timeout
    distributed_c10d.default_pg_nccl_timeout = timeout
    if not dist.is_initialized():
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(free_port()))
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if device_type == "cuda" else "gloo", timeout=timeout)
    return dist.get_rank(), dist.get_world_size()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for single-process / test rendezvous)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
