"""Muon on the hidden matrices, AdamW on the rest: ``optimizer.name = "muon"`` (docs/muon.md).

Muon (Jordan et al. 2024; Liu et al. 2025, arXiv 2502.16982) with ``torch.optim.Muon``'s semantics:

    B ← μ B + (1-μ) G  (as ``lerp``),   U = lerp(G, B, μ) if nesterov else B,
    O = NS_k(U / max(‖U‖_F, ε))  (quintic Newton–Schulz, coefficients (a, b, c), in ``ns_dtype``),
    W ← W (1 - lr λ) - lr · s(shape) · O,   s = sqrt(max(1, A/B)) ("original") or 0.2 sqrt(max(A, B)).

The 2-D hidden matrices go to Muon; token / position embeddings, the output head and 1-D parameters go to AdamW
(``torch.optim.AdamW``'s functional update) with their own lr and betas (``optimizer.muon_adamw_*``).

Sharded (DTensor) matrices, ``optimizer.muon_layout``:

* ``full``: each matrix is orthogonalised whole on one owner rank (matrix k of the step goes to rank k mod W,
  so owners are spread over the ranks). One ``all_to_all_single`` sends the shards of all matrices to their
  owners (one replica of each shard: with HSDP only the first replica group sends), the owners rebuild the full matrices (with the tile engine's shard index arithmetic, which
  covers FSDP over TP's ``_StridedShard``), run Newton–Schulz, and a second ``all_to_all_single`` returns
  each rank its own block. Two collectives per step for all matrices (not two per matrix as gather / scatter
  would need), balanced over the ranks; the wire carries the Newton–Schulz dtype (bfloat16 by default), which
  is exact because Newton–Schulz casts its input first. The result equals one-rank Muon bitwise for equal
  gradients. ``bytes_sent`` counts what this rank sent.
* ``block``: Newton–Schulz on each tile of the tile engine's global grid (``optimizer.tile_size`` along the
  residual axis, the shard tile along the sharded axis), which every shard holds whole: no communication,
  the same numbers at every aligned layout. The lr scale uses the tile's shape.
* ``block_periodic`` (MuonBP, Khaled et al. 2025, arXiv 2510.16981): ``block`` steps with a ``full`` step on
  steps 1, 1 + k, 1 + 2k, ... (k = ``optimizer.muon_full_every``; k = 1 is ``full``).

``muon_per_head``: the rows of wq / wk / wv are orthogonalised per head ([head_dim, dim] slices) in full steps;
in block steps their row tile is the head dim.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch.optim.adamw import adamw as adamw_update
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from outlier_titan.errors import UserError
from outlier_titan.models.roles import ParamRoles, roles_of
from outlier_titan.optim.params import clean_fqn, trainable_params
from outlier_titan.optim.tile_optimizers import engine_options
from outlier_titan.optim.tiles.kernels import from_tiles, to_tiles
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.optim.tiles.plan import plan_param
from outlier_titan.optim.tiles.shards import local_indices

LAYOUTS = ("full", "block", "block_periodic")
NS_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float64": torch.float64}
ADJUST_LR_FNS = ("original", "match_rms_adamw")


# ------------------------------------------------------------------------------------------------------------
# The math


def newton_schulz(x: torch.Tensor, coefficients, steps: int, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """Orthogonalises the last two dims of ``x`` with ``steps`` quintic Newton–Schulz iterations in ``dtype``.

    A 2-D input runs exactly ``torch.optim.Muon``'s operations (same casts and ``addmm`` calls, so the same
    bits); a batch [..., m, n] runs them as ``baddbmm`` per matrix, each normalised by its own norm."""
    if steps < 1 or steps >= 100:
        raise UserError(f"optimizer.muon_ns_steps = {steps} must be in 1..99")
    a, b, c = (float(v) for v in coefficients)
    if x.ndim == 2:
        y = x.to(dtype)
        tall = x.size(0) > x.size(1)
        if tall:
            y = y.T
        y.div_(y.norm().clamp(min=eps))
        for _ in range(steps):
            gram = y @ y.T
            poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            y = torch.addmm(y, poly, y, beta=a)
        return y.T if tall else y
    lead = x.shape[:-2]
    y = x.reshape(-1, x.shape[-2], x.shape[-1]).to(dtype)
    tall = x.size(-2) > x.size(-1)
    if tall:
        y = y.mT
    y = y / y.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = torch.bmm(y, y.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        y = torch.baddbmm(y, poly, y, beta=a)
    if tall:
        y = y.mT
    return y.reshape(*lead, x.shape[-2], x.shape[-1])


def lr_scale(adjust_lr_fn: str, rows: int, cols: int) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment for an update of shape [rows, cols]."""
    if adjust_lr_fn == "original":
        return math.sqrt(max(1, rows / cols))
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    raise UserError(f"optimizer.muon_adjust_lr_fn = {adjust_lr_fn!r}; choose one of: {', '.join(ADJUST_LR_FNS)}")


