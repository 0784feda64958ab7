"""FSDP2 (``fully_shard``) per block and on the root, with residual-axis-preserving shard placements.

Placement of every weight (global shape -> FSDP shard dim; names of the built-in specs, the model's
``param_roles`` say which are the residual writers):
  wq, wk, wv, w1, w3   [out, d_model]  Shard(0)   (the output / head axis)
  wo, w2               [d_model, in]   Shard(1)   (residual writers: the input axis; d_model rows stay whole)
  tok_embeddings, output, pos_embeddings [V or T, d_model]  Shard(0)
  1-D gains and biases                                     Shard(0)
So the residual (d_model) axis of every matrix stays unsharded on the FSDP mesh, which lets the tile
optimizers rotate along it without communication. With TP the same dims are also the TP dims, and FSDP
composes as ``_StridedShard`` on the same axis.
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from outlier_titan.models.roles import roles_of, shard_dim_for


def apply_fsdp(model: nn.Module, dp_mesh: DeviceMesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True) -> None:
    """fully_shard on every block, then on the root (embeddings, final norm and head)."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    roles = roles_of(model)
    dims = {p: shard_dim_for(n, p, roles) for n, p in model.named_parameters()}
    own = sorted({type(m).__name__ for m in (model, *model.layers.values())})  # before fully_shard renames them

    def placement(p: nn.Parameter) -> Shard:
        return Shard(dims.get(p, 0))

    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward,
                    shard_placement_fn=placement)
    # With TP, the root's logits and the nGPT / anGPT blocks' outputs come out of DTensor.to_local(), a view, and
    # FSDP2 warns on every rank that an in-place op on such a view would skip the module's pre-backward hook. No
    # code here changes a block's output or the logits in place (the next block and the loss only read them; the
    # 1-rank = FSDP = FSDP x TP loss tests of every spec would fail otherwise), so the warning is silenced for this
    # model's own modules only.
    names = "|".join(re.escape(f"FSDP{n}") for n in own)
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \(({names})\) returned a view tensor",
                            category=UserWarning)
    fully_shard(model, mesh=dp_mesh, mp_policy=mp, reshard_after_forward=False, shard_placement_fn=placement)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            # Loss is already divided by the global token count: FSDP must only sum.
            module.set_gradient_divide_factor(1.0)
            if dp_mesh.device_type != "cuda":
                module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
