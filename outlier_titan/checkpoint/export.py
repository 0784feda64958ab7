"""Models in and out of the stack: import Hugging Face folders, export checkpoints, load any of them.

Three on-disk forms hold one model:

- a DCP checkpoint of a run (any world size / layout; ``<run>/checkpoints/step-<N>``),
- an HF folder (``config.json`` + ``*.safetensors``) for the GPT-2 and Llama families (see
  :mod:`outlier_titan.models.hf_adapters`),
- our export: ``model.safetensors`` with our parameter names plus the run's ``config.toml`` (every spec,
  including OP, anGPT and nGPT, which HF has no class for).

Exports also carry the run's BPE file as ``tokenizer.tiktoken`` when it has one; imports use a
``tokenizer.tiktoken`` or a tiktoken-readable ``tokenizer.model`` from the folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn as nn

from outlier_titan.errors import DataError, UserError
from outlier_titan.models.hf_adapters import (
    HFError, adapter_for_args, adapter_for_hf, is_hf_folder, read_hf_config, read_hf_tensors, write_hf_folder,
)

OURS_WEIGHTS = "model.safetensors"
OURS_CONFIG = "config.toml"
TOKENIZER_FILE = "tokenizer.tiktoken"
FORMATS = ("auto", "hf", "safetensors")


def hf_model_config(path: str | Path):
    """The ``[model]`` config section (every ``pre_ln`` option explicit) that reproduces an HF folder's model."""
    from outlier_titan.config.job_config import Model

    config = read_hf_config(path)
    adapter = adapter_for_hf(config)
    options = adapter.options_from_hf(config)
    return Model(name="pre_ln", flavor="debug_llama" if adapter.family == "llama" else "debug", **options)


def folder_tokenizer(path: str | Path):
    """The tokenizer stored in a model folder (``tokenizer.tiktoken`` or a tiktoken ``tokenizer.model``), or None."""
    from outlier_titan.data.tokenizer import load_bpe_file

    for name in (TOKENIZER_FILE, "tokenizer.model"):
        file = Path(path) / name
        if file.is_file():
            try:
                return load_bpe_file(file)
            except DataError:
                continue  # e.g. a SentencePiece tokenizer.model: the user names a tokenizer instead
    return None


def _build(model_cfg, vocab: int, seq_len: int, device, dtype) -> tuple[nn.Module, object]:
    """The model of ``model_cfg`` on ``device`` in ``dtype`` with its buffers (RoPE tables) filled."""
    from outlier_titan.models.init import Initializer
    from outlier_titan.models.registry import build_meta_model

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


def load_model_state(model: nn.Module, path: str | Path) -> None:
    """Loads an HF folder or our export into ``model`` (plain or FSDP/TP-sharded: every rank reads the file)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    path = Path(path)
    if is_hf_folder(path):
        config = read_hf_config(path)
        args = getattr(model, "args", None)
        state = adapter_for_hf(config).from_hf(read_hf_tensors(path), args)
    else:
        state = _read_ours(path)
    own = model.state_dict()  # stored dtype (often bf16) -> the model's
    state = {k: v.to(own[k].dtype) if k in own else v for k, v in state.items()}
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True, strict=True))


def _read_ours(path: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    file = path / OURS_WEIGHTS
    if not file.is_file():
        raise UserError(f"{path} has no {OURS_WEIGHTS}; pass an export of scripts/export.py or an HF folder")
    try:
        return load_file(str(file))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {file}: {str(e).splitlines()[0] if str(e) else type(e).__name__}") from None


def initial_model_config(path: str | Path):
    """The ``[model]`` section of an HF folder or of our export (``checkpoint.initial_load_path``)."""
    from outlier_titan.config.manager import parse_args

    path = Path(path)
    if is_hf_folder(path):
        return hf_model_config(path)
    if (path / OURS_CONFIG).is_file() and (path / OURS_WEIGHTS).is_file():
        return parse_args(["--config", str(path / OURS_CONFIG)]).model
    raise UserError(f"checkpoint.initial_load_path = {str(path)!r} is neither an HF folder (config.json) nor an "
                    f"export ({OURS_WEIGHTS} + {OURS_CONFIG}); export a checkpoint with scripts/export.py")


def apply_initial_model(cfg) -> None:
    """With ``checkpoint.initial_load_path`` set, replaces ``cfg.model`` by the stored model's section."""
    if cfg.checkpoint.initial_load_path:
        cfg.model = initial_model_config(cfg.checkpoint.initial_load_path)


