"""scripts/gpu_check.sh: the runner's per-item time limits and failure handling, the plan, and the whole check in
``--dry`` mode on the CPU (the same code paths as on a device, tiny shapes)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from outlier_titan.tools.gpu_check import cli, environment, runner
from outlier_titan.tools.gpu_check import plan as gpu_plan

REPO = Path(__file__).resolve().parents[1]


def _sleep(name, seconds=0.0, limit_s=30, **kw):
    return dict(name=name, kind="sleep", seconds=seconds, limit_s=limit_s, **kw)


def test_runner_kills_a_slow_item_and_goes_on_with_the_next(tmp_path):
    items = [_sleep("quick", 0.0), _sleep("slow", 60.0, limit_s=2), _sleep("after", 0.0),
             _sleep("fails", fail="on purpose"), _sleep("dies", exit=3), _sleep("last", 0.0)]
    with open(tmp_path / "log", "w") as log:
        t0 = time.monotonic()
        rows = runner.run_items(items, dry=False, deadline=time.monotonic() + 120, log=log, tmp=tmp_path)
    assert time.monotonic() - t0 < 40
    assert [r["status"] for r in rows] == ["ok", "timeout", "ok", "error", "crashed", "ok"]
    assert "2 s limit" in rows[1]["result"]["error"]
    assert "on purpose" in rows[3]["result"]["error"]
    assert "code 3" in rows[4]["result"]["error"]
    assert rows[5]["result"] == {"slept_s": 0.0}


def test_runner_skips_what_the_part_budget_does_not_reach(tmp_path):
    items = [_sleep("long", 60.0, limit_s=50), _sleep("never", 0.0)]
    with open(tmp_path / "log", "w") as log:
        rows = runner.run_items(items, dry=False, deadline=time.monotonic() + 3, log=log, tmp=tmp_path)
    assert [r["status"] for r in rows] == ["timeout", "skipped"]
    assert "budget" in rows[0]["result"]["error"] and "budget" in rows[1]["result"]["error"]


@pytest.mark.parametrize("dry", [False, True])
def test_plan_covers_every_variant_and_optimizer_and_fits_the_budget(dry):
    key, variants = gpu_plan.attention_variants()
    one = gpu_plan.plan("1", dry)
    assert [i["variant"] for i in one if i["kind"] == "attention"] == variants
    assert {i["compile"] for i in one if i["kind"] == "probe"} == {False, True}
    two = gpu_plan.plan("2", dry)
    assert {(i["compile"], i["ac"]) for i in two} == {(c, a) for c in (False, True) for a in ("none", "selective")}
    three = gpu_plan.plan("3", dry)
    optims = [i["optimizer"] for i in three if i["kind"] == "optim"]
    assert optims[0] == "adamw" and {"orthoadam", "soap"} <= set(optims)
    assert not set(optims) & set(gpu_plan.TORCH_OPTIMIZERS)
    four = gpu_plan.plan("4", dry)
    assert [(i["dp_shard"], i.get("tp", 1), i["fake_world"]) for i in four] == [(1, 1, 0), (8, 1, 8), (4, 2, 8)]
    for items in (one, two, three, four):
        assert len({i["name"] for i in items}) == len(items)
        assert all(i["limit_s"] <= gpu_plan.PART_BUDGET_S for i in items)
    if not dry:
        assert all(i["flavor"] == "llama_1b" for i in two)
        flavors = {i["flavor"] for i in three if i["kind"] == "train"}
        assert flavors == {f for _, f in gpu_plan.PAPER_FLAVORS}
        assert {i["flavor"] for i in four} == {"llama_7b"}


def test_device_plan_builds_on_the_meta_device_and_a_typo_is_caught(monkeypatch):
    for part in gpu_plan.PARTS:
        assert gpu_plan.check_plan(part) == [], part
    real = gpu_plan.plan

    def with_typo(part, dry):
        items = real(part, dry)
        items[1] = dict(items[1], flavor="llama_1bb")
        return items

    monkeypatch.setattr(gpu_plan, "plan", with_typo)
    problems = gpu_plan.check_plan("2")
    assert len(problems) == 1 and "llama_1bb" in problems[0], problems


def test_pytest_past_its_limit_is_killed_and_counts_nothing(tmp_path):
    (tmp_path / "pytest_gpu.xml").write_text('<testsuite tests="9" failures="0" errors="0" skipped="0"/>')
    with open(tmp_path / "log", "w") as log:
        t = runner.run_tests(tmp_path, log, limit_s=0.5)
    assert t["returncode"] == "timeout" and t["tests"] == t["passed"] == 0
    assert "killed" in (tmp_path / "log").read_text()


@pytest.mark.parametrize("part", ["5", "3,3", "2,", ""])
def test_unknown_part_is_a_usage_error(part):
    with pytest.raises(SystemExit) as e:
        cli.main(["--part", part, "--dry"])
    assert e.value.code == 2


def test_several_parts_comma_separated_plan_together(capsys):
    """``--part 3,4`` takes both parts' items (here only planned: --only names none, a usage error listing them)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["--part", "3,4", "--dry", "--only", "no such item"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "adamw on pre_ln/debug" in err and "rank 0 of FSDP 4 x TP 2" in err


