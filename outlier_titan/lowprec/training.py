"""``[low_precision]``: the model conversion that makes a run's linear layers compute in FP8 / MXFP8 / MXFP4 /
NVFP4.

:func:`convert_model` runs on the meta model before the parallel plan (torchtitan's order). Each selected
``nn.Linear`` becomes a :class:`LowPrecisionLinear` (same parameters, same names: a checkpoint of one precision loads
into another) whose forward and backward GEMMs read fake-quantised operands (``formats.fake_quantize``), each cast
along the axis its GEMM contracts:

  forward  y  = q(x, input, in)          @ q(w, weight, in)^T
  dgrad    dx = q(g, grad_output, out)   @ q(w, weight, out)
  wgrad    dw = q(g, grad_output, tok)^T @ q(x, input, tok)     (RHT on both along tokens where the recipe says)

On a GPU with FP8 kernels (CUDA SM 8.9+) and ``emulate = auto``, the FP8 recipes use torchao's ``Float8Linear``
instead. Every converted module carries ``lowprec_recipe`` (the probe finds the casts by it).

Tensor parallelism: the module sees its TP shards as DTensors and computes on the local shards; a scale that spans a
sharded axis (a row's amax along a sharded contraction axis, a whole tensor's amax) is the global one (a MAX
all-reduce over the TP group), so every layout casts like one rank. Block scales need no communication: a shard
holds whole blocks (checked).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from outlier_titan.errors import ConfigError
from outlier_titan.lowprec.formats import ELEMENTS, Cast, fake_quantize, random_hadamard, random_signs
from outlier_titan.lowprec.recipes import RECIPES, Recipe

_RNG = {"seed": 0, "step": 0, "micro": 0}


def set_rng_position(seed: int, step: int, micro: int) -> None:
    """Where the run is: the stochastic rounding and the random Hadamard signs of the casts are seeded from the
    training seed, the step and the micro-batch's index in the global batch (dp_rank x accumulation steps + micro),
    so every layout that computes the same micro-batch draws the same numbers."""
    _RNG.update(seed=seed, step=step, micro=micro)


def _generator(index: int, purpose: int, device: torch.device) -> torch.Generator:
    s = ((((_RNG["seed"] * 1_000_003 + _RNG["step"]) * 10_007 + _RNG["micro"]) * 4099 + index) * 4 + purpose)
    return torch.Generator(device=device).manual_seed(s % (2**63 - 1))


def kernels_wanted(recipe: Recipe, emulate: str, device_type: str, tp: int = 1) -> bool:
    """Whether the run asks for torchao's FP8 kernels: an FP8 recipe, ``emulate = auto``, CUDA, no tensor
    parallelism (torchao's TP styles for Float8Linear are not wired here; the emulation handles TP)."""
    return emulate == "auto" and recipe.torchao_float8 is not None and device_type == "cuda" and tp == 1


def uses_real_kernels(recipe: Recipe, emulate: str, device_type: str, tp: int = 1) -> bool:
    """:func:`kernels_wanted` on a GPU that has FP8 kernels (SM 8.9+)."""
    return (kernels_wanted(recipe, emulate, device_type, tp) and torch.cuda.is_available()
            and torch.cuda.get_device_capability() >= (8, 9))


# ------------------------------------------------------------------ the casts


def _cast(t: torch.Tensor, cast: Cast, axis: int, group, sharded: tuple[int, ...], *,
          stochastic: bool = False, generator: torch.Generator | None = None) -> torch.Tensor:
    """``fake_quantize(t, cast, axis)`` of the full tensor that ``t`` is a shard of (``sharded``: its dims split over
    ``group``). A per-tensor scale takes the global amax (``tensor_amax``); a row's scale along a sharded axis takes
    the row's global amax, appended to each row (which makes it the local amax and leaves every other element's
    cast unchanged) and dropped again. A stochastic cast of a shard casts the gathered full tensor (the same random
    numbers as one rank)."""
    axis %= t.dim()
    if group is None or not sharded:
        return fake_quantize(t, cast, axis, stochastic=stochastic, generator=generator, check=False)
    if stochastic:
        dim = sharded[0]
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        q = fake_quantize(torch.cat(parts, dim=dim), cast, axis, stochastic=True, generator=generator, check=False)
        return q.narrow(dim, dist.get_rank(group) * t.shape[dim], t.shape[dim])
    if cast.scaling == "row" and axis in sharded:
        amax = t.detach().abs().amax(dim=axis, keepdim=True)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        q = fake_quantize(torch.cat([t, amax.to(t.dtype)], dim=axis), cast, axis, check=False)
        return q.narrow(axis, 0, t.shape[axis])
    if cast.scaling == "tensor" or cast.scale == "e4m3":  # NVFP4: an FP32 tensor scale over the E4M3 block scales
        amax = t.detach().abs().amax().float()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
        return fake_quantize(t, cast, axis, tensor_amax=amax, check=False)
    return fake_quantize(t, cast, axis, check=False)  # blocks: a shard holds whole blocks


@dataclasses.dataclass(frozen=True)
class _Shards:
    """Which dims of the GEMM operands (x and g as [tokens, features], w as [out, in]) are split over the TP group."""

    group: object = None
    x: tuple[int, ...] = ()
    w: tuple[int, ...] = ()
    g: tuple[int, ...] = ()


_ONE_RANK = _Shards()


class LowPrecisionMatmul(torch.autograd.Function):
    """``x @ w^T`` with every operand of the three GEMMs cast by the recipe (module docstring); saves the
    high-precision x and w and recasts them along the backward GEMMs' contraction axes."""

    @staticmethod
    def forward(ctx, x, w, recipe: Recipe, shards: _Shards, index: int):
        x2 = x.reshape(-1, x.shape[-1])
        why = _check_blocks(recipe, {"tokens per micro-batch": x2.shape[0]})
        if why:
            raise ConfigError(f"low_precision.recipe = {recipe.name}: the wgrad casts along tokens: {why}; change "
                              "training.seq_len or the micro-batch size")
        xq = _cast(x2, recipe.input, 1, shards.group, shards.x)
        wq = _cast(w, recipe.weight, 1, shards.group, shards.w)
        ctx.save_for_backward(x, w)
        ctx.recipe, ctx.shards, ctx.index = recipe, shards, index
        return (xq @ wq.t()).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        recipe, shards, index = ctx.recipe, ctx.shards, ctx.index
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        sr = recipe.stochastic_grad
        dx = dw = None
        if ctx.needs_input_grad[0]:
            gq = _cast(g2, recipe.grad_output, 1, shards.group, shards.g, stochastic=sr,
                       generator=_generator(index, 0, g.device) if sr else None)
            wq = _cast(w, recipe.weight, 0, shards.group, shards.w)
            dx = (gq @ wq).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            if recipe.wgrad_hadamard:
                # one sign vector for both operands and every chunk of tokens: (HDg)^T (HDx) = g^T x
                signs = random_signs(recipe.wgrad_hadamard, _generator(index, 1, g.device), g.device)
                g2 = random_hadamard(g2, recipe.wgrad_hadamard, 0, signs=signs)
                x2 = random_hadamard(x2, recipe.wgrad_hadamard, 0, signs=signs)
            gq = _cast(g2, recipe.grad_output, 0, shards.group, shards.g, stochastic=sr,
                       generator=_generator(index, 2, g.device) if sr else None)
            xq = _cast(x2, recipe.input, 0, shards.group, shards.x)
            dw = gq.t() @ xq
        return dx, dw, None, None, None


def _check_blocks(recipe: Recipe, sizes: dict[str, int]) -> str | None:
    """Why a GEMM of these contraction sizes cannot be cast in whole blocks, or None."""
    for name, cast in (("input", recipe.input), ("weight", recipe.weight), ("grad_output", recipe.grad_output)):
        if cast.scaling != "block":
            continue
        for dim, n in sizes.items():
            if n % cast.block:
                return f"{dim} = {n} is not a multiple of the {name} cast's block of {cast.block}"
    return None


class LowPrecisionLinear(nn.Linear):
    """An ``nn.Linear`` whose GEMMs compute in its recipe's formats (``lowprec_recipe``); the parameters are the
    Linear's own (same names and shapes)."""

    lowprec_recipe: Recipe
    lowprec_index: int = 0  # its place among the converted modules: seeds its casts' random numbers

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias, self.lowprec_recipe, self.lowprec_index)


