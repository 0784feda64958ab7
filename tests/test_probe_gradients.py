"""Gradient-side probe metrics (``observe.gradients``): the float64 reference of every formula, the probe's values
on a tiny float64 model against autograd by hand, no parameter ``.grad`` written, the option off leaving the probe
bitwise unchanged, activation checkpointing, the sinks-vs-massive panel and its report table."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outlier_titan.config.job_config import Observe
from outlier_titan.eval.report import markdown
from outlier_titan.observe import gradients, metrics, panel, sinks
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.parallel.parallelize import apply_activation_checkpointing
from tests.small_model import tiny_model

GRAD_NAMES = [n for m in (gradients.GRAD_KURTOSIS, gradients.GRAD_MAX_ABS, gradients.GRAD_SINK) for n in m.names]
BLOCK_GRAD_NAMES = ["grad_sink_rgs"]  # only the blocks' pre-attention norm outputs (no head input)


def tokens(b=3, t=16, seed=0):
    return torch.randint(0, 128, (b, t), generator=torch.Generator().manual_seed(seed))


def reference_gradients(model, tok):
    """dL/dx at every block output, the final norm's output and (keys ``norm_<i>``) every block's attention_norm
    output, by autograd in float64 on a second forward, ``L`` the mean next-token cross entropy over positions
    0 .. T-2 (targets: the next token of the window)."""
    xs = {}
    hooks = [block.register_forward_hook(lambda m, i, o, n=n: xs.__setitem__(n, o))
             for n, block in model.layers.items()]
    hooks += [block.attention_norm.register_forward_hook(lambda m, i, o, n=n: xs.__setitem__(f"norm_{n}", o))
              for n, block in model.layers.items()]
    hooks.append(model.norm.register_forward_hook(lambda m, i, o: xs.__setitem__("head", o)))
    logits = model(tok)
    for h in hooks:
        h.remove()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), tok[:, 1:].flatten())
    names = list(xs)
    return dict(zip(names, torch.autograd.grad(loss, [xs[n] for n in names])))


def reference_stats(g):
    """The gradient metrics of one layer by the direct formulas (float64), over positions 0 .. T-2."""
    g = g[:, :-1].to(torch.float64)
    c = g - g.mean(-1, keepdim=True)
    kurt = (c ** 4).mean(-1) / ((c ** 2).mean(-1)) ** 2  # [B, T'] Pearson kurtosis over channels
    a = g.abs().amax(-1)  # [B, T']
    norms = g.norm(dim=-1)
    return {"grad_kurtosis_first": kurt[:, 0].mean().item(), "grad_kurtosis_rest": kurt[:, 1:].mean().item(),
            "grad_kurtosis_all": kurt.mean().item(),
            "grad_max_abs_first": a[:, 0].mean().item(), "grad_max_abs_rest": a[:, 1:].amax(-1).mean().item(),
            "grad_max_abs_rest_token": a[:, 1:].mean().item(),
            "grad_sink_share": (norms[:, 0] ** 2 / (norms ** 2).sum(-1)).mean().item(),
            "grad_sink_ratio": (norms[:, 0] / norms[:, 1:].mean(-1)).mean().item()}


def reference_rgs(g, t_e=31):
    """Chen, Lin, Yao 2026 Eq. 3 with s = 0: the gradient at the attention input summed over the batch per
    position, ||G_0|| / ((1/T_e) sum_{t=1..T_e} ||G_t||), T_e cut to the positions with a target (T-2)."""
    t_e = min(t_e, g.shape[1] - 2)
    norms = [g[:, t].to(torch.float64).sum(0).norm().item() for t in range(t_e + 1)]
    return norms[0] / (sum(norms[1:]) / t_e)


def reference_t0_early(x):
    """The rebuttal's t0/early: mean over sequences of ||x_0|| over the mean of ||x_t||, t = 1 .. 15."""
    n = x.to(torch.float64).norm(dim=-1)
    return (n[:, 0].mean() / n[:, 1:16].mean()).item()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def test_probe_gradient_metrics_equal_float64_autograd_reference(model):
    tok = tokens()
    ref = reference_gradients(model, tok)
    scalars, _ = OutlierProbe(model, Observe(mode="full", gradients=True)).run(tok)
    for name, g in ref.items():
        if name.startswith("norm_"):
            got = scalars[f"outliers/layer_{name[5:]}/grad_sink_rgs"]
            assert got == pytest.approx(reference_rgs(g), rel=1e-9), name
            continue
        where = "head_input" if name == "head" else f"layer_{name}"
        want = reference_stats(g)
        for k, v in want.items():
            assert scalars[f"outliers/{where}/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), (where, k)
    layers = list(model.layers)
    for k in GRAD_NAMES + BLOCK_GRAD_NAMES:
        mean = sum(scalars[f"outliers/layer_{n}/{k}"] for n in layers) / len(layers)
        assert scalars[f"outliers/{k}"] == pytest.approx(mean, rel=1e-12)


def test_sink_share_formula_on_a_planted_gradient():
    g = torch.ones(2, 5, 4, dtype=torch.float64)
    g[:, 0] *= 3.0  # first token: norm 6, others 2 -> share 36 / (36 + 4 * 4) over all 5 positions
    got = gradients.GRAD_SINK(g)
    assert got["grad_sink_share"] == pytest.approx(36.0 / 52.0)
    assert got["grad_sink_ratio"] == pytest.approx(3.0)


def test_rgs_sums_over_the_batch_before_the_norm_and_stops_at_t_e():
    """Two sequences whose gradients agree at position 0, cancel at 1 and partly cancel at 2 .. 31: the batch sum
    G_t is taken before the norm (per-sequence norms would give 1 at position 1); positions after T_e = 31 do not
    count."""
    g = torch.ones(2, 40, 3, dtype=torch.float64)
    g[1, 1:] = -1.0
    g[0, 2:] *= 4.0  # G_0 = 2, G_1 = 0, G_t = 3 (t >= 2) in each of the 3 channels
    g[:, 32:] = 1e6
    got = gradients.GRAD_SINK_RGS(g)["grad_sink_rgs"]
    assert got == pytest.approx(2.0 / (30 * 3.0 / 31), rel=1e-12) and got == pytest.approx(reference_rgs(g), rel=1e-12)
    short = gradients.GRAD_SINK_RGS(g[:, :5])["grad_sink_rgs"]  # T' = 5 positions: the window is 1 .. 4
    assert short == pytest.approx(2.0 / (3 * 3.0 / 4), rel=1e-12)
    assert gradients.GRAD_SINK_RGS(g[:, :1]) == {}


def test_massive_t0_early_equals_the_formula_on_the_probe_and_stops_at_15(model):
    tok = tokens(3, 16)
    xs = {}
    hooks = [b.register_forward_hook(lambda m, i, o, n=n: xs.__setitem__(n, o)) for n, b in model.layers.items()]
    with torch.no_grad():
        model(tok)
    for h in hooks:
        h.remove()
    scalars, _ = OutlierProbe(model, Observe(mode="cheap")).run(tok)
    for n, x in xs.items():
        assert scalars[f"outliers/layer_{n}/massive_t0_early"] == pytest.approx(reference_t0_early(x), rel=1e-9)
    x = torch.ones(2, 20, 4, dtype=torch.float64)
    x[:, 0] *= 10.0
    x[:, 16:] *= 1e6  # positions after 15 are not early
    assert sinks.T0_EARLY_METRIC(x)["massive_t0_early"] == pytest.approx(10.0)


def test_op_blocks_without_a_pre_attention_norm_have_no_rgs():
    from outlier_titan.config.job_config import Model as ModelConfig
    from outlier_titan.models.init import Initializer
    from outlier_titan.models.registry import model_args

    def probe(block):
        spec, args = model_args(ModelConfig(name="op", flavor="debug", n_layers=2, dim=32, n_heads=2,
                                            ffn_hidden=64, block=block, input_norm=True), 128, 16)
        m = spec.build(args)
        m.init_weights(Initializer(0, "cpu"))
        return OutlierProbe(m, Observe(mode="cheap", gradients=True)).run(tokens())[0]

    assert not any("grad_sink_rgs" in k for k in probe("op"))  # OP's own block, input LayerNorm included
    assert not any("grad_sink_rgs" in k for k in probe("post_ln"))
    pre = probe("pre_rms")
    assert pre["outliers/layer_0/grad_sink_rgs"] > 0 and "outliers/grad_sink_rgs" in pre


def test_no_parameter_grad_is_written_and_existing_grads_are_kept(model):
    for p in model.parameters():
        p.grad = None
    OutlierProbe(model, Observe(mode="cheap", gradients=True)).run(tokens())
    assert all(p.grad is None for p in model.parameters())
    marks = {n: torch.full_like(p, 0.5) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = marks[n].clone()
    OutlierProbe(model, Observe(mode="full", gradients=True)).run(tokens())
    assert all(torch.equal(p.grad, marks[n]) for n, p in model.named_parameters())
    for p in model.parameters():
        p.grad = None


def test_option_off_leaves_the_probe_bitwise_unchanged_and_on_only_adds_names(model):
    tok = tokens()
    off, off_images = OutlierProbe(model, Observe(mode="full")).run(tok)
    assert not any("grad_" in k for k in off)
    on, on_images = OutlierProbe(model, Observe(mode="full", gradients=True)).run(tok)
    layers = [f"layer_{n}" for n in model.layers]
    assert set(on) - set(off) == ({f"outliers/{w}/{k}" for w in layers + ["head_input"] for k in GRAD_NAMES}
                                  | {f"outliers/{w}/{k}" for w in layers for k in BLOCK_GRAD_NAMES}
                                  | {f"outliers/{k}" for k in GRAD_NAMES + BLOCK_GRAD_NAMES})
    for k, v in off.items():  # the forward metrics are the same numbers with the backward on
        assert on[k] == pytest.approx(v, rel=1e-12, abs=1e-15), k
    # off twice: bitwise the same, and the same names as before the option existed (no gradient metric active)
    again, again_images = OutlierProbe(model, Observe(mode="full")).run(tok)
    assert again == off and again_images.keys() == off_images.keys()
    assert metrics.active(Observe(), "gradient") == []


def test_frozen_weights_still_give_gradients():
    model = tiny_model()
    model.requires_grad_(False)  # the evaluator's model may be frozen
    scalars, _ = OutlierProbe(model, Observe(mode="cheap", gradients=True)).run(tokens())
    ref = reference_stats(reference_gradients(model.requires_grad_(True), tokens())["0"])
    assert scalars["outliers/layer_0/grad_sink_share"] == pytest.approx(ref["grad_sink_share"], rel=1e-9)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_same_gradient_metrics(mode):
    tok = tokens()
    plain, _ = OutlierProbe(tiny_model(), Observe(mode="cheap", gradients=True)).run(tok)
    model = tiny_model()
    apply_activation_checkpointing(model, mode, 1)
    checked, _ = OutlierProbe(model, Observe(mode="cheap", gradients=True)).run(tok)
    assert checked.keys() == plain.keys()
    for k, v in plain.items():
        assert checked[k] == pytest.approx(v, rel=1e-9, abs=1e-15), k


def test_sinks_vs_massive_panel_picture_and_report_table(model):
    scalars, images = OutlierProbe(model, Observe(mode="full", gradients=True)).run(tokens())
    layers, columns = panel.panel_rows(scalars)
    assert layers == list(model.layers)
    for name, values in columns.items():  # the probe's own per-layer values, not recomputed
        assert values == [scalars[f"outliers/layer_{n}/{name}"] for n in layers]
    assert set(columns) == set(panel.PANEL)
    img = images["outliers/sinks_vs_massive"]
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3 and img.std() > 0
    text = markdown({"checkpoint": "c", "tokens": 1, "seq_len": 16, "full_precision": {"ppl": 1.0},
                     "schemes": [], "probe": scalars})
    table = text.split("sinks vs massive activations")[1]
    row0 = next(line for line in table.splitlines() if line.startswith("| 0 |"))
    assert f"{scalars['outliers/layer_0/grad_sink_share']:.4g}" in row0
    assert f"{scalars['outliers/layer_0/massive_ratio']:.4g}" in row0
    without, no_grad_images = OutlierProbe(model, Observe(mode="full")).run(tokens())
    assert "grad_sink_share" not in panel.panel_rows(without)[1]
    assert "outliers/sinks_vs_massive" in no_grad_images  # the forward columns alone


def test_compiled_and_checkpointed_blocks_give_the_same_gradient_metrics():
    """The trainer's ``compile.enable`` (each block compiled; AOT autograd, so the backward runs compiled graphs)
    with activation checkpointing on every block, as ``parallelize`` orders them."""
    tok = tokens(2, 16)
    want, _ = OutlierProbe(tiny_model(), Observe(mode="cheap", gradients=True)).run(tok)
    torch._dynamo.reset()
    model = tiny_model()
    apply_activation_checkpointing(model, "full", 1)
    for block in model.layers.values():
        block.compile(backend="aot_eager")
    probe = OutlierProbe(model, Observe(mode="cheap", gradients=True))
    probe.run(tok)
    got, _ = probe.run(tok)
    torch._dynamo.reset()
    assert got.keys() == want.keys()
    for k in want:
        assert got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-15), k


@pytest.mark.dist
def test_trainer_logs_the_gradient_metrics_and_the_panel_and_trains_as_without(tmp_path):
    """train.py with ``observe.gradients``: the metrics in metrics.jsonl, the panel in a real TensorBoard event file,
    and the losses after a probe step bitwise those of the run whose probe has no backward."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.launch import TINY, train

    common = [*TINY, "--training.steps", "4", "--observe.every", "2", "--observe.batch_size", "2",
              "--metrics.tensorboard", "true"]
    on = train(tmp_path, *common, "--observe.gradients", "true", name="on").check()
    off = train(tmp_path, *common, name="off").check()
    assert on.losses == off.losses and sorted(on.losses) == [1, 2, 3, 4]
    probes = [r for r in on.records if "outliers/grad_sink_share" in r]
    assert [r["step"] for r in probes] == [2, 4]
    assert 0.0 < probes[0]["outliers/grad_sink_share"] < 1.0
    assert not any("outliers/grad_sink_share" in r for r in off.records)
    acc = EventAccumulator(str(next((on.run_dir / "tb").glob("events.out.tfevents.*"))), size_guidance={"images": 0})
    acc.Reload()
    assert "outliers/sinks_vs_massive" in acc.Tags()["images"]
    events = acc.Images("outliers/sinks_vs_massive")
    assert [e.step for e in events] == [2, 4] and events[0].width > 100 and events[0].height > 100
    assert "grad sink" in on.stdout
