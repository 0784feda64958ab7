"""Smooth-SwiGLU (Fishman et al. 2024, ``model.smooth_swiglu``): the same function as SwiGLU in float64 (outputs and
gradients, pre_ln and op, with and without biases), w2's input as the authors' code makes it (the linear branch
divided per token by its max |value|), what it is for (a per-tensor FP8 cast of w2's input keeps the ordinary
tokens' precision beside a quadratic outlier), the one-line config error, HF export, equal losses at 1 rank,
FSDP 2 and FSDP 2 x TP 2 (gloo), and the TP MLP equal to one rank's in float64 under a per-tensor FP8 recipe."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from outlier_titan.config.job_config import LowPrecision
from outlier_titan.config.job_config import Model as ModelConfig
from outlier_titan.config.manager import ConfigError, parse_args
from outlier_titan.hf.adapters import LlamaAdapter, adapter_for_args
from outlier_titan.lowprec.training import convert_model
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import MLP
from outlier_titan.models.registry import model_args
from tests.launch import LAYOUTS, REPO, TINY, assert_losses_close, launch_workers, train

SPECS = {"pre_ln": dict(flavor="debug_llama"), "op": dict(flavor="debug", mlp="swiglu")}


def build(spec_name: str, smooth: bool, bias: bool):
    spec, args = model_args(ModelConfig(name=spec_name, smooth_swiglu=smooth, bias=bias, **SPECS[spec_name]), 256, 64)
    model = spec.build(args)
    model.init_weights(Initializer(0, "cpu"))
    return model.double()


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("spec_name", list(SPECS))
def test_it_is_the_plain_swiglu_in_float64(spec_name, bias):
    plain, smooth = build(spec_name, False, bias), build(spec_name, True, bias)
    if bias:  # the init zeroes biases; w2's must be non-zero for the bias path to be tested
        for model in (plain, smooth):
            torch.manual_seed(1)
            with torch.no_grad():
                for block in model.layers.values():
                    block.feed_forward.w2.bias.normal_()
    assert smooth.state_dict().keys() == plain.state_dict().keys()  # no parameter or buffer of its own
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    outs = []
    for model in (plain, smooth):
        logits = model(tokens)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        outs.append((logits.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (a, grads_a), (b, grads_b) = outs
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    for name, g in grads_a.items():
        assert torch.allclose(grads_b[name], g, rtol=1e-10, atol=1e-13), name


def test_w2_reads_the_linear_branch_divided_by_its_per_token_max():
    """The authors' ScaledSwiglu (not delayed, detached): ``silu(x1) * x2 / max_j |x2_j|``; our float64 reference
    written from that definition, and a token whose linear branch is zero keeps the scale 1."""
    torch.manual_seed(0)
    mlp = MLP(16, 48, "swiglu", bias=False, smooth=True).double()
    with torch.no_grad():
        mlp.w3.weight[:, :4] = 0  # a token reading only the first 4 input dims has a zero linear branch
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    x[1, 2, 4:] = 0
    seen = []
    mlp.w2.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    y = mlp(x)
    gate, lin = x @ mlp.w1.weight.T, x @ mlp.w3.weight.T
    s = lin.abs().amax(-1, keepdim=True)
    s = torch.where(s > 0, s, torch.ones_like(s))
    ref_input = gate * torch.sigmoid(gate) * lin / s
    assert torch.allclose(seen[0], ref_input, rtol=1e-14, atol=0)
    assert torch.allclose(y, (ref_input @ mlp.w2.weight.T) * s, rtol=1e-13, atol=1e-15)
    assert s[1, 2, 0] == 1 and (lin / s).abs().amax(-1)[0].allclose(torch.ones(5, dtype=torch.float64))


def cast_errors(recipe: str) -> list[float]:
    """Beside one token whose input is 300x the others' (SwiGLU's product ~1e5x larger there), the relative error of
    the other tokens' MLP outputs with w1, w2, w3 cast by ``recipe`` (emulated), for SwiGLU and Smooth-SwiGLU with
    the same weights, against the float64 SwiGLU."""
    torch.manual_seed(0)
    plain = MLP(64, 256, "swiglu", bias=False)
    smooth = MLP(64, 256, "swiglu", bias=False, smooth=True)
    smooth.load_state_dict(plain.state_dict())
    x = torch.randn(1, 32, 64)
    x[0, 0] *= 300
    with torch.no_grad():
        ref = copy.deepcopy(plain).double()(x.double())[0, 1:]
    errors = []
    for mlp in (plain, smooth):
        cast = copy.deepcopy(mlp)
        assert convert_model(cast, LowPrecision(recipe=recipe, min_dim=0), "cpu") == ["w1", "w2", "w3"]
        with torch.no_grad():
            out = cast(x)[0, 1:].double()
        errors.append(((out - ref).norm() / ref.norm()).item())
    return errors


def test_a_per_tensor_fp8_cast_keeps_the_other_tokens_precision_beside_a_quadratic_outlier():
    """One FP8 scale per tensor (``fp8_tensorwise``) flushes the other tokens of w2's input; Smooth-SwiGLU's leaves
    them near the error of the other casts. Measured 2026-11-29: 0.41 plain, 0.066 smooth."""
    errors = cast_errors("fp8_tensorwise")
    assert errors[0] > 0.3 and errors[1] < 0.1, errors


def test_per_row_and_mx_casts_need_no_smoothing_but_nvfp4s_tensor_scale_does():
    """Where every token has scales of its own (``fp8_rowwise``; ``mxfp8``'s E8M0 blocks) the option changes the
    error by under 2 % (measured 2026-11-29: 0.0624 vs 0.0622; 0.120 vs 0.121); NVFP4's E4M3 block scales sit under
    one FP32 scale per tensor, which the outlier token sets, and the option roughly halves the other tokens' error
    there (0.47 vs 0.25)."""
    for recipe in ("fp8_rowwise", "mxfp8"):
        errors = cast_errors(recipe)
        assert abs(errors[1] - errors[0]) < 0.02 * errors[0], (recipe, errors)
    nvfp4 = cast_errors("nvfp4")
    assert nvfp4[1] < 0.7 * nvfp4[0], nvfp4


def test_the_super_weight_rule_reads_the_down_projection_of_the_plain_swiglu():
    """Yu et al.'s rule reads the model's down projection: with Smooth-SwiGLU, detection and the probe's metric find
    the super weight planted in tests/test_super_weights.py with the same spikes as the plain SwiGLU with the same
    weights, although w2's own operands are rescaled (its input spike is far smaller)."""
    from outlier_titan.config.job_config import Observe
    from outlier_titan.observe import super_weights as sw
    from outlier_titan.observe.probe import OutlierProbe
    from tests.test_super_weights import PLANT, captured, plant, tokens

    models = []
    for smooth in (False, True):
        spec, args = model_args(ModelConfig(name="pre_ln", flavor="debug_llama", smooth_swiglu=smooth), 512, 16)
        model = spec.build(args)
        model.init_weights(Initializer(7, "cpu"))
        model = model.double()
        plant(model)
        models.append(model)
    toks = tokens()
    plain, smooth = (sw.detect(m, toks) for m in models)
    assert [(f.layer, f.row, f.col) for f in smooth] == [PLANT] == [(f.layer, f.row, f.col) for f in plain]
    assert smooth[0].act_in == pytest.approx(plain[0].act_in, rel=1e-12)
    assert smooth[0].act_out == pytest.approx(plain[0].act_out, rel=1e-12)
    assert captured(models[1], toks)[PLANT[0]][0].abs().max() < abs(plain[0].act_in) / 10  # w2's own input
    probed = [OutlierProbe(m, Observe(mode="full")).run(toks)[0] for m in models]
    keys = [k for k in probed[0] if k.rsplit("/", 1)[-1] in ("super_weight", "sa_in", "sa_out", "sw_value")]
    assert len(keys) >= 4 * len(models[0].layers)
    for key in keys:
        assert probed[1][key] == pytest.approx(probed[0][key], rel=1e-9), key


def test_it_needs_the_swiglu_mlp_in_one_line():
    cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), "--model.smooth_swiglu", "true"])
    with pytest.raises(ConfigError) as e:
        model_args(cfg.model, 256, 64)
    assert "model.mlp = 'gelu'" in str(e.value) and "\n" not in str(e.value)


