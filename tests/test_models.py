"""Model specs on one process: flavors and parameter counts, init properties, options, post-step hooks."""

import dataclasses

import pytest
import torch
import torch.nn as nn

from outlier_titan.config.job_config import Model as ModelConfig
from outlier_titan.config.manager import ConfigError, parse_args
from outlier_titan.models import angpt, op
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import LayerNorm, RMSNorm, RotaryEmbedding
from outlier_titan.models.ngpt import model as ngpt
from outlier_titan.models.pre_ln import model as pre_ln
from outlier_titan.models.registry import count_params, get_spec, model_args
from tests.launch import REPO, train

SPECS = ("pre_ln", "op", "angpt", "ngpt")


CONFIG_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}


def build(spec_name, meta=False, vocab=4096, seq_len=64, **options):
    """Through ``model_args``, as the trainer does. Options that are not ``model.*`` config keys (shapes, for
    small proxies of a flavor) re-derive the args from the flavor with them, so dependent defaults follow."""
    shape = {k: options.pop(k) for k in list(options) if k not in CONFIG_KEYS}
    spec, args = model_args(ModelConfig(name=spec_name, **options), vocab, seq_len)
    if shape:
        overrides = {k: v for k, v in options.items() if k != "flavor"}
        values = {**spec.flavors[options.get("flavor", "debug")], **overrides, **shape,
                  "vocab_size": args.vocab_size, "max_seq_len": args.max_seq_len}
        args = spec.args_cls(**values)
        args.validate()
    if meta:
        with torch.device("meta"):
            return spec, args, spec.build(args)
    model = spec.build(args)
    model.init_weights(Initializer(0, "cpu"))
    if spec.post_step is not None:
        spec.post_step(model)
    return spec, args, model


def meta_count(spec_name, flavor, vocab):
    return count_params(build(spec_name, meta=True, vocab=vocab, seq_len=1024, flavor=flavor)[2])


# ----------------------------------------------------------------------------------------------- flavors


@pytest.mark.parametrize("name", SPECS)
def test_every_spec_has_a_small_debug_flavor_and_builds_every_flavor_on_meta(name):
    spec = get_spec(name)
    assert 1e6 <= meta_count(name, "debug", 4096) <= 3e6
    for flavor in spec.flavors:
        _, _, model = build(name, meta=True, vocab=50304, seq_len=256, flavor=flavor)
        for attr in ("tok_embeddings", "layers", "norm", "output"):
            assert hasattr(model, attr)
        assert isinstance(model.layers, nn.ModuleDict)


# Table F.1 of Franke et al. 2025 (vocab 50,304): anGPT, nGPT and GPT+ columns.
TABLE_F1 = {
    "32m": (32.10e6, 32.11e6, 32.05e6), "62m": (62.28e6, 62.33e6, 62.24e6), "125m": (127.08e6, 127.16e6, 127.03e6),
    "250m": (247.21e6, 247.34e6, 247.17e6), "0.5b": (505.78e6, 506.00e6, 505.73e6), "1b": (1.073e9, 1.073e9, 1.073e9),
}


@pytest.mark.parametrize("size", list(TABLE_F1))
def test_franke2025_parameter_counts_match_table_f1(size):
    an, ng, gp = TABLE_F1[size]
    assert meta_count("angpt", size, 50304) == pytest.approx(an, rel=1e-3)  # 1% asked; it is 0.1%
    assert meta_count("ngpt", size, 50304) == pytest.approx(ng, rel=1e-3)
    assert meta_count("pre_ln", f"gptplus_{size}", 50304) == pytest.approx(gp, rel=1e-3)


