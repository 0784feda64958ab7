"""The outlier probe on the debug models (single process): names, values against direct computation,
cheap/full modes, pictures, and that the model is left untouched."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from outlier_titan.config.job_config import Model, Observe
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import Attention
from outlier_titan.models.registry import model_args
from outlier_titan.observe import outliers as om
from outlier_titan.observe.probe import OutlierProbe

REQUIRED = ("kurtosis_first", "kurtosis_rest", "kurtosis_neuron_rms", "max_abs_first", "max_abs_rest",
            "max_median_ratio", "signal_prop_cos", "first_token_argmax_share", "first_token_attention_mass",
            "residual_rms")


def build(flavor="debug", seed=0, **overrides):
    spec, args = model_args(Model(name="pre_ln", flavor=flavor, **overrides), vocab_size=4096, seq_len=64)
    m = spec.build(args)
    m.init_weights(Initializer(seed, "cpu"))
    return m


def tokens(b=4, t=32, seed=0):
    return torch.randint(0, 4096, (b, t), generator=torch.Generator().manual_seed(seed))


def capture(model, tok):
    """Block outputs, the final-norm output and every layer's attention probabilities, by hand."""
    outs, probs, handles = {}, {}, []
    for name, block in model.layers.items():
        handles.append(block.register_forward_hook(lambda _m, _i, o, n=name: outs.__setitem__(n, o.double())))
        for a in block.modules():
            if isinstance(a, Attention):
                a.prob_hook = lambda p, n=name: probs.__setitem__(n, p.double())
    handles.append(model.norm.register_forward_hook(lambda _m, _i, o: outs.__setitem__("head", o.double())))
    with torch.no_grad():
        model(tok)
    for h in handles:
        h.remove()
    for a in model.modules():
        if isinstance(a, Attention):
            a.prob_hook = None
    return outs, probs


@pytest.fixture(scope="module")
def gpt2():
    # softmax-1 makes the row sums < 1, so raw and normalised first-key mass differ
    return build("debug", softmax="softmax1")


def test_names_and_values_match_direct_computation(gpt2):
    tok = tokens()
    scalars, images = OutlierProbe(gpt2, Observe(mode="full")).run(tok)
    for key in REQUIRED:
        assert f"outliers/{key}" in scalars, key
    n_layers = len(gpt2.layers)
    for i in range(n_layers):
        for key in REQUIRED:
            assert f"outliers/layer_{i}/{key}" in scalars, (i, key)
    assert all(isinstance(v, float) and np.isfinite(v) for v in scalars.values())

    outs, probs = capture(gpt2, tok)
    x0 = outs["0"]
    k0 = om.token_kurtosis(x0)
    assert scalars["outliers/layer_0/kurtosis_first"] == pytest.approx(float(k0[:, 0].mean()), rel=1e-6)
    assert scalars["outliers/layer_0/kurtosis_rest"] == pytest.approx(float(k0[:, 1:].mean()), rel=1e-6)
    assert scalars["outliers/layer_0/kurtosis_neuron_rms"] == pytest.approx(float(om.neuron_rms_kurtosis(x0)),
                                                                            rel=1e-6)
    assert scalars["outliers/layer_0/signal_prop_cos"] == pytest.approx(float(om.mean_pairwise_cosine(x0)),
                                                                        rel=1e-6)
    p1 = probs["1"]
    assert scalars["outliers/layer_1/first_token_argmax_share"] == pytest.approx(
        float(om.first_token_argmax_share(p1)), rel=1e-6)
    assert scalars["outliers/layer_1/first_token_attention_mass"] == pytest.approx(
        float(om.first_token_attention_mass(p1)), rel=1e-6)
    assert scalars["outliers/layer_1/first_token_attention_mass_norm"] > \
        scalars["outliers/layer_1/first_token_attention_mass"]
    assert scalars["outliers/attention_sink_mass"] > 0
    # layer means are the mean over blocks; the head input is reported separately
    for key in ("kurtosis_first", "max_abs_rest", "first_token_argmax_share", "residual_rms"):
        mean = sum(scalars[f"outliers/layer_{i}/{key}"] for i in range(n_layers)) / n_layers
        assert scalars[f"outliers/{key}"] == pytest.approx(mean, rel=1e-12)
    xh = outs["head"]
    assert scalars["outliers/head_input/kurtosis_neuron_rms"] == pytest.approx(
        float(om.neuron_rms_kurtosis(xh)), rel=1e-6)
    assert scalars["outliers/head_input/residual_rms"] == pytest.approx(float(xh.square().mean().sqrt()), rel=1e-6)


