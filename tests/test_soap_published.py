"""Our SOAP with whole axes (the default, ``tile_size = 0``) against a published implementation.

The published reference is ``pytorch_optimizer.SOAP`` (a maintained port of Vyas et al. 2024, arXiv 2409.11321,
nikhilvyas/SOAP; test extra). It is checked first against a dense float64 implementation of the paper's algorithm
(``DenseSOAP``), then our SOAP is trained beside it on a small model, on the same batches.

The port runs its refresh QR in float32 (its comment: bfloat16 support), so after the first refresh the two
differ by float32 rounding of the bases; before it they agree to float64 rounding.
"""

import numpy as np
import pytest
import torch

from outlier_titan.config.job_config import Optimizer as OptimizerConfig
from outlier_titan.optim.builder import build_optimizer, build_param_groups
from tests.small_model import learnable_batches, tiny_model, train_losses
from tests.test_optim_soap import HP, DenseSOAP

pytorch_optimizer = pytest.importorskip("pytorch_optimizer", reason="the published SOAP comes with '.[test]'")


def _port(params, f, wd=HP["wd"]):
    return pytorch_optimizer.SOAP(params, lr=HP["lr"], betas=(HP["b1"], HP["b2"]), eps=HP["eps"],
                                  weight_decay=wd, precondition_frequency=f, shampoo_beta=HP["sb"])


@pytest.mark.parametrize("f, atol", [(100, 1e-12), (4, 1e-6)])
def test_published_port_follows_the_papers_algorithm(f, atol):
    rng = np.random.default_rng(0)
    # square, so the first factors have full rank: numpy's and torch's eigh pick different bases of a null space
    w0 = rng.standard_normal((10, 10))
    ref = DenseSOAP(w0, HP["lr"], HP["b1"], HP["b2"], HP["eps"], HP["wd"], f, HP["sb"])
    p = torch.nn.Parameter(torch.tensor(w0))
    port = _port([p], f)
    for t in range(30):
        scale = np.exp(rng.standard_normal((10, 1))) * np.exp(rng.standard_normal((1, 10)))
        g = rng.standard_normal((10, 10)) * scale
        ref.step(g)
        p.grad = torch.tensor(g)
        port.step()
    np.testing.assert_allclose(p.detach().numpy(), ref.w, rtol=0, atol=atol)
    assert np.abs(ref.w - w0).max() > 1e-2  # it moved


@pytest.mark.parametrize("f, rtol", [(100, 1e-10), (10, 1e-6)])
def test_whole_axis_soap_trains_a_small_model_like_the_published_one(f, rtol):
    """f = 100: no refresh in 30 steps, so everything but the QR (whole-axis factors of every 2-D parameter, the
    vocabulary included; Adam on 1-D parameters; the first call that only initialises; bias correction; weight
    decay per group) must agree to float64 rounding. f = 10 (the published refresh): the port's float32 QR moves
    the bases of the factors' (near-)null spaces, which Adam's normalisation amplifies (8.5e-9 measured; 8.0e-4
    with a refresh every 4 steps); the losses stay within 1e-6."""
    batches = learnable_batches(30)
    cfg = OptimizerConfig(name="soap", lr=HP["lr"], beta1=HP["b1"], beta2=HP["b2"], eps=HP["eps"],
                          weight_decay=0.1, shampoo_beta=HP["sb"], precondition_frequency=f)
    assert cfg.tile_size == 0 and cfg.vocab_axis == "tile"  # the defaults are the published method
    ours_model, port_model = tiny_model(), tiny_model()
    ours = build_optimizer(ours_model, cfg, seed=0)
    for p, plan in ours.plans.items():  # one factor per whole axis of every 2-D parameter
        if p.ndim == 2:
            assert [a.tile for a in plan.axes] == list(p.shape) and plan.axes[0].rotate and plan.axes[1].rotate
    groups = build_param_groups(port_model, cfg)
    port = _port([{"params": gr["params"], "weight_decay": gr["weight_decay"]} for gr in groups], f=f)
    a, b = train_losses(ours_model, ours, batches), train_losses(port_model, port, batches)
    assert a[1] == b[1]  # the first call only initialises the preconditioner, in both
    np.testing.assert_allclose(a[:6], b[:6], rtol=1e-10)  # before the first refresh
    np.testing.assert_allclose(a, b, rtol=rtol)
    assert a[-1] < a[0] - 0.5
