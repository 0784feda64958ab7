"""Parameter roles: the names every model spec gives its parameters, read by every part that treats a parameter
by what it is rather than by its shape (FSDP placement, the tile engine, Muon, the optimizer builders; the TP
plans name the same modules). A new spec that keeps these names gets the right treatment everywhere; one that
does not must map its names here.

* ``tok_embeddings.weight`` [V, d], ``output.weight`` [V, d]: axis 0 is the vocabulary (the tile engine's vocab
  axis); with ``pos_embeddings.weight`` [T, d] they are the embedding-like 2-D parameters that Muon leaves to
  AdamW.
* ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` [out, d]: read the residual stream (FSDP shards their output axis);
  ``wq/wk/wv`` hold one block of rows per head.
* ``wo``, ``w2`` [d, in]: write into the residual stream (FSDP shards their input axis, so the residual axis of
  every matrix stays whole on the FSDP mesh).
* The class of every parameter (embedding, norm, bias, gain, matrix or a module's own ``param_class``):
  :func:`outlier_titan.optim.params.param_class`.
"""

from __future__ import annotations

TOKEN_EMBEDDING = "tok_embeddings.weight"
POSITION_EMBEDDING = "pos_embeddings.weight"
OUTPUT_HEAD = "output.weight"
VOCAB_AXIS_PARAMS = (TOKEN_EMBEDDING, OUTPUT_HEAD)
EMBEDDING_LIKE_PARAMS = (OUTPUT_HEAD, POSITION_EMBEDDING, TOKEN_EMBEDDING)
ATTENTION_INPUT_WEIGHTS = ("wq", "wk", "wv")
RESIDUAL_WRITERS = ("wo", "w2")


def is_one_of(fqn: str, names: tuple[str, ...]) -> bool:
    """``fqn`` is one of ``names`` or ends with ``.<name>`` (wrapped or nested models)."""
    return any(fqn == s or fqn.endswith("." + s) for s in names)


def writes_residual(fqn: str, ndim: int) -> bool:
    """A matrix ``[d, in]`` whose output enters the residual stream (``...wo.weight``, ``...w2.weight``)."""
    parts = fqn.split(".")
    return ndim == 2 and len(parts) >= 2 and parts[-2] in RESIDUAL_WRITERS and parts[-1] == "weight"