# ------------------------------------------------------------------------------------------------------------
# The parameter split


def is_muon_matrix(fqn: str, cls: str, p: torch.Tensor, roles: ParamRoles) -> bool:
    """A 2-D hidden matrix: a "matrix" parameter that is not an embedding or the output head (the model's
    ``roles``)."""
    return cls == "matrix" and p.ndim == 2 and not roles.is_embedding_like(fqn)


def head_dims(model: nn.Module) -> dict[str, int]:
    """FQN -> head dim of every per-head attention input weight (``wq`` / ``wk`` / ``wv`` in the built-in specs:
    the model's ``param_roles.attention_input_weights``) of the modules with a ``head_dim`` attribute."""
    names = roles_of(model).attention_input_weights
    out = {}
    for name, module in model.named_modules():
        hd = getattr(module, "head_dim", None)
        if not isinstance(hd, int):
            continue
        for w in names:
            lin = getattr(module, w, None)
            if isinstance(lin, nn.Module) and isinstance(getattr(lin, "weight", None), torch.Tensor):
                out[clean_fqn(f"{name}.{w}.weight" if name else f"{w}.weight")] = hd
    return out


def split_summary(groups: list[dict]) -> str:
    """One line: how many tensors / elements go to Muon and to AdamW, with their lrs."""
    parts = []
    for algo in ("muon", "adamw"):
        gs = [g for g in groups if g["algorithm"] == algo]
        n = sum(len(g["params"]) for g in gs)
        el = sum(p.numel() for g in gs for p in g["params"])
        lrs = sorted({float(g["lr"]) for g in gs})
        parts.append(f"{algo} {n} tensors ({el:,} elements, lr {', '.join(f'{v:g}' for v in lrs) or '-'})")
    return "optimizer split: " + "; ".join(parts)


def muon_param_groups(model: nn.Module, cfg) -> list[dict]:
    """[Muon group, AdamW decay group, AdamW no-decay group] (empty ones dropped), each with ``names`` and
    ``algorithm``; classes as ``build_param_groups`` sees them, so the split is the same at any world size."""

    muon = {"params": [], "names": [], "algorithm": "muon", "lr": cfg.lr, "weight_decay": cfg.weight_decay,
            "momentum": cfg.muon_momentum, "nesterov": cfg.muon_nesterov,
            "ns_coefficients": _coefficients(cfg.muon_ns_coefficients), "ns_steps": cfg.muon_ns_steps,
            "eps": cfg.muon_eps, "adjust_lr_fn": cfg.muon_adjust_lr_fn}
    adamw = {"algorithm": "adamw", "lr": cfg.muon_adamw_lr, "betas": (cfg.muon_adamw_beta1, cfg.muon_adamw_beta2),
             "eps": cfg.eps}
    decay = {"params": [], "names": [], **adamw, "weight_decay": cfg.muon_adamw_weight_decay}
    no_decay = {"params": [], "names": [], **adamw, "weight_decay": 0.0}
    roles = roles_of(model)
    for fqn, cls, p in trainable_params(model):
        group = muon if is_muon_matrix(fqn, cls, p, roles) else no_decay if cls in cfg.no_decay else decay
        group["params"].append(p)
        group["names"].append(fqn)
    return [g for g in (muon, decay, no_decay) if g["params"]]


