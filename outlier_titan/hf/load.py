"""Models into the stack: an HF folder, our export or a DCP checkpoint as a model at world size 1
(:func:`load_pretrained`, used by evaluation and export), and the start-up import of
``checkpoint.initial_load_path`` (:func:`apply_initial_model` before the model is built, :func:`load_model_state`
into the built, possibly sharded model), which the trainer calls.

Three on-disk forms hold one model:

- a DCP checkpoint of a run (any world size / layout; ``<run>/checkpoints/step-<N>``),
- an HF folder (``config.json`` + ``*.safetensors``) for the GPT-2 and Llama families (see
  :mod:`outlier_titan.hf.adapters`),
- our export: ``model.safetensors`` with our parameter names plus the run's ``config.toml`` (every spec,
  including OP, anGPT and nGPT, which HF has no class for).

Imports use a ``tokenizer.tiktoken`` or a tiktoken-readable ``tokenizer.model`` from the folder.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pathlib import Path

import torch
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

from outlier_titan.checkpoint.manager import load_model_for_eval
from outlier_titan.config.job_config import JobConfig
from outlier_titan.config.manager import parse_args
from outlier_titan.data.tokenizer import build_tokenizer
from outlier_titan.errors import UserError
from outlier_titan.hf.adapters import adapter_for_hf, hf_model_config
from outlier_titan.hf.folders import (
    OURS_CONFIG, OURS_WEIGHTS, TOKENIZER_FILE, folder_tokenizer_file, is_export_folder, is_hf_folder,
    read_export_tensors, read_hf_config, read_hf_tensors,
)
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import build_meta_model

if TYPE_CHECKING:
    from outlier_titan.config.job_config import Model


def _build(model_cfg: Model, vocab: int, seq_len: int, device, dtype) -> tuple[nn.Module, object]:
    """The model of ``model_cfg`` on ``device`` in ``dtype`` with its buffers (RoPE tables) filled."""
    _, args, model = build_meta_model(model_cfg, vocab, seq_len)
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype)
    model.init_weights(Initializer(0, device))  # buffers in the final dtype: float64 tables stay exact
    return model, args


def _load_strict(model: nn.Module, state: dict[str, torch.Tensor], source: Path) -> None:
    own = model.state_dict()
    missing = [k for k in own if k not in state]
    extra = [k for k in state if k not in own]
    if missing or extra:
        what = f"missing {missing[0]!r}" if missing else f"unexpected {extra[0]!r}"
        raise UserError(f"{source}: weights do not match the model of its config ({what}, "
                        f"{len(missing)} missing, {len(extra)} unexpected); re-export the model")
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise UserError(f"{source}: weight {k} has shape {tuple(v.shape)}, the config implies "
                            f"{tuple(own[k].shape)}; re-export the model")
    model.load_state_dict(state)


def import_hf(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype | None = None):
    """Builds the ``pre_ln`` model of an HF folder and loads its weights. Returns ``(model, model_cfg)``."""
    path = Path(path)
    model_cfg = hf_model_config(path)
    adapter = adapter_for_hf(read_hf_config(path))
    model, args = _build(model_cfg, model_cfg.vocab_size, 1, device, dtype)
    state = adapter.from_hf(read_hf_tensors(path), args)
    _load_strict(model, state, path)
    model.eval()
    return model, model_cfg


# ---------------------------------------------------------------- start-up import (checkpoint.initial_load_path)

def initial_model_config(path: str | Path) -> Model:
    """The ``[model]`` section of an HF folder or of our export (``checkpoint.initial_load_path``)."""
    path = Path(path)
    if is_hf_folder(path):
        return hf_model_config(path)
    if is_export_folder(path):
        return parse_args(["--config", str(path / OURS_CONFIG)]).model
    raise UserError(f"checkpoint.initial_load_path = {str(path)!r} is neither an HF folder (config.json) nor an "
                    f"export ({OURS_WEIGHTS} + {OURS_CONFIG}); export a checkpoint with scripts/export.py")


def apply_initial_model(cfg: JobConfig) -> None:
    """With ``checkpoint.initial_load_path`` set, replaces ``cfg.model`` by the stored model's section."""
    if cfg.checkpoint.initial_load_path:
        cfg.model = initial_model_config(cfg.checkpoint.initial_load_path)


def load_model_state(model: nn.Module, path: str | Path) -> None:
    """Loads an HF folder or our export into ``model`` (plain or FSDP/TP-sharded: every rank reads the file)."""
    path = Path(path)
    if is_hf_folder(path):
        config = read_hf_config(path)
        args = getattr(model, "args", None)
        state = adapter_for_hf(config).from_hf(read_hf_tensors(path), args)
    else:
        state = read_export_tensors(path)
    own = model.state_dict()  # stored dtype (often bf16) -> the model's
    state = {k: v.to(own[k].dtype) if k in own else v for k, v in state.items()}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


# ---------------------------------------------------------------- any stored model at world size 1

def load_pretrained(path: str | Path, device: str | torch.device = "cpu", tokenizer: str | None = None,
                    dtype: torch.dtype | None = None, need_tokenizer: bool = True):
    """Any stored model at world size 1: an HF folder, our export, or a DCP checkpoint / run folder.

    Returns ``(model, cfg, tokenizer)``. ``tokenizer`` (a ``data.tokenizer`` value) overrides the folder's;
    an HF folder without a tiktoken-readable tokenizer needs it (else the tokenizer is None when
    ``need_tokenizer`` is false). ``cfg`` is the saved run config, or the
    defaults with the imported ``[model]`` for an HF folder.
    """
    path = Path(path)
    own_tok = folder_tokenizer_file(path) if path.is_dir() else None
    if is_hf_folder(path):
        model, model_cfg = import_hf(path, device, dtype)
        cfg = JobConfig()
        cfg.model = model_cfg
        if tokenizer is None and own_tok is None and need_tokenizer:
            raise UserError(f"{path} has no tiktoken-readable tokenizer ({TOKENIZER_FILE} or tokenizer.model); "
                            f"name one with --tokenizer (a BPE rank file, tiktoken:<encoding> or embedded)")
        if tokenizer is not None:
            cfg.data.tokenizer = tokenizer
        elif own_tok is not None:
            cfg.data.tokenizer = str(own_tok)
        tok = build_tokenizer(cfg.data.tokenizer) if tokenizer is not None or own_tok is not None else None
        cfg.training.seq_len = min(cfg.training.seq_len, model_cfg.max_seq_len)
    elif is_export_folder(path):
        cfg = parse_args(["--config", str(path / OURS_CONFIG)])
        if tokenizer is not None or own_tok is not None:
            cfg.data.tokenizer = tokenizer or str(own_tok)
        tok = build_tokenizer(cfg.data.tokenizer)
        model, _ = _build(cfg.model, tok.vocab_size, cfg.training.seq_len, device, dtype)
        _load_strict(model, read_export_tensors(path), path)
        model.eval()
    else:
        model, cfg, tok = load_model_for_eval(path, device)
        if dtype is not None:
            model.to(dtype)
        if tokenizer is not None:
            cfg.data.tokenizer = tokenizer
            tok = build_tokenizer(tokenizer)
    if tok is not None and tok.vocab_size > _vocab(model):
        raise UserError(f"tokenizer {cfg.data.tokenizer!r} has {tok.vocab_size} tokens but the model's vocabulary "
                        f"is {_vocab(model)}; name the model's tokenizer with --tokenizer")
    return model, cfg, tok


def _vocab(model: nn.Module) -> int:
    return model.tok_embeddings.weight.shape[0]
