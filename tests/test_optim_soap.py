"""SOAP on the tile engine against a plain dense float64 implementation of the published algorithm.

The reference below is written from the paper (Vyas et al. 2024, arXiv 2409.11321, Algorithm 1), in numpy,
with the paper's form of the first moment (an EMA of the raw gradient in the original basis, projected
every step), which is mathematically equal to the official code's rotated-basis momentum.
"""

import numpy as np
import pytest
import torch

from outlier_titan.errors import CheckpointError
from outlier_titan.optim.soap import SOAP
from outlier_titan.optim.tiles.options import EngineOptions


def _eig_desc(p):
    w, q = np.linalg.eigh(p + 1e-30 * np.eye(p.shape[0]))
    return q[:, ::-1]


class DenseSOAP:
    """One matrix, both factors, official order of operations (refresh when (t + offset) % f == 0)."""

    def __init__(self, w, lr, b1, b2, eps, wd, f, sb, offset=0):
        self.w = w.copy()
        self.lr, self.b1, self.b2, self.eps, self.wd, self.f, self.sb = lr, b1, b2, eps, wd, f, sb
        self.offset = offset
        m, n = w.shape
        self.L, self.R = np.zeros((m, m)), np.zeros((n, n))
        self.M, self.V = np.zeros((m, n)), np.zeros((m, n))
        self.t = 0
        self.QL = self.QR = None

    def step(self, g):
        if self.QL is None:  # first call: factors and eigh bases only
            self.L = (1 - self.sb) * g @ g.T
            self.R = (1 - self.sb) * g.T @ g
            self.QL, self.QR = _eig_desc(self.L), _eig_desc(self.R)
            return
        self.t += 1
        t = self.t
        gh = self.QL.T @ g @ self.QR
        self.M = self.b1 * self.M + (1 - self.b1) * g
        self.V = self.b2 * self.V + (1 - self.b2) * gh * gh
        n = (self.QL.T @ self.M @ self.QR) / (np.sqrt(self.V) + self.eps)
        step_size = self.lr * np.sqrt(1 - self.b2 ** t) / (1 - self.b1 ** t)
        self.w = self.w - step_size * (self.QL @ n @ self.QR.T)
        self.w = self.w - self.lr * self.wd * self.w
        self.L = self.sb * self.L + (1 - self.sb) * g @ g.T
        self.R = self.sb * self.R + (1 - self.sb) * g.T @ g
        if (t + self.offset) % self.f == 0:
            est = np.diag(self.QL.T @ self.L @ self.QL)
            order = np.argsort(-est, kind="stable")
            self.V = self.V[order, :]
            self.QL = np.linalg.qr(self.L @ self.QL[:, order])[0]
            est = np.diag(self.QR.T @ self.R @ self.QR)
            order = np.argsort(-est, kind="stable")
            self.V = self.V[:, order]
            self.QR = np.linalg.qr(self.R @ self.QR[:, order])[0]


HP = dict(lr=3e-3, b1=0.95, b2=0.95, eps=1e-8, wd=0.01, f=4, sb=0.9)


def _soap(params, names, tile, stagger=True, **options):
    return SOAP([{"params": params, "names": names, "weight_decay": HP["wd"]}], lr=HP["lr"],
                betas=(HP["b1"], HP["b2"]), eps=HP["eps"], precondition_frequency=HP["f"],
                shampoo_beta=HP["sb"], stagger=stagger, options=EngineOptions(tile_size=tile, **options))


def _grads(shape, n, seed):
    g = torch.Generator().manual_seed(seed)
    # An anisotropic scale per row and column, so the factors have distinct eigenvalues; it is redrawn every
    # 7 steps, so the eigen-directions change their order and the refresh's sort really permutes v.
    out = []
    for k in range(n):
        if k % 7 == 0:
            rows = torch.rand(shape[0], 1, generator=g, dtype=torch.float64) * 3 + 0.1
            cols = torch.rand(1, shape[1], generator=g, dtype=torch.float64) * 3 + 0.1
        out.append(rows * cols * torch.randn(*shape, generator=g, dtype=torch.float64))
    return out


def test_single_tile_matches_dense_reference_over_30_steps():
    # Square, so that the first factors are full rank and their eigenbases unique (up to signs, which Adam
    # in the rotated basis does not see); a rank-deficient factor's null-space basis is arbitrary.
    shape = (10, 10)
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = _soap([p], ["layers.0.attention.wq.weight"], tile=16)
    ref = DenseSOAP(w0.numpy(), **HP)
    for g in _grads(shape, 31, seed=2):
        p.grad = g.clone()
        opt.step()
        ref.step(g.numpy())
    assert ref.t == 30
    np.testing.assert_allclose(p.detach().numpy(), ref.w, rtol=0, atol=1e-10)
    assert not np.allclose(ref.w, w0.numpy(), atol=1e-3)  # it moved


