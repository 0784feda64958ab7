"""Attention variants (models/attention.py): each against its formula written out here in float64, one query
at a time over its visible keys only (no masks, no max-subtraction), values and gradients; the backend each
runs on; the gates and sink logits as model parameters; one-line errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from outlier_titan.config.job_config import Model, Optimizer
from outlier_titan.config.manager import ConfigError
from outlier_titan.models import attention as attn_mod
from outlier_titan.models.attention import attention_weights
from outlier_titan.models.attention_variants import AttentionOptions, variants
from outlier_titan.models.layers import Attention, attention
from outlier_titan.models.registry import model_args
from outlier_titan.optim.builder import build_param_groups

TOL = 1e-10


def weights_formula(s: torch.Tensor, i: int, variant: str, sink: torch.Tensor | None = None, t: int = 0,
                    eps: float = 1e-6, bias: float | None = None, relu_norm: str = "prefix", zeta: float = 1.0,
                    gamma: float = -0.03) -> torch.Tensor:
    """Weights of query i over its i + 1 visible logits s [..., i + 1], straight from the papers' formulas."""
    if variant in ("softmax", "gated_head", "gated_elementwise"):
        return torch.exp(s) / torch.exp(s).sum(-1, keepdim=True)
    if variant == "softmax1":
        return torch.exp(s) / (1.0 + torch.exp(s).sum(-1, keepdim=True))
    if variant == "sink_logit":
        return torch.exp(s) / (torch.exp(sink).view(-1, 1) + torch.exp(s).sum(-1, keepdim=True))
    if variant == "softpick":
        a = torch.exp(s) - 1.0
        return torch.relu(a) / (a.abs().sum(-1, keepdim=True) + eps)
    if variant == "sigmoid":
        b = -math.log(t) if bias is None else bias
        return 1.0 / (1.0 + torch.exp(-(s + b)))
    if variant == "relu":
        n = {"prefix": i + 1, "seq_len": t, "none": 1}[relu_norm]
        return torch.relu(s) / n
    if variant == "clipped_softmax":
        p = torch.exp(s) / torch.exp(s).sum(-1, keepdim=True)
        return torch.clamp((zeta - gamma) * p + gamma, 0.0, 1.0)
    raise AssertionError(variant)


def attention_formula(q, k, v, variant, scale, **kw):
    """[B, H, T, d] output, one query at a time (k, v with H heads)."""
    b, h, t, d = q.shape
    out = torch.zeros(b, h, t, v.shape[-1], dtype=q.dtype)
    for i in range(t):
        s = torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : i + 1]) * scale
        w = weights_formula(s, i, variant, t=t, **kw)
        out[:, :, i] = torch.einsum("bhj,bhjd->bhd", w, v[:, :, : i + 1])
    return out


