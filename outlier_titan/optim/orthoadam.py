"""OrthoAdam (Kaul et al. 2024, arXiv 2410.17174, Algorithm 1) on the tile engine: Adam whose moments live in a
fixed orthogonal basis.

The paper's Q is a dense orthogonal matrix over the whole flattened parameter, which is infeasible; here
Q = ⊕_tiles (B0 ⊗ B1), a Kronecker product of per-axis tile bases on the global tile grid (a legal instance
of Algorithm 1: any fixed orthogonal Q will do). Each basis is regenerated from (global seed, FQN, axis, tile) on
every rank that owns the tile (see ``bases.py``), so nothing but a spec and a checksum is checkpointed.

Update per tile (bias-corrected as in Algorithm 1 and torch AdamW, eps added to sqrt(v̂)):
    Ĝ = B0ᵀ G B1;  m̂ ← lerp(m̂, Ĝ, 1-β1);  v̂ ← β2 v̂ + (1-β2) Ĝ²
    θ ← θ (1 - lr·wd) - lr/(1-β1^t) · B0 [m̂ / (√v̂/√(1-β2^t) + ε)] B1ᵀ
With identity bases this is exactly torch.optim.AdamW.
"""

from __future__ import annotations

import torch

from outlier_titan.errors import UserError
from outlier_titan.optim.bases import (Basis, BasisFn, basis_checksum, check_basis, is_signed_permutation,
                                       resolve_representation, structured_basis, tile_seed)
from outlier_titan.optim.tiles.base import TileAdamBase
from outlier_titan.optim.tiles.kernels import from_tiles, rotate_tiles, to_tiles
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.optim.tiles.plan import ParamPlan, Segment
from outlier_titan.optim.tiles.state import state_dtype_for
from outlier_titan.tensors import local


class KronAxis:
    """A structured basis B = P·D·(K_1 ⊗ ... ⊗ K_m) per tile along one axis of a local 2-D tensor, applied
    in the tensor's own layout: a row / column gather with signs, then each factor as one batched matmul
    on a reshaped view ([tiles, before, f, after]); no tile-major copies, no dense t x t products."""

    def __init__(self, ax, fqn: str, axis: int, seed: int, name: str, dtype, device) -> None:
        self.axis = axis
        fwd_idx, back_idx, fwd_sign, back_sign = [], [], [], []
        self.segments: list[tuple[Segment, list[torch.Tensor]]] = []
        permuted = False
        for seg in ax.segments:
            per_tile = []
            for k, g in enumerate(ax.local_tiles[seg.pos:seg.pos + seg.count]):
                perm, signs, factors = structured_basis(name, seg.size, tile_seed(seed, fqn, axis, g))
                base = seg.start + k * seg.size
                if perm is None:
                    perm = torch.arange(seg.size)
                    signs = torch.ones(seg.size, dtype=torch.float64)
                else:
                    permuted = True
                inv = torch.argsort(perm)
                # forward Bᵀx = Kᵀ·D·x[inv];  back B·u = signs[perm] * (K·u)[perm]
                fwd_idx.append(base + inv)
                fwd_sign.append(signs)
                back_idx.append(base + perm)
                back_sign.append(signs[perm])
                per_tile.append(factors)
            shared = name == "hadamard"
            facs = [torch.stack([f[i] for f in per_tile]) if not shared else per_tile[0][i]
                    for i in range(len(per_tile[0]))]
            self.segments.append((seg, [f.to(device=device, dtype=dtype) for f in facs]))
        shape = (-1, 1) if axis == 0 else (1, -1)
        to = dict(device=device)
        self.gather = None
        if permuted:
            self.gather = (torch.cat(fwd_idx).to(**to), torch.cat(fwd_sign).to(dtype=dtype, **to).view(shape),
                           torch.cat(back_idx).to(**to), torch.cat(back_sign).to(dtype=dtype, **to).view(shape))
        self.extent = ax.extent

    def _factors(self, x: torch.Tensor, seg: Segment, factors: list[torch.Tensor], forward: bool) -> torch.Tensor:
        """Kᵀ (forward) or K applied along ``self.axis`` of the segment's region ``x`` (contiguous)."""
        sizes = [f.shape[-1] for f in factors]
        n_other = x.shape[1 - self.axis]
        for i, f in enumerate(factors):
            pre = 1
            for s in sizes[:i]:
                pre *= s
            post = 1
            for s in sizes[i + 1:]:
                post *= s
            fsz = sizes[i]
            batched = f.dim() == 3
            if self.axis == 0:
                # x rows: [tiles, pre, f, post * n_other]; y = M x with M = Kᵀ (forward) or K
                m = f.transpose(-1, -2) if forward else f
                x = torch.matmul(m[:, None] if batched else m, x.reshape(seg.count, pre, fsz, post * n_other))
            elif post == 1:
                # columns, last factor: [n_other, tiles, pre, f] @ N, N = K (forward) or Kᵀ
                n = f if forward else f.transpose(-1, -2)
                x = torch.matmul(x.reshape(n_other, seg.count, pre, fsz), n)
            else:
                m = f.transpose(-1, -2) if forward else f
                x = torch.matmul(m[:, None] if batched else m, x.reshape(n_other, seg.count, pre, fsz, post))
        return x.reshape((seg.count * seg.size, n_other) if self.axis == 0 else (n_other, seg.count * seg.size))

    def apply(self, x: torch.Tensor, forward: bool) -> torch.Tensor:
        """Bᵀ x (``forward``) or B x along this axis, per tile, of a local 2-D tensor."""
        if forward and self.gather is not None:
            x = x.index_select(self.axis, self.gather[0]).mul_(self.gather[1])
        if len(self.segments) == 1 and self.segments[0][0].count * self.segments[0][0].size == self.extent:
            seg, facs = self.segments[0]
            out = self._factors(x.contiguous(), seg, facs, forward)
        else:
            out = torch.empty_like(x)
            for seg, facs in self.segments:
                n = seg.count * seg.size
                out.narrow(self.axis, seg.start, n).copy_(
                    self._factors(x.narrow(self.axis, seg.start, n).contiguous(), seg, facs, forward))
        if not forward and self.gather is not None:
            out = out.index_select(self.axis, self.gather[2]).mul_(self.gather[3])
        return out


