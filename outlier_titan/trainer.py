"""Set-up order and the step loop (DESIGN.md §3).

mesh -> tokenizer -> meta model -> parallelize (TP -> AC -> compile -> FSDP2) -> materialise + init ->
optimizer -> LR schedule -> data -> checkpoint load -> steps.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from outlier_titan import preempt
from outlier_titan.checkpoint.manager import Checkpointer, ModelState, OptimizerState
from outlier_titan.config.job_config import JobConfig
from outlier_titan.config.manager import ConfigError, to_toml
from outlier_titan.data import build_dataloader, build_tokenizer
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import build_meta_model, count_params, flops_per_token
from outlier_titan.observe.logger import MetricsLogger, Throughput, peak_memory_gib
from outlier_titan.optim.builder import build_optimizer
from outlier_titan.optim.lr_schedule import build_lr_scheduler
from outlier_titan.parallel.dims import ParallelDims, device_type_for, init_distributed
from outlier_titan.parallel.grads import clip_grads, grad_norm
from outlier_titan.parallel.parallelize import parallelize


class TrainState:
    """Step counter, skipped-step count and RNG, checkpointed with the run."""

    def __init__(self):
        self.step = 0
        self.skipped_steps = 0

    def state_dict(self):
        return {"step": self.step, "skipped_steps": self.skipped_steps, "rng": torch.get_rng_state()}

    def load_state_dict(self, state):
        self.step = int(state["step"])
        self.skipped_steps = int(state["skipped_steps"])
        torch.set_rng_state(state["rng"])


def loss_context(logits: torch.Tensor):
    """``loss_parallel`` when the logits are vocab-sharded over TP (the cross entropy then reduces across the
    TP ranks instead of gathering [B, T, V]); a no-op otherwise."""
    if isinstance(logits, DTensor):
        return loss_parallel()
    return nullcontext()


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Cross entropy summed over tokens, in fp32."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")


def replicated_value(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor of a scalar that may be a (replicated) DTensor from the parallel loss."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def batch_layout(cfg: JobConfig, dp: int) -> tuple[int, int, int]:
    """(local batch, micro batch, accumulation steps) per DP rank, validated."""
    t = cfg.training
    if t.global_batch_size % dp:
        raise ConfigError(f"training.global_batch_size = {t.global_batch_size} is not divisible by the "
                          f"data-parallel degree {dp}")
    local = t.global_batch_size // dp
    micro = t.micro_batch_size or local
    if local % micro:
        raise ConfigError(f"training.micro_batch_size = {micro} does not divide the per-rank batch {local} "
                          f"(global_batch_size {t.global_batch_size} / dp {dp})")
    return local, micro, local // micro


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        device_type = device_type_for(cfg.training.device)
        self.rank, self.world_size = init_distributed(device_type)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                       else torch.device("cpu"))
        self.dims = ParallelDims.from_config(cfg.parallelism, self.world_size)
        self.mesh = self.dims.build_mesh(device_type)
        self.dp_rank = self.dims.dp_mesh.get_local_rank()
        self.local_batch, self.micro_batch, self.accum_steps = batch_layout(cfg, self.dims.dp)
        self.run_dir = Path(cfg.job.dump_folder) / cfg.job.name
        self.config_toml = to_toml(cfg)
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.toml").write_text(self.config_toml)
        torch.manual_seed(cfg.training.seed)

        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.spec, self.args, self.model = build_meta_model(cfg.model, self.tokenizer.vocab_size, cfg.training.seq_len)
        self.n_params = count_params(self.model)
        self.flops_per_token = flops_per_token(self.model, cfg.training.seq_len)
        parallelize(self.model, self.spec, self.args, cfg, self.dims, self.mesh, device_type)
        self.model.to_empty(device=self.device)
        self.model.init_weights(Initializer(cfg.training.seed, self.device))
        if self.spec.post_step is not None:
            self.spec.post_step(self.model)
        self.model.train()

        self.optimizer = build_optimizer(self.model, cfg.optimizer, seed=cfg.training.seed)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.train_loader = self.build_loader("train", cfg.training.global_batch_size, self.micro_batch)
        self.train_iter = iter(self.train_loader)
        # Validation always reads the same first batches: one loader, rewound before each evaluation.
        self.val_loader = (self.build_loader("validation", cfg.training.global_batch_size, self.micro_batch)
                           if cfg.eval.every else None)
        self.state = TrainState()
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint.keep_latest_k,
            {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer),
             "lr_scheduler": self.lr_scheduler, "dataloader": self.train_loader, "train_state": self.state},
            self.config_toml)
        self.logger = MetricsLogger(self.run_dir, self.rank, cfg.metrics.tensorboard)
        self.throughput = Throughput(self.flops_per_token, self.device, self.world_size)
        self.probe = None
        self.preempted = False  # some rank received a stop signal (reduced over ranks)
        self.tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
        self.cross_entropy = torch.compile(cross_entropy_sum) if cfg.compile.enable else cross_entropy_sum

    def build_loader(self, split: str, global_batch_size: int, micro_batch_size: int):
        """This DP rank's loader of ``split`` (see ``data.build_dataloader``)."""
        return build_dataloader(self.cfg.data, self.tokenizer, split=split, seq_len=self.cfg.training.seq_len,
                                global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                                dp_rank=self.dp_rank, dp_degree=self.dims.dp, seed=self.cfg.training.seed)

    def log0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    # ---------------------------------------------------------------- step

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Token-summed cross entropy divided by the global number of target tokens (compiled with
        ``compile.enable``, except on vocab-sharded logits, which take the loss-parallel path)."""
        ce = cross_entropy_sum if isinstance(logits, DTensor) else self.cross_entropy
        return ce(logits, labels) / self.tokens_per_step

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(self.accum_steps):
            inputs, labels = next(self.train_iter)
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            logits = self.model(inputs)
            with loss_context(logits):
                loss = self.loss_fn(logits, labels)
                loss.backward()
            loss_sum += replicated_value(loss.detach())
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = grad_norm(params)
        finite = bool(torch.isfinite(norm))
        if finite:
            if self.cfg.training.max_norm > 0:
                clip_grads(params, self.cfg.training.max_norm, norm)
            self.optimizer.step()
            if self.spec.post_step is not None:
                self.spec.post_step(self.model)
        else:
            self.state.skipped_steps += 1
            self.log0(f"step {self.state.step + 1}: non-finite gradient norm, update skipped on all ranks")
        self.lr_scheduler.step()
        return loss_sum, norm

    def global_loss(self, local: torch.Tensor) -> float:
        """Sum of the ranks' normalised losses over the data-parallel ranks = the global mean loss."""
        dist.all_reduce(local, group=self.dims.dp_mesh.get_group())
        return local.item()

    @torch.no_grad()
    def validate(self) -> float:
        cfg = self.cfg
        self.val_loader.load_state_dict({"position": 0})
        self.model.eval()
        total = torch.zeros((), device=self.device)
        it = iter(self.val_loader)
        for _ in range(cfg.eval.steps * self.accum_steps):
            inputs, labels = next(it)
            logits = self.model(inputs.to(self.device))
            with loss_context(logits):
                total += replicated_value(self.loss_fn(logits, labels.to(self.device)))
        self.model.train()
        return self.global_loss(total) / cfg.eval.steps

    # ---------------------------------------------------------------- loop

    def train(self) -> None:
        cfg = self.cfg
        resumed = self.checkpointer.load(cfg.checkpoint.load_step) if cfg.checkpoint.enable else None
        if resumed is not None:
            self.train_iter = iter(self.train_loader)
            self.logger.mark_resume(resumed)
            self.log0(f"resumed from {self.checkpointer.folder / f'step-{resumed}'}")
        self.log0(f"model {cfg.model.name}/{cfg.model.flavor}: {self.n_params / 1e6:.2f}M params, "
                  f"{self.flops_per_token / 1e6:.1f} MFLOP/token | world {self.world_size} "
                  f"(dp_replicate {self.dims.dp_replicate}, dp_shard {self.dims.dp_shard}, tp {self.dims.tp}) "
                  f"| batch {cfg.training.global_batch_size}x{cfg.training.seq_len}, "
                  f"micro {self.micro_batch} x {self.accum_steps} | {self.device}")
        if self.probe is None and cfg.observe.every > 0:
            self._build_probe()
        self.throughput.reset()
        if self._preempt_now():  # a stop signal during start-up: the step reached is already saved
            self.log0(f"{self.preempted} received during start-up: stopped before step {self.state.step + 1}")
            return
        while self.state.step < cfg.training.steps:
            self.state.step += 1
            step = self.state.step
            lr = self.optimizer.param_groups[0]["lr"]
            loss, norm = self.train_step()
            self.throughput.add(self.tokens_per_step)
            last = step == cfg.training.steps
            if step % cfg.metrics.log_every == 0 or last or step == 1:
                self._log(step, loss, norm, lr)
            if cfg.eval.every and (step % cfg.eval.every == 0 or last):
                val = self.validate()
                self.logger.log(step, {"val_loss": val}, console=f"step {step:>6}  val_loss {val:.4f}")
                self.throughput.reset()
            if self.probe is not None and (step % cfg.observe.every == 0 or last):
                self._run_probe(step)
            stop = self._preempt_now()
            if cfg.checkpoint.enable and (step % cfg.checkpoint.interval == 0 or last or stop):
                path = self.checkpointer.save(step)
                self.log0(f"checkpoint saved: {path}")
                self.throughput.reset()
            if stop:
                saved = "checkpoint saved" if cfg.checkpoint.enable else "checkpointing disabled, nothing saved"
                self.log0(f"{self.preempted} received: stopped after step {step} ({saved})")
                break

    def _log(self, step: int, loss: torch.Tensor, norm: torch.Tensor, lr: float) -> None:
        loss_v = self.global_loss(loss)
        scalars = {"loss": loss_v, "lr": lr, "grad_norm": float(norm), **self.throughput.read(),
                   "memory_gib": peak_memory_gib(self.device), "skipped_steps": float(self.state.skipped_steps)}
        mfu = f"  mfu {scalars['mfu']:.1f}%" if "mfu" in scalars else ""
        line = (f"step {step:>6}  loss {loss_v:.4f}  lr {lr:.2e}  gnorm {scalars['grad_norm']:.3f}  "
                f"tok/s {scalars['tokens_per_second']:,.0f}{mfu}  mem {scalars['memory_gib']:.2f}GiB")
        self.logger.log(step, scalars, console=line)

    def _build_probe(self) -> None:
        from outlier_titan.observe.probe import OutlierProbe

        cfg = self.cfg
        loader = self.build_loader("validation", cfg.observe.batch_size * self.dims.dp, cfg.observe.batch_size)
        self.probe_tokens = next(iter(loader))[0].to(self.device)
        self.probe = OutlierProbe(self.model, cfg.observe, self.mesh)

    def _run_probe(self, step: int) -> None:
        t0 = time.perf_counter()
        scalars, images = self.probe.run(self.probe_tokens)
        scalars["outliers/probe_seconds"] = time.perf_counter() - t0
        self.logger.log(step, scalars, images)
        self.throughput.reset()

    def _preempt_now(self) -> str | bool:
        """The stop signal's name on every rank once any rank got one (checkpoint.stop_signals), else False.
        A rank whose launcher died stops here, before it can write anything."""
        if not preempt.launcher_alive():
            print(f"rank {self.rank}: launcher is gone; stopping without saving", file=sys.stderr, flush=True)
            os._exit(1)
        name = preempt.stop_requested()
        flag = torch.tensor([float(getattr(signal, name)) if name else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._cpu_group())
        self.preempted = signal.Signals(int(flag.item())).name if flag.item() else False
        return self.preempted

    def _cpu_group(self):
        if not hasattr(self, "_gloo"):
            self._gloo = dist.new_group(backend="gloo") if self.device.type == "cuda" else dist.group.WORLD
        return self._gloo

    def close(self) -> None:
        """Waits for every rank, then tears the process groups down (a rank that exits while a peer's gloo
        threads still talk to it can abort the peer at exit)."""
        self.logger.close()
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()


def main(argv: list[str]) -> int:
    from outlier_titan.config.manager import parse_args
    from outlier_titan.errors import UserError

    trainer = None
    try:
        cfg = parse_args(argv)
        preempt.configure(cfg.checkpoint.stop_signals)
        if cfg.job.dry_run:
            from outlier_titan.parallel.planning import dry_run

            dry_run(cfg)
            return 0
        trainer = Trainer(cfg)
        trainer.train()
        trainer.close()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        preempt.report_user_error(f"error: {e}")
        if dist.is_initialized():
            dist.destroy_process_group()
        return 2
    return 0
