"""The lowprec2026 suite: its gap claims are paired by seed and gate on the baseline's own gap; the kurtosis claim
is a rank correlation over every arm and seed; its sweep files plan every arm (an op-spec arm beside pre_ln ones,
through the sweep file's "unset" value)."""

import math

import numpy as np
import pytest

from outlier_titan.study import stats
from outlier_titan.study.groups import aggregate
from outlier_titan.study.spec import load_sweep
from outlier_titan.study.suite_files import suite_file
from outlier_titan.study.suites import lowprec2026 as lp


def _groups(arms: dict[str, dict[str, tuple[list[float], list[float]]]], kurtosis=None):
    """``arms``: arm -> precision -> per-seed final val losses (3 seeds); the BF16 runs get ``kurtosis[arm]``."""
    rows = []
    for arm, by_precision in arms.items():
        for precision, losses in by_precision.items():
            for seed, loss in enumerate(losses):
                row = {"point": f"{arm}_{precision}_s{seed}", "seed": seed, lp.ARM: arm, lp.PRECISION: precision,
                       "final_val_loss": loss}
                if precision == lp.HIGH and kurtosis:
                    row[lp.PREDICTOR] = kurtosis[arm][seed]
                rows.append(row)
    return aggregate(rows, [lp.ARM, lp.PRECISION, "seed"])


BF16 = [3.0, 3.1, 2.9]


def _arm(fp8_gap: float, fp4_gap: float, jitter=(0.0, 0.002, -0.002)):
    return {"bf16": BF16, "fp8_rowwise": [x * (1 + fp8_gap + j) for x, j in zip(BF16, jitter)],
            "nvfp4": [x * (1 + fp4_gap + j) for x, j in zip(BF16, jitter)]}


def _verdicts(groups):
    return {text.split(" trains in ")[0] + "@" + text.split(" trains in ")[1].split(" ")[0]: v
            for text, v, _ in lp.claims(groups) if " trains in " in text}


def test_a_remedy_keeps_bf16s_loss_where_the_baseline_loses_it():
    g = _groups({"baseline": _arm(0.01, 0.10), "orthoadam": _arm(0.0, 0.005), "op_soap": _arm(0.0, 0.06)})
    v = _verdicts(g)
    assert v["orthoadam@nvfp4"] == stats.REPRODUCED
    assert v["op_soap@nvfp4"] == stats.NOT_REPRODUCED
    # FP8: the baseline's 1 % gap is not above 2 %, nothing to keep
    assert v["orthoadam@fp8_rowwise"] == stats.UNTESTABLE and v["op_soap@fp8_rowwise"] == stats.UNTESTABLE
    # claims are made for what the scale ran: no osp arm, no fp8_tensorwise points here
    assert not [k for k in v if k.startswith("osp@") or k.endswith("@fp8_tensorwise")]


def test_a_claim_the_scale_ran_but_a_point_lacks_is_missing_and_tweos_names_its_paper():
    """Per tensor FP8 run for the baseline and TWEO only: their claim is made (TWEO's quoting its paper's FP8
    claim), the other arms' in that precision are "missing" (a scale that ran the precision lacks their points)."""
    arms = {"baseline": {**_arm(0.01, 0.10), "fp8_tensorwise": [x * 1.2 for x in BF16]},
            "tweo": {**_arm(0.0, 0.01), "fp8_tensorwise": [x * 1.005 for x in BF16]}, "gated": _arm(0.0, 0.01)}
    got = {t: (v, d) for t, v, d in lp.claims(_groups(arms)) if " trains in " in t}
    tweo = next(t for t in got if t.startswith("tweo trains in fp8_tensorwise"))
    assert got[tweo][0] == stats.REPRODUCED and "Liang et al. 2025 (arXiv 2511.23225)" in tweo
    assert got[next(t for t in got if t.startswith("gated trains in fp8_tensorwise"))][0] == stats.MISSING
    assert "Liang" not in next(t for t in got if t.startswith("gated trains in nvfp4"))
    assert "Liang" not in next(t for t in got if t.startswith("tweo trains in nvfp4"))  # its paper claims FP8 only
    table = lp.gap_table(_groups(arms))
    assert "fp8_tensorwise gap" in table[0] and "+20.00%" in next(r for r in table if r.startswith("| baseline"))


