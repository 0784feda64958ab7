"""Fixtures shared by several test modules."""

import pytest

from outlier_titan.data import build_tokenizer


@pytest.fixture(scope="session")
def tok():
    """The shipped (embedded) BPE tokenizer."""
    return build_tokenizer("embedded")
