"""Each arm at its own best learning rate: the lr scale's choice (lowest final val loss per setting, a choice at the
grid's edge marked), its report section and json, and a scale that reads it (`lr_from`) running each tuned setting
at its chosen lr and naming the settings it did not tune."""

import json
from pathlib import Path

import pytest

from outlier_titan.errors import UserError
from outlier_titan.study import lr_search
from outlier_titan.study.suite_files import suite_file
from outlier_titan.study.spec import load_sweep

AXES = ["optimizer.lr", "model.block", "optimizer.name", "seed"]


def _rows(losses):
    return [{"point": f"{b}_{o}_lr{lr:g}_s0", "status": "done", "seed": 0, "optimizer.lr": lr, "model.block": b,
             "optimizer.name": o, "final_val_loss": loss} for (b, o, lr), loss in losses.items()]


def test_the_choice_is_each_settings_lowest_final_val_loss_and_an_edge_is_marked(tmp_path):
    rows = _rows({("pre_ln", "adamw", 1e-3): 5.0, ("pre_ln", "adamw", 3e-3): 4.6, ("pre_ln", "adamw", 1e-2): 4.9,
                  ("op", "soap", 1e-3): 4.5, ("op", "soap", 3e-3): 4.3, ("op", "soap", 1e-2): 4.2})
    rows.append({**rows[0], "point": "running", "status": "running", "final_val_loss": 1.0})  # never counted
    choice = lr_search.choose(rows, AXES)
    assert choice["tuned_axes"] == ["optimizer.lr"] and choice["setting_axes"] == ["model.block", "optimizer.name"]
    by = {s["setting"]["model.block"]: s for s in choice["settings"]}
    assert by["pre_ln"]["chosen"] == {"optimizer.lr": 3e-3} and by["pre_ln"]["at_edge"] == []
    assert by["op"]["chosen"] == {"optimizer.lr": 1e-2} and by["op"]["at_edge"] == ["optimizer.lr"]
    lines = lr_search.section(choice, tmp_path)
    assert json.loads((tmp_path / lr_search.CHOICE_FILE).read_text()) == choice
    row = next(ln for ln in lines if ln.startswith("| model.block=op"))
    assert "0.001: 4.5; 0.003: 4.3; 0.01: 4.2" in row and "lr 0.01 (at the grid's edge)" in row
    # the claim's metric beside each loss: what the choice does to the phenomenon
    for r in rows:
        r["kurtosis_neuron_rms"] = 10 * r["optimizer.lr"]
        r["sink_rate"] = 0.5
    lines = lr_search.section(lr_search.choose(rows, AXES, ("kurtosis_neuron_rms",)), tmp_path)
    assert "final val loss (kurtosis_neuron_rms)" in lines[4] and "0.003: 4.6 (0.03)" in lines[6]
    lines = lr_search.section(lr_search.choose(rows, AXES, ("sink_rate", "kurtosis_neuron_rms")), tmp_path)
    assert "final val loss (sink_rate, kurtosis_neuron_rms)" in lines[4] and "0.003: 4.6 (0.5, 0.03)" in lines[6]


def test_a_scale_runs_each_tuned_setting_at_its_chosen_lr_and_names_the_others():
    sweep = load_sweep(suite_file("he2024", "cpu"))
    search = load_sweep(suite_file("he2024", "lr"))
    loss = {"adamw": {3e-4: 5.2, 1e-3: 5.0, 3e-3: 4.0, 1e-2: 4.5}, "soap": {3e-4: 4.6, 1e-3: 4.4, 3e-3: 4.3, 1e-2: 4.1}}
    rows = [{"point": p.name, "seed": 0, "final_val_loss": loss[p.cfg.optimizer.name][p.cfg.optimizer.lr], **p.axes}
            for p in search.points]
    choice = lr_search.choose(rows, search.axes)
    untuned = lr_search.apply_choice(sweep, choice)
    lrs = {p.name: p.cfg.optimizer.lr for p in sweep.points}
    assert lrs["pre_ln_adamw_s1"] == 3e-3 and lrs["op_soap_s2"] == 1e-2
    assert "pre_rms_soap_s0" in untuned and "op_adamw_s0" in untuned and "op_soap_s0" not in untuned
    assert lrs["pre_rms_soap_s0"] == 3e-3  # not tuned: the suite file's value
    # the report header names the same untuned points from the plan's recorded configs
    from pathlib import Path

    from outlier_titan.study.plan import build_manifest

    manifest = build_manifest(load_sweep(suite_file("he2024", "cpu")), Path("/nonexistent"))
    assert lr_search.untuned_points(manifest, choice) == untuned
    line = lr_search.header_line(choice, "reports/he2024-lr", untuned)
    soap_arm = "op, fixed, True, False, 50.0, soap, 0.95"
    assert f"{soap_arm}: lr 0.01 from {{0.0003, 0.001, 0.003, 0.01}} (at the grid's edge)" in line
    assert "not tuned, at the suite file's values: " in line


