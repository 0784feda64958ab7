"""A toy PTQ scheme as a plug-in, one file outside the package: W6A16, weights int6 symmetric absmax per output
channel, activations and the head in full precision. Use it with
``outlier-titan-evaluate --plugins tests/plugins/toy_ptq.py --schemes w6a16_toy``."""

from __future__ import annotations

import torch

from outlier_titan.quant import quantizers
from outlier_titan.quant.ptq import SCHEMES, Scheme, register_scheme


def int6_per_channel(w: torch.Tensor) -> torch.Tensor:
    return quantizers.absmax_quantize(w, 6, reduce_dims=(1,))


if "w6a16_toy" not in SCHEMES:
    register_scheme(Scheme("w6a16_toy", "W6A16 toy: W int6 sym. per output channel, head FP", int6_per_channel,
                           act=None, quantize_output=False, head=False))