def test_a_collapse_in_low_precision_is_the_effect_not_a_missing_point(tmp_path):
    """A run the divergence guard stopped (exit 3) has no final loss: a baseline that collapses in FP8 at every
    seed shows the effect (Liang et al.'s collapse), a remedy that collapses at any seed fails the claim, a baseline
    that collapses at some seeds only leaves it inconclusive; the summary table says "collapsed"."""
    import json

    from outlier_titan.exit_codes import DIVERGED, FINISHED
    from outlier_titan.study.plan import point_dir
    from outlier_titan.study.runner import STATE

    def rows_of(arms, collapsed):
        """``collapsed``: (arm, seed) pairs whose fp8_tensorwise run diverged (failed, no loss)."""
        rows = []
        for arm, gap in arms.items():
            for seed, loss in enumerate(BF16):
                rows.append({"point": f"{arm}_bf16_s{seed}", "status": "done", "seed": seed, lp.ARM: arm,
                             lp.PRECISION: "bf16", "final_val_loss": loss})
                down = (arm, seed) in collapsed
                rows.append({"point": f"{arm}_fp8_tensorwise_s{seed}", "status": "failed" if down else "done",
                             "seed": seed, lp.ARM: arm, lp.PRECISION: "fp8_tensorwise",
                             "final_val_loss": None if down else loss * (1 + gap)})
                folder = point_dir(tmp_path, rows[-1]["point"])
                folder.mkdir(parents=True, exist_ok=True)
                (folder / STATE).write_text(json.dumps({"returncode": DIVERGED if down else FINISHED}))
        lp.add_collapses(rows, tmp_path, {})
        return aggregate(rows, [lp.ARM, lp.PRECISION, "seed"])

    def verdicts(groups):
        return {t.split(" ")[0]: (v, d) for t, v, d in lp.claims(groups) if " trains in " in t}

    every = {("baseline", s) for s in range(3)}
    g = rows_of({"baseline": 0.0, "tweo": 0.004, "gated": 0.0}, every | {("gated", 1)})
    v = verdicts(g)
    assert v["tweo"][0] == stats.REPRODUCED
    assert "the baseline collapsed (diverged) in fp8_tensorwise at seed(s) [0, 1, 2]" in v["tweo"][1]
    assert v["gated"][0] == stats.NOT_REPRODUCED
    assert "gated collapsed (diverged) in fp8_tensorwise at seed(s) [1]" in v["gated"][1]
    assert lp.collapsed_seeds(g, "tweo", "fp8_tensorwise") == []
    assert "collapsed at seed(s) [0, 1, 2]" in next(r for r in lp.gap_table(g) if r.startswith("| baseline"))
    some = verdicts(rows_of({"baseline": 0.0, "tweo": 0.004}, {("baseline", 0)}))
    assert some["tweo"][0] == stats.INCONCLUSIVE
    # the baseline keeps its loss: a remedy's collapse cannot be set against anything
    untested = verdicts(rows_of({"baseline": 0.0, "tweo": 0.0}, {("tweo", 2)}))
    assert untested["tweo"][0] == stats.UNTESTABLE


def test_the_gap_is_paired_by_seed():
    """Seeds differ by far more than the gap: unpaired the remedy's 1 % could not be told from 2 %; paired it can."""
    spread = {"bf16": [2.0, 3.0, 4.0], "nvfp4": [2.02, 3.03, 4.04]}
    base = {"bf16": [2.0, 3.0, 4.0], "nvfp4": [2.2, 3.3, 4.4]}
    d = lp.gap(_groups({"baseline": base, "gated": spread}), "gated", "nvfp4")
    assert d.n == 3 and np.allclose(d.values, 0.01) and d.sd < 1e-9
    assert _verdicts(_groups({"baseline": base, "gated": spread}))["gated@nvfp4"] == stats.REPRODUCED


