"""SOAP (Vyas et al. 2024) on the tile engine: Adam in the eigenbasis of per-tile Shampoo factors.

Each tile T of a 2-D weight (global grid, see ``optim/tiles``) keeps its own factors L_T = EMA(G Gᵀ),
R_T = EMA(Gᵀ G) and eigenbases Q_L, Q_R. The order of operations is the official implementation's
(nikhilvyas/SOAP, Vyas et al. 2024, arXiv 2409.11321):

* first call for a parameter: factors ← (1-β_s)·G Gᵀ / Gᵀ G, bases ← eigh (descending), no update;
* later calls: project Ĝ = Q_Lᵀ G Q_R with the *old* bases; m̂ (kept in the rotated basis) and v̂ Adam
  moments; U = Q_L [m̂ / (√v̂ + ε)] Q_Rᵀ; θ ← θ - lr·√(1-β2^t)/(1-β1^t)·U; then θ ← θ - lr·wd·θ;
* then the factors take the current G (lerp with 1-β_s); a tile due for refresh re-sorts its bases by
  diag(Qᵀ P Q) descending, permutes v̂ the same way, and takes one power-iteration step Q ← qr(P Q).Q;
  m̂ is rotated from the old to the new basis (only on refresh, which is equivalent to the official
  every-step back-and-forth). The due tiles of all parameters are refreshed in one batch per tile shape
  (``refresh_tiles``); each tile's numbers depend on that tile alone.

Faithful by default: with ``tile_size = 0`` (the default) every axis up to ``max_precond_dim`` is one tile, the
vocabulary axis included, so each 2-D parameter has the published whole-axis factors and refreshes at
t % f == 0; tests/test_soap_published.py trains a small model beside ``pytorch_optimizer.SOAP`` (a maintained
port of the published code) and agrees to float64 rounding until the port's float32 QR enters. The shard-local
variant (``tile_size > 0``) gives each tile its own factors and staggers refreshes over tiles ((t + k) % f == 0;
tile 0 follows the published schedule). Other differences: state dtypes independent of the gradient dtype
(below), eigh retried with a tiny diagonal shift, and a refresh that fails (non-finite) keeps the old basis.

Precision: moments and bases are fp32; the L/R factors are float64 by default (``factor_dtype``) and all
eigen-work (eigh, diag(QᵀPQ), the power step and its QR) runs in float64. In fp32 the directions of a
factor's small eigenvalues are set by rounding noise, and Adam's per-coordinate normalisation turns that
noise into full-size update differences: on the debug model, FSDP 2 vs world size 1 (gradients equal up to
reduction order) gave per-step losses 1.5e-3 apart with fp32 factors and eigh, 2e-7 apart with float64.
The shard-local variant's default tiles are square (``tiles.plan.plan_param``): a non-square tile's larger factor is rank-deficient at
first, and its null-space eigenvectors are rounding noise too (3e-5 apart between layouts even in float64).
"""

from __future__ import annotations

import contextlib

import torch

from outlier_titan.errors import UserError
from outlier_titan.optim.tiles.base import TileAdamBase
from outlier_titan.optim.tiles.kernels import from_tiles, rotate_tiles, to_tiles
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.optim.tiles.plan import ParamPlan
from outlier_titan.optim.tiles.state import as_global, state_dtype_for
from outlier_titan.tensors import local

FACTOR_KEYS = ("L", "R")
BASIS_KEYS = ("QL", "QR")


