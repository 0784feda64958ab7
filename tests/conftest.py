"""Fixtures shared by several test modules."""

import pytest
import torch

import outlier_titan.components  # noqa: F401  (the built-in specs, variants, optimizers, metrics)
from outlier_titan.data import build_tokenizer

# One intra-op thread in the test process (the ranks and trainers the tests start get OMP_NUM_THREADS=1 too):
# the tests' tensors are small, and with two threads each op waits for the second thread to be scheduled, which
# on a loaded 2-core machine made the 20-step Muon comparison take 15-80 s instead of under 1 s (measured).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tok():
    """The shipped (embedded) BPE tokenizer."""
    return build_tokenizer("embedded")


# The extended tier: long tests (20 s to 3 min each on 2 cores) whose code paths a faster test of the default run
# also crosses (another layout, optimizer, spec or fault of the same kind). The default run leaves them out so
# that CI's whole `.ci/run` stays inside its hour; `--extended` (or a -m expression naming the marker) runs them.
def pytest_addoption(parser):
    parser.addoption("--extended", action="store_true",
                     help="also run the tests marked `extended` (the whole suite; 2.4 times the default's time)")


def _extended_wanted(config) -> bool:
    # a -m expression that names the marker (`-m extended`, `-m "not extended"`) does the selecting itself
    return config.getoption("--extended") or "extended" in (config.getoption("markexpr") or "")


_LEFT_OUT = pytest.StashKey[int]()


def pytest_collection_modifyitems(config, items):
    if _extended_wanted(config):
        return
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker("extended") else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept
        config.stash[_LEFT_OUT] = len(left_out)


@pytest.hookimpl(trylast=True)  # after the durations and the short summary, just above the counts
def pytest_terminal_summary(terminalreporter, config):
    n = config.stash.get(_LEFT_OUT, 0)
    if n:
        tests = f"{n} test{'s' if n != 1 else ''}"
        terminalreporter.write_line(f"the extended tier ({tests} marked `extended`) was left out; "
                                    "`python -m pytest -q tests --extended` runs the whole suite")