def test_the_kurtosis_claim_ranks_gaps_over_arms_and_seeds():
    arms = {"baseline": _arm(0.01, 0.10), "orthoadam": _arm(0.0, 0.01), "op_soap": _arm(0.0, 0.03),
            "osp": _arm(0.0, 0.05), "gated": _arm(0.0, 0.08)}
    kurt = {"baseline": [40, 42, 41], "orthoadam": [3, 3.2, 3.1], "op_soap": [5, 6, 5.5], "osp": [9, 10, 11],
            "gated": [20, 22, 21]}
    claims = {text: (v, d) for text, v, d in lp.claims(_groups(arms, kurt)) if "kurtosis" in text}
    nvfp4 = next(v for t, v in claims.items() if "nvfp4" in t)
    assert nvfp4[0] == stats.REPRODUCED and "15 pairs" in nvfp4[1]
    reverse = {a: [100 - k for k in ks] for a, ks in kurt.items()}
    claims = {text: v for text, v, _ in lp.claims(_groups(arms, reverse)) if "kurtosis" in text and "nvfp4" in text}
    assert list(claims.values()) == [stats.NOT_REPRODUCED]


def test_rank_correlation_interval_against_scipy_and_its_coverage():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(1)
    x = rng.normal(size=15)
    y = x + rng.normal(size=15)
    _, detail = stats.rank_correlation_verdict(list(x), list(y), "x vs y")
    rho = float(detail.split("ρ = ")[1].split(" ")[0])
    assert math.isclose(rho, spearmanr(x, y).statistic, abs_tol=0.005)
    # with ties: mean ranks, as scipy
    xt, yt = [1, 1, 2, 3, 3, 3, 4, 5], [2, 1, 3, 3, 5, 4, 6, 6]
    _, detail = stats.rank_correlation_verdict(xt, yt, "ties")
    assert math.isclose(float(detail.split("ρ = ")[1].split(" ")[0]), spearmanr(xt, yt).statistic, abs_tol=0.005)
    # independent variables: "reproduced" (interval above 0) about 2.5 % of the time at n = 15
    hits = sum(stats.rank_correlation_verdict(list(rng.normal(size=15)), list(rng.normal(size=15)), "")[0]
               == stats.REPRODUCED for _ in range(2000))
    assert 0.01 < hits / 2000 < 0.045, hits
    assert stats.rank_correlation_verdict([1, 2, 3], [1, 2, 3], "few")[0] == stats.INCONCLUSIVE


def test_the_summary_table_has_every_arm_and_gap():
    table = lp.gap_table(_groups({"baseline": _arm(0.01, 0.10), "gated": _arm(0.0, 0.02)}))
    rows = {ln.split("|")[1].strip(): ln for ln in table[2:]}
    assert set(rows) == {"baseline", "gated"}
    assert "+10.00%" in rows["baseline"] and "+1.00%" in rows["baseline"]


def test_the_lr_search_plans_every_arm_on_its_own_spec():
    sweep = load_sweep(suite_file("lowprec2026", "lr"))
    arms = {p.axes[lp.ARM]: p.cfg for p in sweep.points}
    assert set(arms) == {lp.BASELINE, *lp.REMEDIES}
    assert [a for a, cfg in arms.items() if cfg.remedies.tweo] == ["tweo"]
    assert arms["op_soap"].model.name == "op" and arms["op_soap"].model.norm is None
    assert arms["osp"].model.embed_proj is True and arms["osp"].optimizer.name == "muon"
    assert {p.cfg.optimizer.lr for p in sweep.points} == {1e-3, 3e-3, 1e-2, 3e-2}
    assert all(p.cfg.optimizer.muon_adamw_lr == p.cfg.optimizer.lr for p in sweep.points)