def test_multi_tile_with_stagger_matches_per_tile_reference():
    shape, tile = (12, 8), 4   # 3 x 2 square tiles; tile k = 2 i + j refreshes when (t + k) % f == 0
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = _soap([p], ["layers.0.feed_forward.w1.weight"], tile=tile)
    blocks = {(i, j): (slice(4 * i, 4 * i + 4), slice(4 * j, 4 * j + 4)) for i in range(3) for j in range(2)}
    refs = {ij: DenseSOAP(w0.numpy()[rs, cs], **HP, offset=ij[0] * 2 + ij[1]) for ij, (rs, cs) in blocks.items()}
    for g in _grads(shape, 13, seed=4):
        p.grad = g.clone()
        opt.step()
        for ij, r in refs.items():
            r.step(g.numpy()[blocks[ij]])
    for ij, r in refs.items():
        np.testing.assert_allclose(p.detach().numpy()[blocks[ij]], r.w, rtol=0, atol=1e-10)


def test_ragged_tiles_equal_separate_single_tile_parameters():
    """Tiles are independent: a 10 x 7 weight on a 4-grid (ragged last tiles 2 and 3) updates exactly like
    its six blocks optimized as separate parameters, each a single tile."""
    shape, tile = (10, 7), 4
    w0 = torch.randn(*shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    p = torch.nn.Parameter(w0.clone())
    opt = _soap([p], ["layers.0.feed_forward.w1.weight"], tile=tile, stagger=False)
    rows, cols = [slice(0, 4), slice(4, 8), slice(8, 10)], [slice(0, 4), slice(4, 7)]
    parts = [torch.nn.Parameter(w0[r, c].clone()) for r in rows for c in cols]
    names = [f"block{k}.weight" for k in range(len(parts))]
    sep = _soap(parts, names, tile=tile, stagger=False)
    for g in _grads(shape, 12, seed=6):
        p.grad = g.clone()
        for part, (r, c) in zip(parts, [(r, c) for r in rows for c in cols]):
            part.grad = g[r, c].clone()
        opt.step()
        sep.step()
    for part, (r, c) in zip(parts, [(r, c) for r in rows for c in cols]):
        torch.testing.assert_close(p.detach()[r, c], part.detach(), rtol=0, atol=1e-12)


def test_vocab_axis_identity_has_no_factor_and_first_call_does_not_update():
    p = torch.nn.Parameter(torch.randn(16, 8, dtype=torch.float64))
    w0 = p.detach().clone()
    assert "L" in _soap([p], ["tok_embeddings.weight"], tile=8).state[p]  # rotated by default, as published
    opt = _soap([p], ["tok_embeddings.weight"], tile=8, vocab_axis="identity")
    assert set(opt.state[p]) >= {"R", "QR"} and "L" not in opt.state[p]
    p.grad = torch.randn_like(p)
    opt.step()
    assert torch.equal(p.detach(), w0)
    p.grad = torch.randn_like(p)
    opt.step()
    assert not torch.equal(p.detach(), w0)


def test_nonfinite_gradient_skips_the_step_and_keeps_factors_clean():
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    opt = _soap([p], ["layers.0.attention.wo.weight"], tile=8)
    p.grad = torch.randn_like(p)
    opt.step()
    before = {k: v.clone() for k, v in opt.state[p].items()}
    w = p.detach().clone()
    bad = torch.randn_like(p)
    bad[3, 4] = float("nan")
    p.grad = bad
    opt.step()
    assert opt.skipped_steps == 1
    assert torch.equal(p.detach(), w)
    for k, v in opt.state[p].items():
        assert torch.equal(v, before[k]), k


def test_spec_mismatch_on_load_raises():
    p = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    opt = _soap([p], ["layers.0.attention.wo.weight"], tile=8)
    sd = opt.state_dict()
    q = torch.nn.Parameter(torch.randn(8, 8, dtype=torch.float64))
    other = SOAP([{"params": [q], "names": ["layers.0.attention.wo.weight"], "weight_decay": 0.0}],
                 precondition_frequency=5, options=EngineOptions(tile_size=8))
    with pytest.raises(CheckpointError, match="soap_spec"):
        other.load_state_dict(sd)
    other4 = _soap([q], ["layers.0.attention.wo.weight"], tile=4)
    with pytest.raises(CheckpointError, match="tile spec"):
        other4.load_state_dict(sd)


def test_float64_factors_survive_a_state_dict_round_trip():
    """fp32 parameters, fp64 factors: loading must not round the factors through the parameter dtype."""
    import copy

    p = torch.nn.Parameter(torch.randn(8, 8))
    opt = SOAP([{"params": [p], "names": ["layers.0.attention.wq.weight"], "weight_decay": 0.0}],
               options=EngineOptions(tile_size=8))
    for _ in range(3):
        p.grad = torch.randn_like(p)
        opt.step()
    assert opt.state[p]["L"].dtype == torch.float64 and opt.state[p]["exp_avg"].dtype == torch.float32
    q = torch.nn.Parameter(p.detach().clone())
    other = SOAP([{"params": [q], "names": ["layers.0.attention.wq.weight"], "weight_decay": 0.0}],
                 options=EngineOptions(tile_size=8))
    other.load_state_dict(copy.deepcopy(opt.state_dict()))
    for k, v in opt.state[p].items():
        assert other.state[q][k].dtype == v.dtype and torch.equal(other.state[q][k], v), k


def _spd(k, s, gen):
    """k well-conditioned symmetric positive definite matrices with distinct eigenvalues (1 .. 10)."""
    q = torch.linalg.qr(torch.randn(k, s, s, generator=gen, dtype=torch.float64)).Q
    lam = torch.linspace(1.0, 10.0, s, dtype=torch.float64)[torch.randperm(s, generator=gen)]
    return q @ torch.diag_embed(lam.expand(k, s)) @ q.transpose(-1, -2)


def test_refresh_tiles_matches_plain_reference_and_is_per_tile():
    """The batched refresh (one P Q product for the eigenvalue estimate and the power step) equals a plain
    numpy refresh (diag(Qᵀ P Q), sort, permute v, qr(P Q_sorted)) to 1e-10 in float64, and a batch of tiles
    equals each tile refreshed alone bitwise."""
    from outlier_titan.optim.soap import refresh_tiles

    gen = torch.Generator().manual_seed(7)
    k, s0, s1 = 5, 6, 4
    lf, rf = _spd(k, s0, gen), _spd(k, s1, gen)
    ql = torch.linalg.qr(torch.randn(k, s0, s0, generator=gen, dtype=torch.float64)).Q
    qr = torch.linalg.qr(torch.randn(k, s1, s1, generator=gen, dtype=torch.float64)).Q
    m = torch.randn(k, s0, s1, generator=gen, dtype=torch.float64)
    v = torch.rand(k, s0, s1, generator=gen, dtype=torch.float64)
    m_new, v_new, ql_new, qr_new, failed = refresh_tiles(m, v, lf, rf, ql, qr)
    assert failed == 0
    for i in range(k):
        L, R, QL, QR = (x[i].numpy() for x in (lf, rf, ql, qr))
        V = v[i].numpy()
        orig = QL @ m[i].numpy() @ QR.T
        oL = np.argsort(-np.diag(QL.T @ L @ QL), kind="stable")
        oR = np.argsort(-np.diag(QR.T @ R @ QR), kind="stable")
        V = V[oL, :][:, oR]
        nL, nR = np.linalg.qr(L @ QL[:, oL])[0], np.linalg.qr(R @ QR[:, oR])[0]
        np.testing.assert_allclose(ql_new[i].numpy(), nL, rtol=0, atol=1e-10)
        np.testing.assert_allclose(qr_new[i].numpy(), nR, rtol=0, atol=1e-10)
        np.testing.assert_allclose(v_new[i].numpy(), V, rtol=0, atol=0)
        np.testing.assert_allclose(m_new[i].numpy(), nL.T @ orig @ nR, rtol=0, atol=1e-10)
        one = refresh_tiles(m[i:i + 1], v[i:i + 1], lf[i:i + 1], rf[i:i + 1], ql[i:i + 1], qr[i:i + 1])
        for a, b in zip(one[:4], (m_new, v_new, ql_new, qr_new)):
            assert torch.equal(a[0], b[i])


def test_refreshes_batched_across_parameters_equal_separate_optimizers():
    """Due tiles of several parameters are refreshed in one batch; each parameter's numbers equal those of an
    optimizer that holds only that parameter (bitwise, float64)."""
    shapes = {"layers.0.attention.wq.weight": (8, 8), "layers.0.feed_forward.w1.weight": (16, 8),
              "layers.0.feed_forward.w2.weight": (8, 12)}
    gen = torch.Generator().manual_seed(9)
    w0 = {n: torch.randn(*s, generator=gen, dtype=torch.float64) for n, s in shapes.items()}
    joint = [torch.nn.Parameter(w.clone()) for w in w0.values()]
    opt = _soap(joint, list(shapes), tile=4)
    alone = {n: torch.nn.Parameter(w.clone()) for n, w in w0.items()}
    opts = [_soap([p], [n], tile=4) for n, p in alone.items()]
    grads = {n: _grads(s, 9, seed=10 + i) for i, (n, s) in enumerate(shapes.items())}
    for step in range(9):
        for p, n in zip(joint, shapes):
            p.grad = grads[n][step].clone()
            alone[n].grad = grads[n][step].clone()
        opt.step()
        for o in opts:
            o.step()
    for p, n in zip(joint, shapes):
        assert torch.equal(p.detach(), alone[n].detach()), n
        for key, val in opt.state[p].items():
            assert torch.equal(val, opts[list(shapes).index(n)].state[alone[n]][key]), (n, key)
