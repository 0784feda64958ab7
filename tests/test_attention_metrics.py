"""The field's attention-sink metrics (observe/sinks.py, the probe) on constructed attention maps and
activations whose values are known by hand, through the reducible sums and the probe."""

import pytest
import torch
import torch.nn as nn

from outlier_titan.config.job_config import Model, Observe
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args
from outlier_titan.observe import metrics, sinks
from outlier_titan.observe.probe import OutlierProbe

F64 = torch.float64


def constructed_map(alphas, t=5, b=2):
    """[B, H, T, T] weights whose column 0 is alpha_h on every query (rows unnormalised, as under sigmoid)."""
    p = torch.zeros(b, len(alphas), t, t, dtype=F64)
    for h, a in enumerate(alphas):
        p[:, h, :, 0] = a
        p[:, h, 1:, 1] = 0.01
    return p


def test_sink_rate_by_hand_and_through_sums():
    p = constructed_map([1.0, 0.31, 0.29, 0.0])  # two heads above eps = 0.3
    assert sinks.SINK_RATE(p)["sink_rate"] == 0.5
    assert metrics.measure("attention", p)["sink_rate"] == 0.5
    # pooled over two halves of the batch (two DP ranks): per-head means over all sequences
    q = constructed_map([0.2, 0.2, 0.2, 0.2])
    both = metrics.add_sums(metrics.layer_sums("attention", p), metrics.layer_sums("attention", q))
    # per sequence (Gu et al.): 2 of 4 heads sink in p's 2 sequences, none in q's: 4 of 16 (sequence, head) pairs
    assert metrics.finalize_layer(both)["sink_rate"] == 0.25
    # pooled: per head (1 + 0.2) / 2 = 0.6 > 0.3; 0.255, 0.245, 0.1 not
    assert metrics.finalize_layer(both)["sink_rate_pooled"] == 0.25


def _gu_sink_rate(maps: torch.Tensor, eps: float) -> float:
    """Gu et al. 2024's Sink^eps of key 0 as sail-sg/Attention-Sink's ``compute_attention_sink`` computes it on maps
    [samples, layers, heads, T, T]: each key's weight summed over the queries and divided by how many queries see
    it (T - j), thresholded per (sample, layer, head), then averaged over those three axes (a fraction here, a
    percentage there)."""
    t = maps.shape[-1]
    seen_by = torch.arange(t, 0, -1, dtype=maps.dtype)  # key j is seen by T - j queries
    importance = maps.sum(-2) / seen_by  # [S, L, H, T]
    return float((importance[..., 0] > eps).to(F64).mean())


def test_sink_rate_equals_gu_et_als_per_sequence_computation_on_the_same_maps():
    """Six sequences whose heads sink in some sequences only: Gu et al.'s per-sequence share differs from the
    pooled form, and ours equals theirs (layer means of the probe's per-layer values)."""
    g = torch.Generator().manual_seed(0)
    s, n_layers, h, t = 6, 3, 4, 9
    scores = torch.randn(s, n_layers, h, t, t, generator=g, dtype=F64) * 2
    scores[..., 0] += torch.randn(s, n_layers, h, 1, generator=g, dtype=F64) * 3  # key 0 strong in some sequences
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    maps = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    per_layer = [metrics.measure("attention", maps[:, l]) for l in range(n_layers)]
    ours = metrics.layer_mean(per_layer)
    ref = _gu_sink_rate(maps, sinks.SINK_EPS)
    assert ours["sink_rate"] == pytest.approx(ref, abs=1e-12)
    assert ours["sink_rate_pooled"] != pytest.approx(ref)  # the pooled form is another quantity on these maps


def test_sink_rate_heads_split_over_tp_ranks_are_laid_side_by_side():
    p = constructed_map([1.0, 0.31, 0.29, 0.0])
    probe = OutlierProbe.__new__(OutlierProbe)
    probe._tp_mesh = object()  # stands for a TP mesh of 2
    module = nn.Module()
    module.wq, module.head_dim = nn.Linear(8, 4 * 2, bias=False), 2  # 4 global heads
    total = None
    for rank in (0, 1):
        probe._tp_rank = rank
        local = metrics.layer_sums("attention", p[:, 2 * rank:2 * rank + 2])
        total = metrics.add_sums(total, {k: probe._global_heads(s, module, replicated=False) for k, s in local.items()})
    got = metrics.finalize_layer(total)
    ref = metrics.measure("attention", p)
    assert got["sink_rate"] == ref["sink_rate"] == 0.5
    whole = metrics.layer_sums("attention", p)
    assert torch.equal(total["sink_rate"]["head_mass_first"], whole["sink_rate"]["head_mass_first"])


def test_massive_activations_and_residual_peak_by_hand():
    x = torch.ones(2, 3, 3, dtype=F64)
    x[0].view(-1)[7], x[0].view(-1)[8] = 2.0, -300.0  # sequence 0: median 1, max 300, one entry > 100 x median
    x[1] *= 2.0  # sequence 1: all equal, ratio 1, none massive
    m = sinks.MASSIVE(x)
    assert m["massive_ratio"] == pytest.approx((300 + 1) / 2) and m["massive_count"] == 0.5
    # residual peak: token norms [10, 2, 2, 2] -> 5; second sequence [1, 1, 1, 1] -> 1
    y = torch.zeros(2, 4, 3, dtype=F64)
    y[0, 0, 0], y[0, 1:, 1] = 10.0, 2.0
    y[1, :, 2] = 1.0
    assert sinks.RESIDUAL_PEAK(y)["residual_peak"] == pytest.approx(3.0)


