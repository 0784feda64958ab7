"""Attention variants through train.py: equal losses at 1 rank, FSDP 2 and FSDP 2 x TP 2 (gloo), and exact DCP
resume of the variants with new parameters (sink logits, gates). To stay fast, one model holds several variants,
one per block (``model.attention_layers``)."""

import pytest

from tests.launch import LAYOUTS, TINY, assert_losses_close, train

pytestmark = pytest.mark.dist

STEPS = ["--training.steps", "8"]
# Every new variant plus softmax-1, one per block of an 8-block Llama-style debug model (GQA 4 / 2 heads); sink
# logits out of weight decay.
ALL_NEW = "sink_logit,gated_head,gated_elementwise,softpick,sigmoid,relu,clipped_softmax,softmax1"
LLAMA8 = ["--model.flavor", "debug_llama", "--model.n_layers", "8", "--model.attention_layers", ALL_NEW,
          "--model.attention_sink_init", "0.5", "--optimizer.no_decay", "norm,bias,embedding,sink"]
# The 1-rank run also checkpoints at steps 4 and 8 (the uninterrupted reference of the resume test) and probes at
# steps 4 and 8 into metrics.jsonl and TensorBoard (the probe must not change the losses the other layouts match).
CHECKPOINTS = ["--checkpoint.enable", "true", "--checkpoint.interval", "4", "--lr_scheduler.total_steps", "8"]
PROBE = ["--observe.every", "4", "--observe.mode", "full", "--metrics.tensorboard", "true"]
OP = ["--model.name", "op", "--model.attention_layers", "sink_logit,softpick,sigmoid,relu,clipped_softmax",
      "--model.n_layers", "5", "--optimizer.no_decay", "norm,bias,embedding,gain"]


def _layouts(tmp_path, args, one_rank_extra=(), rtol=1e-5):
    runs = {}
    for layout, (nproc, extra) in LAYOUTS.items():
        more = list(one_rank_extra) if layout == "one_rank" else []
        runs[layout] = train(tmp_path, *TINY, *STEPS, *args, *extra, *more, nproc=nproc, name=layout).check()
    base = runs["one_rank"].losses
    assert sorted(base) == list(range(1, 9))
    for layout in ("fsdp2", "fsdp2_tp2"):
        assert_losses_close(runs[layout].losses, base, rtol=rtol)
    assert base[8] < base[1] - 0.3, base
    return runs


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    # 5e-5: the 8-variant model's loss spikes at step 6 (7.80 -> 7.97) and amplifies FSDP 2 x TP 2's reduction-order
    # rounding (<= 2.4e-7 relative at steps 1-6) to 2.1e-5 at step 7 on an AVX-512 / AMX CPU (measured 2026-11-27;
    # the machine of earlier runs stayed under 1e-5; FSDP 2 alone stays within 1.3e-7 at every step).
    return _layouts(tmp_path_factory.mktemp("llama8"), LLAMA8, CHECKPOINTS + PROBE, rtol=5e-5)


def test_every_variant_trains_equally_on_1_rank_fsdp2_and_fsdp2_tp2(llama8):
    assert set(llama8) == set(LAYOUTS)


@pytest.mark.slow
@pytest.mark.extended
def test_op_variants_train_equally_on_1_rank_fsdp2_and_fsdp2_tp2(tmp_path):
    _layouts(tmp_path, OP)


@pytest.mark.slow
@pytest.mark.extended
def test_gpt2_style_variants_train_equally_on_1_rank_fsdp2_and_fsdp2_tp2(tmp_path):
    # learned positions, LayerNorm with biases, tied embeddings, GELU: the other pre_ln style
    _layouts(tmp_path, ["--model.n_layers", "8", "--model.attention_layers", ALL_NEW,
                        "--optimizer.no_decay", "norm,bias,embedding,sink"])


@pytest.mark.extended
def test_chunked_blocks_train_equally_on_1_rank_fsdp2_and_fsdp2_tp2(tmp_path):
    # 160 tokens: two query blocks of the chunked path (128 + 32 rows), recomputed in the backward, with the heads
    # split over TP ranks
    args = [*TINY, "--training.steps", "4", "--training.seq_len", "160", "--model.flavor", "debug_llama",
            "--model.n_layers", "4", "--model.attention_layers", "softpick,sigmoid,relu,clipped_softmax"]
    runs = {layout: train(tmp_path, *args, *extra, nproc=nproc, name=layout).check()
            for layout, (nproc, extra) in LAYOUTS.items()}
    base = runs["one_rank"].losses
    assert sorted(base) == [1, 2, 3, 4] and base[4] < base[1]
    for layout in ("fsdp2", "fsdp2_tp2"):
        assert_losses_close(runs[layout].losses, base, rtol=1e-5)


def test_sink_logits_and_gates_resume_exactly(tmp_path, llama8):
    whole = llama8["one_rank"]
    args = [*TINY, *STEPS, *LLAMA8, *CHECKPOINTS]
    first = train(tmp_path, *args, "--training.steps", "4").check()
    assert sorted(first.losses) == list(range(1, 5))
    resumed = train(tmp_path, *args).check()
    assert "resumed from" in resumed.stdout
    after = {s: v for s, v in resumed.losses.items() if s > 4}
    assert sorted(after) == list(range(5, 9))
    assert_losses_close(after, {s: whole.losses[s] for s in after}, rtol=1e-6)
    # the checkpoint holds the new parameters
    from torch.distributed.checkpoint import FileSystemReader
    keys = FileSystemReader(str(whole.run_dir / "checkpoints" / "step-8")).read_metadata().state_dict_metadata
    assert any(k.endswith("layers.0.attention.sink.weight") for k in keys), sorted(keys)[:20]
    assert any(k.endswith("layers.1.attention.wg.weight") for k in keys)


def test_new_metrics_reach_metrics_jsonl_and_tensorboard(llama8):
    run = llama8["one_rank"]
    probe = [r for r in run.records if "outliers/sink_rate" in r]
    assert [r["step"] for r in probe] == [4, 8], run.records[-1].keys()
    names = ("sink_rate", "massive_ratio", "massive_count", "residual_peak", "value_drain", "dormant_head_share")
    for k in names:
        assert f"outliers/{k}" in probe[-1] and all(f"outliers/layer_{i}/{k}" in probe[-1] for i in range(8))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(next((run.run_dir / "tb").glob("events.out.tfevents.*"))))
    acc.Reload()
    assert {f"outliers/{k}" for k in names} <= set(acc.Tags()["scalars"])
