"""Provenance of results: the code version a sweep point and a report record, and the 4-bit rows every
reproduction report adds beside its paper's schemes."""

from __future__ import annotations

import json
import subprocess

import pytest

from outlier_titan import __version__, provenance
from outlier_titan.study.suites import SUITE_INFO
from outlier_titan.study.suites.base import FOUR_BIT_SCHEMES
from outlier_titan.study.facts import evaluated_by, evaluation_updates, trained_by
from outlier_titan.study.evaluations import is_evaluated
from outlier_titan.study.report_sections import ptq_table
from outlier_titan.study.results import collect
from outlier_titan.study.stats import estimate


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


@pytest.fixture
def checkout(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "PACKAGE_ROOT", tmp_path)
    return tmp_path


def test_code_version_is_the_commit_dirty_only_for_changed_tracked_files(checkout):
    assert provenance.code_version() == f"outlier_titan {__version__}"  # not a git checkout: the version
    _git(checkout, "init", "-q")
    (checkout / "a.py").write_text("x = 1\n")
    (checkout / "reports").mkdir()
    (checkout / "reports" / "report.md").write_text("a committed report\n")
    _git(checkout, "add", "a.py", "reports")
    _git(checkout, "commit", "-q", "-m", "one")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    (checkout / "untracked.txt").write_text("run outputs\n")
    assert provenance.code_version() == head[:12]
    (checkout / "reports" / "report.md").write_text("re-rendered\n")  # results the tools write, not code
    assert provenance.code_version() == head[:12]
    (checkout / "a.py").write_text("x = 2\n")
    assert provenance.code_version() == head[:12] + "+dirty"
    assert provenance.git_commit() == head


def test_report_states_the_code_of_each_finished_point(tmp_path):
    """The code of each finished point; an interrupted point (its state records a code) is not counted."""
    points = tmp_path / "points"
    for name, state in (("a_s0", {"code": ["abc"]}), ("a_s1", {"code": ["abc", "def+dirty"]}), ("a_s2", {}),
                        ("b_s0", {"code": ["ghi"]})):
        (points / name).mkdir(parents=True)
        (points / name / "sweep_state.json").write_text(json.dumps(state))
    rows = [{"point": n, "status": "done"} for n in ("a_s0", "a_s1", "a_s2")]
    rows.append({"point": "b_s0", "status": "interrupted"})
    assert trained_by(tmp_path, rows) == ("points trained at code abc (2 points), def+dirty (1 point) (1 point "
                                          "resumed at other code, counted under each); 1 point without a record.")
    assert "not recorded" in trained_by(tmp_path, rows[2:])


def test_report_states_the_schemes_re_run_into_the_evaluation_reports(tmp_path):
    """scripts/evaluate.py --update leaves an ``updated`` list in a point's newest evaluation report; the row
    collected from the point carries it and the report's header names it."""
    names = ("a_s0", "a_s1", "a_s2")
    manifest = {"axes": {"seed": [0, 1, 2]}, "points": [
        {"name": n, "axes": {"seed": i}, "config": "", "params": 1, "flops_per_token": 1, "tokens": 1, "flops": 1}
        for i, n in enumerate(names)]}
    (tmp_path / "points").mkdir()
    assert evaluation_updates(collect(tmp_path, manifest)[1]) == ""
    stamps = {"a_s0": [{"schemes": ["w4a4kv4_rtn_hadamard"], "at": "2026-11-27 22:40:00"}],
              "a_s1": [{"schemes": ["w4a4kv4_rtn_hadamard"], "at": "2026-11-28 00:10:00"},
                       {"schemes": ["int8_fine", "w8a8_static"], "at": "2026-11-29 09:00:00", "code": "abc"}]}
    for name in names:
        (tmp_path / "points" / name / "eval").mkdir(parents=True)
        report = {"step": 10, "schemes": [], **({"updated": stamps[name]} if name in stamps else {}),
                  **({"code": "def"} if name != "a_s2" else {})}
        (tmp_path / "points" / name / "eval" / "step-10.json").write_text(json.dumps(report))
    (tmp_path / "points" / "a_s2" / "eval" / "step-5.json").write_text(json.dumps(  # older: not the one reported
        {"step": 5, "schemes": [], "updated": stamps["a_s0"]}))
    columns, rows = collect(tmp_path, manifest)
    assert "eval_updated" not in columns  # a stamp, not a column of results.csv
    assert evaluation_updates(rows) == (
        " Re-run into the evaluation reports afterwards (`scripts/evaluate.py --update`): w4a4kv4_rtn_hadamard on "
        "2 points (2026-11-27 to 2026-11-28, code not recorded); int8_fine, w8a8_static on 1 point (2026-11-29, "
        "at code abc).")
    assert evaluated_by([{**r, "status": "done"} for r in rows]) == (
        " Evaluated at code def (2 points), not recorded for 1 point (evaluated before evaluation reports recorded "
        "their code, 2026-11-28).")
    assert evaluated_by(rows) == ""  # not finished (no sweep state here): not counted


