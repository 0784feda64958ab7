"""Super weights (Yu et al. 2024, arXiv 2411.07191): detection against a float64 reference on planted super
weights, no false positive on a Gaussian model, the zeroing schemes, and the probe metric at 1, 2 and 4 ranks
(FSDP2, FSDP2 x TP2), Smooth-SwiGLU's under TP included."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import outlier_titan.components  # noqa: F401  (spawned ranks import this file without conftest)
from outlier_titan.config.job_config import Model, Observe
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args
from outlier_titan.observe import super_weights as sw
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.parallel.dims import free_port
from outlier_titan.quant.ptq import quantized
from tests.launch import gloo_group

SEED, VOCAB, SEQ, BATCH = 7, 512, 16, 4
# name -> (flavor, further model options); smooth_swiglu's rule reads the plain SwiGLU's down projection (w2's operands
# times the per-token scale, all-reduced over TP shards), so it must find what the plain llama finds
FLAVORS = {"gpt2": ("debug", {}), "llama": ("debug_llama", {}),
           "smooth_swiglu": ("debug_llama", {"smooth_swiglu": True})}
PLAIN = ("gpt2", "llama")  # the rule reads w2's own operands (Smooth-SwiGLU's case: tests/test_smooth_swiglu.py)
PLANT = ("1", 7, 5)  # layer, row (output channel), col (input channel)


def tokens(seed: int = 11) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def build(flavor: str, device: str = "cpu"):
    name, options = FLAVORS[flavor]
    spec, args = model_args(Model(name="pre_ln", flavor=name, **options), vocab_size=VOCAB, seq_len=SEQ)
    with torch.device(device):
        return spec, args, spec.build(args)


def _set(p: torch.Tensor, edit) -> None:
    """Applies ``edit`` to the full value of a (possibly sharded) parameter."""
    from torch.distributed.tensor import DTensor, distribute_tensor
    with torch.no_grad():
        if isinstance(p, DTensor):
            full = p.full_tensor()
            edit(full)
            p.copy_(distribute_tensor(full, p.device_mesh, p.placements))
        else:
            edit(p)


def plant(model, layer: str = PLANT[0], row: int = PLANT[1], col: int = PLANT[2], value: float = 3.0) -> None:
    """A super weight: hidden unit ``col`` of block ``layer``'s MLP made huge on every token (its input rows
    scaled up), and ``W2[row, col] = value`` carries it to output channel ``row``."""
    ff = model.layers[layer].feed_forward

    gated = ff.w3 is not None  # swiglu: the unit is a product of two rows, each scaled
    factor = 60.0 if gated else 2000.0  # input spike in the hundreds: > 50, and x 0.02 (other weights) < 50

    def scale(w):
        w[col] *= factor

    for lin in (ff.w1, ff.w3) if gated else (ff.w1,):
        _set(lin.weight, scale)
    _set(ff.w2.weight, lambda w: w.__setitem__((row, col), value))


def model64(flavor: str, planted: bool = True):
    _, _, model = build(flavor)
    model.init_weights(Initializer(SEED, "cpu"))
    model = model.to(torch.float64)
    if planted:
        plant(model)
    return model


def captured(model, toks):
    """Every down projection's input and output on ``toks``."""
    got = {}
    hooks = [lin.register_forward_hook(lambda _m, i, o, n=n: got.__setitem__(n, (i[0].detach(), o.detach())))
             for n, lin in sw.down_projections(model).items()]
    with torch.no_grad():
        model(toks)
    for h in hooks:
        h.remove()
    return got


def reference_top1(t: torch.Tensor) -> tuple[float, int]:
    """The authors' rule in float64: the element of largest |t| over the whole tensor, signed, and its channel."""
    flat = t.to(torch.float64).reshape(-1)
    i = int(flat.abs().argmax())
    return float(flat[i]), i % t.shape[-1]