def test_the_provoked_scale_is_the_cpu_scale_at_one_lr_and_adopts_the_arms_already_there():
    """Every arm at 1e-2 (Muon's AdamW part too); where the cpu scale's tuned lr was already 1e-2 (OP + SOAP, OSP)
    the point is the cpu scale's own, so ``--adopt reports/lowprec2026-cpu`` takes it; the others differ in the lr
    alone."""
    from outlier_titan.study.plan import _config_diff, _defaults, _optimizer_owners
    from outlier_titan.study.suite_files import suite_sweep

    cpu = {p.name: p for p in suite_sweep("lowprec2026", "cpu").points}
    provoked = suite_sweep("lowprec2026", "provoked").points
    assert {p.name for p in provoked} == set(cpu)
    for p in provoked:
        assert p.cfg.optimizer.lr == p.cfg.optimizer.muon_adamw_lr == 1e-2
        diff = _config_diff(cpu[p.name].config_toml, p.config_toml, _defaults(), _optimizer_owners(), ("job",))
        if p.axes[lp.ARM] in ("op_soap", "osp"):
            assert diff == [], (p.name, diff)
        else:
            assert [d.split(":")[0] for d in diff] == ["optimizer.lr"], (p.name, diff)


def test_unset_axis_value_only_where_a_key_can_be_unset(tmp_path):
    from outlier_titan.study.spec import SweepError
    from tests.launch import REPO

    bad = tmp_path / "bad.toml"
    bad.write_text(f'base = "{REPO / "train_configs" / "debug.toml"}"\n[grid]\ntraining.steps = [10, {{}}]\n')
    with pytest.raises(SweepError, match=r"leaves a key unset.*training.steps"):
        load_sweep(bad)


def test_each_blocks_worst_cast_snr_from_the_last_probe(tmp_path):
    import json

    from outlier_titan.study.plan import point_dir

    def write(point, records):
        d = point_dir(tmp_path, point)
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    write("baseline_nvfp4_s0", [
        {"step": 50, "outliers/layer_0/lp_act_mlp_snr_db": 1.0},
        {"step": 100, "outliers/layer_0/lp_act_mlp_snr_db": 18.0, "outliers/layer_0/lp_grad_attn_snr_db": 12.5,
         "outliers/layer_0/lp_weight_mlp_snr_db": 3.0, "outliers/layer_1/lp_act_attn_snr_db": float("inf"),
         "outliers/layer_1/lp_act_mlp_snr_db": 9.0, "outliers/lp_act_mlp_snr_db": 13.5}])
    write("baseline_bf16_s0", [{"step": 100, "loss": 3.0}])
    rows = [{"point": "baseline_nvfp4_s0", "seed": 0, lp.ARM: "baseline", lp.PRECISION: "nvfp4"},
            {"point": "baseline_bf16_s0", "seed": 0, lp.ARM: "baseline", lp.PRECISION: "bf16"}]
    lp.add_layer_snr(rows, tmp_path, {})
    # the last probe, activation and gradient casts only (not the weight's), infinite SNR (exact) ignored
    assert rows[0]["lp_worst_snr_layer_0"] == 12.5 and rows[0]["lp_worst_snr_layer_1"] == 9.0
    assert not any(k.startswith("lp_worst") for k in rows[1])
    table = lp.layer_table(aggregate(rows, [lp.ARM, lp.PRECISION, "seed"]))
    assert table[0] == "| arm | precision | block 0 | block 1 |" and "| baseline | nvfp4 | 12.5 (1 seed) | 9 (1 seed) |" in table


def test_a_provoked_report_opens_by_pointing_at_the_tuned_comparison():
    from outlier_titan.study.report import SCALE_NOTES, scale_note
    from outlier_titan.study.suite_files import SCALES

    note = scale_note("lowprec2026", "provoked")
    assert note[0].startswith("**Provoked:**") and "not at its own best lr" in note[0]
    assert "(`reports/lowprec2026-cpu`)" in note[0] and note[1] == ""
    assert scale_note("lowprec2026", "cpu") == [] and set(SCALE_NOTES) <= set(SCALES)
