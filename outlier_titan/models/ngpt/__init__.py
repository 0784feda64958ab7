"""The ``ngpt`` spec: nGPT (normalised Transformer) as the NVIDIA reference, with correct RoPE. Its options, flavors
and entry, and the pieces the ``angpt`` spec shares (option help, flavors, TP plan, rotation refusal); the model is in
:mod:`outlier_titan.models.ngpt.model`."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.spec import ModelSpec, TPPlan, register_spec
from outlier_titan.options import opt

ALPHA_INIT = "Effective initial LERP step alpha."
ALPHA_ABS = "LERP with |alpha| (nGPT code) instead of signed alpha."
PARAM_SCALE = ("Stored init s_scale of scaling vectors (effective value = param * s_init / s_scale); anGPT 0.01, "
               "nGPT None: 1/sqrt(dim).")
LOGIT_SCALE = "Effective initial per-vocab logit scale s_z."


@dataclass
class NGPTOptions:
    alpha_init: float = opt(0.05, ALPHA_INIT)
    alpha_abs: bool = opt(True, ALPHA_ABS)
    param_scale: float | None = opt(None, PARAM_SCALE)
    logit_scale_init: float = opt(1.0, LOGIT_SCALE)


def normalized_tp_plan(head_scales: str) -> TPPlan:
    """The standard plan for the blocks' linears, the vocab-parallel embedding and the column-parallel head (with
    its s_z vector), plus the LERP steps replicated over the sequence shards and the attention's per-head vector
    ``head_scales`` sharded with the heads. Used by ngpt and angpt."""
    return TPPlan(block_norms=False, extra={
        "layers.*.attn_lerp": "replicated_on_shards", "layers.*.mlp_lerp": "replicated_on_shards",
        f"layers.*.attention.{head_scales}": "sharded_params"})


NOT_ROTATABLE = ("nGPT / anGPT interpolate the normalised stream with per-channel rates, which do not commute with a "
                 "rotation")
"""Why QuaRot leaves the residual stream of ngpt and angpt models unrotated."""

FLAVORS = {
    "debug": dict(dim=128, n_layers=4, n_heads=4),
    # anGPT paper Table F.1 shapes (d_h = 64, 4d SwiGLU per branch, vocab 50,304)
    "32m": dict(dim=256, n_layers=6, n_heads=4, vocab_size=50304),
    "62m": dict(dim=384, n_layers=10, n_heads=6, vocab_size=50304),
    "125m": dict(dim=512, n_layers=18, n_heads=8, vocab_size=50304),
    "250m": dict(dim=768, n_layers=18, n_heads=12, vocab_size=50304),
    "0.5b": dict(dim=1024, n_layers=24, n_heads=16, vocab_size=50304),  # also the NVIDIA reference model
    "1b": dict(dim=1280, n_layers=36, n_heads=20, vocab_size=50304),
}

SPEC = register_spec(ModelSpec(
    name="ngpt",
    model="outlier_titan.models.ngpt.model:NGPT",
    args="outlier_titan.models.ngpt.model:NGPTArgs",
    options=NGPTOptions,
    flavors=FLAVORS,
    tp_plan=normalized_tp_plan("sqk"),
    post_step="outlier_titan.models.ngpt.model:ngpt_post_step",
    rotation=f"NGPT is not rotated ({NOT_ROTATABLE})",
    description="nGPT (normalised Transformer) as the NVIDIA reference, with correct RoPE",
))
