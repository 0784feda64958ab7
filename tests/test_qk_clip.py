"""MaxLogit and QK-Clip (Kimi Team 2025, Kimi K2, arXiv 2507.20534) against float64 references written from the
paper's formulas: the chunked MaxLogit, the probe's metric, the per-head clip factors (GQA included), the clip on a
batch (its logits then peak at tau), and training at a high learning rate with and without the clip."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import outlier_titan.components  # noqa: F401
from outlier_titan.config.job_config import JobConfig, Model, Observe
from outlier_titan.errors import ConfigError
from outlier_titan.models.attention import max_logits
from outlier_titan.models.init import Initializer
from outlier_titan.models.layers import Attention
from outlier_titan.models.registry import model_args
from outlier_titan.observe.maxlogit import MAX_LOGIT
from outlier_titan.observe.probe import OutlierProbe
from outlier_titan.remedies import Remedies, RemedyContext, validate_remedies
from outlier_titan.remedies.qk_clip import clip_factors

CTX = RemedyContext(dp_group=None, tp_group=None, tokens_per_step=0)


def reference_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """S_max[b, h] = max_{j <= i} scale * q_i . k_j, pair by pair in float64."""
    b, h, t, _ = q.shape
    out = torch.full((b, h), -math.inf, dtype=torch.float64)
    for i in range(t):
        for j in range(i + 1):
            out = torch.maximum(out, scale * (q[:, :, i].double() * k[:, :, j].double()).sum(-1))
    return out


def build(seed=0, **overrides):
    spec, args = model_args(Model(name="pre_ln", flavor="debug", **overrides), vocab_size=256, seq_len=32)
    m = spec.build(args)
    m.init_weights(Initializer(seed, "cpu"))
    return m


def tokens(b=4, t=32, seed=0):
    return torch.randint(0, 256, (b, t), generator=torch.Generator().manual_seed(seed))


def attention_inputs(model, tok) -> list[torch.Tensor]:
    """Each Attention's input on ``tok``."""
    xs = []
    handles = [m.register_forward_pre_hook(lambda _m, args: xs.append(args[0].detach()))
               for m in model.modules() if isinstance(m, Attention)]
    with torch.no_grad():
        model(tok)
    for h in handles:
        h.remove()
    return xs