def test_kaul2024_flavors_have_the_papers_sizes_and_settings():
    nominal = {"kaul2024_gpt2_60m": (60e6, 50304), "kaul2024_gpt2_130m": (130e6, 50304),
               "kaul2024_gpt2_350m": (350e6, 50304), "kaul2024_gpt2_1.4b": (1.4e9, 50304),
               "kaul2024_llama2_130m": (130e6, 32000)}
    for flavor, (n, vocab) in nominal.items():
        assert meta_count("pre_ln", flavor, vocab) == pytest.approx(n, rel=0.05), flavor
        _, args, model = build("pre_ln", meta=True, vocab=vocab, flavor=flavor)
        assert args.norm == "rmsnorm_single" and not args.bias
        norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
        assert norms and all(m.weight.numel() == 1 for m in norms)
        assert not any(getattr(m, "bias", None) is not None for m in model.modules() if isinstance(m, nn.Linear))


def test_train_configs_parse_and_build():
    files = sorted(f for prefix in ("kaul2024_", "franke2025_", "he2024_")
                   for f in (REPO / "train_configs").glob(f"{prefix}*.toml")) + [REPO / "train_configs" / "ngpt_0.5b.toml"]
    assert len(files) >= 10
    for f in files:
        cfg = parse_args(["--config", str(f)])
        spec, args = model_args(cfg.model, 50257, cfg.training.seq_len)
        with torch.device("meta"):
            spec.build(args)
        if spec.name in ("angpt", "ngpt"):
            assert cfg.optimizer.weight_decay == 0 and cfg.lr_scheduler.warmup_steps == 0, f.name
        if spec.name == "angpt":
            assert cfg.optimizer.name == "adam" and args.vocab_size == 50304


# ----------------------------------------------------------------------------------------------- pre_ln


def test_partial_rope_rotates_only_the_leading_dims_and_keeps_relative_positions():
    rope = pre_ln.build_rope(16, 32, 10000.0, 0.5)
    full = RotaryEmbedding(8, 32, 10000.0)
    rope.init_weights(), full.init_weights()
    x = torch.randn(2, 3, 32, 16, dtype=torch.float64)
    y = rope(x)
    assert torch.equal(y[..., 8:], x[..., 8:])
    assert torch.allclose(y[..., :8], full(x[..., :8]))
    # q.k depends only on the offset: same vectors at positions (3, 5) and (10, 12)
    q, k = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    seq = torch.zeros(1, 1, 32, 16, dtype=torch.float64)
    seq[0, 0, 3] = seq[0, 0, 10] = q
    seq[0, 0, 5] = seq[0, 0, 12] = k
    r = rope(seq)[0, 0]
    assert torch.allclose(r[3] @ r[5], r[10] @ r[12])
    with pytest.raises(ConfigError):
        pre_ln.rope_dims(16, 0.3)


def test_pre_ln_gptplus_uses_qk_norm_swiglu_and_half_rope():
    _, args, model = build("pre_ln", meta=True, flavor="gptplus_32m")
    att = model.layers["0"].attention
    assert att.q_norm is not None and att.k_norm is not None and model.output is not None
    assert isinstance(model.rope, pre_ln.PartialRotaryEmbedding) and model.rope.head_dim == 32
    assert model.layers["0"].feed_forward.w3 is not None and args.ffn_hidden == 4 * args.dim


# ----------------------------------------------------------------------------------------------- OP


def _norm_modules(model):
    return {name: m for name, m in model.named_modules()
            if isinstance(m, (nn.LayerNorm, nn.RMSNorm, RMSNorm, LayerNorm)) or getattr(m, "is_norm", False)}


@pytest.mark.parametrize("flavor", list(op.FLAVORS))
def test_op_has_no_norm_on_the_residual_path(flavor):
    _, _, model = build("op", meta=True, flavor=flavor)
    norms = _norm_modules(model)
    assert isinstance(model.norm, nn.Identity)
    # the only norms are the per-head QK-norms inside attention (on q and k, not on the residual stream)
    assert norms and all(name.split(".")[-1] in ("q_norm", "k_norm") and ".attention." in name for name in norms)
    for block in model.layers.values():
        assert block.attention_norm is None and block.ffn_norm is None


