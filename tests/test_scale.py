"""Scale-out equivalence on gloo CPU ranks: TP, HSDP, activation checkpointing, compile, grad accumulation,
DCP resharding between layouts, and the dry-run planner."""

import os
import subprocess
import sys
import time

import pytest

from tests.launch import REPO, TINY, assert_losses_close, train

pytestmark = pytest.mark.dist

LAYOUTS = {
    "fsdp2": (2, []),
    "fsdp2_tp2": (4, ["--parallelism.tp", "2"]),
    "hsdp2x2": (4, ["--parallelism.dp_replicate", "2", "--parallelism.dp_shard", "2"]),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), *TINY, "--model.flavor", "debug_llama").check()


@pytest.mark.parametrize("layout", [pytest.param(n, marks=pytest.mark.extended) if n in ("fsdp2", "hsdp2x2") else n
                                    for n in sorted(LAYOUTS)])
def test_layouts_match_world_size_one(tmp_path, reference, layout):
    nproc, extra = LAYOUTS[layout]
    run = train(tmp_path, *TINY, "--model.flavor", "debug_llama", *extra, nproc=nproc).check()
    assert_losses_close(run.losses, reference.losses, rtol=1e-4)
    assert run.losses[20] < run.losses[1]


def test_gpt2_style_tp_with_learned_positions_and_tied_head(tmp_path):
    one = train(tmp_path, *TINY, "--training.steps", "8", name="one").check()
    tp = train(tmp_path, *TINY, "--training.steps", "8", "--parallelism.tp", "2", nproc=2, name="tp").check()
    assert_losses_close(tp.losses, one.losses, rtol=1e-4)


@pytest.mark.parametrize("mode", [("full", "1"), ("selective", "2"), ("selective", "0")])
def test_activation_checkpointing_matches(tmp_path, reference, mode):
    run = train(tmp_path, *TINY, "--model.flavor", "debug_llama", "--activation_checkpoint.mode", mode[0],
                "--activation_checkpoint.selective_every", mode[1]).check()
    assert_losses_close(run.losses, reference.losses, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.extended
def test_compile_matches_eager(tmp_path, reference):
    run = train(tmp_path, *TINY, "--model.flavor", "debug_llama", "--compile.enable", "true", timeout=900).check()
    assert_losses_close(run.losses, reference.losses, rtol=1e-4)


def test_grad_accumulation_equals_big_batch(tmp_path, reference):
    run = train(tmp_path, *TINY, "--model.flavor", "debug_llama", "--training.micro_batch_size", "2").check()
    assert_losses_close(run.losses, reference.losses, rtol=1e-5)


def test_checkpoint_reshards_from_fsdp_tp_to_fsdp_and_one_rank(tmp_path):
    ckpt = ["--checkpoint.enable", "true", "--checkpoint.interval", "10", "--lr_scheduler.total_steps", "20",
            "--model.flavor", "debug_llama"]
    full = train(tmp_path / "full", *TINY, *ckpt, "--parallelism.tp", "2", nproc=4).check()
    src = tmp_path / "full" / "run" / "checkpoints" / "step-10"  # debug.toml keeps the two newest: step 10 and 20
    for nproc in (2, 1):
        dst = tmp_path / f"to{nproc}" / "run" / "checkpoints"
        dst.mkdir(parents=True)
        subprocess.run(["cp", "-r", str(src), str(dst / "step-10")], check=True)
        run = train(tmp_path / f"to{nproc}", *TINY, *ckpt, nproc=nproc).check()
        assert "resumed from" in run.stdout
        after = {s: v for s, v in run.losses.items() if s > 10}
        assert sorted(after) == list(range(11, 21))
        assert_losses_close(after, {s: full.losses[s] for s in after}, rtol=1e-4)


def llama_closed_form(dim, n_layers, n_heads, n_kv_heads, ffn, vocab):
    head = dim // n_heads
    attn = dim * head * n_heads * 2 + dim * head * n_kv_heads * 2
    per_layer = attn + 3 * dim * ffn + 2 * dim
    return vocab * dim * 2 + n_layers * per_layer + dim


def test_dry_run_7b_on_4x8_is_fast_and_counts_exactly():
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(REPO / "train.py"), "--config", str(REPO / "train_configs/debug.toml"),
                           "--dry_run", "--model.flavor", "llama_7b", "--parallelism.dp_shard", "4",
                           "--parallelism.tp", "8", "--training.seq_len", "4096", "--training.global_batch_size",
                           "32", "--activation_checkpoint.mode", "full"],
                          capture_output=True, text=True, timeout=120)
    elapsed = time.perf_counter() - t0
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert elapsed < 60
    expected = llama_closed_form(4096, 32, 32, 32, 11008, 4096)
    assert f"parameters        {expected:,}" in proc.stdout, proc.stdout
    # rank 0 holds 1/32 of every matrix (all dims divide evenly); the RMSNorm gains are replicated over TP
    # (sequence parallel) and sharded over FSDP only: 1/4 of them
    gains = (2 * 32 + 1) * 4096
    assert f"per-rank params   {(expected - gains) // 32 + gains // 4:,}" in proc.stdout, proc.stdout
    for row in ("parameters (fp32)", "gradients (fp32)", "optimizer state (adamw)", "activations (estimate",
                "total"):
        assert row in proc.stdout


