"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout: ``<run>/checkpoints/step-<N>/`` holding DCP shards, ``.metadata`` and ``config.toml``. A save is
written to ``.tmp-step-<N>`` and committed by an atomic rename once every rank has finished, so a folder
named ``step-<N>`` is always complete; an interrupted save leaves only a temporary folder that is ignored
(and removed by the next save). Model and optimizer state are FQN-keyed, so DCP reshards them between
layouts; LR schedule, data position and step are layout independent.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from outlier_titan.errors import CheckpointError

STEP_RE = re.compile(r"^step-(\d+)$")


class ModelState(Stateful):
    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(strict=True))


class OptimizerState(Stateful):
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        return get_optimizer_state_dict(self.model, self.optimizer,
                                        options=StateDictOptions(flatten_optimizer_state_dict=True))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_optimizer_state_dict(self.model, self.optimizer, state,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))


def list_checkpoints(folder: Path) -> list[int]:
    """Steps of the complete checkpoints in ``folder`` (those with DCP metadata), ascending."""
    if not folder.is_dir():
        return []
    steps = []
    for child in folder.iterdir():
        m = STEP_RE.match(child.name)
        if m and (child / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def resolve_checkpoint_dir(path: str | Path) -> Path:
    """Accepts ``.../step-N`` or a run folder or a ``checkpoints`` folder (then its newest step)."""
    p = Path(path)
    if (p / ".metadata").is_file():
        return p
    for folder in (p / "checkpoints", p):
        steps = list_checkpoints(folder)
        if steps:
            return folder / f"step-{steps[-1]}"
    raise CheckpointError(f"no complete checkpoint at {path} (expected a step-<N> folder with DCP .metadata)")


class Checkpointer:
    """Saves and restores the training state: model, optimizer, LR schedule, data position, step, RNG."""

    def __init__(self, folder: Path, keep_latest_k: int, states: dict[str, Any], config_toml: str):
        self.folder = Path(folder)
        self.keep_latest_k = keep_latest_k
        self.states = states
        self.config_toml = config_toml
        self.rank = dist.get_rank()

    def save(self, step: int) -> Path:
        final = self.folder / f"step-{step}"
        tmp = self.folder / f".tmp-step-{step}"
        if self.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        dist.barrier()
        dcp.save(self.states, checkpoint_id=str(tmp))
        dist.barrier()
        if self.rank == 0:
            (tmp / "config.toml").write_text(self.config_toml)
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            self._purge()
        dist.barrier()
        return final

    def _purge(self) -> None:
        for stale in self.folder.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in list_checkpoints(self.folder)[:-self.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)

    def load(self, load_step: int) -> int | None:
        """Restores the requested (or newest) checkpoint in place; returns its step, or None if none."""
        if load_step == 0:
            return None
        steps = list_checkpoints(self.folder)
        if not steps:
            if load_step > 0:
                raise CheckpointError(f"checkpoint.load_step = {load_step} but {self.folder} has no checkpoints")
            return None
        step = steps[-1] if load_step < 0 else load_step
        if step not in steps:
            raise CheckpointError(f"checkpoint.load_step = {load_step} not found in {self.folder}; "
                                  f"available: {', '.join(map(str, steps))}")
        path = self.folder / f"step-{step}"
        check_compatible(path, self.config_toml)
        try:
            dcp.load(self.states, checkpoint_id=str(path))
        except CheckpointError:
            raise
        except Exception as e:  # DCP raises assorted errors for missing keys / shape mismatches
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise CheckpointError(f"cannot load {path}: {first[:300]} (does the checkpoint match this model "
                                  f"and optimizer?)") from None
        return step


def check_compatible(path: Path, current_toml: str) -> None:
    """The model spec/flavor/options and optimizer name of the checkpoint must match the current run."""
    from outlier_titan.config.manager import tomllib

    saved_file = path / "config.toml"
    if not saved_file.is_file():
        return
    saved, current = tomllib.loads(saved_file.read_text()), tomllib.loads(current_toml)
    for section, keys in (("model", None), ("optimizer", ("name",))):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in (keys or sorted(set(a) | set(b))):
            if a.get(key) != b.get(key):
                raise CheckpointError(
                    f"checkpoint {path} was trained with {section}.{key} = {a.get(key)!r}, this run has "
                    f"{b.get(key)!r}; use the same setting or start a new run (job.name) / checkpoint.load_step = 0")


def load_model_for_eval(checkpoint: str | Path, device: str | torch.device = "cpu"):
    """Builds the checkpoint's model at world size 1 and loads its weights (saved at any world size / layout).

    ``checkpoint`` is a ``step-<N>`` folder, a run folder or its ``checkpoints`` folder (then the newest step).
    Returns ``(model, cfg, tokenizer)``; the config is the one saved with the checkpoint.
    """
    from outlier_titan.config.manager import parse_args
    from outlier_titan.data import build_tokenizer
    from outlier_titan.models.registry import build_meta_model

    path = resolve_checkpoint_dir(checkpoint)
    config_file = path / "config.toml"
    if not config_file.is_file():
        config_file = path.parent.parent / "config.toml"
    if not config_file.is_file():
        raise CheckpointError(f"no config.toml in {path} or its run folder; cannot tell which model it holds")
    cfg = parse_args(["--config", str(config_file)])
    tokenizer = build_tokenizer(cfg.data.tokenizer)
    spec, args, model = build_meta_model(cfg.model, tokenizer.vocab_size, cfg.training.seq_len)
    from outlier_titan.models.init import Initializer

    model.to_empty(device=device)
    model.init_weights(Initializer(cfg.training.seed, device))  # fills non-persistent buffers (RoPE tables)
    state = {"model": model.state_dict()}
    try:
        with warnings.catch_warnings():  # loading in one process is the intent here, not a fallback
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            dcp.load(state, checkpoint_id=str(path), no_dist=not dist.is_initialized())
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"cannot load the model from {path}: {first[:300]}") from None
    model.load_state_dict(state["model"])
    model.eval()
    return model, cfg, tokenizer