def test_op_baselines_do_have_their_norms():
    for block, kind in (("pre_ln", LayerNorm), ("post_ln", LayerNorm), ("pre_rms", RMSNorm), ("pre_srms", RMSNorm)):
        _, _, model = build("op", block=block, residual_scale_mode="none", qk_norm=False, final_norm=True)
        b = model.layers["0"]
        assert isinstance(b.attention_norm, kind) and isinstance(b.ffn_norm, kind)
        assert isinstance(model.norm, LayerNorm)
        if block == "pre_srms":
            assert b.attention_norm.weight is None  # no trainable gain
        assert not _norm_modules(model.layers["0"].attention)
    # the authors' first-block input LayerNorm, off by default
    _, _, model = build("op", input_norm=True)
    assert isinstance(model.layers["0"].attention_norm, LayerNorm) and model.layers["1"].attention_norm is None


def test_op_beta_as_configured():
    x = torch.randn(2, 8, 128)
    for mode, value in (("fixed", 0.2), ("scalar", 0.3), ("vector", 0.05), ("none", 1.0)):
        _, args, model = build("op", residual_scale_mode=mode, residual_scale=value)
        block = model.layers["0"]
        if mode == "none":
            assert block.attn_scale is None and block.mlp_scale is None
        elif mode == "fixed":
            assert block.attn_scale.weight is None and block.attn_scale.value == value
        else:
            w = block.attn_scale.weight
            assert w.shape == ((1,) if mode == "scalar" else (128,)) and w.requires_grad
            assert torch.all(w == value) and torch.all(block.mlp_scale.weight == value)
        with torch.no_grad():
            mid = x + value * block.attention(x)
            expected = mid + value * block.feed_forward(mid)
            assert torch.allclose(block(x), expected, atol=1e-6)


def test_op_embedding_scaling():
    tokens = torch.randint(0, 4096, (4, 64))
    for options, ms in (({}, 1.0), ({"embed_scale": 3.0}, 9 * 0.02 ** 2)):
        _, args, model = build("op", pos_encoding="rope", **options)
        seen = []
        model.layers["0"].register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        with torch.no_grad():
            model(tokens)
            assert torch.allclose(seen[0], model.tok_embeddings(tokens) * args.embed_scale)
        assert seen[0].pow(2).mean().item() == pytest.approx(ms, rel=0.05)
    _, args, _ = build("op")
    assert args.embed_scale == pytest.approx(50.0)


def test_op_analytic_alpha_gives_unit_preactivations():
    _, args, model = build("op", seq_len=128, mlp="gelu", mlp_alpha="analytic", pos_encoding="rope", dim=256,
                           n_heads=4, n_layers=6)
    stds = []
    for block in model.layers.values():
        assert block.mlp_input_scale.weight is None  # fixed
        block.feed_forward.w1.register_forward_hook(lambda m, a, o: stds.append(o.std().item()))
    with torch.no_grad():
        model(torch.randint(0, 4096, (2, 128)))
    assert all(0.8 < s < 1.2 for s in stds), stds
    _, _, model = build("op", mlp_alpha="trainable")
    assert model.layers["0"].mlp_input_scale.weight.requires_grad


def test_op_softcap_and_tied_head():
    torch.manual_seed(0)
    _, _, plain = build("op")
    _, _, capped = build("op", logit_softcap=1e6)
    tokens = torch.randint(0, 4096, (2, 32))
    with torch.no_grad():
        assert torch.allclose(plain(tokens), capped(tokens), atol=1e-4)
        _, _, tight = build("op", logit_softcap=0.5)
        assert (tight(tokens) - plain(tokens)).abs().max() > 1e-3
    _, _, tied = build("op", tie_embeddings=True)
    assert tied.output is None
    tied(tokens).sum().backward()
    assert tied.tok_embeddings.weight.grad is not None


