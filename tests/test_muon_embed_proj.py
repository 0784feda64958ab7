"""model.embed_proj (Outlier-Safe Pre-Training's embedding projections, as the released code has them: one after
the embedding, one before the head, orthogonal at init): trains, and is folded into the embedding and the head on
export (HF and safetensors), so the export has the plain architecture and the same logits; the identity-initialised
single projection is a variant."""

import dataclasses

import pytest
import torch

from outlier_titan.config.manager import ConfigError
from outlier_titan.hf.export import export_model
from outlier_titan.hf.load import load_pretrained
from outlier_titan.models.embed_proj import fold_embed_proj, merge_embed_proj
from outlier_titan.models.init import Initializer
from outlier_titan.models.pre_ln.model import PreLNArgs, PreLNTransformer
from tests.launch import TINY, train


def _model(**kw):
    m = PreLNTransformer(PreLNArgs(dim=16, n_layers=1, n_heads=2, vocab_size=32, max_seq_len=8, **kw)).double()
    m.init_weights(Initializer(3, "cpu"))
    return m


def test_published_form_two_orthogonal_projections():
    m = _model(embed_proj=True)
    eye = torch.eye(16, dtype=torch.float64)
    for p in (m.embed_proj.weight, m.head_proj.weight):
        torch.testing.assert_close(p @ p.T, eye, rtol=0, atol=1e-6)  # orthogonal (drawn in float64, kept in fp32)
        assert not torch.allclose(p, eye)
    assert not torch.equal(m.embed_proj.weight, m.head_proj.weight)
    again = _model(embed_proj=True)  # drawn from the run's seed: the same at every layout / restart
    assert torch.equal(again.embed_proj.weight, m.embed_proj.weight)
    x = torch.randn(2, 8, 16, dtype=torch.float64)  # the forward: head(head_proj(norm(blocks(E P1ᵀ))))
    assert m.head_proj(x).shape == x.shape


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("head", [True, False])
def test_merge_and_fold_are_exact_in_float64(tie, head):
    plain = _model(tie_embeddings=tie)
    proj = _model(tie_embeddings=tie, embed_proj=True, embed_proj_head=head, embed_proj_init="identity")
    assert torch.equal(proj.embed_proj.weight, torch.eye(16, dtype=torch.float64))
    assert (proj.head_proj is not None) == head
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        assert torch.equal(plain(tokens), proj(tokens))  # identity at init: the plain model's function
        proj.embed_proj.weight.copy_(torch.randn(16, 16, generator=g))
        if head:
            proj.head_proj.weight.copy_(torch.randn(16, 16, generator=g))
        want = proj(tokens)
    state, args = merge_embed_proj(proj.state_dict(), proj.args)
    assert not args.embed_proj and not args.tie_embeddings
    assert "embed_proj.weight" not in state and "head_proj.weight" not in state
    merged = PreLNTransformer(args).double()
    merged.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(merged(tokens), want, rtol=1e-12, atol=1e-12)
        assert fold_embed_proj(proj) and proj.embed_proj is None and proj.head_proj is None
        torch.testing.assert_close(proj(tokens), want, rtol=1e-12, atol=1e-12)
    assert merge_embed_proj(plain.state_dict(), plain.args)[1] is plain.args
    assert not fold_embed_proj(plain)


def test_tensor_parallel_is_refused_with_a_config_error():
    from outlier_titan.models.spec import get_spec
    from outlier_titan.parallel.tensor_parallel import apply_tp_plan

    with pytest.raises(ConfigError, match="model.embed_proj.*parallelism.tp = 1"):
        apply_tp_plan(None, None, dataclasses.replace(PreLNArgs(), embed_proj=True), get_spec("pre_ln").tp_plan)


@pytest.mark.slow
def test_trains_with_muon_exports_merged_and_reimports_with_equal_logits(tmp_path):
    run = train(tmp_path, *TINY, "--training.steps", "3", "--checkpoint.enable", "true", "--model.n_layers", "2",
                "--training.seq_len", "32", "--model.embed_proj", "true", "--optimizer.name", "muon",
                "--optimizer.lr", "0.02").check()
    # 2 blocks x (wq, wk, wv, wo, w1, w2) + embed_proj + head_proj
    assert "optimizer split: muon 14 tensors" in run.stdout
    ours, _, _ = load_pretrained(run.run_dir)
    init = PreLNTransformer(ours.args)
    init.init_weights(Initializer(0, "cpu"))  # debug.toml's training.seed: the run's initial weights
    for name in ("embed_proj", "head_proj"):  # both trained
        assert not torch.equal(getattr(ours, name).weight, getattr(init, name).weight), name
    tokens = torch.randint(0, ours.args.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        want = ours(tokens)
    for fmt in ("hf", "safetensors"):
        got_fmt, _ = export_model(run.run_dir, tmp_path / fmt, fmt)
        assert got_fmt == fmt
        back, cfg, _ = load_pretrained(tmp_path / fmt)
        assert getattr(back, "embed_proj", None) is None and getattr(back, "head_proj", None) is None
        assert not cfg.model.tie_embeddings
        with torch.no_grad():
            assert (back(tokens) - want).abs().max().item() < 1e-5
