"""The attention paths (models/attention.py, attention_sdpa.py, attention_flex.py): the CPU's paths of every variant
(SDPA, the sink logit's lse rescale on the CPU flash kernel, chunked) against its float64 formula and the explicit
path (values and gradients; GQA, RoPE, the sink logits), under activation checkpointing and compile;
FlexAttention's identities in forward (its backward needs a GPU); peak memory linear in T; a model's loss and
gradients on the default path equal the explicit path's."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from outlier_titan.models import attention as attn_mod
from outlier_titan.models.attention import AttentionError, run_attention
from outlier_titan.models.attention_variants import AttentionOptions, variants
from outlier_titan.models.attention_flex import flex_attention_variant
from outlier_titan.models.layers import Attention, RotaryEmbedding, attention, repeat_kv
from outlier_titan.parallel.parallelize import _op_policy
from outlier_titan.tools.benchmarks.attention import attention_step, peak_bytes
from tests.test_attention import attention_formula

TOL = 1e-10
VARIANTS = [v.name for v in variants()]
SDPA = ("softmax", "softmax1", "gated_head", "gated_elementwise")


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(attn_mod, "CHUNK_ROWS", 8)


def _qkv(h, hk, t, seed, logit_scale=2.0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(2, h, t, 8, generator=g, dtype=torch.float64) * logit_scale).requires_grad_()
    k = torch.randn(2, hk, t, 8, generator=g, dtype=torch.float64).requires_grad_()
    v = torch.randn(2, hk, t, 8, generator=g, dtype=torch.float64).requires_grad_()
    return q, k, v


def _sink(variant):
    return torch.tensor([-1.0, 0.5, 3.0, 0.0], dtype=torch.float64, requires_grad=True) if variant == "sink_logit" \
        else None


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_path_equals_the_formula_with_gqa(small_chunks, variant):
    q, k, v = _qkv(4, 2, 37, seed=3)  # 37 queries: blocks of 8, 8, 8, 8, 5
    sink = _sink(variant)
    inputs = [q, k, v] + ([sink] if sink is not None else [])
    formula = "softmax" if variant.startswith("gated") else variant
    ref = attention_formula(q, *repeat_kv(q, k, v), formula, 8 ** -0.5, **({"sink": sink} if sink is not None else {}))
    up = torch.randn_like(ref)
    want = torch.autograd.grad(ref, inputs, up)
    for impl in ("auto", "chunked", "explicit"):
        got = attention(q, k, v, variant, opts=AttentionOptions(variant=variant, impl=impl), state=sink)
        assert (got - ref).abs().max().item() < TOL, impl
        for gg, gr in zip(torch.autograd.grad(got, inputs, up), want):
            assert (gg - gr).abs().max().item() < TOL, impl


@pytest.mark.parametrize("variant", VARIANTS)
def test_chunked_equals_explicit_under_a_softcap(small_chunks, variant):
    q, k, v = _qkv(4, 4, 37, seed=4, logit_scale=4.0)
    sink = _sink(variant)
    inputs = [q, k, v] + ([sink] if sink is not None else [])
    o = AttentionOptions(variant=variant)
    ref = attn_mod.explicit_attention(q, k, v, o, 8 ** -0.5, state=sink, softcap=2.0)
    got = attn_mod.chunked_attention(q, k, v, o, 8 ** -0.5, state=sink, softcap=2.0)
    assert (got - ref).abs().max().item() < 1e-12
    up = torch.randn_like(ref)
    for gg, gr in zip(torch.autograd.grad(got, inputs, up), torch.autograd.grad(ref, inputs, up)):
        assert (gg - gr).abs().max().item() < 1e-12


def _module(variant, impl, seed=0):
    torch.manual_seed(seed)
    rope = RotaryEmbedding(8, 40)
    rope.init_weights()
    att = Attention(32, 4, 2, bias=False, variant=variant, rope=rope,
                    opts=AttentionOptions(variant=variant, impl=impl)).double()
    if variant == "sink_logit":
        with torch.no_grad():
            att.sink.weight.copy_(torch.tensor([-1.0, 0.5, 3.0, 0.0]))
    return att


@pytest.mark.parametrize("variant", VARIANTS)
def test_module_with_rope_under_activation_checkpointing(small_chunks, variant):
    x = torch.randn(2, 40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    up = torch.randn(2, 40, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(2))

    def run(att):
        xi = x.clone().requires_grad_()
        out = att(xi)
        out.backward(up)
        return out, [xi.grad] + [p.grad for p in att.parameters()]

    ref, ref_grads = run(_module(variant, "explicit"))
    sac = {"context_fn": lambda: create_selective_checkpoint_contexts(_op_policy)}
    for impl in ("chunked", "auto"):
        for wrap in (lambda m: m, lambda m: checkpoint_wrapper(m, preserve_rng_state=False),
                     lambda m: checkpoint_wrapper(m, preserve_rng_state=False, **sac)):
            out, grads = run(wrap(_module(variant, impl)))
            assert (out - ref).abs().max().item() < 1e-12
            assert all((g - r).abs().max().item() < 1e-12 for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("variant,impl", [("softpick", "chunked"), ("sink_logit", "chunked"), ("sink_logit", "auto")])
def test_cpu_paths_compile_in_one_graph(small_chunks, variant, impl):
    att = _module(variant, impl)
    x = torch.randn(2, 40, 32, dtype=torch.float64, requires_grad=True)
    params = [x] + list(att.parameters())
    eager = torch.autograd.grad(att(x).square().sum(), params)
    compiled = torch.compile(att, backend="aot_eager", fullgraph=True)
    for g, r in zip(torch.autograd.grad(compiled(x).square().sum(), params), eager):
        assert (g - r).abs().max().item() < 1e-12


FLEX_CASES = [(v, {}, 0.0) for v in VARIANTS] + [
    ("sigmoid", {"attention_sigmoid_bias": 0.7}, 0.0), ("relu", {"attention_relu_norm": "seq_len"}, 0.0),
    ("relu", {"attention_relu_norm": "none"}, 0.0),
    ("clipped_softmax", {"attention_clip_zeta": 1.1, "attention_clip_gamma": -0.2}, 0.0),
    ("softpick", {"attention_softpick_eps": 1e-2}, 0.0), ("sink_logit", {}, 2.0), ("softpick", {}, 2.0),
    ("clipped_softmax", {}, 2.0), ("relu", {}, 2.0)]


@pytest.mark.parametrize("variant,opts,softcap", FLEX_CASES)
def test_flex_identities_equal_the_explicit_weights_in_forward(variant, opts, softcap):
    q, k, v = (x.detach() for x in _qkv(4, 4, 19, seed=5, logit_scale=4.0))
    q[:, :, 0] = -k[:, :, 0]  # the first query's only logit is negative: relu and softpick give it no weight
    sink = _sink(variant)
    sink = sink.detach() if sink is not None else None
    o = AttentionOptions.of(variant, **opts)
    ref = attn_mod.explicit_attention(q, k, v, o, 8 ** -0.5, state=sink, softcap=softcap)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention's "without torch.compile" notice
        got = flex_attention_variant(q, k, v, o, 8 ** -0.5, state=sink, softcap=softcap)
    assert torch.isfinite(got).all()
    assert (got - ref).abs().max().item() < TOL


def test_paths_chosen_per_device_and_fused_refuses_cpu_training():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    path = attn_mod.attention_path
    on_cpu = SDPA + ("sink_logit",)
    assert [path(v, "auto", cpu) for v in VARIANTS] == ["sdpa" if v in on_cpu else "chunked" for v in VARIANTS]
    assert [path(v, "auto", gpu) for v in VARIANTS] == ["sdpa" if v in SDPA else "flex" for v in VARIANTS]
    assert path("softmax", "auto", gpu, softcap=30.0) == "flex" and path("softmax", "auto", cpu, 30.0) == "chunked"
    assert {path(v, "explicit", gpu) for v in VARIANTS} == {"explicit"}
    q, k, v = _qkv(4, 4, 6, seed=1)
    with pytest.raises(AttentionError, match="no backward on the CPU"):
        run_attention(q, k, v, AttentionOptions(variant="softpick", impl="fused"), 0.5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_peak_memory_grows_linearly_in_t(variant):
    def peak(impl, t):
        step = attention_step(variant, impl, 1, 2, t, 16, torch.float32, torch.device("cpu"))
        return peak_bytes(step, torch.device("cpu"))

    growth = peak("auto", 2048) / peak("auto", 1024)
    assert growth < 2.5, growth
    if variant == "softpick":  # the measure sees the explicit path's T x T weights
        assert peak("explicit", 2048) / peak("explicit", 1024) > 3.5


def test_default_path_losses_and_grads_equal_the_explicit_path():
    from outlier_titan.config.job_config import Model
    from outlier_titan.models.init import Initializer
    from outlier_titan.models.registry import model_args

    every = "sink_logit,gated_head,gated_elementwise,softpick,sigmoid,relu,clipped_softmax,softmax1,softmax"
    tokens = torch.randint(0, 256, (2, 300), generator=torch.Generator().manual_seed(0))  # 3 blocks of 128 rows
    results = {}
    for impl in ("explicit", "auto"):
        spec, args = model_args(Model(name="pre_ln", flavor="debug_llama", n_layers=9, attention_layers=every,
                                      attention_impl=impl, attention_sink_init=0.5), 256, 300)
        model = spec.build(args)
        model.init_weights(Initializer(0, torch.device("cpu")))
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        results[impl] = loss.item(), {n: p.grad for n, p in model.named_parameters()}
    (loss_e, grads_e), (loss_a, grads_a) = results["explicit"], results["auto"]
    assert abs(loss_a - loss_e) <= 1e-6 * abs(loss_e)
    for name, g in grads_e.items():
        assert (grads_a[name] - g).abs().max().item() <= 1e-5 * g.abs().max().item() + 1e-9, name


def test_sink_logit_on_the_cpu_runs_the_flash_kernel_forward_and_backward():
    from torch.profiler import ProfilerActivity, profile

    q, k, v = _qkv(4, 4, 40, seed=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        attention(q, k, v, "sink_logit", opts=AttentionOptions(variant="sink_logit"), state=_sink("sink_logit")).sum() \
            .backward()
    names = {e.key.removeprefix("aten::") for e in prof.key_averages()}
    assert {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"} \
        <= names and "bmm" not in names, sorted(names)


def test_resuming_on_another_attention_path_is_listed_not_refused():
    from outlier_titan.checkpoint.manager import config_changes

    changes = config_changes('[model]\nattention = "softpick"\nattention_impl = "explicit"\n',
                             '[model]\nattention = "relu"\n')
    assert {k: w for k, _, _, w in changes} == {"model.attention_impl": None, "model.attention": "the model differs"}


def test_attention_benchmark_prints_a_row_per_variant_path_and_length(capsys):
    from outlier_titan.tools.benchmark import main

    main(["attention", "--variants", "sink_logit,relu", "--seq-lens", "32,64", "--reps", "1", "--batch", "1",
          "--heads", "2", "--head-dim", "8", "--threads", str(torch.get_num_threads())])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines() if line.startswith("| 32 ")
            or line.startswith("| 64 ")]
    got = {(r[0].strip("| "), r[1], r[2]): (r[3], r[6]) for r in rows}
    assert len(rows) == 12 and got[("64", "softmax", "auto")] == ("sdpa", "1.00x")
    assert got[("64", "sink_logit", "auto")][0] == "sdpa" and got[("64", "relu", "auto")][0] == "chunked"
    assert {p for (_, _, impl), (p, _) in got.items() if impl == "explicit"} == {"explicit"}