class SOAP(TileAdamBase):
    """SOAP with per-tile Kronecker factors; see the module docstring.

    Args:
        params: param groups with ``names`` (FQNs).
        precondition_frequency: eigenbasis refresh period f, in updates.
        shampoo_beta: EMA factor of L/R; < 0 means beta2 (the official default).
        stagger: spread refreshes over tiles ((t + k) % f == 0 for global tile index k).
        options: tile-engine options.
    """

    spec_keys = ("soap_spec",)
    published_one_d = "adamw"  # the published SOAP leaves 1-D parameters unpreconditioned (Adam)
    group_other_axis = True
    stacked_state = True

    def __init__(self, params, lr: float = 3e-3, betas: tuple[float, float] = (0.95, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.01, *, precondition_frequency: int = 10, shampoo_beta: float = -1.0,
                 stagger: bool = True, factor_dtype: str = "float64", options: EngineOptions | None = None,
                 flag_group=None) -> None:
        if precondition_frequency < 1:
            raise UserError(f"optimizer.precondition_frequency = {precondition_frequency} must be >= 1")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, options or EngineOptions(), flag_group=flag_group)
        self.frequency = int(precondition_frequency)
        self.shampoo_beta = float(shampoo_beta)
        self.stagger = bool(stagger)
        if factor_dtype not in ("float64", "float32"):
            raise UserError(f"optimizer.soap_factor_dtype = {factor_dtype!r}; choose float64 or float32")
        self.factor_dtype = getattr(torch, factor_dtype)
        self.failed_refreshes = 0
        for group in self.param_groups:
            sb = self.shampoo_beta if self.shampoo_beta >= 0 else group["betas"][1]
            group["soap_spec"] = (f"f={self.frequency};shampoo_beta={sb!r};stagger={int(self.stagger)};"
                                  f"order=official(project-old,moments,update,wd,factors,sort+permute-v,qr)")
        self._materialize()

    # -- state ----------------------------------------------------------------------------------------
    def _init_state(self, p: torch.Tensor, plan: ParamPlan, group: dict) -> dict:
        st = self._moments(p, plan)
        st["initialized"] = torch.tensor(0.0, dtype=torch.float32)
        a0, a1 = plan.axes
        dt = state_dtype_for(p)
        device = local(p).device
        for axis in (0, 1):
            if not plan.axes[axis].rotate:
                continue
            t = plan.axes[axis].tile
            lshape = (len(a0.local_tiles), len(a1.local_tiles), t, t)
            gshape = (a0.n_tiles, a1.n_tiles, t, t)
            eye = torch.eye(t, dtype=dt, device=device).expand(lshape).contiguous()
            fdt = torch.float64 if dt == torch.float64 else self.factor_dtype
            st[FACTOR_KEYS[axis]] = as_global(torch.zeros(lshape, dtype=fdt, device=device), plan, gshape)
            st[BASIS_KEYS[axis]] = as_global(eye, plan, gshape)
        return st

    def _beta_s(self, group: dict) -> float:
        return self.shampoo_beta if self.shampoo_beta >= 0 else group["betas"][1]

    @staticmethod
    def _slices(st: dict, plan: ParamPlan, rseg, cseg) -> tuple:
        """(L, R, QL, QR) views of this region's tiles (None where the axis does not rotate)."""
        rows = slice(rseg.pos, rseg.pos + rseg.count)
        cols = slice(cseg.pos, cseg.pos + cseg.count)
        out = []
        for key, axis, s in (("L", 0, rseg.size), ("R", 1, cseg.size), ("QL", 0, rseg.size), ("QR", 1, cseg.size)):
            out.append(local(st[key])[rows, cols, :s, :s] if plan.axes[axis].rotate else None)
        return tuple(out)

    # -- step -----------------------------------------------------------------------------------------
    def _apply(self, work: list) -> None:
        ms, vs, ghats, items = [], [], [], []
        with _precise_matmul(work):
            for group, p, plan, g in work:
                st = self.state[p]
                g2 = plan.view2d(g.to(state_dtype_for(p))).contiguous()
                if not bool(st["initialized"]):
                    self._first_call(st, plan, g2, group)
                    continue
                st["step"] += 1
                tiles = {}
                ghat = torch.empty_like(g2) if plan.rotated else g2
                for rseg, cseg in plan.regions():
                    if not plan.rotated:
                        break
                    g4 = to_tiles(g2, rseg, cseg)
                    tiles[(rseg.pos, cseg.pos)] = g4
                    _, _, ql, qr = self._slices(st, plan, rseg, cseg)
                    from_tiles(ghat, rotate_tiles(g4, ql, qr, transpose=False), rseg, cseg)
                ms.append(plan.view2d(local(st["exp_avg"])))
                vs.append(plan.view2d(local(st["exp_avg_sq"])))
                ghats.append(ghat)
                items.append((group, p, plan, float(st["step"]), tiles))
            if not items:
                return
            # SOAP folds the bias corrections into the update's step size below (c2 = c1 = 1 here)
            rows = [(1.0 - b1, b2, 1.0 - b2, 1.0, float(group["eps"]), 1.0)
                    for group, *_ in items for b1, b2 in [group["betas"]]]
            steps = self._directions(ms, vs, ghats, rows)
            due = {}
            for (group, p, plan, t, tiles), s in zip(items, steps):
                st = self.state[p]
                b1, b2 = group["betas"]
                lr = float(group["lr"])
                u = torch.empty_like(s) if plan.rotated else s
                for rseg, cseg in plan.regions():
                    if not plan.rotated:
                        break
                    _, _, ql, qr = self._slices(st, plan, rseg, cseg)
                    from_tiles(u, rotate_tiles(to_tiles(s, rseg, cseg), ql, qr, transpose=True), rseg, cseg)
                lp = plan.view2d(local(p))
                lp.add_(u.to(lp.dtype), alpha=-lr * (1.0 - b2 ** t) ** 0.5 / (1.0 - b1 ** t))
                wd = float(group["weight_decay"])
                if wd:
                    lp.add_(lp, alpha=-lr * wd)
                if plan.rotated:
                    self._update_preconditioner(st, plan, tiles, int(t), self._beta_s(group), due)
            self._refresh_due(due)

    def _first_call(self, st: dict, plan: ParamPlan, g2: torch.Tensor, group: dict) -> None:
        """Factors from the first gradient and eigh bases; the parameter is not updated."""
        beta_s = self._beta_s(group)
        for rseg, cseg in plan.regions():
            if not plan.rotated:
                break
            g4 = to_tiles(g2, rseg, cseg)
            lf, rf, ql, qr = self._slices(st, plan, rseg, cseg)
            _accumulate(lf, rf, g4, beta_s)
            if lf is not None:
                ql.copy_(self._eigh_bases(lf, ql))
            if rf is not None:
                qr.copy_(self._eigh_bases(rf, qr))
        st["initialized"].fill_(1.0)

    def _eigh_bases(self, factors: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
        """Eigenvectors in descending eigenvalue order, per tile; float64 retry; failures keep ``old``."""
        s = factors.shape[-1]
        mats = factors.reshape(-1, s, s)
        out = old.reshape(-1, s, s).clone()
        vecs = _eigh_descending(mats)
        if vecs is not None:
            out.copy_(vecs)
        else:
            for i in range(mats.shape[0]):
                one = _eigh_descending(mats[i])
                if one is None:
                    self.failed_refreshes += 1
                else:
                    out[i] = one
        return out.reshape(factors.shape)

    def _update_preconditioner(self, st: dict, plan: ParamPlan, tiles: dict, t: int, beta_s: float,
                               due: dict) -> None:
        """Factor EMA of every tile; the tiles due for a refresh are gathered into ``due`` (by tile shape)."""
        n1_tiles = plan.axes[1].n_tiles
        m2 = plan.view2d(local(st["exp_avg"]))
        v2 = plan.view2d(local(st["exp_avg_sq"]))
        for rseg, cseg in plan.regions():
            g4 = tiles[(rseg.pos, cseg.pos)]
            lf, rf, ql, qr = self._slices(st, plan, rseg, cseg)
            _accumulate(lf, rf, g4, beta_s)
            # Which of this region's tiles refresh now.
            gi = torch.tensor(plan.axes[0].local_tiles[rseg.pos:rseg.pos + rseg.count])
            gj = torch.tensor(plan.axes[1].local_tiles[cseg.pos:cseg.pos + cseg.count])
            k = gi[:, None] * n1_tiles + gj[None, :]   # global linear tile index
            if not self.stagger:
                k = torch.zeros_like(k)
            ii, jj = torch.nonzero((t + k) % self.frequency == 0, as_tuple=True)
            if ii.numel() == 0:
                continue
            ii, jj = ii.to(m2.device), jj.to(m2.device)
            # Only the due tiles of m̂ and v̂ are gathered, straight from the parameter-layout state.
            mv = [_region4(x, rseg, cseg) for x in (m2, v2)]
            sel = [x[ii, :, jj, :] for x in mv] + [x[ii, jj] if x is not None else None for x in (lf, rf, ql, qr)]
            fdt = (lf if lf is not None else rf).dtype
            key = (rseg.size, cseg.size, lf is not None, rf is not None, sel[0].dtype, fdt)
            due.setdefault(key, []).append((sel, mv, ql, qr, ii, jj))

    def _refresh_due(self, due: dict) -> None:
        """Refreshes every due tile, batched over all tiles of one shape (across regions and parameters)."""
        for jobs in due.values():
            stacked = [torch.cat([sel[i] for sel, *_ in jobs]) if jobs[0][0][i] is not None else None
                       for i in range(6)]
            m_new, v_new, ql_new, qr_new, failed = refresh_tiles(*stacked)
            self.failed_refreshes += failed
            pos = 0
            for sel, (m4, v4), ql, qr, ii, jj in jobs:
                n = ii.numel()
                m4[ii, :, jj, :] = m_new[pos:pos + n]
                v4[ii, :, jj, :] = v_new[pos:pos + n]
                if ql is not None:
                    ql[ii, jj] = ql_new[pos:pos + n]
                if qr is not None:
                    qr[ii, jj] = qr_new[pos:pos + n]
                pos += n


def _region4(x2: torch.Tensor, rseg, cseg) -> torch.Tensor:
    """The region (rseg x cseg) of a contiguous local 2-D tensor as an [a, s0, b, s1] view (no copy)."""
    region = x2[rseg.start:rseg.start + rseg.count * rseg.size, cseg.start:cseg.start + cseg.count * cseg.size]
    return region.view(rseg.count, rseg.size, cseg.count, cseg.size)


def refresh_tiles(m, v, lf, rf, ql, qr) -> tuple:
    """One eigenbasis refresh of k stacked tiles (m, v [k, s0, s1]; factors and bases [k, s, s], None for an
    axis without a factor): sort each basis by the estimated eigenvalues diag(Qᵀ P Q), permute v̂ the same way,
    one power-iteration step Q ← qr(P Q), and rotate m̂ from the old to the new basis.

    Eigen-work runs in float64: in fp32 the directions of small eigenvalues are set by rounding noise, and
    Adam's per-coordinate normalisation turns that noise into full-size update differences. P Q is computed
    once: diag(Qᵀ P Q)_j = Σ_i Q_ij (P Q)_ij, and the sorted power step P Q_sorted is P Q with its columns
    permuted. Every tile's result depends on that tile alone (batched products and QR of fixed shape).
    Returns (m, v, ql, qr, failed): a tile whose factor or new basis is non-finite keeps its sorted old basis.
    """
    m_orig = rotate_tiles(m, ql, qr, transpose=True)
    new, failed = {}, 0
    for side, (factor, q_old) in enumerate(((lf, ql), (rf, qr))):
        if factor is None:
            continue
        p64 = factor.to(torch.float64)
        q64 = q_old.to(torch.float64)
        pq = p64 @ q64
        est = (q64 * pq).sum(dim=-2)
        order = torch.argsort(est, dim=-1, descending=True, stable=True)
        cols = order[:, None, :].expand_as(q64)
        q_sorted = torch.gather(q64, 2, cols)
        k, s0, s1 = v.shape
        if side == 0:
            v = torch.gather(v, 1, order[:, :, None].expand(k, s0, s1))
        else:
            v = torch.gather(v, 2, order[:, None, :].expand(k, s0, s1))
        q_new = torch.linalg.qr(torch.gather(pq, 2, cols)).Q
        ok = torch.isfinite(p64).flatten(1).all(1) & torch.isfinite(q_new).flatten(1).all(1)
        if not bool(ok.all()):
            failed += int((~ok).sum())
            q_new = torch.where(ok[:, None, None], q_new, q_sorted)
        new[side] = q_new.to(q_old.dtype)
    m_new = rotate_tiles(m_orig, new.get(0), new.get(1), transpose=False)
    return m_new, v, new.get(0), new.get(1), failed


def _accumulate(lf, rf, g4: torch.Tensor, beta_s: float) -> None:
    """Factor EMA: L ← lerp(L, G Gᵀ, 1-β_s), R ← lerp(R, Gᵀ G, 1-β_s), in the factors' dtype."""
    factor = lf if lf is not None else rf
    g = g4.to(factor.dtype)
    if lf is not None:
        lf.lerp_(g @ g.transpose(-1, -2), 1.0 - beta_s)
    if rf is not None:
        rf.lerp_(g.transpose(-1, -2) @ g, 1.0 - beta_s)


def _eigh_descending(mats: torch.Tensor) -> torch.Tensor | None:
    """Eigenvectors of symmetric matrices (+1e-30·I, as the reference), columns in descending eigenvalue
    order. eigh runs in float64 (see ``_refresh``), retried once with a relative 1e-12 diagonal shift;
    None when both fail or give non-finite values (the caller keeps the old basis)."""
    s = mats.shape[-1]
    m64 = mats.to(torch.float64)
    eye = torch.eye(s, dtype=torch.float64, device=mats.device)
    scale = m64.diagonal(dim1=-2, dim2=-1).abs().amax(-1, keepdim=True)[..., None].clamp_min(1e-30)
    for shift in (1e-30 * eye, 1e-12 * scale * eye):
        try:
            _, vecs = torch.linalg.eigh(m64 + shift)
        except RuntimeError:
            continue
        if torch.isfinite(vecs).all():
            return vecs.flip(-1).to(mats.dtype)
    return None


@contextlib.contextmanager
def _precise_matmul(work: list):
    """Full-precision fp32 matmuls (no TF32) for factors, eigen-estimates and rotations on CUDA."""
    cuda = any(g.is_cuda for *_, g in work)
    if not cuda:
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
