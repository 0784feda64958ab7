"""End-to-end training runs through train.py (python and torchrun on gloo), as users launch them."""

import json

import pytest

from tests.launch import TINY, assert_losses_close, train

pytestmark = pytest.mark.dist

RESUME = [*TINY, "--checkpoint.enable", "true", "--checkpoint.interval", "10", "--lr_scheduler.total_steps", "20"]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """One uninterrupted 1-rank run of 20 steps with a checkpoint every 10 (shared by several tests)."""
    return train(tmp_path_factory.mktemp("base"), *RESUME, "--metrics.tensorboard", "true").check()


def test_loss_falls_and_metrics_are_written(baseline):
    losses = baseline.losses
    assert sorted(losses) == list(range(1, 21))
    assert losses[20] < losses[1] - 1.0, losses
    rec = baseline.records[-1]
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_second"):
        assert key in rec
    for line in (baseline.run_dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line)
    assert (baseline.run_dir / "config.toml").is_file()
    assert sorted(p.name for p in (baseline.run_dir / "checkpoints").iterdir()) == ["step-10", "step-20"]


def test_tensorboard_events_hold_the_scalars(baseline):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((baseline.run_dir / "tb").glob("events.out.tfevents.*"))
    assert events
    acc = EventAccumulator(str(events[0]))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in ("loss", "lr", "grad_norm", "tokens_per_second"):
        assert tag in tags
    loss_events = acc.Scalars("loss")
    assert [e.step for e in loss_events] == list(range(1, 21))
    assert loss_events[-1].value == pytest.approx(baseline.losses[20], rel=1e-6)


def test_fsdp2_two_ranks_equals_one_rank(tmp_path, baseline):
    two = train(tmp_path, *RESUME, nproc=2).check()
    assert_losses_close(two.losses, baseline.losses, rtol=1e-5)


@pytest.mark.parametrize("nproc", [1, pytest.param(2, marks=pytest.mark.extended)])
def test_resume_is_exact(tmp_path, baseline, nproc):
    first = train(tmp_path, *RESUME, "--training.steps", "10", nproc=nproc).check()
    assert sorted(first.losses) == list(range(1, 11))
    resumed = train(tmp_path, *RESUME, nproc=nproc).check()
    assert "resumed from" in resumed.stdout
    after = {s: l for s, l in resumed.losses.items() if s > 10}
    assert sorted(after) == list(range(11, 21))
    rtol = 1e-6 if nproc == 1 else 1e-5
    assert_losses_close(after, {s: baseline.losses[s] for s in after}, rtol=rtol)


def test_keep_latest_k_and_interrupted_save_leave_complete_checkpoints(tmp_path):
    run = train(tmp_path, *TINY, "--training.steps", "6", "--checkpoint.enable", "true", "--checkpoint.interval", "2",
                "--checkpoint.keep_latest_k", "2", "--lr_scheduler.total_steps", "8").check()
    ckpts = run.run_dir / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-4", "step-6"]
    # A crash during a save leaves a temporary folder; it is ignored on resume and purged by the next save.
    (ckpts / ".tmp-step-8").mkdir()
    (ckpts / ".tmp-step-8" / "garbage").write_text("partial")
    again = train(tmp_path, *TINY, "--training.steps", "8", "--checkpoint.enable", "true", "--checkpoint.interval",
                  "2", "--checkpoint.keep_latest_k", "2", "--lr_scheduler.total_steps", "8").check()
    assert "resumed from" in again.stdout and "step-6" in again.stdout
    assert sorted(p.name for p in ckpts.iterdir()) == ["step-6", "step-8"]


@pytest.mark.parametrize("override, fragment, nproc", [
    (["--data.source", "/no/such/corpus"], "/no/such/corpus", 1),
    (["--data.tokenizer", "{bad}"], "tokenizer", 1),
    (["--training.global_batch_size", "7"], "not divisible by the data-parallel degree 2", 2),
])
def test_bad_input_exits_2_with_one_line(tmp_path, override, fragment, nproc):
    if "{bad}" in override:
        bad = tmp_path / "garbage.tiktoken"
        bad.write_bytes(b"\x00\x01 not a bpe file\n")
        override = [override[0], str(bad)]
    run = train(tmp_path, *TINY, *override, nproc=nproc)
    errors = [l for l in run.stderr.splitlines() if l.startswith("error:")]
    assert errors and fragment in errors[0], run.stderr[-2000:]
    # train.py exits 2; under torchrun the launcher reports the failed ranks with its own non-zero code
    assert run.returncode == 2 if nproc == 1 else run.returncode != 0


