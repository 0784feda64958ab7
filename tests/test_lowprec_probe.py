"""What the probe sees of the low-precision casts (outlier_titan/observe/lowprec.py): per block, module group and
tensor class, the statistics equal a float64 computation on the tensors the cast modules see (input, weight, and
the output gradient of the probe's backward); they are off unless asked; ``observe.lowprec_recipe`` measures a BF16
model as a recipe would cast it; the picture, metrics.jsonl, TensorBoard and the console line carry them. The
layouts' equality (FSDP2, FSDP2 x TP2) is tests/test_lowprec_probe_dist.py."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import outlier_titan.components  # noqa: F401  (spawned ranks import this file without conftest)
from outlier_titan.config.job_config import Model, Observe
from outlier_titan.errors import ConfigError
from outlier_titan.lowprec.formats import cast_stats, fake_quantize
from outlier_titan.lowprec.recipes import RECIPES
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import Attention
from outlier_titan.models.registry import model_args
from outlier_titan.observe import lowprec, metrics
from outlier_titan.observe.probe import OutlierProbe
from tests.launch import gloo_group

VOCAB, SEQ = 256, 32


def tiny_model(flavor: str = "debug", recipe: str | None = None) -> nn.Module:
    """The pre_ln debug model; ``recipe``: its blocks' linear maps marked as cast modules (what the
    ``[low_precision]`` conversion leaves on them)."""
    spec, args = model_args(Model(name="pre_ln", flavor=flavor), vocab_size=VOCAB, seq_len=SEQ)
    model = spec.build(args)
    model.init_weights(Initializer(0, "cpu"))
    if recipe:
        mark(model, recipe)
    return model


def mark(model: nn.Module, recipe: str) -> None:
    for block in model.layers.values():
        for m in block.modules():
            if isinstance(m, nn.Linear):
                m.lowprec_recipe = RECIPES[recipe]


def tokens(b: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (b, SEQ), generator=torch.Generator().manual_seed(3))


def captured(model: nn.Module, tok: torch.Tensor) -> dict:
    """``{(layer, group): [(module, x, w, g)]}``: every block linear's input, weight and output gradient (of the
    probe's loss: mean next-token cross entropy over the in-window targets), by plain autograd."""
    seen, outs = {}, {}
    handles = []
    for layer, block in model.layers.items():
        attn = {id(m) for a in block.modules() if isinstance(a, Attention) for m in a.modules()}
        for name, m in block.named_modules():
            if isinstance(m, nn.Linear):
                key = (layer, "attn" if id(m) in attn else "mlp", name)

                def hook(mod, inputs, out, key=key):
                    out.retain_grad()
                    seen[key], outs[key] = (mod, inputs[0].detach(), mod.weight.detach()), out
                handles.append(m.register_forward_hook(hook))
    logits = model(tok)
    for h in handles:
        h.remove()
    b, t = tok.shape
    F.cross_entropy(logits.float()[:, :-1].flatten(0, 1), tok[:, 1:].flatten(), reduction="sum").div(
        b * (t - 1)).backward()
    model.zero_grad(set_to_none=True)
    out: dict = {}
    for (layer, group, _), (mod, x, w) in seen.items():
        out.setdefault((layer, group), []).append((mod, x, w, outs[(layer, group, _)].grad[:, :-1]))
    return out


