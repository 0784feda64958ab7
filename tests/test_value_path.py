"""V-scale (Chen, Lin, Yao 2026) and head-wise RMSNorm (Li et al. 2026) on pre_ln and op: their formulas against a
float64 attention written from the papers, the backward-only V-scale's forward bitwise equal to no V-scale on
every variant and path, parameters (classes, init), the HF refusal and the one-line config errors."""

import math

import pytest
import torch

from outlier_titan.config.job_config import Model as ModelConfig
from outlier_titan.config.manager import ConfigError, parse_args
from outlier_titan.hf.adapters import adapter_for_args
from outlier_titan.models.attention_variants import variants
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import get_spec, model_args
from outlier_titan.models.value_path import calibrated_gain
from outlier_titan.optim.params import trainable_params
from tests.launch import REPO

IMPLS = ("explicit", "chunked", "auto")


def build(seed=0, spec_name="pre_ln", **options):
    flavor = {"pre_ln": "debug_llama", "op": "debug"}[spec_name]
    spec, args = model_args(ModelConfig(name=spec_name, flavor=flavor, **options), 256, 64)
    model = spec.build(args)
    model.init_weights(Initializer(seed, "cpu"))
    return args, model


def reference_attention(att, x, v_scale=None, theta=None, c0=None, head_norm=None, gain=None, eps=1e-6):
    """Causal softmax attention of one block in float64, from the papers' formulas: V-scale
    ``v^ = |v|^2 / (|v|^2 + C) v`` with ``C = c0 exp(theta_h)`` per KV head (Chen et al. 2026, Sec. 5.1; ``backward``:
    their rebuttal's ``sg(v) + phi v - sg(phi v)`` at theta = 0), and head-wise RMSNorm of each head's
    ``y = A v^`` with gain ``g`` (Li et al. 2026)."""
    b, t, _ = x.shape
    d = att.head_dim
    q = (x @ att.wq.weight.T).view(b, t, -1, d).transpose(1, 2)
    k = (x @ att.wk.weight.T).view(b, t, -1, d).transpose(1, 2)
    v = (x @ att.wv.weight.T).view(b, t, -1, d).transpose(1, 2)
    if att.rope is not None:  # RoPE is the model's own (not under test here)
        q, k = att.rope(q), att.rope(k)
    if v_scale is not None:
        c = c0 * (theta.exp().view(1, -1, 1, 1) if theta is not None else torch.ones(1, dtype=x.dtype))
        r = (v * v).sum(-1, keepdim=True)
        scaled = r / (r + c) * v
        v = scaled if v_scale == "on" else v.detach() + scaled - scaled.detach()
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    y = torch.softmax(s, -1) @ v
    if head_norm is not None:
        y = y / torch.sqrt((y * y).mean(-1, keepdim=True) + eps)
        if gain is not None:
            y = y * gain.view(1, -1, 1, d)
    return y.transpose(1, 2).reshape(b, t, -1) @ att.wo.weight.T


@pytest.mark.parametrize("v_scale,head_norm", [("on", "off"), ("backward", "off"), ("off", "on"), ("off", "nogain"),
                                               ("on", "on")])
@pytest.mark.parametrize("impl", IMPLS)
def test_block_output_and_gradients_match_the_float64_formula(v_scale, head_norm, impl):
    check_against_formula("pre_ln", v_scale, head_norm, impl)


@pytest.mark.parametrize("v_scale,head_norm", [("on", "on"), ("backward", "nogain")])
def test_the_op_block_takes_the_same_steps(v_scale, head_norm):
    """He et al. 2024's OP block (MHA, learned positions; QK-norm off so the float64 formula stays plain attention)."""
    check_against_formula("op", v_scale, head_norm, "chunked", qk_norm=False)


def check_against_formula(spec_name, v_scale, head_norm, impl, **options):
    args, model = build(spec_name=spec_name, v_scale=v_scale, head_norm=head_norm, attention_impl=impl, **options)
    model = model.double()
    att = model.layers["0"].attention
    with torch.no_grad():  # move theta and the gain off their init so the test sees them
        if att.v_scale is not None and att.v_scale.theta is not None:
            att.v_scale.theta.copy_(torch.linspace(0.7, -1.3, att.v_scale.theta.numel(), dtype=torch.float64))
        if att.head_norm is not None and att.head_norm.weight is not None:
            att.head_norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 40, args.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    # half the tokens with small values: V-scale's phi is far from 1 there
    x[:, ::2] *= 0.05
    x.requires_grad_(True)
    params = [p for p in att.parameters() if p.requires_grad]
    ours = att(x)
    g_out = torch.randn_like(ours)
    grads = torch.autograd.grad(ours, [x, *params], g_out)

    x_ref = x.detach().clone().requires_grad_(True)
    theta = att.v_scale.theta if att.v_scale is not None else None
    gain = att.head_norm.weight if att.head_norm is not None else None
    ref = reference_attention(att, x_ref, v_scale if v_scale != "off" else None, theta,
                              args.dim * att.head_dim * args.init_std ** 2,
                              head_norm if head_norm != "off" else None, gain)
    ref_grads = torch.autograd.grad(ref, [x_ref, *params], g_out)
    torch.testing.assert_close(ours, ref, rtol=1e-10, atol=1e-12)
    for name, a, b in zip(["x", *[n for n, p in att.named_parameters() if p.requires_grad]], grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, msg=name)
    if v_scale != "off":  # the step does change the values' gradient (phi is far from 1 on the small tokens)
        _, plain = build(spec_name=spec_name, v_scale="off", head_norm=head_norm, attention_impl=impl, **options)
        plain = plain.double()
        plain.load_state_dict(model.state_dict(), strict=False)
        g_plain = torch.autograd.grad(plain.layers["0"].attention(x), x, g_out)[0]
        assert (g_plain - grads[0]).abs().max() > 1e-3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("variant", [v.name for v in variants()])
