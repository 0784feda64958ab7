"""The ``angpt`` spec: anGPT, the approximately normalised GPT with norm-bounded weights and LERP residuals. Its
options, flavors and entry; the model is in :mod:`outlier_titan.models.angpt.model`."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.models.ngpt import (ALPHA_ABS, ALPHA_INIT, FLAVORS, LOGIT_SCALE, NOT_ROTATABLE, PARAM_SCALE,
                                      normalized_tp_plan)
from outlier_titan.models.spec import ModelSpec, register_spec
from outlier_titan.options import opt


@dataclass
class ANGPTOptions:
    lerp_form: str = opt("corrected", "LERP factor nu(alpha): corrected (1-2a+2a^2)^-1/2 or the paper's printed "
                                      "1-2a+2a^2.", ("corrected", "printed"))
    lerp_factor: str = opt("elementwise", "nu(alpha) per dimension, or one scalar from the mean over dims.",
                           ("elementwise", "mean"))
    alpha_init: float = opt(0.05, ALPHA_INIT)
    alpha_abs: bool = opt(False, ALPHA_ABS)
    param_scale: float | None = opt(0.01, PARAM_SCALE)
    logit_scale_init: float = opt(1.0, LOGIT_SCALE)
    attn_scale_init: float | None = opt(None, "Initial learnable attention temperature g per head (None: "
                                              "sqrt(d_h)).")


SPEC = register_spec(ModelSpec(
    name="angpt",
    model="outlier_titan.models.angpt.model:ANGPT",
    args="outlier_titan.models.angpt.model:ANGPTArgs",
    options=ANGPTOptions,
    flavors=FLAVORS,  # nGPT's: the anGPT paper's Table F.1 sizes
    tp_plan=normalized_tp_plan("temperature"),
    post_step="outlier_titan.models.angpt.model:angpt_post_step",
    rotation=f"ANGPT is not rotated ({NOT_ROTATABLE})",
    description="anGPT: approximately normalised GPT with norm-bounded weights and LERP residuals",
))
