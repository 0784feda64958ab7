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