def reference_layers(model, xs) -> list[torch.Tensor]:
    """Per layer, the float64 reference MaxLogit [H] over the batch of the q, k its Attention makes of ``xs``."""
    out = []
    with torch.no_grad():
        for m, x in zip((m for m in model.modules() if isinstance(m, Attention)), xs):
            q, k, _ = m.project_qkv(x)
            out.append(reference_max_logits(q, k.repeat_interleave(q.shape[1] // k.shape[1], dim=1),
                                            q.shape[-1] ** -0.5).amax(0))
    return out


def captured_logit_max(model, tok) -> list[torch.Tensor]:
    return reference_layers(model, attention_inputs(model, tok))


def test_chunked_max_logits_equal_the_pairwise_formula():
    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 3, 11, 4, generator=g, dtype=torch.float64), torch.randn(2, 3, 11, 4, generator=g,
                                                                                       dtype=torch.float64)
    want = reference_max_logits(q, k, 0.7)
    for rows in (1, 3, 11, 128):  # blocks of query rows: any split gives the same maxima
        torch.testing.assert_close(max_logits(q, k, 0.7, rows=rows), want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kv", [None, 2])
def test_the_probe_metric_is_the_largest_head_logit_per_layer_and_over_layers(kv):
    model = build(n_heads=4, n_kv_heads=kv).double()
    tok = tokens()
    want = captured_logit_max(model, tok)
    scalars, _ = OutlierProbe(model, Observe(mode="full")).run(tok)
    for i, w in enumerate(want):
        assert scalars[f"outliers/layer_{i}/max_logit"] == pytest.approx(float(w.max()), rel=1e-10)
    assert scalars["outliers/max_logit"] == pytest.approx(max(float(w.max()) for w in want), rel=1e-10)
    assert MAX_LOGIT(torch.stack([w, w]).float())["max_logit"] == pytest.approx(float(want[-1].max()), rel=1e-6)
    # two batches pool by max, not by sum
    probe = OutlierProbe(model, Observe(mode="full"))
    both, _ = probe.measure([tok[:2], tok[2:]])
    assert both["outliers/max_logit"] == pytest.approx(scalars["outliers/max_logit"], rel=1e-10)


def test_clip_factors_scale_each_heads_logits_by_its_own_gamma():
    tau = 100.0
    s = torch.tensor([50.0, 200.0, 400.0, 100.0], dtype=torch.float64)
    gamma = torch.tensor([1.0, 0.5, 0.25, 1.0], dtype=torch.float64)  # min(1, tau / S_max)
    q, k = clip_factors(s, tau, n_kv_heads=4)  # MHA: the paper's sqrt(gamma) on both
    torch.testing.assert_close(q, gamma.sqrt(), rtol=0, atol=1e-15)
    torch.testing.assert_close(k, gamma.sqrt(), rtol=0, atol=1e-15)
    q, k = clip_factors(s, tau, n_kv_heads=2)  # GQA: heads (0, 1) share key 0, (2, 3) key 1
    torch.testing.assert_close(q * k.repeat_interleave(2), gamma, rtol=0, atol=1e-15)
    torch.testing.assert_close(k, torch.tensor([0.5, 0.25], dtype=torch.float64).sqrt(), rtol=0, atol=1e-15)
    q, k = clip_factors(s, tau, n_kv_heads=1)  # MQA
    torch.testing.assert_close(q * k, gamma, rtol=0, atol=1e-15)


def _qk_clip_config(tau: float) -> JobConfig:
    cfg = JobConfig()
    cfg.remedies.qk_clip, cfg.remedies.qk_clip_tau = True, tau
    return cfg


@pytest.mark.parametrize("overrides", [dict(n_heads=4), dict(n_heads=4, n_kv_heads=2, bias=True)],
                         ids=["mha", "gqa_bias"])
def test_after_the_clip_the_batch_logits_peak_at_tau(overrides):
    model = build(**overrides).double()
    tok = tokens()
    xs = attention_inputs(model, tok)
    before = torch.stack(reference_layers(model, xs))  # [L, H]
    mid = before.flatten().sort().values[before.numel() // 2 - 1:before.numel() // 2 + 1]
    tau = float(mid.mean())  # half the heads above it, none at it: a head exactly at tau is a float tie
    remedies = Remedies(model, _qk_clip_config(tau), CTX)
    model(tok)  # the step's training forward (grad enabled) records the MaxLogit
    remedies.after_step()
    after = torch.stack(reference_layers(model, xs))  # each layer on the same input (the clip changes later ones')
    clipped = before > tau
    assert bool(clipped.any()) and not bool(clipped.all())
    torch.testing.assert_close(after[clipped], torch.full_like(after[clipped], tau), rtol=1e-9, atol=0)
    torch.testing.assert_close(after[~clipped], before[~clipped], rtol=1e-9, atol=0)
    assert remedies.scalars() == {"remedies/qk_clip_max_logit": pytest.approx(float(before.max()), rel=1e-6),
                                  "remedies/qk_clip_heads": float(clipped.sum())}
    remedies.close()


def _train(clip: bool, tau: float, optimizer: str = "adamw", lr: float = 3e-2) -> list[float]:
    """MaxLogit (the metric on the step's batch) after each of 12 steps at a high learning rate."""
    torch.manual_seed(0)
    model = build(n_heads=4)
    cfg = _qk_clip_config(tau)
    remedies = Remedies(model, cfg, CTX) if clip else None
    if optimizer == "muon":
        from outlier_titan.config.job_config import Optimizer
        from outlier_titan.optim.builder import build_optimizer
        opt = build_optimizer(model, Optimizer(name="muon", lr=lr, weight_decay=0.0), seed=0)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    seen = []
    for step in range(12):
        x = tokens(seed=step)
        loss = torch.nn.functional.cross_entropy(model(x)[:, :-1].flatten(0, 1), x[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if remedies is not None:
            remedies.after_step()
        seen.append(metric_max_logit(model, x))
    return seen


def metric_max_logit(model, x) -> float:
    """The MaxLogit metric's direct form on each layer's logits of ``x`` (what the probe logs as
    ``outliers/max_logit``, without the probe's other metrics), any training remedy's hook put back."""
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    saved, seen = [m.logit_hook for m in layers], []
    for m in layers:
        m.logit_hook = seen.append
    with torch.no_grad():
        model(x)
    for m, hook in zip(layers, saved):
        m.logit_hook = hook
    return max(MAX_LOGIT(lg)["max_logit"] for lg in seen)


# measured: AdamW plain peaks at 16.5 (5.5 tau), clipped at 4.2 (1.4 tau); Muon plain 0.90 (2.25 tau), clipped 0.66
# (1.65 tau): Muon's update has a fixed spectral size, so one update regrows a clipped head by more
@pytest.mark.parametrize("optimizer,lr,tau,bound", [("adamw", 1e-2, 3.0, 1.5), ("muon", 0.05, 0.4, 1.75)])
def test_high_lr_training_exceeds_tau_and_qk_clip_holds_the_max_logit_near_it(optimizer, lr, tau, bound):
    """The paper clips with the S_max of the step's forward, measured before the update that follows, so the next
    forward may exceed tau by one update's growth; the clip then pulls it back (exactness on the batch it measured
    is ``test_after_the_clip_the_batch_logits_peak_at_tau``)."""
    plain = _train(False, tau, optimizer, lr)
    assert max(plain) > 2 * tau, plain  # without the clip the MaxLogit keeps growing past tau
    clipped = _train(True, tau, optimizer, lr)
    assert max(clipped) <= bound * tau and clipped[-1] < 0.6 * plain[-1], (clipped, plain)


def test_bad_settings_are_one_line_errors():
    cfg = _qk_clip_config(0.0)
    with pytest.raises(ConfigError, match="remedies.qk_clip_tau must be > 0"):
        validate_remedies(cfg.remedies)
    with pytest.raises(ConfigError, match="normalised"):
        Remedies(build(qk_norm=True), _qk_clip_config(100.0), CTX)
