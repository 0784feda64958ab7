"""TWEO through ``train.py``: a run with it ends with a smaller largest activation than the same run without (its
equality across layouts is in tests/test_remedies_dist.py)."""

from __future__ import annotations

from tests.launch import TINY, train

PROBE = ["--observe.every", "20", "--observe.batch_size", "4", "--optimizer.lr", "3e-3"]
TWEO = ["--remedies.tweo", "true", "--remedies.tweo_weight", "0.05", "--remedies.tweo_tau", "0.5"]


def _last(run, key):
    return [r[key] for r in run.records if key in r][-1]


def test_tweo_lowers_the_largest_activation(tmp_path):
    with_tweo = train(tmp_path, *TINY, *PROBE, *TWEO, name="tweo").check()
    without = train(tmp_path, *TINY, *PROBE, name="plain").check()
    a, b = _last(with_tweo, "outliers/max_abs_all"), _last(without, "outliers/max_abs_all")
    assert a < 0.5 * b, (a, b)  # measured: 0.97 against 12.5