def test_op_trains_200_steps_without_divergence(tmp_path):
    run = train(tmp_path, "--model.name", "op", "--training.steps", "200", "--training.seq_len", "32",
                "--training.global_batch_size", "8", "--lr_scheduler.warmup_steps", "10", "--metrics.log_every", "1",
                "--eval.every", "0", "--observe.every", "0", "--checkpoint.enable", "false",
                "--metrics.tensorboard", "false").check()
    losses = run.losses
    assert sorted(losses) == list(range(1, 201))
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert max(losses.values()) < losses[1] + 0.5  # no blow-up
    late = [losses[s] for s in range(181, 201)]
    assert sum(late) / len(late) < losses[1] - 2.0, losses
    assert run.records[-1]["skipped_steps"] == 0


# ----------------------------------------------------------------------------------------------- anGPT / nGPT


def _block_output_rms(model, tokens):
    rms = []
    hooks = [b.register_forward_hook(lambda m, a, o: rms.append(o.pow(2).mean().sqrt().item()))
             for b in model.layers.values()]
    with torch.no_grad():
        emb = model.tok_embeddings(tokens).pow(2).mean().sqrt().item()
        model(tokens)
    for h in hooks:
        h.remove()
    return emb, rms


def test_angpt_residual_rms_is_preserved_through_the_depth_of_the_05b_flavor():
    # the 0.5B flavor's depth (24 blocks) and head dim 64, at width 128 (a proxy: same depth, d_h and ratios)
    depth = angpt.FLAVORS["0.5b"]["n_layers"]
    tokens = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    _, _, model = build("angpt", vocab=512, seq_len=64, flavor="0.5b", dim=128, n_heads=2)
    assert len(model.layers) == depth == 24
    emb, rms = _block_output_rms(model, tokens)
    assert all(abs(r / emb - 1) < 0.10 for r in rms), [r / emb for r in rms]
    # the printed factor 1 - 2a + 2a^2 does not preserve it (the spec's reason for the corrected form)
    _, _, printed = build("angpt", vocab=512, seq_len=64, flavor="0.5b", dim=128, n_heads=2, lerp_form="printed")
    emb, rms = _block_output_rms(printed, tokens)
    assert rms[-1] / emb < 0.5


def test_angpt_lerp_factor_values():
    lerp = ngpt.Lerp(4, alpha_init=0.05, stored_init=0.01, abs_alpha=False, form="corrected")
    lerp.alpha.data.fill_(0.01)
    h = torch.zeros(1, 4)
    x = torch.ones(1, 4)
    assert torch.allclose(lerp(h, x), torch.full((1, 4), 0.05 * 1.0512), atol=1e-4)
    lerp.form = "printed"
    assert torch.allclose(lerp(h, x), torch.full((1, 4), 0.05 * 0.905), atol=1e-6)


def test_angpt_constant_factors_after_the_post_norms_do_not_change_the_function():
    _, _, model = build("angpt")
    tokens = torch.randint(0, 4096, (2, 16))
    with torch.no_grad():
        ref = model(tokens)
        for block in model.layers.values():
            block.attention.nu_p *= 2
            block.feed_forward.nu_acf *= 2
            block.feed_forward.nu_d *= 2
        assert torch.allclose(model(tokens), ref, atol=1e-5)


def _constrained(model, residual_axis):
    return [(name, p.detach(), dim) for name, p, dim in ngpt.normalized_matrices(model, residual_axis)]


@pytest.mark.parametrize("name", ["angpt", "ngpt"])
def test_norm_constraint_holds_after_optimizer_steps(name):
    spec, args, model = build(name)
    residual_axis = name == "ngpt"
    names = [n for n, _, _ in _constrained(model, residual_axis)]
    assert {"tok_embeddings", "output", "layers.0.attention.wo", "layers.0.feed_forward.w2"} <= set(names)
    for _, p, dim in _constrained(model, residual_axis):  # init: exactly unit vectors
        assert (p.norm(dim=dim) - 1).abs().max() < 1e-6
    opt = torch.optim.Adam(model.parameters(), lr=3e-2)
    tokens = torch.randint(0, 4096, (4, 32))
    for _ in range(5):
        opt.zero_grad()
        nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        spec.post_step(model)
    hit_bound = False
    for n, p, dim in _constrained(model, residual_axis):
        norms = p.norm(dim=dim)
        if name == "angpt":
            assert norms.max() <= 1 + 1e-6, n
            hit_bound |= bool((norms > 1 - 1e-6).any())
        else:
            assert (norms - 1).abs().max() <= 1e-6, n
    assert name == "ngpt" or hit_bound  # the projection was active


