"""Models out of the stack: any stored model (a run's DCP checkpoint, our export or an HF folder) written as an HF
folder (``pre_ln`` models shaped like GPT-2 or Llama, with the tokenizer's end-of-text id as BOS / EOS) or as our
safetensors export (every spec), with the run's BPE file as ``tokenizer.tiktoken`` when it has one.
``outlier-titan-export`` is its command line."""

from __future__ import annotations

import shutil
from pathlib import Path

from outlier_titan.config.manager import to_toml
from outlier_titan.data.tokenizer import EMBEDDED_BPE
from outlier_titan.errors import UserError
from outlier_titan.hf.folders import TOKENIZER_FILE, HFError, write_export_folder, write_hf_folder
from outlier_titan.hf.load import load_pretrained
from outlier_titan.models.embed_proj import merge_embed_proj
from outlier_titan.models.spec import get_spec, resolve

FORMATS = ("auto", "hf", "safetensors")


def _tokenizer_file(spec: str) -> Path | None:
    """The BPE rank file behind a ``data.tokenizer`` value, or None (a named tiktoken encoding has none)."""
    if spec == "embedded":
        return EMBEDDED_BPE
    if spec.startswith("tiktoken:"):
        return None
    return Path(spec).expanduser() if Path(spec).expanduser().is_file() else None


def special_tokens(tok) -> dict[str, int | None]:
    """``config.json``'s special tokens: our documents end with the tokenizer's end-of-text token, which also
    starts the next one (GPT-2's convention), so it is both BOS and EOS; None without a tokenizer (not the
    ``transformers`` config classes' defaults, e.g. GPT-2's 50256, outside a smaller vocabulary)."""
    eos = tok.eos_id if tok is not None else None
    return {"bos_token_id": eos, "eos_token_id": eos}


def export_model(source: str | Path, out: str | Path, fmt: str = "auto",
                 max_shard_bytes: int = 5 * 2**30) -> tuple[str, list[Path]]:
    """Writes the model stored at ``source`` to ``out`` as an HF folder or as our safetensors export.

    ``fmt``: ``hf`` (GPT-2 / Llama-shaped ``pre_ln`` models only), ``safetensors`` (any spec) or ``auto``
    (hf where possible); HF weights above ``max_shard_bytes`` are sharded with an index file. Returns the
    format written and the files. ``out`` must not hold files already.
    """
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out {out} already exists and is not empty; pass a new folder (nothing was written)")
    model, cfg, tok = load_pretrained(source, need_tokenizer=False)
    state, args = merge_embed_proj({k: v.detach() for k, v in model.state_dict().items()}, model.args)
    if args is not model.args:  # the projection is folded into the embedding: export the plain architecture
        cfg.model.embed_proj, cfg.model.tie_embeddings = False, args.tie_embeddings
    hf_adapter = get_spec(cfg.model.name).hf_adapter
    adapter, why = resolve(hf_adapter)(args) if hf_adapter else (None, f"model.name = {cfg.model.name!r}")
    if fmt == "hf" and adapter is None:
        raise HFError(f"cannot export to HF: {why}; use --format safetensors (weights + config.toml)")
    fmt = "hf" if fmt == "auto" and adapter is not None else ("safetensors" if fmt == "auto" else fmt)
    if fmt == "hf":
        config = adapter.hf_config(args) | {"torch_dtype": "float32"} | special_tokens(tok)
        files = write_hf_folder(out, config, adapter.to_hf(state, args), max_shard_bytes)
    else:
        files = write_export_folder(out, state, to_toml(cfg), cfg.model.name)
    tok_file = _tokenizer_file(cfg.data.tokenizer) if tok is not None else None
    if tok_file is not None:
        shutil.copyfile(tok_file, out / TOKENIZER_FILE)
        files.append(out / TOKENIZER_FILE)
    return fmt, files
