"""Muon (optimizer.name = "muon"): one rank against torch.optim.Muon + torch.optim.AdamW split by hand, the
Newton-Schulz math against a plain float64 loop, the block layout's layout invariance (fake process group),
and block_periodic with muon_full_every = 1 against full."""

import copy

import pytest
import torch

from outlier_titan.config.job_config import Optimizer as OptimizerConfig
from outlier_titan.errors import UserError
from outlier_titan.models.pre_ln import PreLNArgs, PreLNTransformer
from outlier_titan.optim.builder import build_optimizer
from outlier_titan.optim.muon import MuonAdamW, muon_param_groups, newton_schulz, split_summary

STEPS = 20


def small_model(seed=0, **kw):
    torch.manual_seed(seed)
    args = PreLNArgs(dim=32, n_layers=2, n_heads=4, vocab_size=64, max_seq_len=16, **kw)
    return PreLNTransformer(args).double()


def loss_of(model, step):
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, 64, (4, 16), generator=g)
    logits = model(tokens[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def cfg_for(**kw):
    base = dict(name="muon", lr=2e-2, weight_decay=0.1, muon_adamw_lr=3e-3, muon_adamw_beta1=0.8,
                muon_adamw_beta2=0.97, muon_adamw_weight_decay=0.05, eps=1e-8)
    base.update(kw)
    return OptimizerConfig(**base)


def train(model, opts, steps=STEPS):
    losses = []
    for step in range(steps):
        for o in opts:
            o.zero_grad(set_to_none=True)
        loss = loss_of(model, step)
        loss.backward()
        for o in opts:
            o.step()
        losses.append(loss.item())
    return losses


def reference_opts(model, cfg):
    """torch.optim.Muon on the hidden matrices and torch.optim.AdamW on the rest, split by hand."""
    muon, decay, no_decay = [], [], []
    for name, p in model.named_parameters():
        hidden = p.ndim == 2 and name.startswith("layers.")
        if hidden:
            muon.append(p)
        elif "embeddings" in name or "norm" in name or name.endswith(".bias"):
            no_decay.append(p)
        else:
            decay.append(p)
    assert muon and no_decay
    opts = [torch.optim.Muon(muon, lr=cfg.lr, weight_decay=cfg.weight_decay, momentum=cfg.muon_momentum,
                             nesterov=cfg.muon_nesterov, ns_coefficients=tuple(cfg.muon_ns_coefficients),
                             eps=cfg.muon_eps, ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_adjust_lr_fn)]
    groups = [{"params": no_decay, "weight_decay": 0.0}]
    if decay:
        groups.append({"params": decay, "weight_decay": cfg.muon_adamw_weight_decay})
    opts.append(torch.optim.AdamW(groups, lr=cfg.muon_adamw_lr, betas=(cfg.muon_adamw_beta1, cfg.muon_adamw_beta2),
                                  eps=cfg.eps, foreach=True))
    return opts, len(muon)


@pytest.mark.parametrize("kw", [dict(), dict(muon_adjust_lr_fn="match_rms_adamw", muon_nesterov=False,
                                             muon_momentum=0.9, muon_ns_steps=3)])
@pytest.mark.parametrize("untied", [False, True])
def test_one_rank_equals_torch_muon_plus_adamw(kw, untied):
    cfg = cfg_for(**kw)
    model = small_model(tie_embeddings=not untied)
    ref = copy.deepcopy(model)
    opt = build_optimizer(model, cfg, seed=0)
    ref_opts, n_muon = reference_opts(ref, cfg)
    assert sum(len(g["params"]) for g in opt.param_groups if g["algorithm"] == "muon") == n_muon
    got, want = train(model, [opt]), train(ref, ref_opts)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-12
    assert want[-1] < want[0]
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert (p - q).abs().max().item() <= 1e-12, n
    if untied:
        names = {n for g in opt.param_groups if g["algorithm"] == "adamw" for n in g["names"]}
        assert "output.weight" in names and "tok_embeddings.weight" in names


def test_newton_schulz_equals_a_float64_loop_and_batches_per_matrix():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 8, 20, generator=g, dtype=torch.float64)
    a, b, c = 3.4445, -4.775, 2.0315

    def plain(m):
        tall = m.shape[0] > m.shape[1]
        y = m.T if tall else m
        y = y / max(torch.linalg.matrix_norm(y).item(), 1e-7)
        for _ in range(5):
            gram = y @ y.T
            y = a * y + (b * gram + c * gram @ gram) @ y
        return y.T if tall else y

    batched = newton_schulz(x, (a, b, c), 5, 1e-7, torch.float64)
    for i in range(3):
        torch.testing.assert_close(newton_schulz(x[i], (a, b, c), 5, 1e-7, torch.float64), plain(x[i]),
                                   rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(batched[i], plain(x[i]), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(newton_schulz(x[i].T, (a, b, c), 5, 1e-7, torch.float64), plain(x[i].T),
                                   rtol=1e-12, atol=1e-13)
    # the singular values land in the quintic's band around 1 (Jordan's coefficients: about 0.7..1.2)
    s = torch.linalg.svdvals(batched)
    assert s.min() > 0.5 and s.max() < 1.3


def test_split_and_summary():
    model = small_model(tie_embeddings=False)
    groups = muon_param_groups(model, cfg_for())
    assert [g["algorithm"] for g in groups] == ["muon", "adamw", "adamw"]
    assert set(groups[0]["names"]) == {f"layers.{i}.{m}.{w}.weight" for i in range(2)
                                       for m, ws in (("attention", "qkvo"), ("feed_forward", ("1", "2")))
                                       for w in (["w" + x for x in ws])}
    assert groups[1]["names"] == ["output.weight"]
    line = split_summary(groups)
    assert line.startswith("optimizer split: muon 12 tensors") and "lr 0.02" in line and "lr 0.003" in line


def test_bad_options_raise_user_errors():
    model = small_model()
    with pytest.raises(UserError, match="muon_layout"):
        build_optimizer(model, cfg_for(muon_layout="rows"), 0)
    with pytest.raises(UserError, match="muon_full_every"):
        build_optimizer(model, cfg_for(muon_layout="block_periodic", muon_full_every=0), 0)
    with pytest.raises(UserError, match="muon_ns_coefficients"):
        build_optimizer(model, cfg_for(muon_ns_coefficients=[1.0, 2.0]), 0)
    with pytest.raises(UserError, match="muon_ns_steps"):
        opt = build_optimizer(model, cfg_for(muon_ns_steps=0), 0)
        loss_of(model, 0).backward()
        opt.step()