@pytest.mark.slow
@pytest.mark.extended
def test_dry_mode_runs_every_part_on_the_cpu(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--part", "all", "--dry"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted([f"gpu_check_part{n}.{ext}" for n in "1234" for ext in ("json", "md")]
                           + ["gpu_check_partall.log", "pytest_gpu.xml"])
    for n in "1234":
        report = json.loads((tmp_path / f"gpu_check_part{n}.json").read_text())
        assert report["dry"] and report["env"]["torch"] and not report["env"]["import_failures"]
        assert report["plan_problems"] == []
        assert report["items"] and all(it["status"] == "ok" for it in report["items"]), report["items"]
        md = (tmp_path / f"gpu_check_part{n}.md").read_text()
        assert "dry run" in md and "| ok |" in md
    one = json.loads((tmp_path / "gpu_check_part1.json").read_text())
    # without a GPU every gpu-marked test is collected and skipped ("needs a CUDA device"), none fails
    assert one["tests"]["tests"] > 0 and one["tests"]["skipped"] == one["tests"]["tests"]
    for it in one["items"]:
        if it["kind"] == "attention" and it["item"]["variant"] in ("softmax", "softmax1"):
            assert it["result"]["sdpa_kernels"] == ["_scaled_dot_product_flash_attention_for_cpu"]
        if it["kind"] == "probe":
            assert it["result"]["overhead_pct"] > 0
    three = json.loads((tmp_path / "gpu_check_part3.json").read_text())
    steps = [it["result"]["optimizer_step_s"] for it in three["items"] if it["kind"] == "optim"]
    assert steps and all(s > 0 for s in steps)
    assert all(it["result"]["finite"] for it in three["items"] if it["kind"] == "train")
    # part 4: rank 0 holds the share of the parameters the dry-run planner says, at world 1 and on the fake world
    four = json.loads((tmp_path / "gpu_check_part4.json").read_text())
    ranks = [(it["result"]["world_size"], it["result"]["local_params"], it["result"]["planned_local_params"])
             for it in four["items"]]
    assert [w for w, _, _ in ranks] == [1, 8, 8] and all(mine == planned for _, mine, planned in ranks), ranks
    assert ranks[1][1] < ranks[0][1] / 7 and four["items"][0]["result"]["finite"]


@pytest.mark.parametrize("version, ok", [("2.11.0+cu130", False), ("2.13.0+cpu", True), ("2.14.0a0+git1", True),
                                         ("2.9.1", False)])
def test_report_says_whether_the_torch_meets_pyproject(version, ok):
    assert environment._meets(version, "torch>=2.13") is ok
    assert environment._meets(version, None) is None


def test_only_runs_the_named_items_and_a_name_that_matches_nothing_is_a_usage_error(tmp_path, capsys):
    """``--only``: just the items whose name contains one of the strings (here part 3's AdamW step, dry, the
    cheapest); a string that names no item at all exits 2 with the part's item names."""
    reports = cli.run_parts(("3",), True, tmp_path, 300, "test", only=("adamw on", "no such item"))
    names = [it["name"] for it in reports[0]["items"]]
    assert names == ["adamw on pre_ln/debug fp32 CPU (dry)"], names
    assert all(it["status"] == "ok" for it in reports[0]["items"]), reports[0]["items"]
    assert "| adamw |" in (tmp_path / "gpu_check_part3.md").read_text()
    with pytest.raises(SystemExit) as e:
        cli.main(["--part", "3", "--dry", "--out", str(tmp_path), "--only", "no such item"])
    assert e.value.code == 2 and "soap on pre_ln" in capsys.readouterr().err