def test_backward_only_v_scale_leaves_the_forward_bitwise_and_changes_the_gradient(variant, impl):
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    outs = {}
    for mode in ("off", "backward"):
        _, model = build(v_scale=mode, attention=variant, attention_impl=impl)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens.roll(-1, 1).flatten())
        loss.backward()
        outs[mode] = logits.detach(), model.layers["0"].attention.wv.weight.grad.clone()
    assert torch.equal(outs["off"][0], outs["backward"][0])
    assert not torch.allclose(outs["off"][1], outs["backward"][1], rtol=1e-3, atol=0)


def test_parameters_classes_init_and_tp_placements():
    args, model = build(v_scale="on", head_norm="on")
    classes = {fqn: cls for fqn, cls, _ in trainable_params(model)}
    assert classes["layers.0.attention.v_scale.theta"] == "v_scale"
    assert classes["layers.0.attention.head_norm.weight"] == "head_norm"
    att = model.layers["1"].attention
    assert att.v_scale.theta.shape == (args.n_kv_heads,) and torch.equal(att.v_scale.theta, torch.zeros(2))
    # the authors' calibration: one value per head, the std of that head's W_V z (about sqrt(dim) * init_std)
    gain = att.head_norm.weight.detach().view(args.n_heads, -1)
    assert gain.shape == (args.n_heads, args.dim // args.n_heads) and torch.equal(gain, gain[:, :1].expand_as(gain))
    assert ((gain[:, 0] / (args.dim ** 0.5 * args.init_std)).log().abs() < 1.0).all(), gain[:, 0]
    # GQA: query heads 0, 1 read KV head 0 and share its value; 2, 3 read KV head 1
    assert gain[0, 0] == gain[1, 0] and gain[2, 0] == gain[3, 0] and gain[0, 0] != gain[2, 0]
    assert att.v_scale.base == pytest.approx(args.dim * (args.dim // args.n_heads) * 0.02 ** 2)
    extra = get_spec("pre_ln").tp_plan.extra
    assert extra["layers.*.attention.v_scale"] == extra["layers.*.attention.head_norm"] == "sharded_params"
    _, plain = build(v_scale="backward", head_norm="nogain")  # neither has a parameter
    _, off = build()
    assert sum(p.numel() for p in plain.parameters()) == sum(p.numel() for p in off.parameters())


def test_hf_export_refuses_and_bad_values_are_one_line():
    for kw in ({"v_scale": "on"}, {"v_scale": "backward"}, {"head_norm": "nogain"}):
        _, args = model_args(ModelConfig(name="pre_ln", flavor="debug_llama", **kw), 256, 32)
        adapter, why = adapter_for_args(args)
        assert adapter is None and f"model.{next(iter(kw))}" in why
    for key, value in (("v_scale", "yes"), ("head_norm", "true")):
        with pytest.raises(ConfigError) as e:
            parse_args(["--config", str(REPO / "train_configs/debug.toml"), f"--model.{key}", value])
        assert "\n" not in str(e.value) and key in str(e.value) and "choose one of" in str(e.value)
    with pytest.raises(ConfigError, match="not an option of model spec 'ngpt'"):
        model_args(ModelConfig(name="ngpt", v_scale="on"), 256, 32)


def test_head_norm_calibration_is_the_std_of_each_heads_first_value():
    """``calibrated_gain`` against the authors' rule in float64: query head h takes the population std over d_head
    of KV head ``h // (H / H_kv)`` of ``W_V z + b``."""
    gen = torch.Generator().manual_seed(3)
    n_heads, n_kv, d_head, dim = 6, 2, 4, 12
    w, b, z = (torch.randn(n_kv * d_head, dim, generator=gen, dtype=torch.float64),
               torch.randn(n_kv * d_head, generator=gen, dtype=torch.float64),
               torch.randn(dim, generator=gen, dtype=torch.float64))
    got = calibrated_gain(w, b, z, n_heads, d_head).view(n_heads, d_head)
    v0 = [sum(w[i, j] * z[j] for j in range(dim)) + b[i] for i in range(n_kv * d_head)]
    for h in range(n_heads):
        part = v0[(h // 3) * d_head:(h // 3 + 1) * d_head]
        mean = sum(part) / d_head
        std = math.sqrt(sum((x - mean) ** 2 for x in part) / d_head)
        for c in range(d_head):
            assert abs(got[h, c].item() - float(std)) < 1e-12
