"""The sinks_vs_massive2026 suite: its claims follow the spread over seeds and gate on the baseline's own
phenomenon; the decoupling table names what each arm removes; its sweep files plan every arm (QK-Clip at the
threshold its claim uses)."""

import pytest

from outlier_titan.study.groups import aggregate
from outlier_titan.study.spec import load_sweep
from outlier_titan.study.suite_files import suite_file
from outlier_titan.study.suites import sinks_vs_massive2026 as svm


def _groups(values: dict[str, dict[str, list[float]]]):
    rows = [{"point": f"{arm}_s{seed}", "seed": seed, svm.ARM: arm,
             **{k: v[seed] for k, v in metrics.items()}}
            for arm, metrics in values.items() for seed in range(3)]
    return aggregate(rows, [svm.ARM, "seed"])


BASE = {"sink_rate": [0.4, 0.45, 0.5], "massive_t0_early": [8.0, 9.0, 10.0], "final_val_loss": [2.0, 2.0, 2.0],
        "max_abs_all": [300.0, 350.0, 320.0], "max_logit": [40.0, 45.0, 42.0], "d_w8a8": [1.0, 1.2, 1.1],
        "ppl": [10.0, 10.0, 10.0]}


def _claims(**arms):
    claims = svm.claims(_groups({"baseline": BASE, **arms}))
    return {text.split(" ")[0]: (verdict, detail) for text, verdict, detail in claims[:2] + claims[3:]}, claims


def test_v_scale_keeps_the_sink_and_removes_the_massive_activations():
    got, _ = _claims(v_scale={**BASE, "massive_t0_early": [2.0, 2.2, 1.9], "final_val_loss": [2.01, 2.0, 2.0]})
    assert got["V-scale"][0] == "reproduced"
    got, _ = _claims(v_scale={**BASE, "sink_rate": [0.0, 0.0, 0.01], "massive_t0_early": [2.0, 2.2, 1.9]})
    assert got["V-scale"][0] == "not reproduced"  # the sink went too
    no_sink = {**BASE, "sink_rate": [0.0, 0.02, 0.0]}
    claims = svm.claims(_groups({"baseline": no_sink, "v_scale": BASE}))
    assert claims[0][1] == "cannot be tested" and "forms no sink" in claims[0][2]
    no_ma = {**BASE, "massive_t0_early": [1.0, 1.1, 1.05]}
    claims = svm.claims(_groups({"baseline": no_ma, "v_scale": BASE}))
    assert claims[0][1] == "cannot be tested" and "not above 2" in claims[0][2]


def test_tweo_and_qk_clip_claims_gate_on_the_baseline():
    _, claims = _claims(tweo={**BASE, "max_abs_all": [12.0, 15.0, 11.0], "d_w8a8": [0.1, 0.2, 0.1]},
                        qk_clip={**BASE, "max_logit": [18.0, 18.5, 18.2]})
    assert [c[1] for c in claims[1:]] == ["reproduced", "reproduced", "reproduced"], claims
    small = {**BASE, "max_abs_all": [5.0, 6.0, 5.5], "max_logit": [3.0, 3.2, 3.1], "d_w8a8": [0.1, 0.12, 0.11]}
    claims = svm.claims(_groups({"baseline": small, "tweo": small, "qk_clip": small}))
    assert claims[0][1] == "not determined"  # no V-scale arm among these groups
    assert [c[1] for c in claims[1:]] == ["cannot be tested"] * 3


def test_the_decoupling_table_names_what_each_arm_removes():
    table = svm.decoupling_table(_groups({
        "baseline": BASE,
        "v_scale": {**BASE, "massive_t0_early": [2.0, 2.2, 1.9]},
        "gated": {**BASE, "sink_rate": [0.0, 0.0, 0.0], "massive_t0_early": [1.0, 1.1, 1.2]}}))
    rows = {ln.split("|")[1].strip(): ln for ln in table[2:]}
    assert "(kept)" in rows["v_scale"].split("|")[2] and "(removed)" in rows["v_scale"].split("|")[4]
    assert "(removed)" in rows["gated"].split("|")[2] and "(removed)" in rows["gated"].split("|")[4]


@pytest.mark.parametrize("scale", ["smoke", "lr", "cpu"])
def test_every_arm_is_planned_and_qk_clip_uses_the_claims_tau(scale):
    points = load_sweep(suite_file("sinks_vs_massive2026", scale)).points
    arms = {p.axes[svm.ARM] for p in points}
    assert arms == {svm.BASELINE, *svm.REMEDIES}
    for p in points:
        assert p.cfg.remedies.qk_clip_tau == svm.QK_CLIP_TAU.value
        assert p.cfg.remedies.qk_clip == (p.axes[svm.ARM] == "qk_clip")
        assert p.cfg.remedies.tweo == (p.axes[svm.ARM] == "tweo")
        assert p.cfg.observe.gradients