def test_checkpoint_of_another_model_is_refused_and_kept(tmp_path):
    train(tmp_path, *TINY, "--training.steps", "2", "--checkpoint.enable", "true").check()
    ckpt = tmp_path / "run" / "checkpoints" / "step-2"
    before = sorted((p.name, p.stat().st_size) for p in ckpt.iterdir())
    run = train(tmp_path, *TINY, "--training.steps", "4", "--checkpoint.enable", "true", "--model.softmax", "softmax1")
    assert run.returncode == 2
    assert "model.softmax" in run.stderr and "start a new run" in run.stderr
    assert sorted((p.name, p.stat().st_size) for p in ckpt.iterdir()) == before


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tmp_path):
    import os
    import signal
    import subprocess
    import sys

    from tests.launch import REPO

    cmd = [sys.executable, str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"), *TINY,
           "--training.steps", "100000", "--checkpoint.enable", "true", "--checkpoint.interval", "100000",
           "--job.dump_folder", str(tmp_path), "--job.name", "pre"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in proc.stdout:
        if line.startswith("step      2"):
            break
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 75, err[-2000:]  # stopped on request, resumable (outlier_titan.exit_codes)
    assert "SIGTERM received" in out
    steps = [int(p.name.split("-")[1]) for p in (tmp_path / "pre" / "checkpoints").glob("step-*")]
    assert len(steps) == 1 and 2 <= steps[0] < 100000


def test_probe_run_writes_outlier_scalars_and_both_images(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = train(tmp_path, *TINY, "--training.steps", "4", "--observe.every", "2", "--observe.batch_size", "2",
                "--metrics.tensorboard", "true").check()
    probe_steps = [r["step"] for r in run.records if "outliers/kurtosis_first" in r]
    assert probe_steps == [2, 4]
    for name in ("kurtosis_first", "kurtosis_rest", "kurtosis_neuron_rms", "max_abs_first", "max_abs_rest",
                 "max_median_ratio", "signal_prop_cos", "first_token_argmax_share", "first_token_attention_mass"):
        assert f"outliers/{name}" in run.records[-1]
        assert f"outliers/layer_0/{name}" in run.records[-1] and f"outliers/layer_3/{name}" in run.records[-1]
    acc = EventAccumulator(str(next((run.run_dir / "tb").glob("events.out.tfevents.*"))),
                           size_guidance={"images": 0, "scalars": 0})
    acc.Reload()
    assert "outliers/kurtosis_first" in acc.Tags()["scalars"]
    assert {"outliers/attention_map", "outliers/hidden_magnitude"} <= set(acc.Tags()["images"])
    img = acc.Images("outliers/attention_map")[-1]
    assert img.step == 4 and img.width > 16 and img.height > 16


def test_non_finite_gradient_skips_the_update(tmp_path, monkeypatch):
    """A NaN anywhere in the gradients skips the optimizer step (counted), leaving the weights unchanged."""
    import torch

    from outlier_titan.config.manager import parse_args
    from outlier_titan.parallel.dims import free_port
    from outlier_titan.trainer import Trainer
    from tests.launch import REPO

    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)  # restored after the test
    cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), *TINY, "--job.dump_folder", str(tmp_path),
                      "--optimizer.name", "orthoadam", "--optimizer.tile_size", "32"])
    trainer = Trainer(cfg)
    try:
        with torch.no_grad():
            trainer.model.norm.weight.to_local()[0] = float("nan")  # poisons the logits, hence every gradient
        before = {n: p.detach().to_local().clone() for n, p in trainer.model.named_parameters()}
        _, norm = trainer.train_step()
        assert not torch.isfinite(norm) and trainer.state.skipped_steps == 1
        for n, p in trainer.model.named_parameters():
            torch.testing.assert_close(p.detach().to_local(), before[n], equal_nan=True, rtol=0, atol=0)
    finally:
        trainer.close()


def test_console_progress_summary_small_validation_split_and_finished_rerun(tmp_path):
    """Console: step N/total with tokens, elapsed and ETA, an end summary, and 'already complete' on a re-run.
    A validation split smaller than eval.steps batches is scored once, whole, with a warning."""
    import math

    import numpy as np

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"text {i}: " + "the quick brown fox jumps over the lazy dog. " * 23)
    args = [*TINY, "--training.steps", "4", "--eval.every", "2", "--eval.steps", "4", "--checkpoint.enable", "true",
            "--checkpoint.interval", "4", "--data.source", str(corpus), "--data.val_fraction", "0.5",
            "--data.cache_dir", str(tmp_path / "cache")]
    run = train(tmp_path, *args).check()
    lines = run.stdout.splitlines()
    step_lines = [line for line in lines if line.startswith("step") and " loss " in line]
    assert [line.split()[1] for line in step_lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert all("elapsed 0:00:" in line and " eta " in line and " tokens " in line for line in step_lines)
    assert "tokens 2.05k" in step_lines[-1]  # 4 steps x 8 sequences x 64 tokens
    summary = lines[-1]
    assert summary.startswith("finished 4/4 steps in ") and str(run.run_dir) in summary
    assert "train loss" in summary and "val loss" in summary and "(ppl " in summary
    # the validation split: every window once, not eval.steps x global batch rows cycled
    cached = [p for p in (tmp_path / "cache" / "tokens").glob("*-validation-*.npy")]
    windows = (len(np.load(cached[0], mmap_mode="r")) - 1) // 64
    assert 0 < windows < 4 * 8 and windows % 8  # the last validation batch is partly masked
    assert "fewer than the 2,048 asked by eval.steps" in run.stderr
    val = [r for r in run.records if "val_loss" in r]
    assert [r["val_tokens"] for r in val] == [windows * 64.0] * 2
    assert val[-1]["val_ppl"] == pytest.approx(math.exp(val[-1]["val_loss"]), rel=1e-9)
    assert all("time" in r and "elapsed" in r for r in run.records if "loss" in r)
    again = train(tmp_path, *args).check()
    assert "already complete (4/4 steps)" in again.stdout and "loss" not in again.stdout
