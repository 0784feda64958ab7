"""TWEO (Liang et al. 2025): the loss term against the paper's formula in float64 (value and gradient), a forward
whose term is not asked for (the probe's) is not counted, and bad options are one line."""

import pytest
import torch

from outlier_titan.config.job_config import Model as ModelConfig
from outlier_titan.config.manager import ConfigError, parse_args
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import model_args
from outlier_titan.remedies import RemedyContext
from outlier_titan.remedies.tweo import TWEO
from tests.launch import REPO

B, T = 3, 16


def setup(**remedies):
    spec, args = model_args(ModelConfig(name="pre_ln", flavor="debug"), 256, T)
    model = spec.build(args)
    model.init_weights(Initializer(0, "cpu"))
    model = model.double().train()
    cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), "--remedies.tweo", "true",
                      "--training.seq_len", str(T), *[f"--remedies.{k}={v}" for k, v in remedies.items()]])
    hooks = TWEO(model, cfg, RemedyContext(None, None, tokens_per_step=B * T))
    return model, cfg, hooks


def reference(outputs, weight, tau, p):
    """lambda * (1/L) sum_l mean((|A_l| / (tau + 1e-6))^p), as the paper writes it."""
    return weight * sum(((a.abs() / (tau + 1e-6)) ** p).mean() for a in outputs) / len(outputs)


@pytest.mark.parametrize("opts", [{}, {"tweo_weight": 0.5, "tweo_tau": 0.05, "tweo_p": 2.0}])
def test_the_term_is_the_papers_formula(opts):
    model, cfg, hooks = setup(**opts)
    kept = []
    for block in model.layers.values():
        block.register_forward_hook(lambda m, i, o: kept.append(o))
    tokens = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(1))
    model(tokens)
    term = hooks.loss_term()
    r = cfg.remedies
    ref = reference(kept, r.tweo_weight, r.tweo_tau, r.tweo_p)
    assert ref > 0
    torch.testing.assert_close(term, ref, rtol=1e-12, atol=0)
    w = model.layers["0"].feed_forward.w2.weight
    g, g_ref = torch.autograd.grad(term, w, retain_graph=True)[0], torch.autograd.grad(ref, w)[0]
    torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-30)
    assert g.abs().max() > 0


def test_a_forward_whose_term_is_not_asked_for_is_not_counted():
    model, cfg, hooks = setup(tweo_tau=0.1)
    tokens = torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(2))
    with torch.enable_grad():
        model(tokens.flip(0))  # e.g. the probe's forward with observe.gradients
    with torch.no_grad():
        model(tokens)  # validation
        assert hooks.outputs == []
    kept = []
    for block in model.layers.values():
        block.register_forward_hook(lambda m, i, o: kept.append(o))
    model(tokens)
    r = cfg.remedies
    torch.testing.assert_close(hooks.loss_term(), reference(kept, r.tweo_weight, r.tweo_tau, r.tweo_p))
    assert hooks.loss_term() is None  # asked twice: the outputs were used once


@pytest.mark.parametrize("key,value", [("tweo_weight", "-1"), ("tweo_tau", "0"), ("tweo_p", "-2")])
def test_bad_values_are_one_line(key, value):
    from outlier_titan.remedies import validate_remedies
    cfg = parse_args(["--config", str(REPO / "train_configs/debug.toml"), f"--remedies.{key}", value])
    with pytest.raises(ConfigError) as e:
        validate_remedies(cfg.remedies)
    assert "\n" not in str(e.value) and f"remedies.{key}" in str(e.value)
