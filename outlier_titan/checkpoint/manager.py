"""Distributed checkpoints with torch.distributed.checkpoint (DCP).

Layout: ``<run>/checkpoints/step-<N>/`` holding DCP shards, ``.metadata``, ``config.toml`` (the reference for
the resume compatibility check), ``meta.json`` (tokenizer fingerprint) and ``checksums.json`` (every file's
size and hash, see ``integrity``: verified before a resume, a damaged checkpoint is moved aside). A save is
written to ``.tmp-step-<N>`` and committed by an atomic rename once every rank has finished, so a folder
named ``step-<N>`` is always complete; an interrupted save leaves only a temporary folder that is ignored
(and removed by the next save). Model and optimizer state are FQN-keyed, so DCP reshards them between
layouts; LR schedule, data position and step are layout independent. A ``step-<N>`` without ``.metadata`` is
never overwritten: resuming moves it aside to ``step-<N>.corrupt``. Every failure to read, match or write a
checkpoint is a one-line :class:`CheckpointError` (DCP's own ``CheckpointException`` is a ``BaseException``).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from outlier_titan.checkpoint import integrity
from outlier_titan.checkpoint.run_folder import on_rank0
from outlier_titan.config.job_config import LowPrecision, OptimizerCommon
from outlier_titan.errors import CheckpointError, RunFailure
from outlier_titan.optim.builder import get_optimizer  # the registry, with the built-ins registered

if TYPE_CHECKING:
    from outlier_titan.config.job_config import Optimizer as OptimizerConfig

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
        # torch restores each group's settings from the checkpoint, its fused / foreach flags too; the kernel is
        # this run's choice (optimizer.implementation: a run saved on the CPU takes the fused kernel on a GPU).
        kernels = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in self.optimizer.param_groups]
        set_optimizer_state_dict(self.model, self.optimizer, state,
                                 options=StateDictOptions(flatten_optimizer_state_dict=True))
        for group, kept in zip(self.optimizer.param_groups, kernels):
            group.update(kept)
            if not group.get("fused"):
                continue
            for p in group["params"]:  # the fused kernel keeps its step counts on the parameter's device
                st = self.optimizer.state.get(p, {})
                if torch.is_tensor(st.get("step")):
                    st["step"] = st["step"].to(dtype=torch.float32, device=p.device)


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


def _root_causes(e: BaseException) -> list[BaseException]:
    """The underlying exceptions of a DCP ``CheckpointException`` (one per failed rank), else ``[e]``."""
    if isinstance(e, CheckpointException):
        return [exc for exc, _ in e.failures.values()] or [e]
    return [e]


def _first_line(e: BaseException) -> str:
    """``Type: first sentence`` of an exception's message."""
    text = str(e).strip()
    if not text:
        return type(e).__name__
    line = text.splitlines()[0]
    return f"{type(e).__name__}: {line.split('. ')[0].rstrip('.')[:200]}"


