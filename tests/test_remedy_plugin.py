"""A training remedy from one file outside the package (tests/plugins/toy_remedy.py) through ``train.py
--job.plugins``: its option in ``--help``, its loss term trained and logged the same at 1 rank and FSDP2 over 2,
changing the run, and its one-line errors."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.launch import REPO, TINY, assert_losses_close, train

PLUGIN = REPO / "tests" / "plugins" / "toy_remedy.py"
ON = ["--job.plugins", str(PLUGIN), "--remedies.toy_hidden_l2", "0.5", "--training.steps", "6"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remedy")
    return (train(tmp, *TINY, *ON, name="one").check(), train(tmp, *TINY, *ON, name="two", nproc=2).check(),
            train(tmp, *TINY, "--training.steps", "6", name="off").check())


def test_the_loss_term_trains_and_logs_the_same_at_1_and_2_ranks(runs):
    one, two, off = runs
    assert_losses_close(one.losses, two.losses, rtol=1e-5)
    terms = {r["step"]: r["remedies/toy_hidden_l2"] for r in one.records if "remedies/toy_hidden_l2" in r}
    assert sorted(terms) == list(range(1, 7)) and all(v > 0 for v in terms.values())
    for r in two.records:
        if "remedies/toy_hidden_l2" in r:
            assert r["remedies/toy_hidden_l2"] == pytest.approx(terms[r["step"]], rel=1e-5)
    # the term reaches the gradients: the cross entropy of step 2 on differs from the run without it
    assert one.losses[1] == pytest.approx(off.losses[1], rel=1e-6) and one.losses[2] != off.losses[2]
    assert not any("remedies/toy_hidden_l2" in r for r in off.records)


def test_its_option_is_in_help_and_bad_values_are_one_line_errors(tmp_path):
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, str(REPO / "train.py"), "--job.plugins", str(PLUGIN), "--help"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert "--remedies.toy_hidden_l2" in out.stdout and "--remedies.qk_clip_tau" in out.stdout
    bad = train(tmp_path, *TINY, "--job.plugins", str(PLUGIN), "--remedies.toy_hidden_l2", "-1", name="bad")
    assert bad.returncode != 0 and "remedies.toy_hidden_l2 must be >= 0" in bad.stderr
    assert len([line for line in bad.stderr.splitlines() if line.strip()]) == 1, bad.stderr


def test_the_guide_shows_the_toy_remedy_as_it_is():
    code = PLUGIN.read_text().split('"""', 2)[2].lstrip("\n")  # after the module docstring
    assert code in (REPO / "docs" / "extending.md").read_text()
