"""Model folders on disk: Hugging Face folders (``config.json`` + ``*.safetensors``, sharded or not), our export
(``model.safetensors`` with our parameter names + the run's ``config.toml``) and the tokenizer file either may hold.

Reading and writing only: what the tensors mean is :mod:`outlier_titan.hf.adapters`' business.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from outlier_titan.data.tokenizer import load_bpe_file
from outlier_titan.errors import DataError, UserError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
WEIGHTS = "model.safetensors"
OURS_WEIGHTS = "model.safetensors"
OURS_CONFIG = "config.toml"
TOKENIZER_FILE = "tokenizer.tiktoken"


class HFError(UserError):
    """An HF folder that cannot be imported or a model that cannot be exported to HF."""


def _reason(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


# ---------------------------------------------------------------- HF folders

def is_hf_folder(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def read_hf_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / CONFIG
    if not file.is_file():
        raise HFError(f"{path} has no {CONFIG}; pass a Hugging Face model folder (save_pretrained output)")
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise HFError(f"{file} is not valid JSON ({e}); restore the file from the model's source") from None


def read_hf_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in ``model.safetensors.index.json``."""
    folder = Path(path)
    if (folder / INDEX).is_file():
        try:
            weight_map = json.loads((folder / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise HFError(f"{folder / INDEX} has no valid 'weight_map'; the sharded checkpoint is corrupt") from None
        files = sorted(set(weight_map.values()))
    elif (folder / WEIGHTS).is_file():
        files = [WEIGHTS]
    else:
        raise HFError(f"{folder} has no {WEIGHTS} or {INDEX}; the folder holds no safetensors weights "
                      f"(save with safe_serialization=True)")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        file = folder / name
        if not file.is_file():
            raise HFError(f"{folder} lacks the weight shard {name} named in {INDEX}; copy the missing shard")
        try:
            tensors.update(load_file(str(file)))
        except (SafetensorError, OSError) as e:
            raise HFError(f"cannot read {file}: {_reason(e)}") from None
    return tensors


def write_hf_folder(path: str | Path, config: dict[str, Any], tensors: dict[str, torch.Tensor],
                    max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Writes ``config.json`` and the tensors as one ``model.safetensors`` or as shards plus an index file."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.detach().contiguous().cpu()
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(folder / WEIGHTS), metadata=meta)
        return [folder / CONFIG, folder / WEIGHTS]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for name, shard in zip(names, shards):
        save_file(shard, str(folder / name), metadata=meta)
        weight_map.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                           indent=2, sort_keys=True) + "\n")
    return [folder / CONFIG, folder / INDEX, *(folder / n for n in names)]


# ---------------------------------------------------------------- our export

def is_export_folder(path: str | Path) -> bool:
    return (Path(path) / OURS_WEIGHTS).is_file() and (Path(path) / OURS_CONFIG).is_file()


def read_export_tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / OURS_WEIGHTS
    if not file.is_file():
        raise UserError(f"{path} has no {OURS_WEIGHTS}; pass an export of scripts/export.py or an HF folder")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {file}: {_reason(e)}") from None


def write_export_folder(path: Path, state: dict[str, torch.Tensor], config_toml: str, model_name: str) -> list[Path]:
    """Our export: the tensors under our names in ``model.safetensors`` and the run's config as ``config.toml``."""
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(path / OURS_WEIGHTS),
              metadata={"format": "pt", "model": model_name})
    (path / OURS_CONFIG).write_text(config_toml)
    return [path / OURS_WEIGHTS, path / OURS_CONFIG]


# ---------------------------------------------------------------- tokenizer files

def folder_tokenizer_file(path: str | Path) -> Path | None:
    """The tiktoken-readable tokenizer file of a model folder (``tokenizer.tiktoken``, else a ``tokenizer.model``
    that tiktoken reads), or None."""
    for name in (TOKENIZER_FILE, "tokenizer.model"):
        file = Path(path) / name
        if file.is_file():
            try:
                load_bpe_file(file)
            except DataError:
                continue  # e.g. a SentencePiece tokenizer.model: the user names a tokenizer instead
            return file
    return None