def test_images_are_hwc_uint8(gpt2):
    _, images = OutlierProbe(gpt2, Observe(mode="full", map_tokens=16)).run(tokens())
    assert set(images) == {"outliers/attention_map", "outliers/hidden_magnitude", "outliers/sinks_vs_massive"}
    for name, img in images.items():
        assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3, name
        assert 64 <= img.shape[0] <= 2048 and 64 <= img.shape[1] <= 2048, (name, img.shape)
        assert img.std() > 0, name
        if name == "outliers/sinks_vs_massive":  # per-layer curves (tests/test_probe_gradients.py)
            continue
        # the first token is marked in red (#dc2828: the key-0 outline; the first-token panel's title)
        red = (np.abs(img.astype(int) - (220, 40, 40)).max(-1) < 40).sum()
        assert red > 20, name


def test_cheap_mode_skips_attention_and_images(gpt2):
    scalars, images = OutlierProbe(gpt2, Observe(mode="cheap")).run(tokens())
    assert images == {}
    assert "outliers/kurtosis_first" in scalars
    assert not any("attention" in k or "argmax" in k for k in scalars)


def test_probe_leaves_the_model_untouched(gpt2):
    tok = tokens(seed=3)
    with torch.no_grad():
        ref = gpt2(tok)
    OutlierProbe(gpt2, Observe(mode="full")).run(tok)
    assert all(a.prob_hook is None for a in gpt2.modules() if isinstance(a, Attention))
    assert all(not m._forward_hooks for m in gpt2.modules())
    assert all(p.grad is None for p in gpt2.parameters())
    with torch.no_grad():
        assert torch.equal(gpt2(tok), ref)


def test_measure_pools_batches_like_one_batch(gpt2):
    tok = tokens(b=6, seed=4)
    probe = OutlierProbe(gpt2, Observe(mode="full", kurtosis_centered=True))
    whole, _ = probe.run(tok)
    pooled, _ = probe.measure([tok[:2], tok[2:5], tok[5:]])
    assert whole.keys() == pooled.keys()
    assert "outliers/kurtosis_neuron_rms_centred" in whole
    for k in whole:
        assert pooled[k] == pytest.approx(whole[k], rel=1e-9, abs=1e-12), k


def test_planted_first_token_outlier_is_seen():
    # an embedding row with one huge channel: the first token's activations carry it through the blocks
    m = build("debug_llama")
    tok = tokens(b=2, t=16, seed=5)
    base, _ = OutlierProbe(m, Observe(mode="cheap")).run(tok)
    with torch.no_grad():
        m.tok_embeddings.weight[tok[:, 0], 5] = 300.0
    planted, _ = OutlierProbe(m, Observe(mode="cheap")).run(tok)
    assert planted["outliers/kurtosis_first"] > 20 * base["outliers/kurtosis_first"]
    assert planted["outliers/max_abs_first"] > 100 * base["outliers/max_abs_first"]
    assert planted["outliers/kurtosis_rest"] == pytest.approx(base["outliers/kurtosis_rest"], rel=0.5)


@pytest.mark.parametrize("flavor, options", [("debug", {}), ("debug_llama", {"smooth_swiglu": True})])
def test_a_no_grad_forward_after_the_probe_on_compiled_blocks_runs_without_its_hooks(flavor, options):
    """Dynamo guards neither the hook attributes nor the forward hooks the probe sets on modules (its defaults
    ``guard_nn_modules = False``, ``skip_nnmodule_hook_guards = True``): a no-grad forward after the probe (the
    divergence guard's read-ahead before a save) reused the probe's graph and called a hook the probe had removed
    (``compile.enable`` + ``observe.mode = "full"`` crashed at the first save after a probe). The probe's forward
    runs eager."""
    torch._dynamo.reset()
    model, tok = build(flavor, **options), tokens(2, 16)
    with torch.no_grad():
        want = model(tok)
    for block in model.layers.values():
        block.compile(backend="eager")
    model(tok)
    OutlierProbe(model, Observe(mode="full")).run(tok)
    with torch.no_grad():
        got = model(tok)
    torch._dynamo.reset()
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_probe_on_compiled_blocks_equals_eager_and_compiles_as_many_graphs_at_any_depth():
    """With ``compile.enable`` the blocks are compiled; the probe's forward runs them eager
    (``torch.compiler.set_stance``) and its hooks are ``torch.compiler.disable``d: traced, their growing
    dictionaries were guards, so Dynamo compiled each layer again until its recompile limit (8) and a 12-layer
    model's first probe took 21 s on an H200. The count of graphs does not grow with depth."""
    from torch._dynamo.utils import counters

    graphs = {}
    for n_layers in (3, 10):
        torch._dynamo.reset()
        counters.clear()
        model, tok = build(n_layers=n_layers), tokens(2, 16)
        want, _ = OutlierProbe(model, Observe(mode="full")).run(tok)
        for block in model.layers.values():
            block.compile(backend="eager")
        model(tok)
        probe = OutlierProbe(model, Observe(mode="full"))
        got, _ = probe.run(tok)
        probe.run(tok)
        graphs[n_layers] = counters["stats"]["unique_graphs"]
        assert got.keys() == want.keys()
        for k in want:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7, nan_ok=True), k
    torch._dynamo.reset()
    assert graphs[10] == graphs[3], graphs
