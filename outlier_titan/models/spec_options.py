"""The ``[model]`` options that belong to one model spec (or a few), declared once with their defaults and help.

Each spec's args dataclass (``PreLNArgs`` in ``models/pre_ln.py``, ``OPArgs``, ``ANGPTArgs``, ``NGPTArgs``) inherits
its group below, so the defaults live here only; the config composes the groups into ``[model]`` (each field's
metadata naming its spec), ``--help`` lists them under their spec, and ``models/registry.py`` rejects an option of
another spec in one line naming the spec(s) that have it. This module imports no torch.
Options every spec reads (``dim``, ``n_layers``, ...) stay in the config's common ``[model]`` fields.

A spec outside the package registers its group with :func:`register_spec_options`; configs made afterwards have
its options.
"""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.config.job_config import add_option_group
from outlier_titan.options import OptionGroup, opt

KIND = "model spec"
_GROUPS: dict[str, OptionGroup] = {}


def register_spec_options(spec: str, cls: type) -> type:
    """Registers ``cls`` (a dataclass declared with ``opt``) as spec ``spec``'s own ``[model]`` options."""
    if spec in _GROUPS:
        raise ValueError(f"model spec {spec!r} already has registered options")
    _GROUPS[spec] = OptionGroup("model", KIND, spec, cls)
    add_option_group(_GROUPS[spec])
    return cls


def option_groups() -> list[OptionGroup]:
    return list(_GROUPS.values())


NORMS = ("layernorm", "rmsnorm", "rmsnorm_single", "rmsnorm_nogain")


@dataclass
class PreLNOptions:
    norm: str = opt("layernorm", "Norm type (rmsnorm_single: one scalar gain, Kaul et al. 2024's RMSNormSingle; "
                                 "rmsnorm_nogain: no gain).", NORMS)
    embed_proj: bool = opt(False, "Outlier-Safe Pre-Training's embedding projection (Park et al. 2025): learnable d x d "
                                  "projections after the token embedding and (embed_proj_head) between the final "
                                  "norm and the head; merged into the embedding and the head on export.")
    embed_proj_head: bool = opt(True, "With model.embed_proj: also the projection before the head, as the released "
                                      "OSP code has it (false: only the one after the embedding, a variant).")
    embed_proj_init: str = opt("orthogonal", "With model.embed_proj: the projections' initialisation, a random "
                                             "orthogonal matrix as the released OSP code (identity: a variant).",
                               ("orthogonal", "identity"))


OP_BLOCKS = ("op", "pre_ln", "pre_rms", "pre_srms", "post_ln")


@dataclass
class OPOptions:
    block: str = opt("op", "Block variant: the Outlier Protected block or a baseline of He et al. 2024.", OP_BLOCKS)
    final_norm: bool = opt(False, "A final norm before the head (OP: none).")
    residual_scale: float = opt(0.2, "beta, the residual-branch scale (its init when trainable).")
    residual_scale_mode: str = opt("fixed", "beta as a fixed scalar, trainable scalar, trainable LayerScale vector, "
                                            "or none (beta = 1).", ("none", "fixed", "scalar", "vector"))
    mlp_alpha: str = opt("none", "alpha on the MLP input: none, analytic (fixed, from the init signal propagation), "
                                 "trainable (scalar, init analytic).", ("none", "analytic", "trainable"))
    embed_scale: float | None = opt(None, "Multiplier of the token embeddings (None: 1/init std, mean square 1 at "
                                          "init).")
    input_norm: bool = opt(False, "LayerNorm on block 0's attention input (the authors' code).")
    logit_softcap: float = opt(0.0, "tanh soft-cap c*tanh(s/c) of attention logits (0 = off).")


_ALPHA_INIT = "Effective initial LERP step alpha."
_ALPHA_ABS = "LERP with |alpha| (nGPT code) instead of signed alpha."
_PARAM_SCALE = ("Stored init s_scale of scaling vectors (effective value = param * s_init / s_scale); anGPT 0.01, "
                "nGPT None: 1/sqrt(dim).")
_LOGIT_SCALE = "Effective initial per-vocab logit scale s_z."


@dataclass
class NGPTOptions:
    alpha_init: float = opt(0.05, _ALPHA_INIT)
    alpha_abs: bool = opt(True, _ALPHA_ABS)
    param_scale: float | None = opt(None, _PARAM_SCALE)
    logit_scale_init: float = opt(1.0, _LOGIT_SCALE)


@dataclass
class ANGPTOptions:
    lerp_form: str = opt("corrected", "LERP factor nu(alpha): corrected (1-2a+2a^2)^-1/2 or the paper's printed "
                                      "1-2a+2a^2.", ("corrected", "printed"))
    lerp_factor: str = opt("elementwise", "nu(alpha) per dimension, or one scalar from the mean over dims.",
                           ("elementwise", "mean"))
    alpha_init: float = opt(0.05, _ALPHA_INIT)
    alpha_abs: bool = opt(False, _ALPHA_ABS)
    param_scale: float | None = opt(0.01, _PARAM_SCALE)
    logit_scale_init: float = opt(1.0, _LOGIT_SCALE)
    attn_scale_init: float | None = opt(None, "Initial learnable attention temperature g per head (None: "
                                              "sqrt(d_h)).")


register_spec_options("pre_ln", PreLNOptions)
register_spec_options("op", OPOptions)
register_spec_options("angpt", ANGPTOptions)
register_spec_options("ngpt", NGPTOptions)