def test_rank_0_of_a_fake_world_trains_its_share_of_the_model(tmp_path):
    """parallelism.fake_world_size: rank 0 of FSDP 2 x TP 2 in one process on the fake process group (its share of
    the parameters against the planner's: test_gpu_check's dry part 4); checkpointing and a launcher are refused."""
    layout = ["--model.flavor", "debug_llama", "--parallelism.dp_shard", "2", "--parallelism.tp", "2"]
    run = train(tmp_path, *TINY, *layout, "--parallelism.fake_world_size", "4", "--training.steps", "2").check()
    assert "rank 0 of a fake world of 4" in run.stdout + run.stderr
    assert [r["step"] for r in run.records if "loss" in r] == [1, 2]
    saving = train(tmp_path, *TINY, *layout, "--parallelism.fake_world_size", "4", "--checkpoint.enable", "true",
                   name="ckpt")
    assert saving.returncode != 0 and "set checkpoint.enable = false" in saving.stderr
    assert len([line for line in saving.stderr.splitlines() if line.strip()]) == 1, saving.stderr
    launched = train(tmp_path, *TINY, "--parallelism.fake_world_size", "4", nproc=2, name="launched")
    assert launched.returncode != 0 and "not under torchrun" in launched.stderr


def test_mesh_that_does_not_fit_world_size_is_a_one_line_error(tmp_path):
    run = train(tmp_path, *TINY, "--parallelism.tp", "2", "--parallelism.dp_shard", "2", nproc=2)
    assert run.returncode != 0
    assert "but the world size is 2" in run.stderr


def test_tp_logits_stay_vocab_sharded_and_the_parallel_loss_is_exact():
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(REPO / "tests/dist/loss_parallel_worker.py")], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.extended
def test_probe_metrics_are_the_same_at_every_layout(tmp_path):
    """observe.batch_size is global: 1 rank, FSDP 2 and FSDP 2 x TP 2 probe the same sequences and agree. The
    validation split (15 windows) is smaller than eval.steps global batches: every layout scores it whole, once,
    with the tail rows of the second batch masked on whichever rank holds them."""
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(4):
        (corpus / f"{i}.txt").write_text(f"text {i}: " + "the quick brown fox jumps over the lazy dog. " * 23)
    probe = [*TINY, "--model.flavor", "debug_llama", "--training.steps", "2", "--observe.every", "1",
             "--eval.every", "2", "--eval.steps", "4", "--data.source", str(corpus), "--data.val_fraction", "0.5",
             "--data.cache_dir", str(tmp_path / "cache")]
    runs = {name: train(tmp_path, *probe, *extra, nproc=nproc, name=name).check()
            for name, (nproc, extra) in {"one": (1, []), **{k: LAYOUTS[k] for k in ("fsdp2", "fsdp2_tp2")}}.items()}

    def metrics(run):
        return {(r["step"], k): v for r in run.records for k, v in r.items()
                if (k.startswith("outliers/") and k != "outliers/probe_seconds") or k.startswith("val_")}

    ref = metrics(runs["one"])
    assert {s for s, _ in ref} == {1, 2} and (2, "outliers/first_token_argmax_share") in ref
    assert ref[(2, "val_tokens")] == 15 * 64
    for name in ("fsdp2", "fsdp2_tp2"):
        got = metrics(runs[name])
        assert got.keys() == ref.keys(), name
        for key, v in ref.items():
            assert got[key] == pytest.approx(v, rel=1e-5, abs=1e-7), (name, key)