def plan_muon_state(model: nn.Module, cfg) -> tuple[str, float]:
    """The dry run's Muon entry: the split line (with the layout), and this rank's state bytes: an fp32 momentum buffer per Muon
    element, AdamW's two fp32 moments per other element (the ``full`` layout's transient owner buffers are not
    counted)."""
    groups = muon_param_groups(model, cfg)
    per = {"muon": 4, "adamw": 8}
    total = sum(per[g["algorithm"]] * _local(p).numel() for g in groups for p in g["params"])
    return f"{split_summary(groups)} | muon_layout {cfg.muon_layout}", float(total)


def _coefficients(values) -> tuple[float, ...]:
    try:
        return tuple(float(c) for c in values)
    except (TypeError, ValueError):
        raise UserError(f"optimizer.muon_ns_coefficients = {list(values)} must be three numbers, e.g. "
                        f"[3.4445, -4.775, 2.0315]") from None


def block_plans(model: nn.Module, cfg) -> list[tuple[torch.Tensor, str, Any]]:
    """``(matrix, FQN, tile plan)`` of every Muon matrix a ``block`` / ``block_periodic`` layout orthogonalises in
    blocks, as ``build_muon`` plans them (works on a meta model); empty for ``full``."""
    opt = build_muon(model, cfg, seed=0)
    return [(p, n, opt.plans[p]) for g in opt.param_groups for p, n in zip(g["params"], g["names"]) if p in opt.plans]


def build_muon(model: nn.Module, cfg, seed: int) -> "MuonAdamW":
    """``optimizer.name = "muon"`` from the config (``seed`` unused: Muon has no random state)."""
    return MuonAdamW(muon_param_groups(model, cfg), layout=cfg.muon_layout, full_every=cfg.muon_full_every,
                     ns_dtype=cfg.muon_ns_dtype, per_head=head_dims(model) if cfg.muon_per_head else None,
                     options=engine_options(cfg, roles_of(model)))


