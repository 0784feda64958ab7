"""The suite's two tiers (tests/conftest.py): the default run leaves the `extended` tests out and says so;
``--extended``, or a -m expression naming the marker, runs them."""

import subprocess
import sys

from tests.launch import REPO


def collect(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "tests/test_train.py", *args], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_the_default_run_leaves_the_extended_tier_out_and_says_how_to_run_it():
    out = collect()
    assert "test_resume_is_exact[1]" in out and "test_resume_is_exact[2]" not in out
    assert "(1 deselected)" in out
    assert "the extended tier (1 test marked `extended`) was left out" in out and "--extended" in out


def test_extended_runs_the_whole_suite_and_m_extended_the_tier_alone():
    whole = collect("--extended")
    assert "test_resume_is_exact[1]" in whole and "test_resume_is_exact[2]" in whole and "deselected" not in whole
    tier = collect("-m", "extended")
    assert "test_resume_is_exact[2]" in tier and "test_resume_is_exact[1]" not in tier
    assert "was left out" not in tier