@pytest.mark.parametrize("suite,base,arms,lr", [
    ("he2024", "cpu", ("pre_ln_adamw", "op_soap"), "0.003"), ("park2025", "cpu", ("adam", "osp"), "0.01"),
    ("franke2025", "cpu", ("pre_ln", "angpt", "ngpt"), "0.002"),
    ("sinks2025", "synthetic", ("adam_softmax", "adam_gated_elementwise", "orthoadam_softpick"), "0.002")])
def test_the_lr_search_at_the_tuned_scales_lr_is_that_scales_own_point(suite, base, arms, lr):
    """So the search can adopt the seed-0 points of the scale it tunes (the cpu one; sinks2025's synthetic one) at
    the lr they share instead of training them."""
    from outlier_titan.study.plan import _config_diff, _defaults, _optimizer_owners

    searched = {p.name: p for p in load_sweep(suite_file(suite, base)).points}
    search = {p.name: p for p in load_sweep(suite_file(suite, "lr")).points}
    for arm in arms:
        assert _config_diff(searched[f"{arm}_s0"].config_toml, search[f"{arm}_lr{lr}_s0"].config_toml, _defaults(),
                            _optimizer_owners(), ("job", "checkpoint")) == []


def test_sinks2025s_tuned_scale_runs_every_variant_at_the_lr_its_search_chose():
    """Before its search has run: with a choice made from made-up losses (Adam best at 4e-3, OrthoAdam at 1e-3),
    every point of the tuned scale is tuned, five seeds each, its seed-0 point the search's own at that lr, and its
    report opens with the tuned note and the synthetic task's."""
    from outlier_titan.study.plan import _config_diff, _defaults, _optimizer_owners
    from outlier_titan.study.report import scale_note

    search = load_sweep(suite_file("sinks2025", "lr"))
    best = {"adam": 4e-3, "orthoadam": 1e-3}
    rows = [{"point": p.name, "seed": 0, **p.axes,
             "final_val_loss": 3.0 + abs(p.cfg.optimizer.lr - best[p.cfg.optimizer.name]) * 10}
            for p in search.points]
    choice = lr_search.choose(rows, search.axes)
    tuned = load_sweep(suite_file("sinks2025", "tuned"))
    assert lr_search.apply_choice(tuned, choice) == []
    assert len(tuned.points) == 90 and {p.axes["seed"] for p in tuned.points} == set(range(5))
    by_name = {p.name: p for p in search.points}
    for p in (p for p in tuned.points if p.axes["seed"] == 0):
        lr = best[p.cfg.optimizer.name]
        assert p.cfg.optimizer.lr == lr
        own = by_name[p.name.replace("_s0", f"_lr{lr}_s0")]
        assert _config_diff(own.config_toml, p.config_toml, _defaults(), _optimizer_owners(), ("job", "checkpoint")) == []
    note = scale_note("sinks2025", "tuned")
    assert note[0].startswith("**Tuned:**") and "(`reports/sinks2025-synthetic`)" in note[0]
    assert note[2].startswith("**Synthetic task:**") and note[1] == note[3] == ""


def test_a_missing_lr_report_is_one_line_naming_the_command(tmp_path):
    with pytest.raises(UserError, match=r"run it first \(python scripts/reproduce.py --suite SUITE --scale lr\)"):
        lr_search.read_choice(tmp_path)


def test_a_second_search_on_the_cpu_recipe_is_a_search_of_its_own(tmp_path, monkeypatch):
    """sinks_vs_massive2026's ``lr`` tunes its synthetic scale; ``cpu_lr`` searches the cpu recipe: every arm at each
    lr of its grid on cpu.toml's settings, seed 0, and a scale reading it names its command when it is missing."""
    from outlier_titan.study import suite_files

    cpu = {p.axes["job.description"]: p.cfg for p in load_sweep(suite_file("sinks_vs_massive2026", "cpu")).points}
    search = load_sweep(suite_file("sinks_vs_massive2026", "cpu_lr")).points
    assert {p.cfg.optimizer.lr for p in search} == {1e-3, 3e-3, 1e-2} and {p.axes["seed"] for p in search} == {0}
    assert {p.axes["job.description"] for p in search} == set(cpu)
    for p in search:  # the cpu recipe, but for the lr
        same = cpu[p.axes["job.description"]]
        assert (p.cfg.model, p.cfg.training.steps, p.cfg.data) == (same.model, same.training.steps, same.data)
    assert "cpu_lr" in suite_files.LR_SEARCH_SCALES
    monkeypatch.setattr(suite_files, "suite_file_keys", lambda suite, scale: {"lr_from": "cpu_lr"})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"--suite sinks_vs_massive2026 --scale cpu_lr\)"):
        suite_files.suite_sweep("sinks_vs_massive2026", "cpu")