@pytest.mark.parametrize("flavor", PLAIN)
def test_detection_finds_the_planted_super_weight_like_the_float64_reference(flavor):
    model = model64(flavor)
    toks = tokens()
    found = sw.detect(model, toks)
    assert [(f.layer, f.row, f.col) for f in found] == [PLANT]
    assert found[0].weight == 3.0
    x_in, x_out = captured(model, toks)[PLANT[0]]
    (v_in, c_in), (v_out, c_out) = reference_top1(x_in), reference_top1(x_out)
    assert (c_out, c_in) == PLANT[1:] and abs(v_in) > sw.SPIKE_THRESHOLD and abs(v_out) > sw.SPIKE_THRESHOLD
    assert found[0].act_in == pytest.approx(v_in, rel=1e-12) and found[0].act_out == pytest.approx(v_out, rel=1e-12)
    # the probe metric (one shard) reads the same spikes and the weight at their crossing
    got = sw.SUPER_WEIGHTS(x_in, x_out, model.layers[PLANT[0]].feed_forward.w2.weight)
    assert got == pytest.approx({"super_weight": 1.0, "sa_in": v_in, "sa_in_channel": c_in, "sa_out": v_out,
                                 "sa_out_channel": c_out, "sw_value": 3.0}, rel=1e-12)
    assert sum(p.numel() for p in model.parameters()) and model.layers[PLANT[0]].feed_forward.w2.weight[7, 5] == 3.0


@pytest.mark.parametrize("flavor", PLAIN)
def test_no_super_weight_in_a_gaussian_model(flavor):
    model = model64(flavor, planted=False)
    toks = tokens()
    assert sw.detect(model, toks) == []
    for name, (x_in, x_out) in captured(model, toks).items():  # the rule's reason: no spike above |50|
        assert abs(reference_top1(x_in)[0]) < sw.SPIKE_THRESHOLD and abs(reference_top1(x_out)[0]) < 50
        assert sw.SUPER_WEIGHTS(x_in, x_out, sw.down_projections(model)[name].weight)["super_weight"] == 0.0


def test_super_weights_in_two_layers_are_both_found():
    model = model64("llama")
    plant(model, layer="0", row=3, col=9, value=-2.0)
    found = sw.detect(model, tokens())
    assert [(f.layer, f.row, f.col, f.weight) for f in found] == [("0", 3, 9, -2.0), (*PLANT, 3.0)]


def test_spike_ties_go_to_the_smallest_channel_then_the_largest_value():
    x = torch.zeros(2, 3, 6, dtype=torch.float64)
    x[0, 1, 4], x[1, 2, 2], x[1, 0, 2] = -8.0, -8.0, 8.0
    value, channel = sw.spike(x)
    assert (float(value), float(channel)) == (8.0, 2.0)


@pytest.mark.parametrize("scheme", ["superweight_zero", "superweight_random", "superweight_topk"])
def test_zeroing_schemes_change_one_weight_per_super_weight(scheme):
    model = model64("llama")
    plant(model, layer="0", row=3, col=9, value=-2.0)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with quantized(model, scheme, [tokens()], seed=3) as info:
        after = model.state_dict()
        changed = [(k, tuple(i)) for k in before for i in (before[k] != after[k]).nonzero().tolist()]
        assert info["edit"]["super_weights"] == [["0", 3, 9], list(PLANT)]
        zeroed = [tuple(c) for c in info["edit"]["zeroed"]]
        assert len(changed) == 2 and all(after[k][i] == 0 for k, i in changed)
        assert sorted(changed) == sorted((f"layers.{l}.feed_forward.w2.weight", (r, c)) for l, r, c in zeroed)
        if scheme == "superweight_zero":
            assert zeroed == [("0", 3, 9), PLANT]
        else:
            assert not set(zeroed) & {("0", 3, 9), PLANT}
        if scheme == "superweight_topk":  # the largest |w| of the down projections but the super weights
            w = torch.cat([before[f"layers.{n}.feed_forward.w2.weight"].abs().reshape(-1)
                           for n in sw.down_projections(model)])
            assert sorted(float(before[k][i].abs()) for k, i in changed) == sorted(w.topk(4).values[2:].tolist())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # restored


def _worker(rank: int, world: int, port: int, layouts: list, out_dir: str) -> None:
    from outlier_titan.parallel.dims import ParallelDims
    from outlier_titan.parallel.fsdp import apply_fsdp
    from outlier_titan.parallel.tensor_parallel import apply_tp_plan

    results = {}
    with gloo_group(rank, world, port):
        for dp_replicate, dp_shard, tp, flavors in layouts:
            mesh = ParallelDims(dp_replicate, dp_shard, tp, world).build_mesh("cpu")
            for flavor in flavors:
                spec, args, model = build(flavor, "meta")
                if tp > 1:
                    apply_tp_plan(model, mesh["tp"], args, spec.tp_plan)
                apply_fsdp(model, mesh["dp_shard"], torch.float32, torch.float32)
                model.to_empty(device="cpu")
                model.init_weights(Initializer(SEED, "cpu"))
                plant(model)
                dp_rank, per = mesh["dp"].get_local_rank(), BATCH // dp_shard
                share = tokens()[dp_rank * per:(dp_rank + 1) * per]
                results[(dp_shard, tp, flavor)] = OutlierProbe(model, Observe(mode="full"), mesh).run(share)[0]
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()