# ------------------------------------------------------------------------------------------------------------
# The optimizer


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the param groups with ``algorithm = "muon"``, AdamW on those with ``algorithm = "adamw"``.

    Muon groups: lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn, names.
    AdamW groups: lr, betas, eps, weight_decay, names. State is created at construction (so every rank has
    the same keys and DCP can load into it): Muon ``momentum_buffer`` and ``step``; AdamW ``step``,
    ``exp_avg``, ``exp_avg_sq`` as ``torch.optim.AdamW`` keeps them.
    """

    def __init__(self, groups: list[dict], *, layout: str = "full", full_every: int = 1,
                 ns_dtype: str = "bfloat16", per_head: dict[str, int] | None = None,
                 options: EngineOptions | None = None) -> None:
        if layout not in LAYOUTS:
            raise UserError(f"optimizer.muon_layout = {layout!r}; choose one of: {', '.join(LAYOUTS)}")
        if full_every < 1:
            raise UserError(f"optimizer.muon_full_every = {full_every} must be >= 1")
        if ns_dtype not in NS_DTYPES:
            raise UserError(f"optimizer.muon_ns_dtype = {ns_dtype!r}; choose one of: {', '.join(NS_DTYPES)}")
        for g in groups:
            if g.get("algorithm") not in ("muon", "adamw"):
                raise UserError("MuonAdamW: every param group needs algorithm = 'muon' or 'adamw'")
            if "names" not in g or len(g["names"]) != len(g["params"]):
                raise UserError("MuonAdamW: give each param group 'names' (the FQNs)")
            if g["algorithm"] == "muon":
                lr_scale(g["adjust_lr_fn"], 1, 1)
                if len(tuple(g["ns_coefficients"])) != 3:
                    raise UserError(f"optimizer.muon_ns_coefficients = {list(g['ns_coefficients'])} needs 3 values")
                if g["momentum"] < 0:
                    raise UserError(f"optimizer.muon_momentum = {g['momentum']} must be >= 0")
                for p, n in zip(g["params"], g["names"]):
                    if p.ndim != 2:
                        raise UserError(f"muon: {n} has {p.ndim} dims; Muon takes 2-D matrices only")
        super().__init__(groups, {})
        self.layout, self.full_every, self.ns_dtype = layout, full_every, NS_DTYPES[ns_dtype]
        self.per_head = dict(per_head or {})
        self.bytes_sent = 0  # full-layout all-to-all bytes sent by this rank, summed over steps
        self._index_cache: dict = {}
        base = options or EngineOptions()
        if layout != "full" and base.whole_axes:
            raise UserError(f"muon_layout = {layout} orthogonalises blocks of optimizer.tile_size, which is 0 (whole "
                            f"matrices); set the block edge (e.g. optimizer.tile_size = 256) or use muon_layout = full")
        self.plans = {}
        for g in self.param_groups:
            for p, n in zip(g["params"], g["names"]):
                if g["algorithm"] == "muon":
                    self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                     "momentum_buffer": torch.zeros_like(p, memory_format=torch.preserve_format)}
                    if layout != "full":
                        self.plans[p] = self._block_plan(n, p, base)
                else:
                    self.state[p] = {"step": torch.tensor(0.0, dtype=torch.float32),
                                     "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                                     "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}

    def describe(self) -> str:
        """The parameter split and the layout, printed at start-up."""
        extra = f", full every {self.full_every}" if self.layout == "block_periodic" else ""
        per_head = f", per head ({len(self.per_head)} matrices)" if self.per_head else ""
        return f"{split_summary(self.param_groups)} | muon_layout {self.layout}{extra}{per_head}"

    def _block_plan(self, fqn: str, p: torch.Tensor, base: EngineOptions):
        overrides = tuple(base.tile_size_overrides)
        if fqn in self.per_head:
            overrides += (f"{fqn}:0={self.per_head[fqn]}",)
        opts = EngineOptions(tile_size=base.tile_size, shard_tile_size=base.shard_tile_size,
                             max_shards=base.max_shards, tile_size_overrides=overrides,
                             tile_alignment=base.tile_alignment, max_precond_dim=1 << 62, nonfinite_guard=False,
                             roles=base.roles)
        return plan_param(fqn, p, opts, group_other_axis=False, basis=None, stacked_state=False)

    # -- step ---------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        muon_items = []
        for g in self.param_groups:
            if g["algorithm"] == "adamw":
                self._adamw_step(g)
                continue
            for p, n in zip(g["params"], g["names"]):
                if p.grad is None:
                    continue
                st = self.state[p]
                grad, buf = _local(p.grad), _local(st["momentum_buffer"])
                buf.lerp_(grad, 1 - g["momentum"])
                update = grad.lerp(buf, g["momentum"]) if g["nesterov"] else buf
                st["step"] += 1
                muon_items.append((g, p, n, update))
        if not muon_items:
            return loss
        step = int(self.state[muon_items[0][1]]["step"].item())
        full = self.layout == "full" or (self.layout == "block_periodic" and (step - 1) % self.full_every == 0)
        if full:
            self._full_step(muon_items)
        else:
            self._block_step(muon_items)
        return loss

    def _adamw_step(self, g: dict) -> None:
        params, grads, m, v, steps = [], [], [], [], []
        for p in g["params"]:
            if p.grad is None:
                continue
            st = self.state[p]
            params.append(p)
            grads.append(p.grad)
            m.append(st["exp_avg"])
            v.append(st["exp_avg_sq"])
            steps.append(st["step"])
        if not params:
            return
        beta1, beta2 = g["betas"]
        adamw_update(params, grads, m, v, [], steps, foreach=True, capturable=False, differentiable=False,
                     fused=None, grad_scale=None, found_inf=None, has_complex=False, amsgrad=False, beta1=beta1,
                     beta2=beta2, lr=g["lr"], weight_decay=g["weight_decay"], eps=g["eps"], maximize=False)

    def _apply(self, g: dict, p: torch.Tensor, ortho: torch.Tensor, scale: float | torch.Tensor) -> None:
        """W ← W (1 - lr λ) - lr · scale · O on the local shard (``scale``: a float or a broadcastable tensor)."""
        lp = _local(p)
        lp.mul_(1 - g["lr"] * g["weight_decay"])
        if isinstance(scale, torch.Tensor):
            lp.sub_(ortho.to(lp.dtype) * (scale.to(lp.dtype) * g["lr"]))
        else:
            lp.add_(ortho, alpha=-g["lr"] * scale)

    def _ns_full(self, g: dict, fqn: str, full: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Newton–Schulz of a whole matrix (per head for wq / wk / wv with ``per_head``) and its lr scale."""
        coeffs, steps, eps = g["ns_coefficients"], g["ns_steps"], g["eps"]
        rows, cols = full.shape
        hd = self.per_head.get(fqn)
        if hd is not None and hd < rows:
            if rows % hd:
                raise UserError(f"muon: {fqn} has {rows} rows, not a multiple of its head dim {hd}")
            out = newton_schulz(full.reshape(rows // hd, hd, cols), coeffs, steps, eps, self.ns_dtype)
            return out.reshape(rows, cols), lr_scale(g["adjust_lr_fn"], hd, cols)
        return (newton_schulz(full, coeffs, steps, eps, self.ns_dtype),
                lr_scale(g["adjust_lr_fn"], rows, cols))

    def _full_step(self, items: list) -> None:
        sharded = [(g, p, n, u) for g, p, n, u in items if isinstance(p, DTensor)]
        for g, p, n, u in items:
            if not isinstance(p, DTensor):
                ortho, scale = self._ns_full(g, n, u)
                self._apply(g, p, ortho, scale)
        if sharded:
            for (g, p, n, _), (ortho, scale) in zip(sharded, self._exchange(sharded)):
                self._apply(g, p, ortho, scale)

    def _indices(self, p: DTensor) -> list[tuple[torch.Tensor, torch.Tensor, bool]]:
        """Per global rank r: the global row and column indices of r's local shard of ``p``, and whether r sends
        that shard to the owner (only the first replica of a shard does: coordinate 0 on every mesh dim that does
        not shard ``p``, e.g. HSDP's replicate dim)."""
        key = (tuple(p.shape), tuple(p.placements), id(p.device_mesh))
        if key not in self._index_cache:
            mesh = p.device_mesh
            ranks = mesh.mesh
            world = dist.get_world_size()
            if ranks.numel() != world:
                raise UserError(f"muon_layout = 'full' needs the parameters' mesh to span all {world} ranks "
                                f"(it has {ranks.numel()}); use muon_layout = 'block'")
            out = [None] * world
            for coord in torch.cartesian_prod(*[torch.arange(s) for s in ranks.shape]).reshape(-1, ranks.ndim):
                c = coord.tolist()
                r = int(ranks[tuple(c)])
                sends = all(c[d] == 0 for d, pl in enumerate(p.placements)
                            if not isinstance(pl, (Shard, _StridedShard)))
                out[r] = (*(local_indices(p.shape[a], a, tuple(ranks.shape), p.placements, c) for a in (0, 1)), sends)
            self._index_cache[key] = out
        return self._index_cache[key]

    def _exchange(self, items: list) -> list[tuple[torch.Tensor, float]]:
        """The ``full`` layout on sharded matrices: all-to-all to the owners, Newton–Schulz, all-to-all back.

        Returns per item this rank's block of the orthogonalised matrix and its lr scale."""
        world, me = dist.get_world_size(), dist.get_rank()
        owner = [k % world for k in range(len(items))]
        wire = min((items[0][3].dtype, self.ns_dtype), key=lambda d: torch.finfo(d).bits)  # NS casts first
        idx = [self._indices(p) for _, p, _, _ in items]
        device = items[0][3].device
        # 1. the first replica of every shard of matrix k sends it to owner[k]
        send = [[] for _ in range(world)]
        for k, (_, _, _, u) in enumerate(items):
            if idx[k][me][2]:
                send[owner[k]].append(u.to(wire).reshape(-1).view(torch.uint8))
        recv_sizes = [sum(len(idx[k][s][0]) * len(idx[k][s][1]) for k in range(len(items))
                          if owner[k] == me and idx[k][s][2]) * _bytes(wire) for s in range(world)]
        got = _all_to_all(send, recv_sizes, device)
        self.bytes_sent += sum(sum(t.numel() for t in send[r]) for r in range(world) if r != me)
        # 2. the owner rebuilds and orthogonalises its matrices, and cuts them into the ranks' blocks
        back = [[] for _ in range(world)]
        offsets = [0] * world
        scales = {}
        for k, (g, p, n, _) in enumerate(items):
            if owner[k] != me:
                continue
            full = torch.empty(tuple(p.shape), dtype=wire, device=device)
            for s in range(world):
                r_idx, c_idx, sent = idx[k][s]
                if not sent:
                    continue
                nbytes = len(r_idx) * len(c_idx) * _bytes(wire)
                piece = got[s][offsets[s]:offsets[s] + nbytes].view(wire).reshape(len(r_idx), len(c_idx))
                offsets[s] += nbytes
                full[r_idx[:, None], c_idx[None, :]] = piece
            ortho, scales[k] = self._ns_full(g, n, full)
            for s in range(world):
                r_idx, c_idx, _ = idx[k][s]
                back[s].append(ortho[r_idx[:, None], c_idx[None, :]].contiguous().reshape(-1).view(torch.uint8))
        out_dtype = self.ns_dtype
        mine_sizes = [sum(len(idx[k][me][0]) * len(idx[k][me][1]) for k in range(len(items)) if owner[k] == r)
                      * _bytes(out_dtype) for r in range(world)]
        ret = _all_to_all(back, mine_sizes, device)
        self.bytes_sent += sum(sum(t.numel() for t in back[r]) for r in range(world) if r != me)
        # 3. unpack this rank's blocks (the lr scale depends on the global shape only)
        result, offsets = [], [0] * world
        for k, (g, p, n, u) in enumerate(items):
            r = owner[k]
            nbytes = u.numel() * _bytes(out_dtype)
            block = ret[r][offsets[r]:offsets[r] + nbytes].view(out_dtype).reshape(u.shape)
            offsets[r] += nbytes
            scale = scales.get(k)
            if scale is None:
                rows, cols = p.shape
                hd = self.per_head.get(n)
                scale = lr_scale(g["adjust_lr_fn"], hd if hd is not None and hd < rows else rows, cols)
            result.append((block, scale))
        return result

    def _block_step(self, items: list) -> None:
        for g, p, n, u in items:
            plan = self.plans[p]
            u2 = plan.view2d(u)
            ortho = torch.empty(u2.shape, dtype=self.ns_dtype, device=u.device)
            scale = torch.ones(u2.shape[0], u2.shape[1], dtype=torch.float64)
            for rseg, cseg in plan.regions():
                tiles = to_tiles(u2, rseg, cseg)
                o = newton_schulz(tiles, g["ns_coefficients"], g["ns_steps"], g["eps"], self.ns_dtype)
                from_tiles(ortho, o, rseg, cseg)
                scale[rseg.start:rseg.start + rseg.count * rseg.size,
                      cseg.start:cseg.start + cseg.count * cseg.size] = lr_scale(g["adjust_lr_fn"], rseg.size,
                                                                                  cseg.size)
            self._apply(g, p, ortho.reshape(u.shape), scale.to(u.device).reshape(u.shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _bytes(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _all_to_all(send: list[list[torch.Tensor]], recv_bytes: list[int], device) -> list[torch.Tensor]:
    """One ``all_to_all_single`` of byte buffers: ``send[r]`` goes to rank r; returns what each rank sent here."""
    inputs = [torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device) for parts in send]
    inp = torch.cat(inputs)
    out = torch.empty(sum(recv_bytes), dtype=torch.uint8, device=device)
    dist.all_to_all_single(out, inp, output_split_sizes=recv_bytes, input_split_sizes=[t.numel() for t in inputs])
    return list(torch.split(out, recv_bytes))
