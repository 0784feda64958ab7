"""The activation anatomy (observe/anatomy.py, scripts/anatomy.py): large entries attributed to positions, tokens
and channels, checked on constructed activations and on a model with planted outliers; over a real run's
checkpoints."""

from __future__ import annotations

import json

import pytest
import torch

from outlier_titan.observe.anatomy import LayerAnatomy, markdown, persistence, residual_anatomy
from tests.test_evaluate import debug_model, load_script


def test_counts_and_attributions_on_constructed_activations():
    x = torch.full((2, 4, 8), 0.5)
    x[0, 0, 3] = 100.0    # position 0, channel 3: 200 x the median 0.5
    x[1, 2, 5] = -80.0    # position 2 (token 7), channel 5: sign does not matter
    x[1, 3, 5] = 60.0     # position 3 (token 7), channel 5
    x[1, 1, 6] = 40.0     # 80 x the median: not large at factor 100
    tokens = torch.tensor([[1, 2, 3, 4], [9, 8, 7, 7]])
    a = LayerAnatomy(dim=8, vocab=10, top_k=3)
    a.add(x, tokens)
    s = a.summary(decode=lambda i: f"t{i}")
    assert s["large"] == 3 and s["per_sequence"] == 1.5 and s["max_abs"] == 100.0
    assert s["first_position_share"] == pytest.approx(1 / 3)
    assert [(c["channel"], c["count"]) for c in s["channels"]] == [(5, 2), (3, 1)]
    assert s["channels"][0]["share"] == pytest.approx(2 / 3) and s["channels"][0]["max_abs"] == 80.0
    assert s["top_channel_share"] == pytest.approx(1.0)
    assert [(t["token"], t["count"]) for t in s["busiest_tokens"]] == [("t7", 2)]  # position 0 is not a token's
    assert [(e["abs"], e["sequence"], e["position"], e["token"], e["channel"]) for e in s["top"]] == [
        (100.0, 0, 0, "t1", 3), (80.0, 1, 2, "t7", 5), (60.0, 1, 3, "t7", 5)]
    # a second batch: sequences are numbered on, the top list is merged, the counts add up
    y = torch.full((1, 4, 8), 1.0)
    y[0, 1, 2] = 500.0
    a.add(y, torch.tensor([[0, 4, 4, 4]]))
    s = a.summary()
    assert s["large"] == 4 and s["sequences"] == 3 and s["tokens"] == 12
    assert (s["top"][0]["abs"], s["top"][0]["sequence"], s["top"][0]["channel"]) == (500.0, 2, 2)
    assert len(s["top"]) == 3


def test_planted_outlier_channel_and_token_are_found_in_every_block():
    model = debug_model()  # pre_ln, vocab 256
    with torch.no_grad():
        model.tok_embeddings.weight[:, 11] = 0.0
        model.tok_embeddings.weight[42, 11] = 400.0  # token 42 carries a huge channel 11 into the residual stream
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 256, (4, 16), generator=g) for _ in range(2)]
    for b in batches:
        b[:, 5] = 42
    out = residual_anatomy(model, batches, 256, decode=lambda i: f"t{i}")
    assert list(out) == list(model.layers.keys())
    for block, a in out.items():
        assert a["channels"][0]["channel"] == 11 and a["channels"][0]["share"] > 0.9, (block, a["channels"])
        assert a["busiest_tokens"][0]["token"] == "t42", block
        assert a["top"][0]["channel"] == 11 and a["top"][0]["token"] == "t42"
        assert a["sequences"] == 8 and a["max_abs"] > 100


def test_persistence_follows_channels_over_checkpoints():
    def step(shares):
        return {"layers.0": {"channels": [{"channel": c, "share": s} for c, s in shares.items()]}}

    by_step = {100: step({3: 0.02}), 200: step({3: 0.5, 9: 0.3}), 300: step({3: 0.9})}
    rows = persistence(by_step)["layers.0"]
    assert rows == [{"channel": 3, "first_step": 200, "at_last": True, "shares": [0.02, 0.5, 0.9]},
                    {"channel": 9, "first_step": 200, "at_last": False, "shares": [0.0, 0.3, 0.0]}]
    for s in by_step.values():
        s["layers.0"].update(max_abs=1.0, per_sequence=0.0, first_position_share=0.0, busiest_tokens=[])
    text = markdown(by_step, 100)
    assert "| layers.0 | 9 | 200 | no | 0% / 30% / 0% |" in text


@pytest.mark.slow
def test_anatomy_script_over_a_runs_checkpoints(tmp_path, capsys):
    from tests.launch import TINY, train

    run = train(tmp_path, *TINY, "--training.steps", "4", "--checkpoint.enable", "true", "--checkpoint.interval",
                "2", "--checkpoint.keep_latest_k", "0").check()
    tool = load_script("anatomy")
    assert tool.main([str(run.run_dir), "--tokens", "256", "--batch-size", "2"]) == 0
    out = capsys.readouterr().out
    data = json.loads((run.run_dir / "anatomy.json").read_text())
    assert sorted(data["steps"]) == ["2", "4"] and data["factor"] == 100.0
    blocks = data["steps"]["4"]
    assert blocks and all(a["sequences"] == 4 for a in blocks.values())  # 256 tokens = 4 sequences of 64
    assert "| 2 | 0 |" in out and "| 4 | 3 |" in out  # step, block
    assert (run.run_dir / "anatomy.md").read_text() in out + "\n"
    # one checkpoint; bad input is a one-line error with exit code 2
    assert tool.main([str(run.run_dir / "checkpoints" / "step-2"), "--tokens", "64", "--out",
                      str(tmp_path / "a.md")]) == 0
    capsys.readouterr()
    assert tool.main([str(run.run_dir), "--steps", "3"]) == 2
    assert "no checkpoint at step 3" in capsys.readouterr().err
    assert tool.main([str(tmp_path / "nothing")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