def _super_weight_metrics(probe: dict) -> list[str]:
    """The names of the probe's super-weight metrics in ``probe`` (its output)."""
    return [k for k in probe if k.rsplit("/", 1)[-1] in sw.SUPER_WEIGHTS.names]


@pytest.mark.dist
@pytest.mark.parametrize("world,layouts", [
    (2, [(1, 2, 1, ("gpt2", "llama"))]),
    pytest.param(4, [(1, 4, 1, ("llama",)), (1, 2, 2, ("gpt2", "llama", "smooth_swiglu"))],
                 marks=pytest.mark.extended)],
    ids=["fsdp2", "fsdp4-fsdp2xtp2"])
def test_tracked_super_weight_equal_at_1_2_4_ranks_and_tp(world, layouts, tmp_path):
    refs = {}
    for flavor in FLAVORS:
        _, _, model = build(flavor)
        model.init_weights(Initializer(SEED, "cpu"))
        plant(model)
        refs[flavor] = OutlierProbe(model, Observe(mode="full")).run(tokens())[0]
        n_layers = len(model.layers)
        assert refs[flavor][f"outliers/layer_{PLANT[0]}/super_weight"] == 1.0
        assert refs[flavor][f"outliers/layer_{PLANT[0]}/sw_value"] == 3.0
    sw_names = _super_weight_metrics(refs["llama"])
    assert {k: refs["smooth_swiglu"][k] for k in sw_names} == pytest.approx({k: refs["llama"][k] for k in sw_names},
                                                                            rel=1e-5, abs=1e-7)
    mp.start_processes(_worker, args=(world, free_port(), layouts, str(tmp_path)), nprocs=world, join=True,
                       start_method="spawn")
    per_rank = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]
    for key, got in per_rank[0].items():
        ref = refs[key[-1]]
        names = _super_weight_metrics(ref)
        assert len(names) == 6 * n_layers + 1 and "outliers/sa_in_channel" not in ref  # channels are not averaged
        for k in names:
            assert got[k] == pytest.approx(ref[k], rel=1e-5, abs=1e-7), (key, k, got[k], ref[k])
        for r in range(1, world):
            assert per_rank[r][key] == got, (key, r)


def test_evaluate_runs_the_zeroing_schemes_on_a_debug_checkpoint(tmp_path, capsys):
    """A real checkpoint (train.py, 1 rank, debug flavor) through scripts/evaluate.py with the three schemes: they
    are listed in --help and the report; a 3-step model has no spike above |50|, so nothing is zeroed and Δppl = 0."""
    import json

    from outlier_titan.tools import evaluate as ev
    from tests.launch import TINY, train

    run = train(tmp_path, *TINY, "--training.steps", "3", "--checkpoint.enable", "true", "--training.seq_len", "32")
    run.check()
    with pytest.raises(SystemExit):
        ev.main(["--help"])
    text = "".join(capsys.readouterr().out.split())  # argparse wraps to the terminal's width
    assert all(n in text for n in ("superweight_zero:", "superweight_random:", "superweight_topk:"))
    names = ["superweight_zero", "superweight_random", "superweight_topk"]
    rc = ev.main(["--checkpoint", str(run.run_dir), "--tokens", "128", "--batch-size", "2", "--calib-batches", "1",
                  "--calib-seeds", "1", "--schemes", ",".join(names), "--device", "cpu"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    report = json.loads((run.run_dir / "eval" / "step-3.json").read_text())
    assert [e["scheme"] for e in report["schemes"]] == names
    for e in report["schemes"]:
        assert e["edit"] == [{"super_weights": [], "zeroed": []}] and e["delta"] == 0.0
    assert "| superweight_zero |" in (run.run_dir / "eval" / "step-3.md").read_text()
    assert any(k.endswith("/sa_out_channel") for k in report["probe"])