@pytest.mark.parametrize("suite,scale,search_scale,n_seeds", [
    ("franke2025", "tuned", "lr", 5), ("he2024", "tuned", "lr", 5), ("kaul2024", "tuned", "lr", 5),
    ("park2025", "tuned", "lr", 5),
    ("sinks_vs_massive2026", "synthetic", "lr", 3), ("sinks_vs_massive2026", "cpu", "cpu_lr", 3)])
def test_a_tuned_scale_runs_every_arm_at_its_searched_lr_as_the_search_trained_it(suite, scale, search_scale,
                                                                                   n_seeds):
    """Every point of a tuned scale is a setting the search tuned, at its chosen lr; its seed-0 points are the
    search's own points at that lr (so ``--adopt reports/<suite>-<search>`` takes them instead of training them
    again)."""
    from outlier_titan.study import suite_files
    from outlier_titan.study.plan import _config_diff, _defaults, _optimizer_owners

    report, choice = suite_files.lr_search_of(suite, scale)
    tuned = suite_files.suite_sweep(suite, scale)
    assert report == Path("reports") / f"{suite}-{search_scale}"
    assert len({p.axes["seed"] for p in tuned.points}) == n_seeds
    assert lr_search.apply_choice(tuned, choice) == []  # no untuned point
    search = {p.name: p for p in load_sweep(suite_file(suite, search_scale)).points}
    chosen = {g["point"] for s in choice["settings"] for g in s["grid"] if g["values"] == s["chosen"]}
    seed0 = [p for p in tuned.points if p.axes["seed"] == 0]
    assert len(seed0) == len(chosen) == len(choice["settings"])
    for p in seed0:
        same = [n for n in chosen if _config_diff(search[n].config_toml, p.config_toml, _defaults(),
                                                  _optimizer_owners(), ("job", "checkpoint")) == []]
        assert len(same) == 1, (p.name, same)


def test_a_tuned_report_says_its_claims_about_arms_it_did_not_run_stay_the_cpu_scales():
    """park2025's tuned scale runs Adam and OSP only: its SSNorm, EmbProj and MuonBP claims are not determined
    there, and the report's opening note says why and where they are decided."""
    from outlier_titan.study.report import scale_note

    note = scale_note("park2025", "tuned")
    assert note[0].startswith("**Tuned:**") and "own best learning rate" in note[0]
    assert "(`reports/park2025-cpu`)" in note[0] and note[1] == ""


@pytest.mark.slow
def test_an_lr_search_report_puts_no_paper_row_beside_an_untuned_grid_point(tmp_path):
    """A search's first grid point per setting is not its best lr (franke2025's anGPT vs GPT+ speed-up at 1e-3 is
    against an untuned GPT+): the committed franke2025 search, re-rendered from its runs, names the tuned scale
    instead of comparing the paper with such a point; a suite whose search nothing reads yet says so."""
    import subprocess
    import sys

    from outlier_titan.study.report import paper_rows_elsewhere

    repo = Path(__file__).resolve().parents[1]
    out = tmp_path / "lr"
    proc = subprocess.run([sys.executable, "-m", "outlier_titan.tools.reproduce", "--suite", "franke2025", "--scale",
                           "lr", "--report-only", "--adopt", str(repo / "reports" / "franke2025-lr"), "--out",
                           str(out)], capture_output=True, text=True, cwd=repo, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    section = (out / "report.md").read_text().split("## The paper's numbers beside ours")[1].split("## ")[0]
    assert "| paper row |" not in section and "_lr0.001_s0" not in section
    assert section.strip() == paper_rows_elsewhere("franke2025", "lr")
    assert "[`tuned`](../franke2025-tuned/report.md)" in section
    assert "[`tuned`](../kaul2024-tuned/report.md), [`tiles`](../kaul2024-tiles/report.md)" in paper_rows_elsewhere(
        "kaul2024", "lr")
    assert paper_rows_elsewhere("franke2025", "cpu_lr").endswith("No scale of this suite runs at this search's "
                                                                  "choice yet.")
