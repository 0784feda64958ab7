"""Parameter roles: which parameters are what, provided by each model spec and read by every part that treats a
parameter by what it is rather than by its shape (FSDP placement, the tile engine, Muon's split and per-head
option). In the spirit of torchtitan's ``protocols/``: the spec's model class declares a ``param_roles``
attribute (a :class:`ParamRoles`), and consumers ask :func:`roles_of` for it, never for fixed names.

The four built-in specs use the same names, :data:`DEFAULT_ROLES`:

* ``tok_embeddings.weight`` [V, d], ``output.weight`` [V, d]: axis 0 is the vocabulary (the tile engine's vocab
  axis); with ``pos_embeddings.weight`` [T, d] they are the embedding-like 2-D parameters that Muon leaves to
  AdamW.
* ``wq``, ``wk``, ``wv``, ``w1``, ``w3`` [out, d]: read the residual stream (FSDP shards their output axis);
  ``wq/wk/wv`` hold one block of rows per head.
* ``wo``, ``w2`` [d, in]: write into the residual stream (FSDP shards their input axis, so the residual axis of
  every matrix stays whole on the FSDP mesh).

A spec whose modules are named otherwise declares its own ``ParamRoles`` with those names. Names match a
parameter's FQN exactly or as its last dotted components (wrapped or nested models). The class of every parameter
(embedding, norm, bias, gain, matrix or a module's own ``param_class``) comes from its module's type:
:func:`outlier_titan.optim.params.param_class`. The TP plans (each spec's ``tp_plan``) name their modules
themselves, with the same names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from outlier_titan.errors import UserError


def is_one_of(fqn: str, names: tuple[str, ...]) -> bool:
    """``fqn`` is one of ``names`` or ends with ``.<name>`` (wrapped or nested models)."""
    return any(fqn == s or fqn.endswith("." + s) for s in names)


@dataclass(frozen=True)
class ParamRoles:
    """The names a model gives its parameters by role (see the module docstring)."""

    vocab_axis_params: tuple[str, ...]
    """Parameter FQNs [V, d] whose axis 0 is the vocabulary (``optimizer.vocab_axis``)."""
    embedding_like_params: tuple[str, ...]
    """2-D parameter FQNs that are embeddings or the output head (Muon leaves them to AdamW)."""
    attention_input_weights: tuple[str, ...]
    """Module names of the per-head input projections [n_heads * head_dim, d] (Muon's ``muon_per_head``)."""
    residual_writers: tuple[str, ...]
    """Module names of the matrices [d, in] whose output enters the residual stream (FSDP shards axis 1)."""

    def is_one_of(self, fqn: str, names: tuple[str, ...]) -> bool:
        """``fqn`` is one of ``names`` or ends with ``.<name>``."""
        return is_one_of(fqn, names)

    def has_vocab_axis(self, fqn: str) -> bool:
        """Axis 0 of ``fqn`` is the vocabulary."""
        return is_one_of(fqn, self.vocab_axis_params)

    def is_embedding_like(self, fqn: str) -> bool:
        """``fqn`` is an embedding or the output head."""
        return is_one_of(fqn, self.embedding_like_params)

    def writes_residual(self, fqn: str, ndim: int) -> bool:
        """A matrix ``[d, in]`` whose output enters the residual stream (``<writer>.weight``)."""
        parts = fqn.split(".")
        return ndim == 2 and len(parts) >= 2 and parts[-2] in self.residual_writers and parts[-1] == "weight"


DEFAULT_ROLES = ParamRoles(
    vocab_axis_params=("tok_embeddings.weight", "output.weight"),
    embedding_like_params=("output.weight", "pos_embeddings.weight", "tok_embeddings.weight"),
    attention_input_weights=("wq", "wk", "wv"),
    residual_writers=("wo", "w2"),
)
"""The names every built-in spec (pre_ln, op, angpt, ngpt) uses."""

_WRAPPER_ATTRS = ("_orig_mod", "_checkpoint_wrapped_module")


def roles_of(model: nn.Module) -> ParamRoles:
    """The model's ``param_roles`` (through compile / checkpoint wrappers; FSDP keeps the class attribute), or
    :data:`DEFAULT_ROLES` for a model that declares none."""
    m = model
    while True:
        roles = getattr(type(m), "param_roles", None)
        if roles is None:
            roles = m.__dict__.get("param_roles")
        if roles is not None:
            if not isinstance(roles, ParamRoles):
                raise UserError(f"{type(m).__name__}.param_roles is a {type(roles).__name__}; declare it as an "
                                f"outlier_titan.models.roles.ParamRoles")
            return roles
        inner = next((getattr(m, a) for a in _WRAPPER_ATTRS if isinstance(getattr(m, a, None), nn.Module)), None)
        if inner is None:
            return DEFAULT_ROLES
        m = inner


def shard_dim_for(fqn: str, param: torch.Tensor, roles: ParamRoles) -> int:
    """The dim FSDP (and TP) shard a parameter on: 1 for the matrices that write the residual stream (their input
    axis), else 0, so the residual axis stays whole on every rank."""
    return 1 if roles.writes_residual(fqn, param.ndim) else 0
