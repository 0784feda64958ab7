"""The synthetic Bigram-Backcopy source: windows, the task's rules, splits, DP layouts, errors, a training run."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from outlier_titan.config.job_config import Data
from outlier_titan.data import build_dataloader
from outlier_titan.data.sources import resolve_source
from outlier_titan.data.synthetic import BigramBackcopyWindows
from outlier_titan.errors import DataError
from tests.launch import TINY, assert_losses_close, train
from tests.loaders import step_rows

SEQ = 64
STATES = 64


@pytest.fixture(scope="module")
def windows(tok):
    return BigramBackcopyWindows("bigram_backcopy", tok, SEQ)


@pytest.fixture(scope="module")
def many_rows(windows):
    return windows.rows(0, 4000)


def _fires(rows: np.ndarray, triggers) -> np.ndarray:
    """[rows, SEQ - 1] mask over target positions t = 2..SEQ: token t must copy token t - 2."""
    is_trigger = np.isin(rows, triggers)
    return is_trigger[:, 1:-1] & ~is_trigger[:, :-2] & (np.arange(SEQ - 1) >= 1)


def test_rows_are_deterministic_random_access_bos_then_states(windows, tok):
    rows = windows.rows(0, 8)
    assert rows.shape == (8, SEQ + 1) and rows.dtype == np.int64
    np.testing.assert_array_equal(windows.rows(5, 3), rows[5:8])
    np.testing.assert_array_equal(BigramBackcopyWindows("bigram_backcopy", tok, SEQ).rows(0, 8), rows)
    assert (rows[:, 0] == tok.eos_id).all()
    assert ((rows[:, 1:] >= 0) & (rows[:, 1:] < STATES)).all()
    assert len({r.tobytes() for r in rows}) == 8


def test_triggers_are_the_most_likely_states_of_the_stationary_distribution(windows):
    p = windows.transition
    assert p.dtype == np.float64 and p.shape == (STATES, STATES)
    np.testing.assert_allclose(p.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    eigvals, eigvecs = np.linalg.eig(p.T)
    pi = np.real(eigvecs[:, np.argmin(np.abs(eigvals - 1))])
    pi /= pi.sum()
    np.testing.assert_allclose(windows.stationary, pi, rtol=1e-9)
    assert sorted(windows.triggers.tolist()) == sorted(np.argsort(-pi)[:3].tolist())


def test_the_token_after_a_trigger_copies_the_token_before_it(windows, many_rows):
    fires = _fires(many_rows, windows.triggers)
    assert fires.sum() > 5000
    np.testing.assert_array_equal(many_rows[:, 2:][fires], many_rows[:, :-2][fires])
    # a trigger right after another trigger does not copy: its successor comes from the chain
    is_trigger = np.isin(many_rows, windows.triggers)
    pairs = is_trigger[:, 1:-1] & is_trigger[:, :-2]
    assert pairs.sum() > 30
    assert (many_rows[:, 2:][pairs] == many_rows[:, :-2][pairs]).mean() < 0.3


def test_every_other_transition_follows_the_chain(windows, many_rows):
    fires = _fires(many_rows, windows.triggers)
    prev, nxt = many_rows[:, 1:-1][~fires], many_rows[:, 2:][~fires]
    counts = np.zeros((STATES, STATES), dtype=np.float64)
    np.add.at(counts, (prev, nxt), 1.0)
    visits = counts.sum(axis=1, keepdims=True)
    assert visits.min() > 50  # triggers mostly copy: their rows get the fewest chain draws
    p = windows.transition
    # within 5 binomial standard deviations, plus 3 counts of slack for the rare successors of rare rows
    excess = np.abs(counts / visits - p) - 5 * np.sqrt(p * (1 - p) / visits) - 3 / visits
    assert excess.max() < 0, np.unravel_index(excess.argmax(), excess.shape)
    first = np.bincount(many_rows[:, 1], minlength=STATES) / len(many_rows)
    assert 0.5 * np.abs(first - windows.stationary).sum() < 0.1


def test_splits_differ_but_share_the_chain(tok, windows):
    val = BigramBackcopyWindows("bigram_backcopy", tok, SEQ, split="validation")
    np.testing.assert_array_equal(val.transition, windows.transition)
    np.testing.assert_array_equal(val.triggers, windows.triggers)
    train_rows = {r.tobytes() for r in windows.rows(0, 64)}
    assert not train_rows & {r.tobytes() for r in val.rows(0, 64)}
    # the training seed draws other training windows, never other validation windows or another chain
    other = BigramBackcopyWindows("bigram_backcopy", tok, SEQ, seed=1)
    np.testing.assert_array_equal(other.transition, windows.transition)
    assert not train_rows & {r.tobytes() for r in other.rows(0, 64)}
    np.testing.assert_array_equal(BigramBackcopyWindows("bigram_backcopy", tok, SEQ, "validation", 1).rows(0, 4),
                                  val.rows(0, 4))
    # the task seed draws another chain
    assert not np.allclose(BigramBackcopyWindows("bigram_backcopy:seed=1", tok, SEQ).transition, windows.transition)


@pytest.mark.parametrize("split", ["train", "validation"])
def test_the_same_windows_at_any_dp_degree_and_on_resume(tok, windows, split):
    cfg = Data(source="bigram_backcopy")

    def loaders(dp: int, m: int):
        return [build_dataloader(cfg, tok, seq_len=SEQ, global_batch_size=8, micro_batch_size=m, dp_rank=r,
                                 dp_degree=dp, split=split) for r in range(dp)]

    one = step_rows(loaders(1, 2), 3)
    if split == "train":
        np.testing.assert_array_equal(torch.cat(one).numpy(), windows.rows(0, 24))
    for dp, m in ((2, 2), (4, 1), (4, 2)):
        for a, b in zip(step_rows(loaders(dp, m), 3), one):
            assert torch.equal(a, b)
    first = loaders(2, 2)
    step_rows(first, 1)
    resumed = loaders(4, 1)
    for dl in resumed:
        dl.load_state_dict(first[0].state_dict())
    assert all(torch.equal(a, b) for a, b in zip(step_rows(resumed, 2), one[1:]))


@pytest.mark.parametrize("source, fragment", [
    ("bigram_backcopy:colors=3", "unknown bigram_backcopy parameter 'colors'; use states, triggers, alpha, seed"),
    ("bigram_backcopy:states", "parameter 'states' is not key=value"),
    ("bigram_backcopy:states=6.5", "states='6.5' is not an integer"),
    ("bigram_backcopy:alpha=x", "alpha='x' is not a number"),
    ("bigram_backcopy:states=8,states=9", "'states' is given twice"),
    ("bigram_backcopy:states=1", "states=1 must be at least 2"),
    ("bigram_backcopy:states=8,triggers=8", r"triggers=8 must be in \[0, states=8\)"),
    ("bigram_backcopy:alpha=0", "alpha=0.0 must be a positive number"),
    ("bigram_backcopy:alpha=nan", "alpha=nan must be a positive number"),
    ("bigram_backcopy:seed=-1", "seed=-1 must be non-negative"),
    ("bigram_backcopy:states=4096", "states=4096 needs token ids 0..4095 below the tokenizer's end-of-text id 4095"),
])
def test_bad_parameters_are_one_line_data_errors(tok, source, fragment):
    with pytest.raises(DataError, match=fragment) as err:
        build_dataloader(Data(source=source), tok, seq_len=SEQ, global_batch_size=2, micro_batch_size=2,
                         dp_rank=0, dp_degree=1)
    assert str(err.value).startswith("data.source: ") and "\n" not in str(err.value)


def test_parameters_in_the_source_string(tok):
    w = BigramBackcopyWindows("bigram_backcopy: states=16 ,triggers=0,alpha=1.5", tok, SEQ)
    assert (w.task.states, w.task.triggers, w.task.alpha, w.task.seed) == (16, 0, 1.5, 0)
    assert len(w.triggers) == 0 and w.rows(0, 50)[:, 1:].max() < 16
    with pytest.raises(DataError, match="synthetic task without documents"):
        resolve_source("bigram_backcopy", "train")


def test_training_run_learns_the_chain_and_resumes_exactly(tmp_path, tok):
    source = "bigram_backcopy:states=16,alpha=0.1"  # a small, peaked chain: learnt within 40 tiny steps
    args = [*TINY, "--data.source", source, "--training.steps", "40", "--lr_scheduler.total_steps", "40",
            "--checkpoint.enable", "true", "--checkpoint.interval", "20", "--eval.every", "40", "--eval.steps", "4",
            "--observe.every", "40"]
    full = train(tmp_path, *args, name="full").check()
    losses = full.losses
    assert sorted(losses) == list(range(1, 41))
    assert losses[1] > 0.95 * math.log(tok.vocab_size)
    # well below the entropy of the stationary distribution: the model predicts from the previous token
    pi = BigramBackcopyWindows(source, tok, SEQ).stationary
    val = [r["val_loss"] for r in full.records if "val_loss" in r]
    assert val and val[-1] < float(-(pi * np.log(pi)).sum()) - 0.5, val
    assert any("outliers/kurtosis_first" in r for r in full.records)

    half = train(tmp_path, *args, "--training.steps", "20", name="resumed").check()
    assert sorted(half.losses) == list(range(1, 21))
    resumed = train(tmp_path, *args, name="resumed").check()
    assert "resumed from" in resumed.stdout
    after = {s: v for s, v in resumed.losses.items() if s > 20}
    assert_losses_close(after, {s: losses[s] for s in after}, rtol=1e-6)
