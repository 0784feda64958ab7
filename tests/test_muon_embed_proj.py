"""model.embed_proj (Outlier-Safe Pre-Training's embedding projection): identity at init, trains, and is
folded into the embedding on export (HF and safetensors), so the export has the plain architecture and the same
logits."""

import dataclasses

import pytest
import torch

from outlier_titan.config.manager import ConfigError
from outlier_titan.hf.export import export_model
from outlier_titan.hf.load import load_pretrained
from outlier_titan.models.embed_proj import merge_embed_proj
from outlier_titan.models.init import Initializer
from outlier_titan.models.pre_ln import PreLNArgs, PreLNTransformer
from tests.launch import TINY, train


def _model(**kw):
    m = PreLNTransformer(PreLNArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=8, **kw)).double()
    m.init_weights(Initializer(3, "cpu"))
    return m


@pytest.mark.parametrize("tie", [True, False])
def test_identity_at_init_and_merge_is_exact_in_float64(tie):
    plain, proj = _model(tie_embeddings=tie), _model(tie_embeddings=tie, embed_proj=True)
    assert torch.equal(proj.embed_proj.weight, torch.eye(16, dtype=torch.float64))
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(plain(tokens), proj(tokens))
        proj.embed_proj.weight.copy_(torch.randn(16, 16, generator=torch.Generator().manual_seed(1)))
        want = proj(tokens)
    state, args = merge_embed_proj(proj.state_dict(), proj.args)
    assert not args.embed_proj and not args.tie_embeddings and "embed_proj.weight" not in state
    merged = PreLNTransformer(args).double()
    merged.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), want, rtol=1e-12, atol=1e-12)
    assert merge_embed_proj(plain.state_dict(), plain.args)[1] is plain.args


def test_tensor_parallel_is_refused_with_a_config_error():
    from outlier_titan.models.pre_ln import _tp_plan

    with pytest.raises(ConfigError, match="model.embed_proj.*parallelism.tp = 1"):
        _tp_plan(None, None, dataclasses.replace(PreLNArgs(), embed_proj=True))


@pytest.mark.slow
def test_trains_with_muon_exports_merged_and_reimports_with_equal_logits(tmp_path):
    run = train(tmp_path, *TINY, "--training.steps", "3", "--checkpoint.enable", "true", "--model.n_layers", "2",
                "--training.seq_len", "32", "--model.embed_proj", "true", "--optimizer.name", "muon",
                "--optimizer.lr", "0.02").check()
    assert "optimizer split: muon 13 tensors" in run.stdout  # 2 blocks x (wq, wk, wv, wo, w1, w2) + embed_proj
    ours, _, _ = load_pretrained(run.run_dir)
    assert not torch.equal(ours.embed_proj.weight, torch.eye(128))  # it trained
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ours(tokens)
    for fmt in ("hf", "safetensors"):
        got_fmt, _ = export_model(run.run_dir, tmp_path / fmt, fmt)
        assert got_fmt == fmt
        back, cfg, _ = load_pretrained(tmp_path / fmt)
        assert getattr(back, "embed_proj", None) is None and not cfg.model.tie_embeddings
        with torch.no_grad():
            assert (back(tokens) - want).abs().max().item() < 1e-5