@torch.compiler.disable  # runs eagerly inside a compiled block: its seeds and collectives are Python state
def _linear(x, weight, bias, recipe: Recipe, index: int) -> torch.Tensor:
    if not isinstance(weight, DTensor) or all(isinstance(p, Replicate) for p in weight.placements):
        w = weight.to_local() if isinstance(weight, DTensor) else weight
        xl = x.to_local() if isinstance(x, DTensor) else x
        y = LowPrecisionMatmul.apply(xl, w, recipe, _ONE_RANK, index)
        b = bias.to_local() if isinstance(bias, DTensor) else bias
        return y if b is None else y + b
    mesh, (placement,) = weight.device_mesh, weight.placements
    group = mesh.get_group()
    w = weight.to_local()
    if placement == Shard(0):  # column-parallel: out-features split; x replicated, y and g split on features
        _require_blocks(recipe, w.shape[0], "out-features per TP shard")
        xl = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
        y = LowPrecisionMatmul.apply(xl, w, recipe, _Shards(group, (), (0,), (1,)), index)
        if bias is not None:
            y = y + bias.to_local()
        return DTensor.from_local(y, mesh, [Shard(y.dim() - 1)], run_check=False)
    if placement == Shard(1):  # row-parallel: in-features split; x split on features, y a partial sum
        _require_blocks(recipe, w.shape[1], "in-features per TP shard")
        xl = x.to_local() if isinstance(x, DTensor) else x
        y = DTensor.from_local(LowPrecisionMatmul.apply(xl, w, recipe, _Shards(group, (1,), (1,), ()), index),
                               mesh, [Partial()], run_check=False)
        return y if bias is None else y + bias
    raise ConfigError(f"low_precision: a converted Linear's weight has the TP placement {placement}; only "
                      "column- and row-parallel Linears can be cast (set low_precision.recipe = bf16)")


