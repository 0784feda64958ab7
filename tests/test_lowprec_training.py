"""``[low_precision]`` at one rank: the converted Linear's three GEMMs against a float64 reference of "cast, multiply"
written from the recipe (each operand cast along its GEMM's contraction axis), the emulated FP8 recipes against
torchao's ``Float8Linear(emulate=True)``, the filters, the one-line errors, and the debug model trained in every
precision."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from outlier_titan.errors import ConfigError
from outlier_titan.lowprec.formats import fake_quantize, random_hadamard, random_signs
from outlier_titan.lowprec.recipes import PRECISIONS, RECIPES
from outlier_titan.lowprec.training import (LowPrecisionLinear, _generator, cast_bytes, convert_model,
                                            set_rng_position)
from tests.launch import TINY, train


def lp_cfg(recipe: str = "mxfp8", **kw) -> SimpleNamespace:
    base = dict(recipe=recipe, emulate="always", skip_first_blocks=0, skip_last_blocks=0, skip_output=True,
                skip_attention=False, min_dim=0)
    return SimpleNamespace(**{**base, **kw})


def _converted_linear(recipe: str, d_in=64, d_out=96, seed=0) -> nn.Module:
    torch.manual_seed(seed)
    holder = nn.Module()
    holder.proj = nn.Linear(d_in, d_out, bias=True)
    assert convert_model(holder, lp_cfg(recipe), "cpu") == ["proj"]
    return holder.proj


def _reference(recipe, x, w, b, g, index):
    """float64 GEMMs of the operands cast by the recipe (the casts as the formats module defines them)."""
    r = RECIPES[recipe]
    x2, g2 = x.reshape(-1, x.shape[-1]).double(), g.reshape(-1, g.shape[-1]).double()
    w = w.double()
    y = fake_quantize(x2, r.input, 1) @ fake_quantize(w, r.weight, 1).T + b.double()
    sr = r.stochastic_grad
    dx = fake_quantize(g2, r.grad_output, 1, stochastic=sr, generator=_generator(index, 0, g.device) if sr else None) \
        @ fake_quantize(w, r.weight, 0)
    gw, xw = g2, x2
    if r.wgrad_hadamard:
        signs = random_signs(r.wgrad_hadamard, _generator(index, 1, g.device), g.device)
        gw, xw = (random_hadamard(t, r.wgrad_hadamard, 0, signs=signs) for t in (g2, x2))
    dw = fake_quantize(gw, r.grad_output, 0, stochastic=sr, generator=_generator(index, 2, g.device) if sr else None
                       ).T @ fake_quantize(xw, r.input, 0)
    return y.reshape(*x.shape[:-1], -1), dx.reshape(x.shape), dw, g2.sum(0)


def _heavy(shape, seed):
    """Gaussian with a few large channels: the casts' scales then differ between rows, blocks and axes."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
    t[..., :: 7] *= 20.0
    return t


@pytest.mark.parametrize("recipe", list(RECIPES))
def test_the_linear_equals_a_float64_reference_of_its_casts(recipe):
    lin = _converted_linear(recipe)
    assert isinstance(lin, LowPrecisionLinear) and lin.lowprec_recipe is RECIPES[recipe]
    with torch.no_grad():
        lin.weight.copy_(_heavy((96, 64), 3) * 0.05)
    set_rng_position(seed=3, step=7, micro=1)
    x = _heavy((2, 32, 64), 1).requires_grad_()
    g = _heavy((2, 32, 96), 2) * 1e-3
    y = lin(x)
    y.backward(g)
    ry, rdx, rdw, rdb = _reference(recipe, x.detach(), lin.weight.detach(), lin.bias.detach(), g, lin.lowprec_index)
    for got, want in ((y, ry), (x.grad, rdx), (lin.weight.grad, rdw), (lin.bias.grad, rdb)):
        err = (got.double() - want).norm() / want.norm()
        assert err < 1e-6, (recipe, err.item())
    # the reference is sharp: the high-precision GEMMs, or the weight cast along the forward's axis in the dgrad,
    # miss it by far more than the float32 rounding allowed above
    plain = (g.reshape(-1, 96).double() @ lin.weight.detach().double()).reshape(x.shape)
    assert (plain - rdx).norm() / rdx.norm() > 1e-3
    r = RECIPES[recipe]
    if r.weight.element == "e2m1" and not r.weight.block_2d:  # 4-bit blocks: the scale's axis matters
        sr = dict(stochastic=True, generator=_generator(lin.lowprec_index, 0, g.device)) if r.stochastic_grad else {}
        wrong_axis = (fake_quantize(g.reshape(-1, 96).double(), r.grad_output, 1, **sr) @ fake_quantize(
            lin.weight.detach().double(), r.weight, 1)).reshape(x.shape)
        assert (wrong_axis - rdx).norm() / rdx.norm() > 1e-2


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "nvfp4"])
def test_a_non_finite_gradient_spreads_instead_of_raising(recipe):
    """Training casts skip formats' NaN/inf refusal (and its device sync): a non-finite output gradient gives
    non-finite parameter gradients, which the trainer's divergence guard sees as a skipped step, not a crash."""
    lin = _converted_linear(recipe, d_in=32, d_out=32)
    set_rng_position(0, 1, 0)
    g = torch.zeros(64, 32)
    g[3, 5] = float("nan")
    lin(_heavy((64, 32), 1)).backward(g)
    assert not torch.isfinite(lin.weight.grad).all()