def test_it_exports_to_hf_as_the_plain_llama(tmp_path):
    """An identity in full precision, so HF Llama holds the model exactly (importing gives smooth_swiglu off): the
    export is allowed, and with an HF Llama's weights the smoothed model's float64 logits are transformers'."""
    from dataclasses import replace

    from outlier_titan.hf.load import _build, import_hf
    from tests.test_hf import VOCAB, hf_logits, tiny_llama

    _, args = model_args(ModelConfig(name="pre_ln", flavor="debug_llama", smooth_swiglu=True), 256, 64)
    assert adapter_for_args(args) == (LlamaAdapter, "")
    folder = tiny_llama(tmp_path / "llama")
    plain, cfg = import_hf(folder, dtype=torch.float64)
    smooth, _ = _build(replace(cfg, smooth_swiglu=True), cfg.vocab_size, 1, "cpu", torch.float64)  # import_hf's
    smooth.load_state_dict(plain.state_dict())
    assert smooth.layers["0"].feed_forward.smooth_scale is not None
    tokens = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(smooth(tokens), hf_logits(folder, tokens, torch.float64), rtol=0, atol=1e-10)


OPTIONS = ["--model.flavor", "debug_llama", "--model.smooth_swiglu", "true"]


@pytest.mark.dist
@pytest.mark.extended
def test_it_trains_equally_on_1_rank_fsdp2_and_fsdp2_tp2_and_like_the_plain_swiglu(tmp_path):
    runs = {layout: train(tmp_path, *TINY, *OPTIONS, *extra, nproc=nproc, name=layout).check()
            for layout, (nproc, extra) in LAYOUTS.items()}
    base = runs["one_rank"].losses
    for layout in ("fsdp2", "fsdp2_tp2"):
        assert_losses_close(runs[layout].losses, base, rtol=1e-4)
    plain = train(tmp_path, *TINY, "--model.flavor", "debug_llama", name="plain").check()
    assert_losses_close(base, plain.losses, rtol=1e-4)  # full precision: rounding apart, the same model


@pytest.mark.dist
def test_under_tp_the_scale_is_the_max_over_every_shard_so_the_mlp_casts_like_one_rank(tmp_path):
    """In float64, the TP 2 MLP (the blocks' plan) equals the unsharded one in full precision and under
    ``fp8_tensorwise`` (one scale over all of w2's input): only the GEMMs' sum order differs. Each rank's own max,
    as the authors' code takes it, is not even the same function at TP 2 (the control)."""
    out = tmp_path / "tp.pt"
    launch_workers(REPO / "tests" / "dist" / "smooth_swiglu_worker.py", [str(out)], world=2)
    results = torch.load(out)
    for case in ("full", "fp8_tensorwise", "own_shard_max"):
        for what, (one, tp) in results[case].items():
            err = ((one - tp).norm() / one.norm()).item()
            if case == "own_shard_max":
                assert what != "y" or err > 1e-3, (what, err)
            else:
                assert err < 1e-12, (case, what, err)
