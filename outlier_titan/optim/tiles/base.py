"""``TileAdamBase``: the skeleton OrthoAdam and SOAP share.

It plans every parameter at construction (``plan.plan_param`` with the subclass' grid rules), creates the state
(subclass hook ``_init_state``; ``tile_spec`` is added to it), and steps: collect the local gradients, an
all-reduced "some gradient is non-finite" flag (the one collective; such a step is skipped on every rank and
counted in ``skipped_steps``), then the subclass' ``_apply``. On load it verifies the per-parameter tile spec
(a state tensor) and the subclass' spec strings in the param groups (``spec_keys``); a mismatch raises
``CheckpointError``.
"""

from __future__ import annotations

import abc

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from outlier_titan.errors import CheckpointError, UserError
from outlier_titan.optim.bases import Basis
from outlier_titan.optim.tiles.adam import adam_directions, compiled_adam_directions
from outlier_titan.optim.tiles.options import EngineOptions
from outlier_titan.optim.tiles.plan import ParamPlan, describe_spec, plan_param
from outlier_titan.optim.tiles.state import as_global, state_dtype_for
from outlier_titan.tensors import local


class TileAdamBase(torch.optim.Optimizer, metaclass=abc.ABCMeta):
    """Shared machinery of the tile optimizers; subclasses provide the bases and the update.

    ``params``: param groups as ``build_param_groups`` makes them (each with ``names``, the FQNs).
    ``basis``: the fixed basis of the rotated axes, whose tile rule (``needs_pow2``) the plans obey; None when
    the subclass' bases bring no rule.
    """

    spec_keys: tuple[str, ...] = ()
    group_other_axis = False
    stacked_state = False
    published_one_d = "adamw"
    """What ``one_d = "auto"`` means for this optimizer: how its published method treats 1-D parameters."""

    def __init__(self, params, defaults: dict, options: EngineOptions, basis: Basis | None = None,
                 flag_group=None) -> None:
        super().__init__(params, defaults)
        self.options = options = options.resolved(self.published_one_d)
        self._flag_group = flag_group
        self._directions = adam_directions
        self.plans: dict[torch.Tensor, ParamPlan] = {}
        for group in self.param_groups:
            names = group.get("names")
            if names is None or len(names) != len(group["params"]):
                raise UserError("tile optimizers need the parameters' FQNs: give each param group 'names' "
                                "(build_param_groups does)")
            group.setdefault("skipped_steps", 0)
            for p, fqn in zip(group["params"], names):
                self.plans[p] = self.plan(fqn, p, options, basis)

    # -- planning (also run on the meta model, before materialising it: ``tile_optimizers.tile_plans``) ------
    @classmethod
    def tile_basis(cls, basis) -> Basis | None:
        """The fixed basis ``optimizer.basis`` gives this optimizer (None: it has none; SOAP's are eigenbases)."""
        return None

    @classmethod
    def plan(cls, fqn: str, p: torch.Tensor, options: EngineOptions, basis: Basis | None) -> ParamPlan:
        """The tile plan of one parameter under this optimizer's grid rules."""
        return plan_param(fqn, p, options.resolved(cls.published_one_d), cls.group_other_axis, basis,
                          cls.stacked_state)

    # -- subclass hooks ---------------------------------------------------------------------------------
    @abc.abstractmethod
    def _init_state(self, p: torch.Tensor, plan: ParamPlan, group: dict) -> dict:
        """The per-parameter state (moments, and the basis provider's own) created at construction."""

    @abc.abstractmethod
    def _apply(self, work: list) -> None:
        """Rotates, updates the moments and applies the update for a batch of same-shape tiles."""

    def compile_math(self) -> None:
        """Runs Adam's element-wise math compiled (``compile.enable``); the eager foreach form stays the reference."""
        self._directions = compiled_adam_directions()

    # -- state ----------------------------------------------------------------------------------------
    def _materialize(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                plan = self.plans[p]
                st = self._init_state(p, plan, group)
                st["tile_spec"] = plan.spec_tensor()
                self.state[p] = st

    def _moments(self, p: torch.Tensor, plan: ParamPlan) -> dict:
        dt = state_dtype_for(p)
        lp = local(p)
        m = torch.zeros(lp.shape, dtype=dt, device=lp.device)
        return {"step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": as_global(m, plan, p.shape),
                "exp_avg_sq": as_global(torch.zeros_like(m), plan, p.shape)}
    # -- step -----------------------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps skipped because some rank saw a non-finite gradient."""
        return int(self.param_groups[0]["skipped_steps"]) if self.param_groups else 0

    def _collect(self) -> list:
        work = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if isinstance(g, DTensor):
                    if isinstance(p, DTensor) and tuple(g.placements) != tuple(p.placements):
                        raise RuntimeError(f"optimizer: gradient of {self.plans[p].fqn} has placements "
                                           f"{g.placements}, parameter {p.placements}; reduce it first")
                    g = g.to_local()
                work.append((group, p, self.plans[p], g))
        return work

    def _all_finite(self, work: list) -> bool:
        if not self.options.nonfinite_guard:
            return True
        grads = [g for _, _, _, g in work if g.numel()]
        device = work[0][3].device if work else torch.device("cpu")
        if grads:
            # A float64 sum is non-finite iff some element is (short of 1e308 overflow); a cheap reduction.
            sums = torch.stack([g.sum(dtype=torch.float64) for g in grads])
            bad = (~torch.isfinite(sums)).any().to(torch.float32)
        else:
            bad = torch.zeros((), dtype=torch.float32, device=device)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self._flag_group) > 1:
            flag = bad.reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._flag_group)
            bad = flag[0]
        return not bool(bad.item())

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        work = self._collect()
        if not self._all_finite(work):
            for group in self.param_groups:
                group["skipped_steps"] = int(group["skipped_steps"]) + 1
            return loss
        if work:
            self._apply(work)
        return loss

    # -- checkpoints ----------------------------------------------------------------------------------
    def load_state_dict(self, state_dict: dict) -> None:
        self._verify(state_dict)
        # torch casts loaded state to the parameter's dtype; keep each tensor in the dtype this optimizer
        # keeps it in (fp32 moments, fp64 SOAP factors) without a round trip through the parameter dtype.
        want = {}
        for group, saved in zip(self.param_groups, state_dict["param_groups"]):
            for p, pid in zip(group["params"], saved["params"]):
                for k, v in state_dict["state"].get(pid, {}).items():
                    cur = self.state.get(p, {}).get(k)
                    if torch.is_tensor(v) and torch.is_tensor(cur) and k != "step":
                        want[(p, k)] = (v, cur.dtype)
        super().load_state_dict(state_dict)
        for (p, k), (v, dtype) in want.items():
            st = self.state[p]
            st[k] = v.to(device=st[k].device, dtype=dtype)

    def _verify(self, state_dict: dict) -> None:
        saved_groups = state_dict.get("param_groups", [])
        if len(saved_groups) != len(self.param_groups):
            raise CheckpointError(f"optimizer checkpoint has {len(saved_groups)} param groups, this run "
                                  f"{len(self.param_groups)}")
        saved_state = state_dict.get("state", {})
        for cur, saved in zip(self.param_groups, saved_groups):
            for key in self.spec_keys:
                if key not in saved:
                    raise CheckpointError(f"optimizer checkpoint has no {key}: it was written by another "
                                          f"optimizer; resume with that optimizer.name")
                if str(saved[key]) != str(cur[key]):
                    raise CheckpointError(f"optimizer {key} differs: checkpoint '{saved[key]}', this run "
                                          f"'{cur[key]}'; resume with the checkpoint's optimizer settings")
            for pid, p in zip(saved["params"], cur["params"]):
                plan = self.plans[p]
                st = saved_state.get(pid, {})
                if "tile_spec" not in st:
                    raise CheckpointError(f"optimizer checkpoint has no tile spec for {plan.fqn}: it was written "
                                          f"by another optimizer")
                got = torch.as_tensor(local(st["tile_spec"])).to(torch.float64).cpu()
                want = plan.spec_tensor().to(torch.float64)
                # Sizes, tiles and rotated axes must match; whether a tile was adapted is informational.
                if got.shape != want.shape or not torch.equal(got[:6], want[:6]):
                    raise CheckpointError(f"optimizer tile spec of {plan.fqn} differs: checkpoint "
                                          f"{describe_spec(got)}, this run {describe_spec(want)}; use the "
                                          f"checkpoint's tile sizes (optimizer.tile_size / overrides)")