def test_value_drain_and_dormant_heads_by_hand():
    b, h, t, d = 1, 4, 3, 2
    v = torch.ones(b, h, t, d, dtype=F64)
    v[:, :, 0] *= 0.1 / 2 ** 0.5  # ||v_0|| = 0.1
    v[:, :, 2] *= 3.0  # norms [0.1, sqrt 2, 3 sqrt 2]
    drain = 0.1 / ((2 ** 0.5 + 3 * 2 ** 0.5) / 2)
    out = torch.zeros(b, h, t, d, dtype=F64)
    out[:, :, 1:, 0] = torch.tensor([1.0, 1.0, 1.0, 0.01]).view(1, h, 1)
    out[:, 3, 0, 0] = 50.0  # the first token's output does not count
    m = metrics.measure("heads", out, v)
    assert m["value_drain"] == pytest.approx(drain)
    assert m["dormant_head_share"] == 0.25  # 0.01 < 0.1 x mean(1, 1, 1, 0.01)


@pytest.mark.parametrize("variant", ["sigmoid", "sink_logit", "gated_head"])
def test_probe_reports_the_new_metrics_from_the_variants_own_weights(variant):
    spec, args = model_args(Model(name="pre_ln", flavor="debug", attention=variant), 512, 16)
    model = spec.build(args)
    model.init_weights(Initializer(0, torch.device("cpu")))
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    seen, outs, res = [], [], []
    att = model.layers["1"].attention
    att_hook = model.layers["1"].register_forward_hook(lambda m, i, o: res.append(o.detach()))
    scalars, images = OutlierProbe(model, Observe(mode="full", map_tokens=8)).run(tokens)
    att_hook.remove()
    # the same forward again with our own hooks (every layer on the explicit path, as in the probe)
    for blk in model.layers.values():
        blk.attention.prob_hook = lambda p: None
    att.prob_hook, att.head_hook = seen.append, (lambda o, v: outs.append((o, v)))
    with torch.no_grad():
        model(tokens)
    for blk in model.layers.values():
        blk.attention.prob_hook = blk.attention.head_hook = None
    p = seen[0]
    if variant == "sigmoid":  # unnormalised weights: rows do not sum to 1
        assert (p.sum(-1) - 1).abs().max().item() > 0.1
    if variant == "sink_logit":  # the sink keeps part of each row
        assert (p.sum(-1) < 1).all()
    assert scalars["outliers/layer_1/sink_rate"] == sinks.SINK_RATE(p)["sink_rate"]
    heads = metrics.measure("heads", *outs[0])
    assert scalars["outliers/layer_1/value_drain"] == pytest.approx(heads["value_drain"], rel=1e-9)
    assert scalars["outliers/layer_1/dormant_head_share"] == heads["dormant_head_share"]
    massive = sinks.MASSIVE(res[0])
    assert scalars["outliers/layer_1/massive_ratio"] == pytest.approx(massive["massive_ratio"], rel=1e-9)
    assert scalars["outliers/layer_1/massive_count"] == massive["massive_count"]
    assert scalars["outliers/layer_1/residual_peak"] == pytest.approx(sinks.RESIDUAL_PEAK(res[0])["residual_peak"],
                                                                        rel=1e-9)
    for k in ("sink_rate", "massive_ratio", "massive_count", "residual_peak", "value_drain", "dormant_head_share"):
        assert f"outliers/{k}" in scalars
    assert "outliers/attention_map" in images


def test_evaluation_report_and_collected_tables_show_the_new_metrics():
    from outlier_titan.eval.report import markdown
    from outlier_titan.study.results import probe_metrics

    names = ("sink_rate", "massive_ratio", "massive_count", "residual_peak", "value_drain", "dormant_head_share")
    probe = {f"outliers/{k}": 0.25 + i for i, k in enumerate(names)}
    text = markdown({"checkpoint": "c", "tokens": 10, "seq_len": 4, "full_precision": {"ppl": 5.0}, "schemes": [],
                     "probe": probe})
    for i, k in enumerate(names):
        assert f"| {k} | {0.25 + i:.4g} |" in text
        assert k in probe_metrics()  # sweep.py collect: final_<k> and peak_<k> columns


def test_runs_that_logged_the_pooled_sink_rate_as_sink_rate_are_collected_under_its_name_now():
    from outlier_titan.study.results import LEGACY_PROBE_NAMES, logged_key

    assert LEGACY_PROBE_NAMES == {"sink_rate": "sink_rate_pooled"}
    old = {10: {"outliers/sink_rate": 0.5}}
    new = {10: {"outliers/sink_rate": 0.25, "outliers/sink_rate_pooled": 0.5}}
    assert logged_key(old, "sink_rate") is None and logged_key(old, "sink_rate_pooled") == "sink_rate"
    assert logged_key(new, "sink_rate") == "sink_rate" and logged_key(new, "sink_rate_pooled") == "sink_rate_pooled"