def test_the_random_numbers_follow_the_step_and_micro_batch():
    lin = _converted_linear("nvfp4", d_in=32, d_out=32)
    x = _heavy((64, 32), 1)
    grads = []
    for step, micro in ((1, 0), (1, 0), (2, 0), (1, 1)):
        set_rng_position(0, step, micro)
        lin.weight.grad = None
        lin(x).backward(_heavy((64, 32), 2))
        grads.append(lin.weight.grad.clone())
    assert torch.equal(grads[0], grads[1])
    assert not torch.equal(grads[0], grads[2]) and not torch.equal(grads[0], grads[3])


@pytest.mark.parametrize("recipe", ["fp8_rowwise", "fp8_tensorwise"])
def test_the_emulated_fp8_linear_equals_torchaos_float8_linear(recipe):
    from outlier_titan.lowprec.torchao_kernels import convert_float8

    ours = _converted_linear(recipe, seed=4)
    theirs = nn.Module()
    theirs.proj = nn.Linear(64, 96, bias=True)
    theirs.proj.load_state_dict(ours.state_dict())
    convert_float8(theirs, ["proj"], RECIPES[recipe], emulate=True)
    assert type(theirs.proj).__name__ == "Float8Linear"
    outs = []
    for lin in (ours, theirs.proj):
        x = _heavy((4, 32, 64), 5).requires_grad_()
        y = lin(x)
        y.backward(_heavy((4, 32, 96), 6) * 1e-2)
        outs.append((y, x.grad, lin.weight.grad))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6 * b.abs().max().item()), (a - b).abs().max()


def _toy_model(n_blocks=4, dim=64, hidden=128, small=16) -> nn.Module:
    model = nn.Module()
    model.layers = nn.ModuleDict()
    for i in range(n_blocks):
        block = nn.Module()
        block.attention = nn.Module()
        block.attention.wq = nn.Linear(dim, dim)
        block.feed_forward = nn.Module()
        block.feed_forward.w1 = nn.Linear(dim, hidden)
        block.feed_forward.gate = nn.Linear(dim, small)
        model.layers[str(i)] = block
    model.output = nn.Linear(dim, 200)
    return model


def _select(recipe="mxfp8", **kw):
    return convert_model(_toy_model(), lp_cfg(recipe, **kw), "cpu")


def test_the_filters_pick_the_modules_they_say():
    every = {f"layers.{i}.{m}" for i in range(4) for m in ("attention.wq", "feed_forward.w1")}
    assert set(_select("fp8_rowwise")) == every | {f"layers.{i}.feed_forward.gate" for i in range(4)}
    assert set(_select("fp8_rowwise", min_dim=32)) == every
    assert set(_select("fp8_rowwise", min_dim=32, skip_output=False)) == every | {"output"}
    assert set(_select("fp8_rowwise", min_dim=32, skip_attention=True)) == {
        f"layers.{i}.feed_forward.w1" for i in range(4)}
    assert set(_select("fp8_rowwise", min_dim=32, skip_first_blocks=1, skip_last_blocks=2)) == {
        f"layers.1.{m}" for m in ("attention.wq", "feed_forward.w1")}
    # -1: the recipe's share of the last blocks: nvfp4 keeps ceil(0.15 x 4) = 1, mxfp8 none
    assert {n.split(".")[1] for n in _select("nvfp4", skip_last_blocks=-1)} == {"0", "1", "2"}
    assert {n.split(".")[1] for n in _select("mxfp8", skip_last_blocks=-1)} == {"0", "1", "2", "3"}
    assert _select("bf16") == []


def test_a_linear_that_does_not_fill_whole_blocks_stays_and_says_so():
    assert "layers.0.feed_forward.gate" in _select("nvfp4")  # 16 out-features: one whole NVFP4 block
    model = _toy_model(small=24)
    lines = []
    names = convert_model(model, lp_cfg("mxfp8"), "cpu", log=lines.append)
    assert not any("gate" in n for n in names) and type(model.layers["0"].feed_forward.gate) is nn.Linear
    skipped = [line for line in lines if "gate" in line]
    assert len(skipped) == 4 and "out_features = 24 is not a multiple of the input cast's block of 32" in skipped[0]
    assert lines[-1] == "low_precision: mxfp8 on 8 Linear layers, emulated (fake-quantised operands)"


