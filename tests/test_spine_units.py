"""Unit tests of spine pieces: LR schedules, parameter groups, optimizers, grad clipping, MFU lookup, FSDP dims."""

import math

import pytest
import torch

from outlier_titan.config.job_config import LRScheduler, Model, Optimizer
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import count_params, model_args
from outlier_titan.observe.logger import Throughput, peak_flops
from outlier_titan.optim.builder import build_optimizer, build_param_groups
from outlier_titan.optim.lr_schedule import build_lr_scheduler, lr_factor
from outlier_titan.models.roles import DEFAULT_ROLES
from outlier_titan.models.roles import shard_dim_for
from outlier_titan.parallel.grads import clip_grads, grad_norm


def tiny_model(**kw):
    spec, args = model_args(Model(name="pre_ln", flavor="debug", **kw), vocab_size=256, seq_len=16)
    m = spec.build(args)
    m.init_weights(Initializer(0, "cpu"))
    return m


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant", "wsd"])
def test_schedules_warm_up_then_decay_to_the_floor(decay):
    cfg = LRScheduler(warmup_steps=10, decay=decay, min_lr_ratio=0.1, decay_ratio=0.2)
    f = [lr_factor(s, cfg, 100) for s in range(1, 101)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)  # linear warm-up from 1/warmup
    assert all(0.1 - 1e-12 <= x <= 1.0 for x in f)
    if decay == "constant":
        assert f[-1] == 1.0
    else:
        assert f[-1] == pytest.approx(0.1)
    if decay == "cosine":
        assert f[54] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 45 / 90)))
    if decay == "linear":
        assert f[54] == pytest.approx(0.1 + 0.9 * (1 - 45 / 90))
    if decay == "wsd":
        assert f[79] == 1.0 and f[80] < 1.0  # stable until the last 20%


def test_lambda_lr_applies_factor_of_each_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    cfg = LRScheduler(warmup_steps=4, decay="linear", min_lr_ratio=0.0)
    sched = build_lr_scheduler(opt, cfg, 8)
    seen = []
    for _ in range(8):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * lr_factor(s, cfg, 8) for s in range(1, 9)])


def test_param_groups_exclude_norms_biases_embeddings_by_class():
    m = tiny_model()
    groups = build_param_groups(m, Optimizer())
    decay, no_decay = groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(n.endswith("weight") and ("attention.w" in n or "feed_forward.w" in n) for n in decay["names"])
    assert "tok_embeddings.weight" in no_decay["names"] and "layers.0.attention_norm.weight" in no_decay["names"]
    assert "layers.0.attention.wq.bias" in no_decay["names"]
    assert sum(p.numel() for g in groups for p in g["params"]) == count_params(m)
    only_norm = build_param_groups(m, Optimizer(no_decay=["norm"]))
    assert "tok_embeddings.weight" in only_norm[0]["names"]


@pytest.mark.parametrize("name, extra", [("adamw", {}), ("adam", {}), ("sgd", {"momentum": True}),
                                         ("sgd", {"momentum": False}), ("rmsprop", {})])
def test_every_builtin_optimizer_lowers_the_loss(name, extra):
    torch.manual_seed(0)
    m = tiny_model()
    lr = {"sgd": 0.03 if extra.get("momentum") else 0.1, "rmsprop": 1e-3}.get(name, 3e-3)
    opt = build_optimizer(m, Optimizer(name=name, lr=lr, **extra), seed=0)
    x = torch.randint(0, 256, (4, 16))
    losses = []
    for _ in range(10):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    if name == "sgd":
        assert opt.param_groups[0]["momentum"] == (0.9 if extra["momentum"] else 0.0)


def test_grad_norm_and_clip_match_torch():
    m1, m2 = tiny_model(), tiny_model()
    x = torch.randint(0, 256, (2, 16))
    for m in (m1, m2):
        torch.nn.functional.cross_entropy(m(x).flatten(0, 1), x.flatten()).backward()
    ref = torch.nn.utils.clip_grad_norm_(list(m1.parameters()), 0.5)
    params = list(m2.parameters())
    norm = grad_norm(params)
    clip_grads(params, 0.5, norm)
    assert norm.item() == pytest.approx(ref.item(), rel=1e-6)
    for a, b in zip(m1.parameters(), m2.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-8)


def test_mfu_peak_lookup_and_cpu_reports_no_mfu():
    assert peak_flops(torch.device("cpu")) is None
    tp = Throughput(flops_per_token=6e9, device=torch.device("cpu"), world_size=2)
    tp.add(1000)
    out = tp.read()
    assert "mfu" not in out and out["tokens_per_second_per_device"] == pytest.approx(out["tokens_per_second"] / 2)
    tp.peak = 1e15  # what a known GPU would give: MFU = flops/token x tokens/s/device / peak
    tp.add(1000)
    out = tp.read()
    assert out["mfu"] == pytest.approx(100 * 6e9 * out["tokens_per_second_per_device"] / 1e15)


def test_fsdp_keeps_the_residual_axis_whole():
    w = torch.nn.Parameter(torch.empty(4, 4))
    assert shard_dim_for("layers.0.attention.wo.weight", w, DEFAULT_ROLES) == 1
    assert shard_dim_for("layers.3.feed_forward.w2.weight", w, DEFAULT_ROLES) == 1
    assert shard_dim_for("layers.3._checkpoint_wrapped_module.feed_forward.w2.weight", w, DEFAULT_ROLES) == 1
    for name in ("layers.0.attention.wq.weight", "layers.0.feed_forward.w1.weight", "tok_embeddings.weight",
                 "output.weight"):
        assert shard_dim_for(name, w, DEFAULT_ROLES) == 0
    assert shard_dim_for("layers.0.attention.wo.bias", torch.nn.Parameter(torch.empty(4)), DEFAULT_ROLES) == 0