def _require_blocks(recipe: Recipe, n: int, what: str) -> None:
    why = _check_blocks(recipe, {what: n})
    if why:
        raise ConfigError(f"low_precision.recipe = {recipe.name}: {why}; choose a parallelism.tp that keeps whole "
                          "blocks on each shard")


# ------------------------------------------------------------------ the conversion


def _block_index(name: str, blocks: list[str]) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "layers":
        return blocks.index(parts[1]) if parts[1] in blocks else None
    return None


def select_linears(model: nn.Module, lp_cfg, recipe: Recipe) -> tuple[list[str], list[str]]:
    """The FQNs of the Linears the filters convert, and one line per Linear skipped because its GEMMs cannot be
    cast in whole blocks or it is a subclass of ``nn.Linear`` with its own forward."""
    blocks = list(model.layers.keys()) if hasattr(model, "layers") else []
    n = len(blocks)
    last = lp_cfg.skip_last_blocks
    if last < 0:
        last = math.ceil(recipe.keep_last_fraction * n)
    chosen, notes = [], []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or isinstance(module, LowPrecisionLinear):
            continue
        block = _block_index(name, blocks)
        if block is not None and (block < lp_cfg.skip_first_blocks or block >= n - last):
            continue
        if name.split(".")[-1] == "output" and block is None and lp_cfg.skip_output:
            continue
        if lp_cfg.skip_attention and ".attention." in f".{name}.":
            continue
        if min(module.in_features, module.out_features) < lp_cfg.min_dim:
            continue
        why = _check_blocks(recipe, {"in_features": module.in_features, "out_features": module.out_features})
        if type(module) is not nn.Linear:  # a subclass computes its own forward (nGPT's ScaledLinear): not ours
            why = f"a {type(module).__name__} with its own forward"
        if why:
            notes.append(f"low_precision: {name} stays in high precision ({why})")
            continue
        chosen.append(name)
    return chosen, notes


