"""The tile optimizers under real FSDP2 and FSDP2 x TP2 (gloo, 2 and 4 processes) against world size 1.

One 4-process run (FSDP2 x TP2) and one 2-process run (FSDP2) of tests/dist/optim_worker.py, shared by the
tests below through a module fixture. Equal means bitwise equal: the tile grid is global and every product
has the tile's shape, so the layout changes nothing.
"""

import importlib.util
from pathlib import Path

import pytest
import torch

from outlier_titan.errors import CheckpointError
from tests.launch import launch_workers

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "dist" / "optim_worker.py"
pytestmark = pytest.mark.dist


def _load_worker():
    spec = importlib.util.spec_from_file_location("optim_worker", WORKER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


W = _load_worker()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("optim_dist")
    launch_workers(WORKER, ["fsdp2xtp2", str(out)], world=4, timeout=240)
    launch_workers(WORKER, ["fsdp2", str(out)], world=2, timeout=240)
    return out


def _single(kind, resume_from=None):
    model = W.Tiny()
    opt = W.build_optimizer(kind, model)
    if resume_from is None:
        W.run_steps(model, opt, 1, W.STEPS)
    else:
        fresh = W.Tiny(seed=123)
        model, opt = fresh, W.build_optimizer(kind, fresh)
        W.dcp_load(model, opt, str(resume_from))
        W.run_steps(model, opt, W.RESUME_AT + 1, W.STEPS)
    return W.gather(model, opt)


def _assert_same(got, want, what):
    for n, p in want["params"].items():
        assert torch.equal(got["params"][n], p), (what, n, (got["params"][n] - p).abs().max().item())
    for n, st in want["state"].items():
        assert set(got["state"][n]) == set(st), (what, n)
        for k, v in st.items():
            assert torch.equal(got["state"][n][k].to(v.dtype), v), (what, n, k)


@pytest.mark.parametrize("kind", W.KINDS)
def test_world_size_invariance(runs, kind):
    ref = _single(kind)
    tp = torch.load(runs / f"fsdp2xtp2_{kind}.pt")
    # FSDP over TP really gives strided shards, and the residual axis is never sharded
    assert "_StridedShard" in tp["placements"]["layers.0.feed_forward.w2.weight"]
    _assert_same(tp, ref, "fsdp2xtp2")
    _assert_same(torch.load(runs / f"fsdp2_{kind}.pt"), ref, "fsdp2")
    moved = max((ref["params"][n] - W.Tiny().state_dict()[n]).abs().max().item() for n in ref["params"])
    assert moved > 1e-2


@pytest.mark.parametrize("kind", W.KINDS)
def test_checkpoint_from_4_ranks_resumes_at_2_and_1(runs, kind):
    ref = _single(kind)
    _assert_same(torch.load(runs / f"fsdp2_resumed_{kind}.pt"), ref, "resumed at 2 ranks")
    _assert_same(_single(kind, resume_from=runs / f"ckpt_{kind}"), ref, "resumed at 1 rank")


def test_resume_with_other_bases_is_refused(runs):
    model = W.Tiny()
    opt = W.build_optimizer("orthoadam", model, seed=8)  # the checkpoint's bases came from seed 7
    with pytest.raises(CheckpointError, match="basis_spec"):
        W.dcp_load(model, opt, str(runs / "ckpt_orthoadam"))


def test_strict_misalignment_fails_at_construction(runs):
    msg = (runs / "strict_message.txt").read_text()
    assert msg.startswith("optimizer: ") and "_StridedShard" in msg and "tile_alignment = 'adapt'" in msg
    assert "=4']" in msg  # names a tile size that works
