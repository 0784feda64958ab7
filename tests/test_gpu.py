"""The GPU paths: bf16 + fp32-reduce FSDP training, compile, the fused attention backends, the optimizers on CUDA
DTensors, the outlier probe and DCP across devices (``pytest -m gpu``; scripts/gpu_check.sh part 1 runs them).

Each test body is parametrised over the device: the ``cuda`` case is marked ``gpu`` and skips with "needs a CUDA
device" where none is visible; the ``cpu`` case runs in the normal suite, so the test logic itself is exercised
on every CI run (on the CPU the trainer always computes in float32, so there the bf16 comparisons hold exactly).
Attention variants and optimizers are read from the config's choices, so variants and optimizers added later are
tested without editing this file.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel

from outlier_titan.config.job_config import Model, Observe, Optimizer
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args
from outlier_titan.optim.builder import optimizer_names
from outlier_titan.observe.logger import read_metrics
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.tools.gpu_check import benchmarks
from outlier_titan.tools.gpu_check.plan import attention_variants
from tests.launch import TINY, train

CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                         reason="needs a CUDA device")])
DEVICES = ["cpu", CUDA]
ATTENTION_KEY, ATTENTION_VARIANTS = attention_variants()
OPTIMIZERS = optimizer_names()

# The SDPA kernel each fused attention variant runs on, as docs/gpu.md states: on CUDA the flash kernel (bf16,
# head dim <= 256), on the CPU its flash kernel for the CPU. A variant missing here must make no SDPA call at
# all (explicit path) or run on a fused kernel, never on the math fallback.
FUSED_KERNEL = {"cuda": "_scaled_dot_product_flash_attention", "cpu": "_scaled_dot_product_flash_attention_for_cpu"}
FUSED_VARIANTS = ("softmax", "softmax1")
KINKED_VARIANTS = ("relu", "softpick")
MATH_KERNEL = "_scaled_dot_product_attention_math"


# ------------------------------------------------------------------------------------------- attention

@pytest.mark.parametrize("variant", ATTENTION_VARIANTS)
@pytest.mark.parametrize("device", DEVICES)
def test_attention_variant_in_bf16_matches_its_explicit_formula_on_the_fused_kernel(device, variant):
    item = dict(flavor="debug_llama", key=ATTENTION_KEY, variant=variant, seq_len=48)  # GQA + RoPE, d_h 32
    ref_mod, dim = benchmarks._attention_module(item, torch.device("cpu"))
    ref_mod.double()
    ref_mod.prob_hook = lambda p: None  # the explicit formula: probabilities written out, then P @ V
    dev_mod, _ = benchmarks._attention_module(item, torch.device(device))
    for p in dev_mod.parameters():
        p.data = p.data.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 48, dim, generator=gen, dtype=torch.float64)
    up = torch.randn(2, 48, dim, generator=gen, dtype=torch.float64)

    xr = x.clone().requires_grad_()
    ref = ref_mod(xr)
    ref.backward(up)
    xd = x.to(device, torch.bfloat16).requires_grad_()
    # The other variants run on FlexAttention on CUDA; on the CPU the learned sink logit runs on the CPU flash
    # kernel (its lse rescaled), the rest on the chunked path (no SDPA call).
    backends = [SDPBackend.FLASH_ATTENTION] + ([SDPBackend.EFFICIENT_ATTENTION] if device == "cuda" else [])
    out = {}

    def fwd_bwd():
        xd.grad = None
        out["y"] = dev_mod(xd)
        out["y"].backward(up.to(device, torch.bfloat16))

    with sdpa_kernel(backends):  # the math fallback is not allowed: an unsupported input raises
        kernels, top = benchmarks.profiled(fwd_bwd, torch.device(device))
    assert top and all(0 < share <= 1 for _, share in top), top
    assert MATH_KERNEL not in kernels
    if variant in FUSED_VARIANTS:
        assert FUSED_KERNEL[device] in kernels, kernels
    y, gx = out["y"].double().cpu(), xd.grad.double().cpu()
    # bf16 inputs, weights and outputs: ~3 significant digits, errors relative to each tensor's scale
    assert (y - ref).abs().max() <= 2e-2 * ref.abs().max(), (y - ref).abs().max()
    # gradients in the Frobenius norm, relative. Measured on CPU (bf16 vs float64): 0.5-0.6 % for the smooth
    # variants, 2.5 % (relu) and 3.0 % (softpick): their weights have a kink at logit 0, where most logits sit,
    # and a bf16-rounded logit on the other side of it flips that entry's gradient.
    rel = (gx - xr.grad).norm() / xr.grad.norm()
    assert rel <= (5e-2 if variant in KINKED_VARIANTS else 1.5e-2), rel


# ------------------------------------------------------------------------------------------- optimizers

@pytest.fixture(scope="module")
def one_rank():
    """A world-size-1 process group (NCCL for CUDA tensors, gloo for CPU ones) for the DTensor tests."""
    if dist.is_initialized():
        yield
        return
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _meta_model():
    spec, args = model_args(Model(name="pre_ln", flavor="debug"), vocab_size=4096, seq_len=64)
    with torch.device("meta"):
        return spec.build(args)


def _debug_model(device, seed=0):
    """The debug model initialised on the CPU (the same numbers for every device), then moved."""
    model = _meta_model()
    model.to_empty(device="cpu")
    model.init_weights(Initializer(seed, "cpu"))
    return model.to(device)


def _step_grads(model, step):
    gen = torch.Generator().manual_seed(100 + step)
    return {n: torch.randn(p.shape, generator=gen) * 1e-2 for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_on_device_dtensors_matches_cpu(one_rank, device, name):
    """The optimizer steps FSDP2 DTensor parameters on a 1-rank ``device`` mesh; the same optimizer steps plain
    CPU tensors with the same gradients; after 4 steps the parameters agree within float32 rounding of the
    update (cuSOLVER vs LAPACK for SOAP's eigenbases, other reduction orders on CUDA). Muon's Newton-Schulz
    runs in float32 here: in its default bfloat16 the two devices' matrix products round differently by about
    bf16's epsilon (on an H200, 6e-6 against an update of 1e-3), which says nothing about the device path."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from outlier_titan.optim.builder import build_optimizer
    from outlier_titan.parallel.fsdp import apply_fsdp

    cfg = Optimizer(name=name, tile_size=32, max_shards=4, lr=1e-3, muon_ns_dtype="float32")
    ref = _debug_model("cpu")
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    mesh = init_device_mesh(device, (1,))
    dev = _meta_model()
    apply_fsdp(dev, mesh, torch.float32, torch.float32)
    dev.to_empty(device=device)
    with torch.no_grad():
        for (n, p), (_, q) in zip(dev.named_parameters(), ref.named_parameters()):
            p.to_local().copy_(q.to(device))
    opt_ref = build_optimizer(ref, cfg, seed=0)
    opt_dev = build_optimizer(dev, cfg, seed=0)
    for step in range(4):
        grads = _step_grads(ref, step)
        for n, p in ref.named_parameters():
            p.grad = grads[n].clone()
        for n, p in dev.named_parameters():
            p.grad = distribute_tensor(grads[n].to(device), mesh, p.placements)
        opt_ref.step()
        opt_dev.step()
    if name in ("adamw", "adam"):  # optimizer.implementation = auto: torch's fused kernel on the GPU only
        assert bool(opt_dev.param_groups[0]["fused"]) == (device == "cuda")
    for n, p in dev.named_parameters():
        got, want = p.full_tensor().cpu(), dict(ref.named_parameters())[n].detach()
        moved = (want - init[n]).abs().max().item()
        assert moved > 0, f"{name}: {n} did not move"
        err = (got - want).abs().max().item()
        assert err <= 1e-3 * moved + 1e-7, f"{name}: {n}: |device - cpu| = {err:.3g}, update {moved:.3g}"


# ------------------------------------------------------------------------------------------- probe

@pytest.mark.parametrize("device", DEVICES)
def test_probe_on_device_matches_cpu(device):
    model_cpu = _debug_model("cpu")
    model_dev = _debug_model(device)
    tokens = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    want, _ = OutlierProbe(model_cpu, Observe(mode="full")).run(tokens)
    got, images = OutlierProbe(model_dev, Observe(mode="full")).run(tokens.to(device))
    assert got.keys() == want.keys() and images
    for k in want:
        if math.isnan(want[k]):
            assert math.isnan(got[k]), k
        elif "argmax" in k:  # shares of rows whose argmax is the first key: a near-tie may flip a few rows
            assert got[k] == pytest.approx(want[k], abs=0.05), k
        else:
            assert got[k] == pytest.approx(want[k], rel=1e-3, abs=1e-5), k


# ------------------------------------------------------------------------------------------- training

def _losses(run):
    return {s: r["loss"] for s, r in read_metrics(run.run_dir / "metrics.jsonl").items() if "loss" in r}


@pytest.mark.parametrize("flavor, device", [("debug", "cpu"), pytest.param("debug", "cuda", marks=CUDA.marks),
                                            pytest.param("llama_1b", "cuda", marks=CUDA.marks)])
def test_bf16_fp32_reduce_training_matches_fp32_and_probes(tmp_path, flavor, device):
    """FSDP2 at world size 1 with bf16 parameters and fp32 gradient reduction trains (loss finite and falling,
    the probe's metrics logged at steps 2 and 4) and stays within bf16 rounding of the all-fp32 run."""
    # debug.toml's rate would make a 1B model's first steps jump; at 3e-4 its 512-token batches still did (H200:
    # losses 8.74, 8.55, 8.58, 10.06 over the 4 steps)
    lr = "3e-3" if flavor == "debug" else "1e-4"
    common = [*TINY, "--training.device", device, "--model.flavor", flavor, "--training.steps", "4",
              "--observe.every", "2", "--observe.mode", "full", "--optimizer.lr", lr]
    bf16 = train(tmp_path, *common, "--training.mixed_precision_param", "bfloat16",
                 "--training.mixed_precision_reduce", "float32", name="bf16").check()
    fp32 = train(tmp_path, *common, "--training.mixed_precision_param", "float32",
                 "--training.mixed_precision_reduce", "float32", name="fp32").check()
    a, b = _losses(bf16), _losses(fp32)
    assert sorted(a) == [1, 2, 3, 4] and all(math.isfinite(v) for v in a.values())
    assert a[4] < a[1], a
    for s in a:
        assert a[s] == pytest.approx(b[s], rel=2e-2), (s, a[s], b[s])
    probed = read_metrics(bf16.run_dir / "metrics.jsonl")
    for s in (2, 4):
        assert math.isfinite(probed[s]["outliers/kurtosis_first"]), probed[s]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compile_matches_eager_in_bf16(tmp_path):
    """The CPU case (float32, rtol 1e-4) is tests/test_scale.py::test_compile_matches_eager."""
    common = [*TINY, "--training.device", "cuda", "--model.flavor", "debug_llama", "--training.steps", "6"]
    eager = _losses(train(tmp_path, *common, name="eager").check())
    compiled = _losses(train(tmp_path, *common, "--compile.enable", "true", name="compiled").check())
    assert sorted(eager) == sorted(compiled) == list(range(1, 7))
    for s in eager:
        assert compiled[s] == pytest.approx(eager[s], rel=1e-2), (s, compiled[s], eager[s])


# 4 runs: ~20-35 s on CPU
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=[pytest.mark.slow, pytest.mark.extended]), CUDA])
def test_dcp_saved_on_device_loads_on_cpu_and_back(tmp_path, device):
    """Steps 1-4 on ``device`` (checkpoints at 2 and 4), 5-6 resumed on the CPU, 7-8 resumed on ``device``:
    each resumed stretch follows the uninterrupted ``device`` run within bf16 rounding."""
    ckpt = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "2", "--lr_scheduler.total_steps", "8"]
    full = _losses(train(tmp_path / "full", *ckpt, "--training.device", device, "--training.steps", "8").check())
    train(tmp_path / "split", *ckpt, "--training.device", device, "--training.steps", "4").check()
    on_cpu = train(tmp_path / "split", *ckpt, "--training.device", "cpu", "--training.steps", "6").check()
    back = train(tmp_path / "split", *ckpt, "--training.device", device, "--training.steps", "8").check()
    assert "resumed from" in on_cpu.stdout and "step-4" in on_cpu.stdout
    assert "resumed from" in back.stdout and "step-6" in back.stdout
    resumed = _losses(back)
    assert sorted(resumed) == list(range(1, 9))
    for s in range(5, 9):
        assert resumed[s] == pytest.approx(full[s], rel=2e-2), (s, resumed[s], full[s])
    assert resumed[8] < full[1] - 0.5  # the trained state was loaded, not a fresh init
