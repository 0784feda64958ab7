"""V-scale and head-wise RMSNorm train through train.py with equal losses on 1 rank, FSDP 2 and FSDP 2 x TP 2 (gloo;
pre_ln; op on 1 rank and FSDP 2 x TP 2;
their per-head parameters sharded with the heads under TP), and their parameters survive the checkpoint."""

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from outlier_titan.config.job_config import Model as ModelConfig
from outlier_titan.models.registry import model_args
from tests.launch import LAYOUTS, TINY, assert_losses_close, train

pytestmark = pytest.mark.dist

CHECKPOINT = ["--checkpoint.enable", "true", "--checkpoint.interval", "20", "--checkpoint.keep_latest_k", "1"]


def test_v_scale_and_head_norm_train_equally_on_1_rank_fsdp2_and_fsdp2_tp2(tmp_path):
    options = ["--model.flavor", "debug_llama", "--model.v_scale", "on", "--model.head_norm", "on",
               "--optimizer.no_decay", "norm,bias,embedding,v_scale"]
    runs = {layout: train(tmp_path, *TINY, *options, *extra, *(CHECKPOINT if layout == "fsdp2_tp2" else []),
                          nproc=nproc, name=layout).check()
            for layout, (nproc, extra) in LAYOUTS.items()}
    base = runs["one_rank"].losses
    assert sorted(base) == list(range(1, 21))
    for layout in ("fsdp2", "fsdp2_tp2"):
        assert_losses_close(runs[layout].losses, base, rtol=1e-4)
    assert sum(base[s] for s in range(16, 21)) / 5 < base[1] - 0.3, base

    # the TP-sharded checkpoint holds the full parameters, moved off their init, and loads into a 1-rank model
    out = tmp_path / "final.pt"
    dcp_to_torch_save(runs["fsdp2_tp2"].run_dir / "checkpoints" / "step-20", out)
    weights = torch.load(out, weights_only=False)["model"]
    theta, gain = weights["layers.0.attention.v_scale.theta"], weights["layers.0.attention.head_norm.weight"]
    assert theta.shape == (2,) and gain.shape == (128,)
    assert theta.abs().min() > 0 and (gain - 1).abs().max() > 0
    spec, args = model_args(ModelConfig(name="pre_ln", flavor="debug_llama", v_scale="on", head_norm="on"),
                            weights["tok_embeddings.weight"].shape[0], 64)
    spec.build(args).load_state_dict(weights, strict=True)


@pytest.mark.extended
def test_the_op_block_with_both_steps_trains_equally_on_1_rank_and_fsdp2_tp2(tmp_path):
    options = ["--model.name", "op", "--model.v_scale", "on", "--model.head_norm", "on"]
    runs = {layout: train(tmp_path, *TINY, *options, *extra, nproc=nproc, name=layout).check()
            for layout, (nproc, extra) in LAYOUTS.items() if layout != "fsdp2"}
    assert_losses_close(runs["fsdp2_tp2"].losses, runs["one_rank"].losses, rtol=1e-4)
