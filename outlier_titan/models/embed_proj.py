"""Outlier-Safe Pre-Training's embedding projection (Park et al. 2025, arXiv 2506.19697), ``model.embed_proj``.

In ``pre_ln`` the token embedding is followed by a learnable d x d projection P (``embed_proj.weight``, an
``nn.Linear`` without bias, identity at init): x = E[token] Pᵀ. On export P is folded into the embedding,
E' = E Pᵀ (computed in float64), so the exported model has the plain architecture. A tied model's head reads
E itself, not E Pᵀ, so a tied model is exported untied (``output.weight`` = E).
"""

from __future__ import annotations

import dataclasses

import torch


def merge_embed_proj(state: dict[str, torch.Tensor], args) -> tuple[dict[str, torch.Tensor], object]:
    """(state, args) of the equivalent plain model: ``embed_proj.weight`` folded into ``tok_embeddings.weight``;
    unchanged when the model has no projection."""
    if not getattr(args, "embed_proj", False):
        return state, args
    state = dict(state)
    proj = state.pop("embed_proj.weight")
    emb = state["tok_embeddings.weight"]
    state["tok_embeddings.weight"] = (emb.double() @ proj.double().T).to(emb.dtype)
    changes = {"embed_proj": False}
    if args.tie_embeddings:
        state["output.weight"] = emb.clone()
        changes["tie_embeddings"] = False
    return state, dataclasses.replace(args, **changes)