def validate_low_precision(lp_cfg) -> None:
    """One-line ConfigError for a ``[low_precision]`` value no filter can mean."""
    for key, low in (("skip_first_blocks", 0), ("skip_last_blocks", -1), ("min_dim", 0)):
        value = getattr(lp_cfg, key)
        if value < low:
            raise ConfigError(f"low_precision.{key} = {value} is below {low}; use a count >= {low}"
                              + (" (-1 = the recipe's share)" if low == -1 else ""))


def convert_model(model: nn.Module, lp_cfg, device_type: str, tp: int = 1,
                  log: Callable[[str], None] | None = None) -> list[str]:
    """Converts the Linears ``lp_cfg`` (``[low_precision]``) selects; returns their names (none for bf16). ``log``
    gets one line per Linear skipped for its block size and one saying which kernels run."""
    validate_low_precision(lp_cfg)
    if lp_cfg.recipe == "bf16":
        return []
    recipe = RECIPES[lp_cfg.recipe]
    chosen, notes = select_linears(model, lp_cfg, recipe)
    if not chosen:
        raise ConfigError(f"low_precision.recipe = {lp_cfg.recipe}: the model has no Linear layer the filters "
                          "select (skip_* / min_dim); loosen them or set low_precision.recipe = bf16")
    if uses_real_kernels(recipe, lp_cfg.emulate, device_type, tp):
        from outlier_titan.lowprec.torchao_kernels import convert_float8

        convert_float8(model, chosen, recipe)
        kernels = f"torchao Float8Linear ({recipe.torchao_float8})"
    else:
        for index, name in enumerate(chosen):
            module = model.get_submodule(name)
            module.__class__ = LowPrecisionLinear
            module.lowprec_index = index
        kernels = "emulated (fake-quantised operands)"
    for name in chosen:
        model.get_submodule(name).lowprec_recipe = recipe
    for line in notes + [f"low_precision: {recipe.name} on {len(chosen)} Linear layers, {kernels}"]:
        if log is not None:
            log(line)
    return chosen


# ------------------------------------------------------------------ the dry run's bytes

_SCALE_BYTES = {"fp32": 4, "pow2": 4, "e8m0": 1, "e4m3": 1}


def cast_bytes(shape: tuple[int, int], cast: Cast) -> float:
    """Bytes of a [rows, cols] operand cast along its cols: the elements plus the scales (one per tensor, row or
    block; NVFP4's E4M3 block scales add one FP32 tensor scale)."""
    rows, cols = shape
    n_scales = {"tensor": 1, "row": rows, "block": rows * cols / max(cast.block, 1)}[cast.scaling]
    extra = 4 if cast.scale == "e4m3" else 0
    element = ELEMENTS[cast.element]
    element_bytes = (1 + element.ebits + element.mbits) / 8  # sign, exponent and mantissa bits
    return rows * cols * element_bytes + n_scales * _SCALE_BYTES[cast.scale] + extra


def fp8_all_gather(recipe: Recipe, emulate: str, device_type: str, tp: int = 1) -> bool:
    """Whether FSDP all-gathers the converted weights in FP8 (torchao's tensorwise recipe on real kernels)."""
    return kernels_wanted(recipe, emulate, device_type, tp) and recipe.torchao_float8 == "tensorwise"