def _qkv(b, h, t, d, logit_scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(b, h, t, d, generator=g, dtype=torch.float64) * logit_scale).requires_grad_()
    k = torch.randn(b, h, t, d, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(b, h, t, d, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v


PARAM_FREE = ["softmax", "softmax1", "softpick", "sigmoid", "relu", "clipped_softmax"]


@pytest.mark.parametrize("variant", PARAM_FREE + ["sink_logit"])
@pytest.mark.parametrize("logit_scale", [1.0, 4.0])
def test_variant_equals_formula_values_and_grads(variant, logit_scale):
    q, k, v = _qkv(2, 3, 13, 8, logit_scale, seed=int(logit_scale))
    scale = 8 ** -0.5
    sink = torch.tensor([-1.0, 0.5, 3.0], dtype=torch.float64, requires_grad=True) if variant == "sink_logit" else None
    opts = AttentionOptions(variant=variant)
    got = attention(q, k, v, variant, opts=opts, state=sink)
    kw = {"sink": sink} if sink is not None else {}
    ref = attention_formula(q, k, v, variant, scale, **kw)
    assert (got - ref).abs().max().item() < TOL
    inputs = [q, k, v] + ([sink] if sink is not None else [])
    up = torch.randn_like(ref)
    for gg, gr in zip(torch.autograd.grad(got, inputs, up), torch.autograd.grad(ref, inputs, up)):
        assert (gg - gr).abs().max().item() < TOL
    # the probe's explicit weights give the same output
    seen = []
    again = attention(q, k, v, variant, opts=opts, state=sink, prob_hook=seen.append)
    assert (again - ref).abs().max().item() < TOL and seen[0].shape == (2, 3, 13, 13)


@pytest.mark.parametrize("variant,kw,opts", [
    ("sigmoid", {"bias": 0.7}, {"attention_sigmoid_bias": 0.7}),
    ("relu", {"relu_norm": "seq_len"}, {"attention_relu_norm": "seq_len"}),
    ("relu", {"relu_norm": "none"}, {"attention_relu_norm": "none"}),
    ("clipped_softmax", {"zeta": 1.1, "gamma": -0.2}, {"attention_clip_zeta": 1.1, "attention_clip_gamma": -0.2}),
    ("softpick", {"eps": 1e-2}, {"attention_softpick_eps": 1e-2}),
])
def test_variant_options(variant, kw, opts):
    q, k, v = _qkv(1, 2, 9, 4, 2.0, seed=11)
    got = attention(q, k, v, variant, opts=AttentionOptions.of(variant, **opts))
    ref = attention_formula(q, k, v, variant, 0.5, **kw)
    assert (got - ref).abs().max().item() < TOL


def test_softpick_stable_form_survives_large_logits():
    # logits up to ~ 400: exp overflows float32 and float64 in the plain form, the stable form stays finite
    q, k, _ = _qkv(1, 1, 6, 4, 200.0, seed=2)
    w = attention_weights(q.float(), k.float(), AttentionOptions(variant="softpick"), 0.5)
    assert torch.isfinite(w).all() and (w >= 0).all() and (w.sum(-1) <= 1 + 1e-6).all()
    # and equals the formula where the formula is finite (float64, moderate logits)
    q2, k2, _ = _qkv(1, 1, 6, 4, 20.0, seed=2)
    w2 = attention_weights(q2, k2, AttentionOptions(variant="softpick"), 0.5)
    for i in range(6):
        s = (q2[0, 0, i] @ k2[0, 0, : i + 1].T) * 0.5
        assert torch.allclose(w2[0, 0, i, : i + 1], weights_formula(s, i, "softpick"), atol=1e-12, rtol=1e-12)


def test_sink_logit_zero_is_softmax1_and_large_negative_is_softmax():
    q, k, v = _qkv(1, 2, 7, 4, 1.0, seed=4)
    zero = attention(q, k, v, "sink_logit", opts=AttentionOptions(variant="sink_logit"),
                     state=torch.zeros(2, dtype=torch.float64))
    assert (zero - attention(q, k, v, "softmax1")).abs().max().item() < TOL
    far = attention(q, k, v, "sink_logit", opts=AttentionOptions(variant="sink_logit"),
                    state=torch.full((2,), -200.0, dtype=torch.float64))
    assert (far - attention(q, k, v, "softmax")).abs().max().item() < TOL


@pytest.mark.parametrize("variant", ["gated_head", "gated_elementwise"])
def test_gated_attention_module_equals_formula(variant):
    torch.manual_seed(0)
    dim, heads, t = 16, 4, 9
    att = Attention(dim, heads, heads, bias=False, variant=variant).double()
    x = torch.randn(2, t, dim, dtype=torch.float64, requires_grad=True)
    got = att(x)
    q, k, v = att.project_qkv(x)
    y = attention_formula(q, k, v, "softmax", (dim // heads) ** -0.5)  # [B, H, T, d]
    logits = x @ att.wg.weight.T  # [B, T, H] or [B, T, H*d]
    per = 1 if variant == "gated_head" else dim // heads
    gate = 1.0 / (1.0 + torch.exp(-logits.view(2, t, heads, per).transpose(1, 2)))
    ref = att.wo((y * gate).transpose(1, 2).reshape(2, t, dim))
    assert (got - ref).abs().max().item() < TOL
    up = torch.randn_like(ref)
    params = [x, att.wg.weight, att.wq.weight]
    for gg, gr in zip(torch.autograd.grad(got, params, up), torch.autograd.grad(ref, params, up)):
        assert (gg - gr).abs().max().item() < TOL
    assert att.wg.weight.shape == (heads * per, dim)


VARIANTS = [v.name for v in variants()]
SDPA = ("softmax", "softmax1", "gated_head", "gated_elementwise")


@pytest.mark.parametrize("variant", VARIANTS)
def test_backend_sdpa_or_chunked_on_the_cpu(monkeypatch, variant):
    calls = []
    real = F.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    seen, real_explicit = [], attn_mod.explicit_attention

    def explicit_spy(q, *args, **kwargs):
        seen.append(q.shape[-2])
        return real_explicit(q, *args, **kwargs)

    monkeypatch.setattr(attn_mod, "explicit_attention", explicit_spy)
    q, k, v = _qkv(1, 2, 300, 4, 1.0, seed=1)
    sink = torch.zeros(2, dtype=torch.float64, requires_grad=True) if variant == "sink_logit" else None
    attention(q, k, v, variant, opts=AttentionOptions(variant=variant), state=sink).sum().backward()
    assert len(calls) == (1 if variant in SDPA else 0), variant
    # the sink logit: the CPU flash kernel called directly (test_attention_paths); the rest: blocks of CHUNK_ROWS
    # queries, each run again in the backward
    chunked = variant not in SDPA + ("sink_logit",)
    assert sorted(seen) == ([44, 44, 128, 128, 128, 128] if chunked else []), seen
    # the probe hook always takes the explicit path, all queries at once
    calls.clear()
    seen.clear()
    attention(q, k, v, variant, opts=AttentionOptions(variant=variant), state=sink, prob_hook=lambda p: None)
    assert calls == [] and seen == [300]


def _args(name="pre_ln", **kw):
    return model_args(Model(name=name, flavor="debug", **kw), 256, 32)


def test_options_errors_are_one_line():
    for kw, text in [({"attention": "gated_head"}, "not supported by model spec 'op'"),
                     ({"softmax": "softmax1", "attention": "relu"}, "disagree"),
                     ({"attention_layers": "softmax,nope"}, "'nope' is not a variant"),
                     ({"attention": "clipped_softmax", "attention_clip_gamma": 0.5}, "gamma <= 0")]:
        with pytest.raises(ConfigError, match=text) as e:
            _args("op" if "gated" in str(kw) else "pre_ln", **kw)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="not an option of model spec 'angpt'"):
        _args("angpt", attention="sigmoid")


def test_old_softmax_key_still_selects_softmax1():
    from outlier_titan.models.attention_variants import uses_only

    _, a = _args(softmax="softmax1")
    assert a.attention == "softmax1"
    _, a = _args(attention_layers="softmax,sink_logit")
    assert a.attention == "softmax" and not uses_only(a, "softmax")  # HF export refuses it
    _, a = _args()
    assert uses_only(a, "softmax")


def test_attention_layers_cycle_and_parameters():
    spec, a = _args(attention_layers="sink_logit,gated_head,softpick", attention_sink_init=-2.0)
    m = spec.build(a)
    kinds = [blk.attention.variant for blk in m.layers.values()]
    assert kinds == ["sink_logit", "gated_head", "softpick", "sink_logit"]
    names = [n for n, _ in m.named_parameters()]
    assert "layers.0.attention.sink.weight" in names and "layers.1.attention.wg.weight" in names
    assert not any(n.startswith("layers.2.attention.wg") or n.startswith("layers.2.attention.sink") for n in names)
    from outlier_titan.models.init import Initializer
    m.init_weights(Initializer(0, torch.device("cpu")))
    assert torch.equal(m.layers["0"].attention.sink.weight, torch.full((4,), -2.0))
    assert m.layers["1"].attention.wg.weight.std().item() > 0
    # optimizer classes: sink logits are class "sink" (decayed unless listed), gates are matrices (decayed)
    decay, no_decay = build_param_groups(m, Optimizer())
    assert "layers.0.attention.sink.weight" in decay["names"] and "layers.1.attention.wg.weight" in decay["names"]
    _, no_decay = build_param_groups(m, Optimizer(no_decay=["norm", "bias", "embedding", "sink"]))
    assert "layers.0.attention.sink.weight" in no_decay["names"]
    assert "layers.1.attention.wg.weight" not in no_decay["names"]


def test_sink_logits_and_gates_export_to_safetensors_and_back_not_to_hf(tmp_path):
    from outlier_titan.errors import UserError
    from outlier_titan.hf.export import export_model
    from outlier_titan.hf.load import load_pretrained
    from tests.test_hf import VOCAB, _save_dcp_checkpoint

    model = _save_dcp_checkpoint(tmp_path / "run", ["--model.attention_layers", "sink_logit,gated_elementwise",
                                                    "--model.attention_sink_init", "1.5"])
    with pytest.raises(UserError, match="attention variant sink_logit, gated_elementwise "):
        export_model(tmp_path / "run", tmp_path / "hf", "hf")
    fmt, _ = export_model(tmp_path / "run", tmp_path / "out", "auto")
    assert fmt == "safetensors"
    back, cfg, _ = load_pretrained(tmp_path / "out")
    assert cfg.model.attention_layers == "sink_logit,gated_elementwise"
    assert torch.equal(back.layers["0"].attention.sink.weight, torch.full((4,), 1.5))
    tokens = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(back(tokens), model(tokens))


@pytest.mark.parametrize("variant", ["sink_logit", "softpick", "clipped_softmax"])
def test_softcap_caps_the_logits_before_the_variant_but_not_the_sink(variant):
    q, k, v = _qkv(1, 2, 6, 4, 6.0, seed=9)
    cap = 3.0
    sink = torch.tensor([2.5, 4.0], dtype=torch.float64) if variant == "sink_logit" else None
    got = attention(q, k, v, variant, opts=AttentionOptions(variant=variant), state=sink, softcap=cap)
    ref = torch.zeros_like(got)
    for i in range(6):
        s = torch.einsum("bhd,bhjd->bhj", q[:, :, i], k[:, :, : i + 1]) * 0.5
        w = weights_formula(cap * torch.tanh(s / cap), i, variant, sink=sink)  # the sink logit 4.0 > cap stays
        ref[:, :, i] = torch.einsum("bhj,bhjd->bhd", w, v[:, :, : i + 1])
    assert (got - ref).abs().max().item() < TOL


def test_an_option_of_another_variant_is_one_line_naming_its_variant():
    with pytest.raises(ConfigError) as e:
        _args(attention="relu", attention_softpick_eps=1e-3)
    msg = str(e.value)
    assert "\n" not in msg and "model.attention_softpick_eps is an option of attention variant 'softpick'" in msg
    assert "this run uses relu" in msg
    # the variant in use (here through attention_layers) owns it: accepted, and it reaches the block
    spec, a = _args(attention_layers="relu,softpick", attention_softpick_eps=1e-3, attention_relu_norm="none")
    assert a.attention_softpick_eps == 1e-3 and a.attention_relu_norm == "none"
    with pytest.raises(ConfigError, match="option of attention variant 'sink_logit'"):
        _args("op", attention_sink_init=0.5)  # op runs softmax by default


def test_the_registry_feeds_the_config_and_the_model_code():
    import dataclasses

    from outlier_titan.config.manager import help_text
    from outlier_titan.models import attention_variants as reg
    from outlier_titan.options import NO_DECAY_CLASSES

    names = [v.name for v in reg.variants()]
    fields = {f.name: f for f in dataclasses.fields(Model)}
    assert list(fields["attention"].metadata["choices"]) == names
    assert {n for n in names if reg.get_variant(n).torch_forms().sdpa is not None} == set(SDPA + ("sink_logit",))
    assert tuple(NO_DECAY_CLASSES) == ("norm", "bias", "embedding", "gain", "v_scale", "head_norm", "sink")
    owned = {k: f.metadata["owner"] for k, f in fields.items() if f.metadata.get("kind") == reg.KIND}
    assert owned == {"attention_sink_init": "sink_logit", "attention_softpick_eps": "softpick",
                     "attention_sigmoid_bias": "sigmoid", "attention_relu_norm": "relu",
                     "attention_clip_zeta": "clipped_softmax", "attention_clip_gamma": "clipped_softmax"}
    # config None = the owner's default, which the spec's args take from the same declaration
    assert all(getattr(Model(), k) is None for k in owned)
    a = attn_mod.AttentionArgs()
    assert (a.attention_sink_init, a.attention_softpick_eps, a.attention_relu_norm) == (0.0, 1e-6, "prefix")
    assert (a.attention_clip_zeta, a.attention_clip_gamma, a.attention_sigmoid_bias) == (1.0, -0.03, None)
    text = help_text()
    assert "options of attention variant 'softpick':" in text and "--model.attention_softpick_eps   default 1e-06" in text
