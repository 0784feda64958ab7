"""The training remedies through ``train.py``, QK-Clip and TWEO on together (one set of launches for both), at 1
rank (also with activation checkpointing, whose recompute runs the logit hook again and must not count a block's
output twice), FSDP2 over 2 ranks and FSDP2 x TP2 over 4: the same losses, the same clipped heads and MaxLogit of
every step (reduced by max over the data-parallel ranks and laid out over the TP ranks' heads before the clip), the
same probe MaxLogit and the same TWEO term (sequence-parallel block outputs counted once)."""

from __future__ import annotations

import pytest

from tests.launch import TINY, assert_losses_close, train

pytestmark = pytest.mark.extended

CLIP = ["--training.steps", "8", "--optimizer.lr", "3e-3", "--remedies.qk_clip", "true",
        "--remedies.qk_clip_tau", "0.25", "--observe.every", "4", "--observe.batch_size", "4",
        "--remedies.tweo", "true", "--remedies.tweo_weight", "0.05", "--remedies.tweo_tau", "0.5"]
LAYOUTS = {"one": (1, []), "one_ac": (1, ["--activation_checkpoint.mode", "full"]), "fsdp2": (2, []),
           "fsdp2_tp2": (4, ["--parallelism.tp", "2"])}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("remedies")
    return {name: train(tmp, *TINY, *CLIP, *extra, name=name, nproc=n).check()
            for name, (n, extra) in LAYOUTS.items()}


def _series(run, key):
    return {r["step"]: r[key] for r in run.records if key in r}


@pytest.mark.parametrize("layout", ["one_ac", "fsdp2", "fsdp2_tp2"])
def test_qk_clip_and_tweo_are_the_same_at_every_layout(runs, layout):
    one, other = runs["one"], runs[layout]
    assert_losses_close(one.losses, other.losses, rtol=1e-5)
    heads = _series(one, "remedies/qk_clip_heads")
    assert len(heads) == 8 and sum(heads.values()) > 0, heads  # the clip fires
    assert _series(other, "remedies/qk_clip_heads") == heads
    for key in ("remedies/qk_clip_max_logit", "outliers/max_logit", "outliers/layer_0/max_logit"):
        a, b = _series(one, key), _series(other, key)
        assert a and a.keys() == b.keys(), key
        for step in a:  # a logit is q . k, quadratic in the activations: their float differences come out 2x larger
            assert b[step] == pytest.approx(a[step], rel=3e-5), (key, step)
    a, b = _series(one, "remedies/tweo"), _series(other, "remedies/tweo")
    assert a and a.keys() == b.keys()
    for step in a:  # a 4th power: the activations' float differences of the layouts (~1e-6) come out 4x larger
        assert b[step] == pytest.approx(a[step], rel=1e-4), step