class OrthoAdam(TileAdamBase):
    """Adam in fixed, seeded, tile-local Kronecker bases; decoupled weight decay in the parameter basis.

    Args:
        params: param groups with ``names`` (FQNs), as ``build_param_groups`` makes them.
        seed: the global seed the bases are derived from (with FQN, axis and tile index).
        basis: "hadamard", "haar", "haar_kron", "identity" (AdamW; tests and ablations) or a callable
            ``(size, seed) -> [size, size] float64 orthogonal matrix``.
        dense: apply "hadamard" / "haar_kron" as dense tile products (the reference) instead of factored.
        factored_min_tile: factored only for parameters whose largest rotated tile is at least this (measured
            on CPU: dense products are faster at tile 32, factored ones 2x at 64 and 7x at 256).
        options: tile-engine options (tile size, overrides, alignment, vocab / 1-D handling).
        flag_group: process group of the non-finite flag all-reduce (default: the world).
    """

    spec_keys = ("basis_spec",)
    published_one_d = "rotate"  # Algorithm 1 rotates every parameter, gains and biases too

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, seed: int = 0, basis: str | BasisFn = "hadamard",
                 options: EngineOptions | None = None, flag_group=None, dense: bool = False,
                 factored_min_tile: int = 64) -> None:
        rep = self.tile_basis(basis)
        name = rep.name
        options = options or EngineOptions()
        if name != "identity" and options.tile_size == 1:
            raise UserError(f"optimizer.tile_size = 1: a rotation needs tiles of at least 2 (0: whole axes)")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
        super().__init__(params, defaults, options, basis=rep, flag_group=flag_group)
        self.seed = int(seed)
        self.representation = name
        self._basis = rep
        self.structured = rep.factored and not dense
        self._bases: dict[torch.Tensor, tuple] = {}
        self._kron: dict[torch.Tensor, tuple] = {}
        for p, plan in self.plans.items():
            if self.structured and max((ax.tile for ax in plan.axes if ax.rotate), default=1) >= factored_min_tile:
                lp = local(p)
                self._kron[p] = tuple(
                    KronAxis(plan.axes[a], plan.fqn, a, self.seed, name, state_dtype_for(p), lp.device)
                    if plan.axes[a].rotate and plan.axes[a].extent else None for a in (0, 1))
            else:
                self._bases[p] = (self._axis_bases(p, plan, 0), self._axis_bases(p, plan, 1))
        sizes = sorted({s for plan in self.plans.values() for ax in plan.axes if ax.rotate
                        for s in (ax.tile, ax.size % ax.tile) if s >= 2})
        spec = f"{name};seed={self.seed};checksum={basis_checksum(name, rep.dense, self.seed, sizes)}"
        for group in self.param_groups:
            group["basis_spec"] = spec
        self._materialize()

    @classmethod
    def tile_basis(cls, basis: str | BasisFn) -> Basis:
        """The fixed basis of ``optimizer.basis`` (its ``needs_pow2`` rule joins the tile plan)."""
        return resolve_representation(basis)

    def resident_basis_bytes(self) -> int:
        """Bytes of the bases this rank holds: dense tile bases, or the factored form's gathers, signs and factors."""
        tensors = [b for axes in self._bases.values() for ax in axes if ax for b in ax.values()]
        for axes in self._kron.values():
            for k in axes:
                if k is not None:
                    tensors += [f for _, factors in k.segments for f in factors] + list(k.gather or ())
        return sum(t.numel() * t.element_size() for t in tensors)

    def _axis_bases(self, p: torch.Tensor, plan: ParamPlan, axis: int) -> dict[int, torch.Tensor] | None:
        """{segment position: [count, s, s] bases of the segment's tiles}, or None for an unrotated axis."""
        ax = plan.axes[axis]
        if not ax.rotate:
            return None
        lp = local(p)
        dtype = state_dtype_for(p)
        out = {}
        for seg in ax.segments:
            mats = []
            for g in ax.local_tiles[seg.pos:seg.pos + seg.count]:
                b = self._basis.dense(seg.size, tile_seed(self.seed, plan.fqn, axis, g))
                where = f"optimizer: {plan.fqn} axis {axis} tile {g}"
                if not self._basis.trusted:
                    check_basis(b, seg.size, where, allow_trivial=self.representation == "identity")
                elif seg.size >= 2 and is_signed_permutation(b):
                    # Orthogonal by construction; still refuse a basis that does not mix.
                    raise ValueError(f"{where}: basis is a signed permutation (a no-op rotation for Adam)")
                mats.append(b)
            out[seg.pos] = torch.stack(mats).to(device=lp.device, dtype=dtype)
        return out

    def _rotate(self, x: torch.Tensor, p: torch.Tensor, plan: ParamPlan, transpose: bool) -> torch.Tensor:
        """B0ᵀ X B1 per tile (``transpose``: B0 X B1ᵀ), batched over each region's equal-size tiles; every
        product has the tile's shape, whatever the layout. Returns ``x`` when nothing rotates."""
        if not plan.rotated or x.numel() == 0:
            return x
        if p in self._kron:
            for k in self._kron[p]:
                if k is not None:
                    x = k.apply(x, forward=not transpose)
            return x
        b0, b1 = self._bases[p]
        out = torch.empty_like(x)
        for rseg, cseg in plan.regions():
            q0 = b0[rseg.pos][:, None] if b0 is not None else None
            q1 = b1[cseg.pos][None] if b1 is not None else None
            from_tiles(out, rotate_tiles(to_tiles(x, rseg, cseg), q0, q1, transpose), rseg, cseg)
        return out

    def _init_state(self, p, plan, group):
        return self._moments(p, plan)

    def _apply(self, work: list) -> None:
        """Rotate the gradients in, Adam's element-wise math as foreach ops over all parameters (the step
        size folded into the denominator), rotate the steps out, decay and add."""
        ms, vs, ghats, items = [], [], [], []
        for group, p, plan, g in work:
            st = self.state[p]
            st["step"] += 1
            g2 = plan.view2d(g.to(state_dtype_for(p)))
            ghats.append(self._rotate(g2.contiguous(), p, plan, transpose=False))
            ms.append(plan.view2d(local(st["exp_avg"])))
            vs.append(plan.view2d(local(st["exp_avg_sq"])))
            items.append((group, p, plan, float(st["step"])))
        # step = -lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)
        rows = []
        for group, *_, t in items:
            b1, b2 = group["betas"]
            rows.append((1.0 - b1, b2, 1.0 - b2, (1.0 - b2 ** t) ** 0.5, float(group["eps"]),
                         -(1.0 - b1 ** t) / float(group["lr"])))
        steps = self._directions(ms, vs, ghats, rows)
        del ghats
        lps, us, decayed, factors = [], [], [], []
        for (group, p, plan, _), s in zip(items, steps):
            lp = plan.view2d(local(p))
            wd = float(group["weight_decay"])
            if wd:
                decayed.append(lp)
                factors.append(1.0 - float(group["lr"]) * wd)
            lps.append(lp)
            us.append(self._rotate(s, p, plan, transpose=True).to(lp.dtype))
        if decayed:
            torch._foreach_mul_(decayed, factors)
        torch._foreach_add_(lps, us)