def load_pretrained(path: str | Path, device: str | torch.device = "cpu", tokenizer: str | None = None,
                    dtype: torch.dtype | None = None, need_tokenizer: bool = True):
    """Any stored model at world size 1: an HF folder, our export, or a DCP checkpoint / run folder.

    Returns ``(model, cfg, tokenizer)``. ``tokenizer`` (a ``data.tokenizer`` value) overrides the folder's;
    an HF folder without a tiktoken-readable tokenizer needs it (else the tokenizer is None when
    ``need_tokenizer`` is false). ``cfg`` is the saved run config, or the
    defaults with the imported ``[model]`` for an HF folder.
    """
    from outlier_titan.checkpoint.manager import load_model_for_eval
    from outlier_titan.config.job_config import JobConfig
    from outlier_titan.config.manager import parse_args
    from outlier_titan.data import build_tokenizer

    path = Path(path)
    own_tok = folder_tokenizer(path) if path.is_dir() else None
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
            cfg.data.tokenizer = str(path / TOKENIZER_FILE if (path / TOKENIZER_FILE).is_file()
                                     else path / "tokenizer.model")
        tok = build_tokenizer(cfg.data.tokenizer) if tokenizer is not None or own_tok is not None else None
        cfg.training.seq_len = min(cfg.training.seq_len, model_cfg.max_seq_len)
    elif (path / OURS_WEIGHTS).is_file() and (path / OURS_CONFIG).is_file():
        cfg = parse_args(["--config", str(path / OURS_CONFIG)])
        if tokenizer is not None or own_tok is not None:
            cfg.data.tokenizer = tokenizer or str(path / TOKENIZER_FILE)
        tok = build_tokenizer(cfg.data.tokenizer)
        model, _ = _build(cfg.model, tok.vocab_size, cfg.training.seq_len, device, dtype)
        _load_strict(model, _read_ours(path), path)
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


def _tokenizer_file(spec: str) -> Path | None:
    from outlier_titan.data.tokenizer import EMBEDDED_BPE

    if spec == "embedded":
        return EMBEDDED_BPE
    if spec.startswith("tiktoken:"):
        return None
    return Path(spec).expanduser() if Path(spec).expanduser().is_file() else None


def export_model(source: str | Path, out: str | Path, fmt: str = "auto",
                 max_shard_bytes: int = 5 * 2**30) -> tuple[str, list[Path]]:
    """Writes the model stored at ``source`` to ``out`` as an HF folder or as our safetensors export.

    ``fmt``: ``hf`` (GPT-2 / Llama-shaped ``pre_ln`` models only), ``safetensors`` (any spec) or ``auto``
    (hf where possible); HF weights above ``max_shard_bytes`` are sharded with an index file. Returns the
    format written and the files. ``out`` must not hold files already.
    """
    from outlier_titan.config.manager import to_toml

    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty; pass a new folder (nothing was written)")
    model, cfg, tok = load_pretrained(source, need_tokenizer=False)
    from outlier_titan.models.embed_proj import merge_embed_proj

    state, args = merge_embed_proj({k: v.detach() for k, v in model.state_dict().items()}, model.args)
    if args is not model.args:  # the projection is folded into the embedding: export the plain architecture
        cfg.model.embed_proj, cfg.model.tie_embeddings = False, args.tie_embeddings
    adapter, why = adapter_for_args(args) if cfg.model.name == "pre_ln" else (None, f"model.name = {cfg.model.name!r}")
    if fmt == "hf" and adapter is None:
        raise HFError(f"cannot export to HF: {why}; use --format safetensors (weights + config.toml)")
    fmt = "hf" if fmt == "auto" and adapter is not None else ("safetensors" if fmt == "auto" else fmt)
    if fmt == "hf":
        files = write_hf_folder(out, adapter.hf_config(args) | {"torch_dtype": "float32"}, adapter.to_hf(state, args),
                                max_shard_bytes)
    else:
        from safetensors.torch import save_file

        out.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous().cpu() for k, v in state.items()}, str(out / OURS_WEIGHTS),
                  metadata={"format": "pt", "model": cfg.model.name})
        (out / OURS_CONFIG).write_text(to_toml(cfg))
        files = [out / OURS_WEIGHTS, out / OURS_CONFIG]
    tok_file = _tokenizer_file(cfg.data.tokenizer) if tok is not None else None
    if tok_file is not None:
        shutil.copyfile(tok_file, out / TOKENIZER_FILE)
        files.append(out / TOKENIZER_FILE)
    return fmt, files
