"""A metric written as one file outside the package (tests/plugins/toy_metric.py), loaded as a plug-in: the probe
logs it per layer (equal to a float64 reference), and the console line, the evaluator's report, a sweep's results
and scripts/analyze.py pick it up by its registered names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from outlier_titan.config.job_config import Model, Observe
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args
from outlier_titan.observe import metrics
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.plugins import load_plugin

TOY = Path(__file__).parent / "plugins" / "toy_metric.py"
NAME = "peak_to_rms"


@pytest.fixture(scope="module")
def toy():
    load_plugin(str(TOY.resolve()))
    yield metrics.get_metric("toy_peak_to_rms")
    metrics.unregister_metric("toy_peak_to_rms")  # the other tests in this process see the built-ins only


def debug_model():
    spec, args = model_args(Model(name="pre_ln", flavor="debug"), vocab_size=256, seq_len=16)
    m = spec.build(args)
    m.init_weights(Initializer(0, "cpu"))
    return m


def reference(x: torch.Tensor) -> float:
    x = x.double()
    return float((x.abs().amax((1, 2)) / x.square().mean((1, 2)).sqrt()).mean())


def test_toy_metric_is_registered_where_it_is_shown(toy):
    assert toy.names == (NAME,) and toy.reads == "residual" and toy.mode == "cheap"
    for place in ("report", "collect", "plot"):
        assert NAME in metrics.shown(place)
    assert metrics.direction(NAME) is True and metrics.label(NAME).startswith("max |x| / RMS")
    assert metrics.registered()[-1] is toy  # after the built-ins: they keep their order in metrics.jsonl


def test_probe_logs_the_toy_metric_per_layer_equal_to_float64(toy):
    m = debug_model()
    tok = torch.randint(0, 256, (3, 16), generator=torch.Generator().manual_seed(0))
    for mode in ("cheap", "full"):  # full mode runs the attention's explicit path: other float32 activations
        outs = {}
        modules = {**m.layers, "head": m.norm}
        handles = [b.register_forward_hook(lambda _m, _i, o, n=n: outs.setdefault(n, []).append(o.detach()))
                   for n, b in modules.items()]
        scalars, _ = OutlierProbe(m, Observe(mode=mode)).measure([tok[:1], tok[1:]])  # two batches: sums add up
        for h in handles:
            h.remove()
        per_layer = [scalars[f"outliers/layer_{n}/{NAME}"] for n in m.layers]
        for n, v in zip(m.layers, per_layer):
            assert v == pytest.approx(reference(torch.cat(outs[n])), rel=1e-12), (mode, n)
        assert scalars[f"outliers/head_input/{NAME}"] == pytest.approx(reference(torch.cat(outs["head"])), rel=1e-12)
        assert scalars[f"outliers/{NAME}"] == pytest.approx(sum(per_layer) / len(per_layer), rel=1e-12)
    scalars["outliers/probe_seconds"] = 0.5
    assert f"peak/RMS {scalars[f'outliers/{NAME}']:.3g}" in metrics.headline(7, scalars)


def test_evaluator_results_and_analyze_read_the_toy_metric(toy, tmp_path, capsys):
    from outlier_titan.eval.report import markdown
    from outlier_titan.eval.runner import evaluate_model
    from outlier_titan.study.results import collect
    from outlier_titan.tools import analyze

    m = debug_model()
    tok = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    report, _ = evaluate_model(m, eval_batches=[(tok, tok)], probe_tokens=[tok], calib_batches=lambda s: [],
                               schemes=[])
    value = report["probe"][f"outliers/{NAME}"]
    assert f"| {NAME} | {value:.4g} |" in markdown({**report, "checkpoint": "c"})

    point = tmp_path / "points" / "p0"
    point.mkdir(parents=True)
    records = [{"step": s, f"outliers/{NAME}": v, **{f"outliers/layer_{i}/{NAME}": v * (i + 1) for i in range(2)}}
               for s, v in ((10, 2.0), (20, 5.0), (30, 3.0))]
    (point / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    entry = {"name": "p0", "axes": {"seed": 0}, "config": "", "steps": 30, "params": 1, "flops_per_token": 1,
             "tokens": 1, "flops": 1}
    manifest = {"axes": {"seed": [0]}, "points": [entry]}
    columns, rows = collect(tmp_path, manifest)
    assert f"final_{NAME}" in columns and f"peak_{NAME}" in columns
    assert rows[0][f"final_{NAME}"] == 3.0 and rows[0][f"peak_{NAME}"] == 5.0

    assert analyze.better(f"outliers/layer_1/{NAME}") == "lower is better"
    assert analyze.main([str(point), "--out", str(tmp_path / "a.png"), "--profiles", NAME]) == 0
    assert f"| outliers/{NAME} | 3 (step 30) |" in capsys.readouterr().out
    assert analyze.layer_profile(analyze.read_run(point), NAME) == (30, [0, 1], [3.0, 6.0])


def test_registration_errors_are_one_line():
    from outlier_titan.errors import UserError

    def finalize(s):
        return {}
    with pytest.raises(UserError, match="'massive_ratio' is already logged by metric 'massive'"):
        metrics.register_metric("mine", "massive_ratio", "residual", dict, finalize, label="x")
    with pytest.raises(UserError, match="mode must be 'full' for attention inputs"):
        metrics.register_metric("mine", "mine", "attention", dict, finalize, label="x", mode="cheap")
    with pytest.raises(UserError, match="unknown place or name 'other'"):
        metrics.register_metric("mine", "mine", "residual", dict, finalize, label="x", shown={"report": ("other",)})
    assert "mine" not in {m.key for m in metrics.registered()}


def test_one_file_is_one_plugin_however_its_path_is_written(toy, monkeypatch):
    """A run's recorded (absolute) path and a tool's ``--plugins`` (relative) name the same file: imported once,
    so its registration does not run twice (which a metric refuses)."""
    monkeypatch.chdir(TOY.parent.parent)
    assert load_plugin("plugins/toy_metric.py") is load_plugin(str(TOY.resolve()))
    assert metrics.get_metric("toy_peak_to_rms") is toy
