"""Outlier-Safe Pre-Training's embedding projections (Park et al. 2025, arXiv 2506.19697), ``model.embed_proj``.

As the authors' released model code has them (``rot1`` / ``rot2`` of ``example_modeling_flax.py``): in ``pre_ln``
the token embedding is followed by a learnable d x d projection P1 (``embed_proj.weight``) and, with
``model.embed_proj_head`` (default), the final norm's output by a second one P2 (``head_proj.weight``) before the
head; both are ``nn.Linear`` without bias (the Flax example's ``DenseGeneral`` layers default to a bias, as do all
its other layers; the paper's models are Llama-shaped, so ours have none), initialised to random orthogonal
matrices (``model.embed_proj_init = "orthogonal"``; ``"identity"`` is a variant). Muon trains them as hidden
matrices.

On export both are folded away in float64, so the exported model has the plain architecture: the embedding
E' = E P1ᵀ and the head W' = W P2 (logits = (n P2ᵀ) Wᵀ = n (W P2)ᵀ). A tied model's head reads E itself, not
E P1ᵀ, so a tied model is exported untied (``output.weight`` = E, or E P2).
"""

from __future__ import annotations

import dataclasses

import torch


def merge_embed_proj(state: dict[str, torch.Tensor], args) -> tuple[dict[str, torch.Tensor], object]:
    """(state, args) of the equivalent plain model: ``embed_proj.weight`` folded into ``tok_embeddings.weight``
    and ``head_proj.weight`` into the head; unchanged when the model has no projection."""
    if not getattr(args, "embed_proj", False):
        return state, args
    state = dict(state)
    proj = state.pop("embed_proj.weight")
    emb = state["tok_embeddings.weight"]
    state["tok_embeddings.weight"] = (emb.double() @ proj.double().T).to(emb.dtype)
    changes = {"embed_proj": False, "embed_proj_head": False}
    head = emb if args.tie_embeddings else state["output.weight"]
    if "head_proj.weight" in state:
        head = (head.double() @ state.pop("head_proj.weight").double()).to(head.dtype)
    if args.tie_embeddings:
        changes["tie_embeddings"] = False
    state["output.weight"] = head.clone()
    return state, dataclasses.replace(args, **changes)


@torch.no_grad()
def fold_embed_proj(model: torch.nn.Module) -> bool:
    """Folds a ``pre_ln`` model's projections into its embedding and head in place, with :func:`merge_embed_proj`'s
    arithmetic (the head is untied when tied); True when there was one. For evaluation transforms that need the
    plain model."""
    if getattr(model, "embed_proj", None) is None:
        return False
    emb = model.tok_embeddings.weight
    state, _ = merge_embed_proj({k: v for k, v in model.state_dict().items()}, model.args)
    if model.output is None:
        model.output = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False).to(device=emb.device, dtype=emb.dtype)
    model.output.weight.copy_(state["output.weight"])
    emb.copy_(state["tok_embeddings.weight"])
    model.embed_proj = model.head_proj = None
    return True
