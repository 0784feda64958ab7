"""The low-precision training recipes: which cast each operand of a linear layer's three GEMMs gets.

Forward ``y = x w^T`` contracts in-features, dgrad ``dx = dy w`` out-features, wgrad ``dw = dy^T x`` tokens; each
operand is cast along the axis its GEMM contracts (the backward recasts the saved high-precision ``x`` and ``w``).
``bf16`` means no recipe: the layer stays in high precision."""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.lowprec.formats import Cast


@dataclass(frozen=True)
class Recipe:
    """One recipe: the casts of the input, the weight and the output gradient, and the papers' extras."""

    name: str
    input: Cast
    weight: Cast
    grad_output: Cast
    stochastic_grad: bool = False  # stochastic rounding of the output gradient's casts (dgrad and wgrad)
    wgrad_hadamard: int = 0  # random Hadamard transform of this size on both wgrad operands along tokens (0: none)
    torchao_float8: str | None = None  # torchao Float8LinearConfig recipe name for real FP8 kernels
    keep_last_fraction: float = 0.0  # the paper's fraction of the last blocks kept in BF16 (a filter's default)
    help: str = ""


E4M3_ROW = Cast("e4m3", "row", scale="pow2")
MX = {element: Cast(element, "block", 32, "e8m0") for element in ("e4m3", "e2m1")}
NVFP4_1D = Cast("e2m1", "block", 16, "e4m3")
NVFP4_2D = Cast("e2m1", "block", 16, "e4m3", block_2d=True)

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    Recipe("fp8_rowwise", E4M3_ROW, E4M3_ROW, E4M3_ROW, torchao_float8="rowwise",
           help="FP8 E4M3 (Micikevicius et al. 2022, arXiv 2209.05433) for input, weight and output gradient, one "
                "power-of-two FP32 scale per row along the contraction axis: torchao 0.18's Float8LinearConfig "
                "recipe 'rowwise'."),
    Recipe("fp8_tensorwise", Cast("e4m3", "tensor"), Cast("e4m3", "tensor"), Cast("e5m2", "tensor"),
           torchao_float8="tensorwise",
           help="FP8 with one FP32 scale per tensor (amax / max): E4M3 input and weight, E5M2 output gradient "
                "(Micikevicius et al. 2022, arXiv 2209.05433); torchao's Float8LinearConfig recipe 'tensorwise'."),
    Recipe("mxfp8", MX["e4m3"], MX["e4m3"], MX["e4m3"],
           help="MXFP8 (OCP MX v1.0; Rouhani et al. 2023, arXiv 2310.10537): E4M3 elements, one E8M0 power-of-two "
                "scale per 32 along the contraction axis (floor(log2 amax) - 8, torchao's FLOOR mode) for all three "
                "operands, as torchao's MX training recipe."),
    Recipe("mxfp4", MX["e2m1"], MX["e2m1"], MX["e2m1"], stochastic_grad=True, wgrad_hadamard=64,
           help="MXFP4 (OCP MX v1.0 E2M1 x 32, E8M0 scales) for all three operands, stochastic rounding (3/4 "
                "pre-scale) of the output gradient and a 64-point random Hadamard transform of both wgrad operands "
                "along tokens (Tseng et al. 2025, arXiv 2502.20586; they keep the forward in BF16, we cast it too)."),
    Recipe("nvfp4", NVFP4_1D, NVFP4_2D, NVFP4_1D, stochastic_grad=True, wgrad_hadamard=16,
           keep_last_fraction=0.15,
           help="NVFP4 (NVIDIA 2025, arXiv 2509.25149): E2M1 elements, an E4M3 scale per 16 times an FP32 tensor "
                "scale; 16x16 weight blocks, stochastic rounding of the output gradient, a 16-point random "
                "Hadamard transform of the wgrad operands, the last ~15% of blocks kept in BF16."),
)}
PRECISIONS = ("bf16", *RECIPES)
