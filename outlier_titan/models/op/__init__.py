"""The ``op`` spec: He et al. 2024's Outlier Protected block (no norms, QK-norm, scaled residuals) and the paper's
Pre-/Post-Norm baselines. Its options, flavors and entry; the model is in :mod:`outlier_titan.models.op.model`."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.smooth_swiglu import SmoothSwiGLUOptions
from outlier_titan.models.spec import ModelSpec, TPPlan, register_spec
from outlier_titan.models.value_path import VALUE_PATH_TP, ValuePathOptions
from outlier_titan.options import opt

OP_BLOCKS = ("op", "pre_ln", "pre_rms", "pre_srms", "post_ln")


@dataclass
class OPOptions(ValuePathOptions, SmoothSwiGLUOptions):
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


_LANGUINI = dict(pos_encoding="rope", mlp="gelu", mlp_alpha="analytic", tie_embeddings=True,
                 residual_scale_mode="scalar")
_FINEWEB = dict(pos_encoding="rope", mlp="gelu", mlp_alpha="analytic", residual_scale_mode="vector")

FLAVORS = {
    "debug": dict(dim=128, n_layers=4, n_heads=4),
    "codeparrot_130m": dict(dim=768, n_layers=6, n_heads=12),
    "languini_100m": dict(_LANGUINI, dim=768, n_layers=12, n_heads=12, residual_scale=0.2),
    "languini_320m": dict(_LANGUINI, dim=1024, n_layers=24, n_heads=16, residual_scale=0.15),
    "languini_1.2b": dict(_LANGUINI, dim=2048, n_layers=24, n_heads=32, residual_scale=0.15),
    "fineweb_1.2b": dict(_FINEWEB, dim=2048, n_layers=24, n_heads=16, residual_scale=0.1),
    "fineweb_7b": dict(_FINEWEB, dim=4096, n_layers=32, n_heads=32, residual_scale=0.05),
    "opt_125m": dict(dim=768, n_layers=12, n_heads=12, bias=True, tie_embeddings=True, residual_scale_mode="scalar",
                     residual_scale=0.2),
}


def _rotation(args) -> str | None:
    if args.block == "post_ln":
        return ("the post_ln block normalises the residual stream itself (a per-channel gain on the stream, "
                "which does not commute with a rotation)")
    return None


SPEC = register_spec(ModelSpec(
    name="op",
    model="outlier_titan.models.op.model:OPTransformer",
    args="outlier_titan.models.op.model:OPArgs",
    options=OPOptions,
    flavors=FLAVORS,
    # The blocks' norms (pre- or post-position) keep local outputs; the trainable scales are replicated over the
    # sequence shards.
    tp_plan=TPPlan(block_norms=False, extra={
        **VALUE_PATH_TP, "layers.*.attention_norm": "sequence_local", "layers.*.ffn_norm": "sequence_local",
        "layers.*.attn_scale": "replicated_on_shards", "layers.*.mlp_scale": "replicated_on_shards",
        "layers.*.mlp_input_scale": "replicated_on_shards"}),
    rotation=_rotation,
    description="Outlier Protected block (no norms, QK-norm, scaled residuals) and the Pre-/Post-Norm baselines",
))