def reference(tensors: list[torch.Tensor], cast) -> dict[str, float]:
    """The statistics of one group's tensors of one class, each cast along its last axis, in float64 from the
    fake-quantised values: amax, underflow share (nonzero -> 0), SNR dB, largest block dynamic range; the scales
    and the saturation from each tensor's cast_stats (their min / max / sum)."""
    xs = [t.double() for t in tensors]
    qs = [fake_quantize(t, cast, -1).double() for t in tensors]
    stats = [cast_stats(t, cast, -1) for t in tensors]
    nonzero = sum(float((x != 0).sum()) for x in xs)
    out = {"amax": max(float(x.abs().max()) for x in xs),
           "underflow": sum(float(((x != 0) & (q == 0)).sum()) for x, q in zip(xs, qs)) / nonzero,
           "snr_db": 10 * math.log10(sum(float(x.square().sum()) for x in xs)
                                     / sum(float((x - q).square().sum()) for x, q in zip(xs, qs))),
           "scale_min": min(float(s["scale_min"]) for s in stats),
           "scale_max": max(float(s["scale_max"]) for s in stats),
           "saturation": sum(float(s["saturated"]) for s in stats) / sum(x.numel() for x in xs)}
    if cast.scaling == "block":
        ratios = []
        for x in xs:
            a = x.abs()
            if cast.block_2d:  # a weight [out, in]: 16 x 16 tiles
                a = a.reshape(a.shape[0] // cast.block, cast.block, -1, cast.block).permute(0, 2, 1, 3).flatten(2)
            else:
                a = a.reshape(*a.shape[:-1], -1, cast.block)
            big, small = a.amax(-1), torch.where(a > 0, a, math.inf).amin(-1)
            ratios.append(float((big / small)[big > 0].max()))
        out["block_dr"] = max(ratios)
    return out


@pytest.mark.parametrize("recipe", ["fp8_tensorwise", "mxfp4", "nvfp4"])
def test_cast_metrics_equal_float64_on_the_captured_tensors(recipe):
    model, tok = tiny_model(recipe=recipe), tokens()
    scalars, _ = OutlierProbe(model, Observe(mode="cheap", gradients=True)).run(tok)
    want = captured(model, tok)
    r = RECIPES[recipe]
    for (layer, group), mods in want.items():
        # activations and gradients per sequence (a tensor scale is taken per probe sequence), weights whole
        for cls, cast, tensors in (("act", r.input, [seq for _, x, _, _ in mods for seq in x]),
                                   ("weight", r.weight, [w for _, _, w, _ in mods]),
                                   ("grad", r.grad_output, [seq for _, _, _, g in mods for seq in g])):
            ref = reference(tensors, cast)
            assert ("block_dr" in ref) == (cast.scaling == "block")
            for q, v in ref.items():
                got = scalars[f"outliers/layer_{layer}/{lowprec.name(cls, group, q)}"]
                assert got == pytest.approx(v, rel=1e-9, abs=1e-12), (layer, group, cls, q)
    assert scalars[f"outliers/{lowprec.name('act', 'mlp', 'snr_db')}"] == pytest.approx(
        np.mean([scalars[f"outliers/layer_{n}/lp_act_mlp_snr_db"] for n in model.layers]), rel=1e-12)
    saturated = scalars["outliers/layer_0/lp_act_mlp_saturation"]
    if recipe == "mxfp4":  # E8M0 scales floor the block amax to a power of two: E2M1 blocks past 6 + 1 clamp
        assert saturated > 0.0
    else:  # amax scales (FP8 tensorwise; NVFP4's E4M3 block scale, off by < 1/16) clamp nothing
        assert saturated == 0.0


@pytest.mark.parametrize("recipe", ["mxfp8", "nvfp4"])
def test_two_batches_pool_like_one(recipe):
    model, tok = tiny_model(recipe=recipe), tokens(4)
    probe = OutlierProbe(model, Observe(mode="cheap"))
    one, _ = probe.run(tok)
    two, _ = probe.measure([tok[:1], tok[1:]])
    lp = [k for k in one if "/lp_" in k]
    assert lp and all(two[k] == pytest.approx(one[k], rel=1e-12) for k in lp)


def test_off_unless_asked_and_bf16_turns_it_off():
    tok = tokens()
    plain, images = OutlierProbe(tiny_model(), Observe(mode="full", gradients=True)).run(tok)
    assert not any("/lp_" in k for k in plain) and "outliers/lowprec" not in images
    off, _ = OutlierProbe(tiny_model(recipe="mxfp4"), Observe(mode="full", gradients=True,
                                                              lowprec_recipe="bf16")).run(tok)
    assert off == plain  # nothing else changes either
    on, images = OutlierProbe(tiny_model(recipe="mxfp4"), Observe(mode="full", gradients=True)).run(tok)
    assert {k for k in on if "/lp_" not in k} == set(plain) and "outliers/lowprec" in images
    assert all(on[k] == plain[k] for k in plain)  # the other metrics bitwise unchanged
    assert "outliers/lp_grad_mlp_snr_db" in on
    forward, _ = OutlierProbe(tiny_model(recipe="mxfp4"), Observe(mode="cheap")).run(tok)
    assert "outliers/lp_act_mlp_snr_db" in forward and not any("lp_grad" in k for k in forward)  # needs gradients


def test_a_bf16_model_is_measured_as_the_named_recipe_would_cast_it():
    tok = tokens()
    asked, _ = OutlierProbe(tiny_model(), Observe(mode="cheap", lowprec_recipe="nvfp4")).run(tok)
    marked, _ = OutlierProbe(tiny_model(recipe="nvfp4"), Observe(mode="cheap")).run(tok)
    assert asked == marked and "outliers/layer_3/lp_weight_attn_block_dr" in asked
    # a marked model measured as another recipe: the override wins for the marked modules
    other, _ = OutlierProbe(tiny_model(recipe="mxfp4"), Observe(mode="cheap", lowprec_recipe="nvfp4")).run(tok)
    assert other == marked


def test_only_the_marked_modules_are_measured():
    model = tiny_model()
    for block in model.layers.values():
        block.feed_forward.w2.lowprec_recipe = RECIPES["fp8_rowwise"]
    found = lowprec.cast_modules(model)
    assert {layer: [(n, g) for n, _, g, _ in mods] for layer, mods in found.items()} == {
        layer: [("feed_forward.w2", "mlp")] for layer in model.layers}
    scalars, _ = OutlierProbe(model, Observe(mode="cheap")).run(tokens())
    assert "outliers/layer_0/lp_act_mlp_snr_db" in scalars and not any("_attn_" in k for k in scalars)
    w2 = model.layers["0"].feed_forward.w2.weight.detach()
    assert scalars["outliers/layer_0/lp_weight_mlp_amax"] == float(w2.abs().max())


def test_an_unknown_recipe_is_one_line_naming_the_choices():
    with pytest.raises(ConfigError, match=r"^observe.lowprec_recipe = 'fp6' is not a recipe; choose one of: "
                                          r"bf16, fp8_rowwise") as e:
        OutlierProbe(tiny_model(), Observe(lowprec_recipe="fp6"))
    assert "\n" not in str(e.value)
    from outlier_titan.config.manager import parse_args

    with pytest.raises(ConfigError, match=r"^observe.lowprec_recipe = 'fp6' is not a recipe"):  # the dry run's too
        parse_args(["--config", "train_configs/debug.toml", "--observe.lowprec_recipe", "fp6"])
    assert parse_args(["--config", "train_configs/debug.toml", "--observe.lowprec_recipe", "mxfp4"]
                      ).observe.lowprec_recipe == "mxfp4"


def test_registry_entries():
    for cls, reads in (("act", "casts"), ("weight", "casts"), ("grad", "cast_gradient")):
        m = metrics.get_metric(f"lowprec_{cls}")
        assert m.reads == reads and m.mode == "cheap" and len(m.names) == 2 * len(lowprec.QUANTITIES)
        assert lowprec.name(cls, "attn", "snr_db") in metrics.shown("collect")
        assert (lowprec.name(cls, "mlp", "underflow") in metrics.shown("collect")) == (cls != "weight")
        assert not any(n.startswith("lp_") for n in metrics.shown("plot"))  # BF16 runs' default panels unchanged
    assert metrics.active(Observe(mode="cheap"), "cast_gradient") == []
    assert [m.key for m in metrics.active(Observe(mode="cheap", gradients=True), "cast_gradient")] == ["lowprec_grad"]


def test_picture_rows_are_the_logged_values():
    model = tiny_model(recipe="mxfp4")
    scalars, images = OutlierProbe(model, Observe(mode="full", gradients=True)).run(tokens())
    layers, columns, table = lowprec.picture_rows(scalars)
    assert layers == list(model.layers)
    assert columns == ["act attn", "act mlp", "weight attn", "weight mlp", "grad attn", "grad mlp"]
    for q in ("underflow", "saturation", "snr_db"):
        for i, n in enumerate(layers):
            for j, c in enumerate(columns):
                assert table[q][i][j] == scalars[f"outliers/layer_{n}/lp_{c.replace(' ', '_')}_{q}"]
    img = images["outliers/lowprec"]
    assert img.dtype == np.uint8 and img.ndim == 3 and img.shape[2] == 3 and img.std() > 0


def test_console_headline_shows_the_snr():
    scalars, _ = OutlierProbe(tiny_model(recipe="mxfp8"), Observe(mode="cheap")).run(tokens())
    line = metrics.headline(10, {**scalars, "outliers/probe_seconds": 0.1})
    assert f"act SNR dB {scalars['outliers/lp_act_attn_snr_db']:.3g}/{scalars['outliers/lp_act_mlp_snr_db']:.3g}" \
        in line and "grad SNR" not in line


@pytest.mark.dist
def test_trainer_logs_the_cast_metrics_to_jsonl_tensorboard_and_console(tmp_path):
    """train.py on a BF16 run asking what MXFP4 would do: the per-layer and mean names in metrics.jsonl at the
    probe steps, the scalars and the picture in the TensorBoard event file, the SNR on the console."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.launch import TINY, train

    run = train(tmp_path, *TINY, "--training.steps", "4", "--observe.every", "2", "--observe.batch_size", "2",
                "--observe.gradients", "true", "--observe.lowprec_recipe", "mxfp4",
                "--metrics.tensorboard", "true").check()
    probes = [r for r in run.records if "outliers/lp_act_mlp_snr_db" in r]
    assert [r["step"] for r in probes] == [2, 4]
    assert 0.0 < probes[0]["outliers/layer_0/lp_grad_attn_underflow"] < 1.0
    assert 5.0 < probes[0]["outliers/lp_weight_mlp_snr_db"] < 40.0
    acc = EventAccumulator(str(next((run.run_dir / "tb").glob("events.out.tfevents.*"))),
                           size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("outliers/layer_1/lp_act_attn_saturation")] == [2, 4]
    events = acc.Images("outliers/lowprec")
    assert [e.step for e in events] == [2, 4] and events[0].width > 100 and events[0].height > 100
    assert "act SNR dB" in run.stdout and "grad underflow" in run.stdout


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_activation_checkpointing_gives_the_same_casts(compiled):
    """A checkpointed block's recompute in the probe's backward calls the cast modules again: counted once; the
    trainer's compiled blocks (AOT autograd) run the hooks eagerly and give the same values."""
    from outlier_titan.parallel.parallelize import apply_activation_checkpointing

    tok, cfg = tokens(), Observe(mode="cheap", gradients=True)
    want, _ = OutlierProbe(tiny_model(recipe="mxfp4"), cfg).run(tok)
    model = tiny_model(recipe="mxfp4")
    apply_activation_checkpointing(model, "full", 1)
    if compiled:
        torch._dynamo.reset()
        for block in model.layers.values():
            block.compile(backend="aot_eager")
    probe = OutlierProbe(model, cfg)
    probe.run(tok)
    got, _ = probe.run(tok)  # the second run: compiled graphs in place
    torch._dynamo.reset()
    assert got.keys() == want.keys() and "outliers/lp_grad_attn_snr_db" in got
    assert all(got[k] == pytest.approx(want[k], rel=1e-9, abs=1e-15) for k in want)


DIST_RECIPES = {"gpt2_s1": "nvfp4", "llama": "fp8_rowwise"}  # 16 x 16 weight tiles and a tensor scale; row scales
DIST_OBSERVE = Observe(mode="cheap", gradients=True)
# float64 models: a cast is a step function of its input, and float32 activations summed in another order under TP
# put a few elements per 1e5 on the other side of a rounding or clamping edge; float64 layouts agree to ~1e-16, which
# the casts' float32 conversion rounds away (the casts themselves are float32 as in training)
DIST_DTYPE = torch.float64


def _dist_reference(flavor: str):
    from tests.test_probe_dist import build, probe_tokens

    torch.set_default_dtype(DIST_DTYPE)
    try:
        _, _, model = build(flavor)
    finally:
        torch.set_default_dtype(torch.float32)
    model.init_weights(Initializer(7, "cpu"))
    mark(model, DIST_RECIPES[flavor])
    return OutlierProbe(model, DIST_OBSERVE).run(probe_tokens())


def _dist_worker(rank: int, world: int, port: int, layouts: list, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    from outlier_titan.parallel.dims import ParallelDims
    from outlier_titan.parallel.fsdp import apply_fsdp
    from outlier_titan.parallel.tensor_parallel import apply_tp_plan
    from tests.test_probe_dist import BATCH, build, probe_tokens

    results = {}
    with gloo_group(rank, world, port):
        for dp_shard, tp in layouts:
            mesh = ParallelDims(1, dp_shard, tp, world).build_mesh("cpu")
            for flavor, recipe in DIST_RECIPES.items():
                torch.set_default_dtype(DIST_DTYPE)  # the parameters; the initializer draws in float32
                try:
                    spec, args, model = build(flavor, "meta")
                finally:
                    torch.set_default_dtype(torch.float32)
                mark(model, recipe)  # before the wrappers, as the conversion runs before parallelize
                if tp > 1:
                    apply_tp_plan(model, mesh["tp"], args, spec.tp_plan)
                apply_fsdp(model, mesh["dp_shard"], DIST_DTYPE, DIST_DTYPE)
                model.to_empty(device="cpu")
                model.init_weights(Initializer(7, "cpu"))
                per = BATCH // dp_shard
                share = probe_tokens()[mesh["dp"].get_local_rank() * per:][:per]
                results[(dp_shard, tp, flavor)] = OutlierProbe(model, DIST_OBSERVE, mesh).run(share)
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()


@pytest.mark.dist
@pytest.mark.parametrize("world,layouts",
                         [(2, [(2, 1)]), pytest.param(4, [(4, 1), (2, 2)], marks=pytest.mark.extended)],
                         ids=["fsdp2", "fsdp4-fsdp2xtp2"])
def test_distributed_cast_metrics_equal_one_rank(world, layouts, tmp_path):
    """FSDP2 over 2 and 4 ranks and FSDP2 x TP2 (sequence parallel: feature- and sequence-sharded casts gathered)
    give the one-rank values of every cast metric, the gradient class included (gloo, CPU)."""
    import torch.multiprocessing as mp

    from outlier_titan.parallel.dims import free_port
    from tests.test_probe_dist import assert_same

    refs = {flavor: _dist_reference(flavor) for flavor in DIST_RECIPES}
    assert "outliers/layer_0/lp_weight_attn_block_dr" in refs["gpt2_s1"][0]
    assert "outliers/layer_0/lp_grad_mlp_scale_min" in refs["llama"][0]
    mp.start_processes(_dist_worker, args=(world, free_port(), layouts, str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for dp_shard, tp in layouts:
        for flavor in DIST_RECIPES:
            key = (dp_shard, tp, flavor)
            (got, got_images), (ref, ref_images) = per_rank[0][key], refs[flavor]
            # softmax's query / key gradient at position 0 (one visible key) is exactly 0 on one rank and ~1e-20
            # where TP sums it from shards: "nonzero" counts those elements there (they then underflow). Softmax-1
            # (gpt2_s1) has no such zeros and is compared on every name.
            noise = {k for k in ref if k.endswith("lp_grad_attn_underflow")} if tp > 1 and flavor == "llama" else set()
            assert_same(({k: v for k, v in got.items() if k not in noise}, got_images),
                        ({k: v for k, v in ref.items() if k not in noise}, ref_images), f"{key}")
            assert noise <= got.keys()
            for r in range(world):
                assert per_rank[r][key][0] == per_rank[0][key][0], (key, r)


def test_the_mean_over_blocks_skips_blocks_left_in_bf16():
    """NVFP4 keeps the last blocks in BF16 by default: the casts' outliers/<name> is the mean over the cast blocks
    (a metric every block has still needs every block)."""
    from outlier_titan.observe.metrics import layer_mean

    snr = "lp_act_mlp_snr_db"
    got = layer_mean([{snr: 20.0, "kurtosis_rest": 3.0}, {snr: 10.0, "kurtosis_rest": 5.0}, {"kurtosis_rest": 4.0}])
    assert got == {snr: 15.0, "kurtosis_rest": 4.0}
    assert "kurtosis_first" not in layer_mean([{"kurtosis_first": 3.0}, {}])