def test_an_evaluation_missing_a_scheme_runs_again(tmp_path):
    report = tmp_path / "step-10.json"
    assert not is_evaluated(report, ("int8_fine",))
    report.write_text(json.dumps({"schemes": [{"scheme": "int8_fine"}]}))
    assert is_evaluated(report, ("int8_fine",))
    assert not is_evaluated(report, ("int8_fine", "w4a4kv4_rtn"))  # an older suite file's evaluation
    report.write_text("{truncated")
    assert not is_evaluated(report, ("int8_fine",))


def test_every_suite_adds_the_4bit_rows_marked_as_added():
    for name, info in SUITE_INFO.items():
        assert info.all_schemes[:len(info.schemes)] == info.schemes, name  # the paper's own first
        assert set(FOUR_BIT_SCHEMES) <= set(info.all_schemes), name
        assert len(set(info.all_schemes)) == len(info.all_schemes), name
    info = SUITE_INFO["he2024"]
    group = {"point": "op_soap", "ppl": estimate([50.0, 52.0]),
             "ptq_delta_ppl_w8a8_static": estimate([0.5, 0.7]), "ptq_calib_sd_w8a8_static": estimate([0.1, 0.1]),
             "ptq_delta_ppl_w4a4kv4_rtn": estimate([3.0, 5.0])}
    lines = ptq_table([group], info)
    header = next(line for line in lines if line.startswith("| setting"))
    assert header == "| setting | PPL | w8a8_static | w4a4kv4_rtn (added) | w4a4kv4_rtn_hadamard (added) |"
    row = lines[-2]
    assert row.startswith("| op_soap | 51 ± 1.4 | 0.6 ± 0.14 (calib. sd 0.1) | 4 ± 1.4 |"), row
    # park2025's verdicts rest on its 4-bit schemes: nothing to mark there
    assert not any("(added)" in line for line in ptq_table([group], SUITE_INFO["park2025"]))
    # what the rotation did, per setting, from the points' evaluation reports
    group["points"] = ["op_soap_s0", "op_soap_s1"]
    other = {"point": "post_ln", "points": ["post_ln_s0"]}
    rows = [{"point": "op_soap_s0", "ptq_rotation": "residual stream: randomised Hadamard 256"},
            {"point": "op_soap_s1", "ptq_rotation": "residual stream: randomised Hadamard 256"},
            {"point": "post_ln_s0", "ptq_rotation": "not applied: the post_ln block ..."}]
    lines = ptq_table([group, other], info, rows)
    assert lines[-3:] == ["Rotated schemes (`_hadamard`) on op_soap: residual stream: randomised Hadamard 256.",
                          "Rotated schemes (`_hadamard`) on post_ln: not applied: the post_ln block ....", ""]


def test_an_unfinished_point_counts_in_no_number():
    """An in-progress report (some points still running or interrupted) averages the finished points only."""
    from outlier_titan.study.groups import aggregate

    rows = [{"point": "a_s0", "status": "done", "seed": 0, "a": 1, "loss": 4.0},
            {"point": "a_s1", "status": "done", "seed": 1, "a": 1, "loss": 5.0},
            {"point": "a_s2", "status": "running", "seed": 2, "a": 1, "loss": 9.0},  # a partial run
            {"point": "b_s0", "status": "interrupted", "seed": 0, "a": 2, "loss": 7.0}]
    groups = aggregate(rows, ["a", "seed"])
    assert [g["points"] for g in groups] == [["a_s0", "a_s1"]]
    assert groups[0]["loss"].mean == 4.5 and groups[0]["loss"].values == (4.0, 5.0)