def test_ngpt_reference_parametrisation():
    _, args, model = build("ngpt", flavor="debug")
    block = model.layers["0"]
    d = args.dim
    assert args.alpha_abs and args.param_scale == pytest.approx(d ** -0.5)
    with torch.no_grad():
        assert torch.allclose(block.attn_lerp.effective_alpha(), torch.full((d,), 0.05))
        assert torch.allclose(block.attention.sqk.weight * block.attention.sqk.mult, torch.ones(d))
        assert torch.allclose(model.output.scale * model.output.mult, torch.ones(args.vocab_size))
    assert block.feed_forward.w1.mult == pytest.approx(d ** 0.5)
    with torch.no_grad():  # every block output is on the unit sphere
        _, rms = _block_output_rms(model, torch.randint(0, 4096, (2, 16)))
    assert all(r == pytest.approx(d ** -0.5, rel=1e-5) for r in rms)


def test_unknown_option_for_a_spec_is_a_config_error():
    with pytest.raises(ConfigError):
        model_args(ModelConfig(name="angpt", block="op"), 4096, 64)
    with pytest.raises(ConfigError):
        model_args(ModelConfig(name="op", lerp_form="printed"), 4096, 64)


def test_an_option_of_another_spec_is_one_line_naming_its_spec():
    from outlier_titan.config.job_config import Model as ModelConfig
    from outlier_titan.config.manager import ConfigError
    from outlier_titan.models.registry import model_args

    with pytest.raises(ConfigError) as err:
        model_args(ModelConfig(name="pre_ln", block="op"), 256, 64)
    msg = str(err.value)
    assert "\n" not in msg and "model.block is not an option of model spec 'pre_ln'" in msg
    assert "it is an option of 'op'" in msg
    with pytest.raises(ConfigError, match="it is an option of 'op', 'pre_ln'"):
        model_args(ModelConfig(name="angpt", attention_sink_init=0.5), 256, 64)


def test_spec_options_are_declared_once_by_their_spec_and_composed_into_model():
    from outlier_titan.config.job_config import Model as ModelConfig
    from outlier_titan.config.manager import help_text
    from outlier_titan.models.spec import all_specs

    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    for spec in (s for s in all_specs() if s.options is not None):
        assert issubclass(spec.args_cls, spec.options), spec.name  # the args take their defaults from the group
        for f in dataclasses.fields(spec.options):
            assert spec.name in fields[f.name].metadata["owner"].split(", ")
            assert getattr(ModelConfig(), f.name) is None  # None in the config: the spec's (or flavor's) value
    assert fields["param_scale"].metadata["defaults"] == {"ngpt": None, "angpt": 0.01}
    assert fields["dim"].metadata.get("owner") is None  # every spec reads it: a common option
    text = help_text()
    assert "  -- options of model spec 'op':\n  --model.block " in text
    assert "--model.alpha_abs                default (ngpt: True, angpt: False)" in text


def test_an_old_flavor_name_is_an_alias_with_a_note(capsys):
    from outlier_titan.config.job_config import Model as ModelConfig

    _, new = model_args(ModelConfig(name="pre_ln", flavor="kaul2024_gpt2_60m"), 50304, 64)
    capsys.readouterr()
    _, old = model_args(ModelConfig(name="pre_ln", flavor="seed000_gpt2_60m"), 50304, 64)
    assert old == new
    assert capsys.readouterr().err == ("note: model.flavor 'seed000_gpt2_60m' of 'pre_ln' is now 'kaul2024_gpt2_60m'; "
                                       "the old name is deprecated\n")
    with pytest.raises(ConfigError, match="'nope' is not a flavor of 'pre_ln'"):
        model_args(ModelConfig(name="pre_ln", flavor="nope"), 50304, 64)
