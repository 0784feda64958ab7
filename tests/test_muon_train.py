"""Muon through train.py: muon_layout = "full" gives world size 1's losses at FSDP 2, FSDP 2 x TP 2 and HSDP 2 x 2
(gloo, fp32), and the FSDP 2 x TP 2 run's checkpoint resumes at world size 1 with the uninterrupted losses;
Newton-Schulz runs in float32 here: the owner rank's Newton-Schulz sees the same matrix as one rank does, but the
gradients differ in their last bits because FSDP reduces them in another order, and torch.optim.Muon's bfloat16
cast (the default muon_ns_dtype) turns such a difference into a whole bfloat16 step (2^-8) wherever it crosses a
rounding boundary (measured: 1.1e-5 relative loss difference at step 9 under FSDP 2 x TP 2). "block" layout
invariance is tested in one process (test_muon.py)."""

import shutil

import pytest

from tests.launch import TINY, assert_losses_close, train

pytestmark = [pytest.mark.dist, pytest.mark.slow, pytest.mark.extended]

STEPS = 10
ARGS = [*TINY, "--training.steps", str(STEPS), "--lr_scheduler.total_steps", str(STEPS), "--optimizer.name", "muon",
        "--optimizer.lr", "0.02", "--optimizer.muon_ns_dtype", "float32"]
CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "5"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon")
    out = {"w1": train(tmp, *ARGS, name="w1").check(),
           "w2": train(tmp, *ARGS, name="w2", nproc=2).check(),
           "w4": train(tmp, *ARGS, *CKPT, "--parallelism.tp", "2", name="w4", nproc=4).check(),
           "hsdp": train(tmp, *ARGS, "--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2",
                         name="hsdp", nproc=4).check()}
    shutil.copytree(tmp / "w4" / "checkpoints" / "step-5", tmp / "resume1" / "checkpoints" / "step-5")
    out["resume1"] = train(tmp, *ARGS, "--checkpoint.enable", "true", "--checkpoint.interval", "100",
                           name="resume1").check()
    return out


def test_full_layout_same_losses_at_world_size_1_fsdp2_fsdp2_tp2_and_hsdp(runs):
    base = runs["w1"].losses
    assert sorted(base) == list(range(1, STEPS + 1)) and base[STEPS] < base[1]
    assert "optimizer split: muon 24 tensors" in runs["w1"].stdout and "muon_layout full" in runs["w1"].stdout
    assert "tp 2" in runs["w4"].stdout and "dp_replicate 2, dp_shard 2" in runs["hsdp"].stdout
    for name in ("w2", "w4", "hsdp"):
        assert_losses_close(runs[name].losses, base, rtol=RTOL)


def test_full_layout_fsdp2_tp2_checkpoint_resumes_at_world_size_1(runs):
    run = runs["resume1"]
    assert "resumed from" in run.stdout
    after = {s: v for s, v in run.losses.items() if s > 5}
    assert sorted(after) == list(range(6, STEPS + 1))
    assert_losses_close(after, {s: runs["w4"].losses[s] for s in after}, rtol=RTOL)