def test_the_conversion_keeps_the_parameters_and_their_names():
    model = _toy_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    convert_model(model, lp_cfg("nvfp4", skip_output=False), "cpu")
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("kw, needle", [
    (dict(skip_first_blocks=-1), "low_precision.skip_first_blocks = -1 is below 0"),
    (dict(skip_last_blocks=-2), "low_precision.skip_last_blocks = -2 is below -1"),
    (dict(min_dim=-5), "low_precision.min_dim = -5 is below 0"),
    (dict(min_dim=10_000), "the model has no Linear layer the filters select"),
])
def test_a_bad_value_gets_one_line(kw, needle):
    with pytest.raises(ConfigError) as e:
        _select("mxfp8", **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_the_tokens_of_a_block_cast_must_fill_blocks():
    lin = _converted_linear("mxfp8")
    with pytest.raises(ConfigError, match="tokens per micro-batch = 20 is not a multiple"):
        lin(torch.randn(20, 64))


def test_the_dry_run_bytes_of_a_cast():
    # 128 x 256 weight: FP8 row-wise 1 B + one FP32 scale per row; MXFP4 0.5 B + one E8M0 byte per 32;
    # NVFP4 0.5 B + one E4M3 byte per 16 + the FP32 tensor scale
    assert cast_bytes((128, 256), RECIPES["fp8_rowwise"].weight) == 128 * 256 + 128 * 4
    assert cast_bytes((128, 256), RECIPES["mxfp4"].weight) == 128 * 256 / 2 + 128 * 256 / 32
    assert cast_bytes((128, 256), RECIPES["nvfp4"].weight) == 128 * 256 / 2 + 128 * 256 / 16 + 4


def test_the_cli_lists_the_precisions_and_refuses_an_unknown_one(tmp_path):
    run = train(tmp_path, *TINY, "--low_precision.recipe", "fp6")
    assert run.returncode == 2
    assert "low_precision.recipe = 'fp6' is not allowed; choose one of: " + ", ".join(PRECISIONS) in run.stderr


def test_a_resume_may_change_the_precision_and_says_so(tmp_path):
    first = train(tmp_path, *TINY, "--training.steps", "4", "--checkpoint.enable", "true",
                  "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "8", "--training.seq_len", "32").check()
    assert "low_precision" not in first.stdout  # bf16: nothing converted, nothing said
    more = train(tmp_path, *TINY, "--training.steps", "8", "--checkpoint.enable", "true",
                 "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "8", "--training.seq_len", "32",
                 "--low_precision.recipe", "mxfp8").check()
    assert ("resume changes low_precision.recipe: 'bf16' -> 'mxfp8' (the same weights load; from here on their "
            "GEMMs cast as the new recipe says)") in more.stdout
    assert "resumed from" in more.stdout and "low_precision: mxfp8 on 24 Linear layers" in more.stdout
    assert sorted(more.losses) == list(range(1, 9)) and more.losses[8] < first.losses[1]  # one metrics file


def test_the_dry_run_prints_the_bytes_per_format():
    import subprocess
    import sys

    from tests.launch import REPO

    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"),
                          "--job.dry_run", "true", "--parallelism.dp_shard", "2", "--parallelism.tp", "2",
                          "--low_precision.recipe", "nvfp4"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    # debug: 4 blocks of 128-wide GPT-2 Linears, nvfp4 keeps the last: 3 x (qkv 3 x 128^2 + wo 128^2 + 2 x 128 x 512)
    elements = 3 * (4 * 128 * 128 + 2 * 128 * 512)
    line = next(x for x in out.stdout.splitlines() if "low precision" in x)
    gib = (elements / 2 + elements / 16 + 18 * 4) / 2 / 2**30
    assert f"nvfp4 on 18 Linears; their weights as the forward GEMMs read them: {gib:.4f} GiB per TP rank" in line


def test_missing_torchao_is_one_line(monkeypatch):
    import sys

    from outlier_titan.lowprec.torchao_kernels import import_torchao_float8

    monkeypatch.setitem(sys.modules, "torchao", None)
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    with pytest.raises(ConfigError, match=r"^low_precision: the FP8 kernels need torchao: pip install "
                                          r"'outlier_titan\[lowprec\]' \(or set low_precision.emulate = always\)$"):
        import_torchao_float8()


def test_a_linear_subclass_with_its_own_forward_stays_and_says_so():
    class Scaled(nn.Linear):
        def forward(self, x):
            return 2.0 * nn.functional.linear(x, self.weight)

    model = _toy_model()
    model.layers["0"].feed_forward.w1 = Scaled(64, 128)
    lines = []
    names = convert_model(model, lp_cfg("mxfp8"), "cpu", log=lines.append)
    assert "layers.0.feed_forward.w1" not in names and type(model.layers["0"].feed_forward.w1) is Scaled
    assert "low_precision: layers.0.feed_forward.w1 stays in high precision (a Scaled with its own forward)" in lines