def _is_disk_full(e: BaseException) -> bool:
    return any(getattr(c, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(c)
               for c in _root_causes(e))


def _size(n: float) -> str:
    """Bytes as GiB, or MiB below one GiB (a small model's checkpoint is not "0.01 GiB")."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def step_folders(folder: Path) -> dict[int, Path]:
    """Every ``step-<N>`` folder in ``folder`` (complete or not), by step."""
    if not folder.is_dir():
        return {}
    return {int(m.group(1)): child for child in folder.iterdir() if (m := STEP_RE.match(child.name))}


def select_checkpoint(folder: Path, load_step: int, verify: bool = True) -> tuple[int | None, dict[int, str]]:
    """The step to resume from (None: start fresh) and the unusable newer ``step-<N>`` folders, each with why
    (no DCP ``.metadata``; with ``verify``, a file that does not match the checkpoint's checksums), to move aside
    with :func:`move_aside`. Reads only. An explicitly requested step that is unusable is an error."""
    if load_step == 0:
        return None, {}
    folders = step_folders(folder)
    complete = list_checkpoints(folder)
    if load_step > 0:
        if load_step in complete:
            bad = integrity.problem(folders[load_step]) if verify else None
            if bad:
                raise CheckpointError(f"checkpoint {folders[load_step]} is damaged: {bad}; choose another "
                                      f"checkpoint.load_step (complete: {', '.join(map(str, complete))}) or load "
                                      "it anyway with --checkpoint.verify false")
            return load_step, {}
        if load_step in folders:
            raise CheckpointError(f"checkpoint {folders[load_step]} is incomplete (no .metadata); choose another "
                                  f"checkpoint.load_step (complete: {', '.join(map(str, complete)) or 'none'})")
        raise CheckpointError(f"checkpoint.load_step = {load_step} not found in {folder}; "
                              f"available: {', '.join(map(str, complete)) or 'none'}")
    unusable = {s: "unreadable (no .metadata)" for s in folders if s not in complete}
    step = None
    for s in reversed(complete):
        bad = integrity.problem(folders[s]) if verify else None
        if not bad:
            step = s
            break
        unusable[s] = f"damaged ({bad})"
    return step, {s: why for s, why in sorted(unusable.items()) if step is None or s > step}


def move_aside(folder: Path, bad: dict[int, str], resume_step: int | None) -> list[str]:
    """Renames each unusable ``step-<N>`` to ``step-<N>.corrupt`` (never deleted or overwritten); returns the
    loud console lines, one per checkpoint, with why it was refused."""
    notes = []
    for s, why in sorted(bad.items()):
        src = folder / f"step-{s}"
        aside, k = src.with_name(src.name + ".corrupt"), 1
        while aside.exists():
            aside, k = src.with_name(f"{src.name}.corrupt{k}"), k + 1
        os.replace(src, aside)
        notes.append(f"WARNING: checkpoint {src} is {why}; moved it aside to {aside.name} and "
                     f"resuming from {f'step-{resume_step}' if resume_step is not None else 'scratch'}")
    return notes


class Checkpointer:
    """Saves and restores the training state: model, optimizer, LR schedule, data position, step, RNG."""

    def __init__(self, folder: Path, keep_latest_k: int, states: dict[str, Any], config_toml: str,
                 meta: dict[str, Any] | None = None):
        self.folder = Path(folder)
        self.keep_latest_k = keep_latest_k
        self.states = states
        self.config_toml = config_toml
        self.meta = meta or {}
        self.rank = dist.get_rank()
        self._expected_bytes: int | None = None

    def expected_bytes(self) -> int:
        """Bytes of a checkpoint: the state's tensor bytes over all ranks (a collective). Before the optimizer's
        first step, when it holds no state yet, that state is estimated as two tensors per parameter (Adam's) and
        the estimate is not kept."""
        if self._expected_bytes is None:
            fresh = not self.states["optimizer"].optimizer.state
            local = 0
            for key in ("model",) if fresh else ("model", "optimizer"):
                for t in self.states[key].state_dict().values():
                    if isinstance(t, torch.Tensor):
                        t = t.to_local() if isinstance(t, DTensor) else t
                        local += t.numel() * t.element_size()
            total = torch.tensor([float(local * (3 if fresh else 1))])
            dist.all_reduce(total, group=_cpu_group())
            if fresh:
                return int(total.item())
            self._expected_bytes = int(total.item())
        return self._expected_bytes

    def check_space(self, step: int) -> None:
        """CheckpointError when the folder's device lacks the room to save ``step`` (before the first step, so no
        step is trained to be refused at its save). Every rank calls it; rank 0 looks."""
        needed = self.expected_bytes()
        on_rank0(lambda: self._check_space(step, self.folder / f"step-{step}", needed), _cpu_group())

    def _check_space(self, step: int, final: Path, needed: int) -> None:
        steps = list_checkpoints(self.folder)
        if steps:
            needed = max(needed, folder_bytes(self.folder / f"step-{steps[-1]}"))
        folder = self.folder
        while not folder.exists():  # before the first save: the device it will be created on
            folder = folder.parent
        free = shutil.disk_usage(folder).free
        if free < needed * 1.05:
            raise CheckpointError(f"not enough space on device to save step {step} to {final} (needs ~{_size(needed)}, "
                                  f"{_size(free)} free); previous checkpoints are kept; free space, lower "
                                  "checkpoint.keep_latest_k or set job.dump_folder elsewhere")

    def save(self, step: int) -> Path:
        final = self.folder / f"step-{step}"
        tmp = self.folder / f".tmp-step-{step}"
        needed = self.expected_bytes()

        def prepare() -> None:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                shutil.rmtree(tmp, ignore_errors=True)
                self._check_space(step, final, needed)
                tmp.mkdir()
            except OSError as e:
                raise CheckpointError(f"cannot write checkpoint step {step} to {final} ({e.strerror or e}); make "
                                      "the folder writable or set job.dump_folder elsewhere") from None

        on_rank0(prepare, _cpu_group())
        try:
            dcp.save(self.states, checkpoint_id=str(tmp))
            dist.barrier()
            # Each rank hashes the shards it wrote (in parallel); rank 0 writes the list with the commit.
            shards = [None] * dist.get_world_size()
            dist.all_gather_object(shards, integrity.digests(tmp, integrity.own_shards(tmp, self.rank)),
                                   group=_cpu_group())
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            raise self._save_failed(step, final, tmp, needed, e) from None

        def commit() -> None:
            try:
                (tmp / "config.toml").write_text(self.config_toml)
                (tmp / "meta.json").write_text(json.dumps({**self.meta, "step": step}, indent=1))
                files = {k: v for part in shards for k, v in part.items()}
                files.update(integrity.digests(tmp, [".metadata", "config.toml", "meta.json"]))
                integrity.write(tmp, files)
                if final.exists():
                    shutil.rmtree(final)
                os.replace(tmp, final)
            except OSError as e:
                shutil.rmtree(tmp, ignore_errors=True)
                raise self._save_failed(step, final, tmp, needed, e) from None
            self._purge(step)

        on_rank0(commit, _cpu_group())
        dist.barrier()
        return final

    @staticmethod
    def _save_failed(step: int, final: Path, tmp: Path, needed: int, e: BaseException) -> Exception:
        """The user's problem (disk full, no permission: CheckpointError, exit 2) or not (RunFailure, exit 1:
        a peer rank died mid-save, a network or file-system error)."""
        if _is_disk_full(e):
            return CheckpointError(f"no space left on device while saving step {step} to {final} (needs "
                                   f"~{_size(needed)}); removed the partial {tmp.name}, previous checkpoints are "
                                   "kept; free space or set job.dump_folder elsewhere")
        cause = _root_causes(e)[0]
        if isinstance(cause, PermissionError) or getattr(cause, "errno", None) in (errno.EACCES, errno.EROFS):
            return CheckpointError(f"saving step {step} to {final} failed ({_first_line(cause)}); removed the "
                                   f"partial {tmp.name}, previous checkpoints are kept; make the folder writable "
                                   "or set job.dump_folder elsewhere")
        return RunFailure(f"saving step {step} to {final} failed ({_first_line(cause)}; a peer rank may have "
                          f"died); the partial {tmp.name} is not used, previous checkpoints are kept: resume from "
                          "the newest")

    def _purge(self, saved: int) -> None:
        """Keeps the newest ``keep_latest_k`` checkpoints up to the step just saved; a newer folder (left by
        another try that went further) is not this run's to count or remove."""
        for stale in self.folder.glob(".tmp-step-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if self.keep_latest_k > 0:
            for step in [s for s in list_checkpoints(self.folder) if s <= saved][:-self.keep_latest_k]:
                shutil.rmtree(self.folder / f"step-{step}", ignore_errors=True)

    def load(self, step: int) -> None:
        """Restores checkpoint ``step`` in place (chosen by :func:`select_checkpoint`); CheckpointError with one
        line naming the checkpoint and what does not match when it cannot."""
        path = self.folder / f"step-{step}"
        older = [s for s in list_checkpoints(self.folder) if s < step]
        fix = (f"move it aside (mv {path} {path}.corrupt) to resume from step-{older[-1]}" if older else
               "start a new run (another job.name, or checkpoint.load_step = 0)")
        try:
            metadata = dcp.FileSystemReader(str(path)).read_metadata()
        except Exception as e:
            raise CheckpointError(f"checkpoint {path} is damaged: its .metadata is unreadable ({_first_line(e)}); "
                                  f"{fix}") from None
        self._check_shapes(path, metadata)
        try:
            dcp.load(self.states, checkpoint_id=str(path))
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            raise CheckpointError(f"cannot load checkpoint {path}: {_first_line(_root_causes(e)[0])} (a truncated "
                                  f"or damaged shard, or another model/optimizer); {fix}") from None

    def _check_shapes(self, path: Path, metadata) -> None:
        """Every model tensor must exist in the checkpoint with this run's global shape."""
        saved = metadata.state_dict_metadata
        for fqn, t in self.states["model"].state_dict().items():
            if not isinstance(t, torch.Tensor):
                continue
            key = f"model.{fqn}"
            have = tuple(saved[key].size) if key in saved and hasattr(saved[key], "size") else None
            if have != tuple(t.shape):
                what = f"holds {key} with shape {list(have)}" if have is not None else f"has no {key}"
                raise CheckpointError(f"checkpoint {path} {what}, this run builds {list(t.shape)} (another model, "
                                      "seq_len or vocabulary); use the checkpoint's settings or start a new run "
                                      "(another job.name, or checkpoint.load_step = 0)")


def _cpu_group():
    """A gloo group for small host-side collectives (the default group is NCCL on GPU)."""
    global _GLOO
    if dist.get_backend() == "gloo":
        return None
    if _GLOO is None:
        _GLOO = dist.new_group(backend="gloo")
    return _GLOO


_GLOO = None

# Settings whose change on resume breaks the run, with the reason (``model.*`` is checked as a section; the
# ``optimizer.*`` keys other than ``name`` come from the optimizer's registration, ``optimizer_breaking``).
BREAKING = {
    "optimizer.name": "the optimizer state differs",
    "training.seq_len": "positions and data windows differ",
    "training.global_batch_size": "the data position and tokens per step differ",
    "training.seed": "the data order and OrthoAdam bases differ",
    "data.source": "the data stream differs",
    "data.text_field": "the data stream differs",
    "data.val_fraction": "the train/validation split differs",
    "data.tokenizer": "token ids differ",
    **{f"lr_scheduler.{k}": "the LR schedule changes mid-run" for k in (
        "warmup_steps", "decay", "decay_ratio", "min_lr_ratio")},
}


def optimizer_breaking(saved: dict, current: dict) -> dict[str, str]:
    """``optimizer.KEY`` -> why, for the layout keys the checkpoint's optimizer registered (``optim/registry.py``);
    with another optimizer name the change of ``optimizer.name`` already breaks the run."""
    default = OptimizerCommon.name
    name = saved.get("optimizer", {}).get("name", default)
    if name != current.get("optimizer", {}).get("name", default):
        return {}
    spec = get_optimizer(name)
    return {f"optimizer.{k}": f"the {name} optimizer state layout differs" for k in spec.breaking_keys()}


NOTES = {"low_precision.recipe": " (the same weights load; from here on their GEMMs cast as the new recipe says)"}
BEFORE = {"low_precision": {f.name: f.default for f in dataclasses.fields(LowPrecision)}}  # a config saved without it
IGNORED = {"checkpoint.load_step", "checkpoint.allow_config_change", "checkpoint.verify", "job.dry_run"}
RUN_ONLY_MODEL_KEYS = {"model.attention_impl"}  # how the model runs, not what it is: a change is listed, not refused


def config_changes(saved_toml: str, current_toml: str, saved_meta: dict | None = None,
                   current_meta: dict | None = None) -> list[tuple[str, Any, Any, str | None]]:
    """(key, saved, current, why-it-breaks or None) for every setting that differs between a checkpoint's
    config and this run's. A changed ``training.steps`` breaks the run only when it changes the LR schedule's
    length (``lr_scheduler.total_steps`` unset): pin ``lr_scheduler.total_steps`` to train longer on the same
    schedule."""
    from outlier_titan.config.manager import tomllib

    saved, current = tomllib.loads(saved_toml), tomllib.loads(current_toml)
    breaking = {**BREAKING, **optimizer_breaking(saved, current)}
    out = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, BEFORE.get(section, {})), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            name = f"{section}.{key}"
            if name in IGNORED or a.get(key) == b.get(key):
                continue
            if section == "model":
                why = None if name in RUN_ONLY_MODEL_KEYS else "the model differs"
            else:
                why = breaking.get(name)
            out.append((name, a.get(key), b.get(key), why))

    def schedule_length(cfg: dict) -> Any:
        return cfg.get("lr_scheduler", {}).get("total_steps") or cfg.get("training", {}).get("steps")

    if schedule_length(saved) != schedule_length(current):
        out = [(k, a, b, "the LR schedule length changes mid-run (pin lr_scheduler.total_steps = "
                         f"{schedule_length(saved)} to keep it)" if k in ("training.steps", "lr_scheduler.total_steps")
                else why) for k, a, b, why in out]
    # The tokenizer's fingerprint (a hash of its BPE ranks) decides: a moved file is fine, other ranks are not.
    fa, fb = (saved_meta or {}).get("tokenizer"), (current_meta or {}).get("tokenizer")
    if fa and fb:
        out = [(k, a, b, None if k == "data.tokenizer" else why) for k, a, b, why in out]
        if fa != fb:
            out.append(("tokenizer vocabulary", fa[:24], fb[:24], "other BPE ranks: token ids differ"))
    return out


def check_resume(path: Path, current_toml: str, current_meta: dict, allow_change: bool) -> list[str]:
    """Compares the checkpoint's saved config (the reference) with this run's. Returns one console line per
    changed setting; raises CheckpointError naming the breaking ones unless ``allow_change``."""
    saved_file = path / "config.toml"
    if not saved_file.is_file():
        saved_file = path.parent.parent / "config.toml"
    if not saved_file.is_file():
        return []
    meta_file = path / "meta.json"
    try:
        saved_meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    except ValueError:
        saved_meta = {}
    changes = config_changes(saved_file.read_text(), current_toml, saved_meta, current_meta)
    breaking = [(k, a, b, why) for k, a, b, why in changes if why]
    if breaking and not allow_change:
        listed = "; ".join(f"{k} {a!r} -> {b!r} ({why})" for k, a, b, why in breaking)
        raise CheckpointError(f"checkpoint {path} was trained with other settings that break the run: {listed}; "
                              "restore them, pass --checkpoint.allow_config_change true, or start a new run "
                              "(another job.name, or checkpoint.load_step = 0)")
    return [f"resume changes {k}: {a!r} -> {b!r}" + (f" ({why}; allowed by checkpoint.allow_config_change)"
                                                       if why else NOTES.get(k, "")) for k, a, b, why in changes]


def run_config_file(path: Path) -> Path | None:
    """The ``config.toml`` of a run folder, or of the run a ``step-<N>`` checkpoint belongs to; None if there is
    none."""
    return next((f for f in (path / "config.toml", path.parent.parent / "config.toml") if f.is_file()), None)


def load_model_for_eval(checkpoint: str | Path, device: str | torch.device = "cpu"):
    """Builds the checkpoint's model at world size 1 and loads its weights (saved at any world size / layout).

    ``checkpoint`` is a ``step-<N>`` folder, a run folder or its ``checkpoints`` folder (then the newest step).
    Returns ``(model, cfg, tokenizer)``; the config is the one saved with the checkpoint.
    """
    from outlier_titan.config.manager import parse_args
    from outlier_titan.data import build_tokenizer
    from outlier_titan.models.registry import build_meta_model

    path = resolve_checkpoint_dir(checkpoint)
    config_file = run_config_file(path)
    if config_file is None:
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
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        raise CheckpointError(f"cannot load the model from {path}: {_first_line(_root_causes(e)[0])}") from None
    model.load_state_dict(state["model"])
    model.eval()
    return model, cfg, tokenizer
