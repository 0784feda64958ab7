"""Set-up order and the step loop.

mesh -> tokenizer -> data -> run folder (lock, writability, which checkpoint, config compatibility) -> meta model
-> parallelize (TP -> AC -> compile -> FSDP2) -> materialise + init -> optimizer -> LR schedule -> training remedies
(outlier_titan.remedies: loss terms, after-step hooks) -> checkpoint
load -> config record -> steps. A failed start removes the run folder it created.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

import outlier_titan.components  # noqa: F401  (the built-ins registered before any config is read)
from outlier_titan import preempt
from outlier_titan.checkpoint.manager import (Checkpointer, ModelState, OptimizerState, check_resume, move_aside,
                                              select_checkpoint)
from outlier_titan.checkpoint.run_folder import RunFolder, check_writable, on_rank0
from outlier_titan.config.job_config import JobConfig
from outlier_titan.config.manager import to_toml
from outlier_titan.data import build_dataloader, build_tokenizer
from outlier_titan.data.sources import tokenizer_mismatch
from outlier_titan.errors import ConfigError
from outlier_titan.eval.perplexity import validation_budget
from outlier_titan.hf.load import apply_initial_model, load_model_state
from outlier_titan.lowprec.training import set_rng_position
from outlier_titan.models.init import Initializer
from outlier_titan.models.registry import build_meta_model, count_params, flops_per_token
from outlier_titan.observe.logger import MetricsLogger, Throughput
from outlier_titan.optim.builder import (after_build, build_optimizer, check_optimizer_layout, checked_optimizer,
                                        config_owned_hyperparameters)
from outlier_titan.optim.lr_schedule import build_lr_scheduler
from outlier_titan.parallel.dims import ParallelDims, device_type_for, fake_world, init_distributed
from outlier_titan.parallel.grads import clip_grads, grad_norm, param_norm
from outlier_titan.parallel.parallelize import parallelize
from outlier_titan.remedies import Remedies, RemedyContext, validate_remedies
from outlier_titan.training.console import RunConsole, perplexity
from outlier_titan.training.divergence import DivergenceGuard, Health
from outlier_titan.training.step import (TrainState, batch_layout, cross_entropy_sum, loss_context, probe_layout,
                                         replicated_value)



class Trainer(RunConsole, DivergenceGuard):
    """The set-up (module docstring) and the step loop; the console lines and the divergence guard are its parts in
    ``outlier_titan.training``."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        device_type = device_type_for(cfg.training.device)
        if cfg.parallelism.fake_world_size and cfg.checkpoint.enable:
            raise ConfigError("parallelism.fake_world_size runs rank 0 alone, which cannot save a checkpoint of "
                              "the whole job: set checkpoint.enable = false")
        self.rank, self.world_size = init_distributed(device_type, cfg.parallelism.collective_timeout_s,
                                                      cfg.parallelism.fake_world_size)
        self.device = (torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda"
                       else torch.device("cpu"))
        self.dims = ParallelDims.from_config(cfg.parallelism, self.world_size)
        self.mesh = self.dims.build_mesh(device_type)
        self.dp_rank = self.dims.dp_mesh.get_local_rank()
        self.local_batch, self.micro_batch, self.accum_steps = batch_layout(cfg, self.dims.dp)
        self.probe_local_batch = probe_layout(cfg, self.dims.dp)
        self.run_dir = Path(cfg.job.dump_folder) / cfg.job.name
        apply_initial_model(cfg)  # continued pretraining: the stored model's shape
        self.config_toml = to_toml(cfg)
        torch.manual_seed(cfg.training.seed)

        # Everything that can fail on bad input is checked before the (possibly minutes-long) model build.
        self.tokenizer = build_tokenizer(cfg.data.tokenizer)
        self.train_loader = self.build_loader("train", cfg.training.global_batch_size, self.micro_batch)
        # Validation always reads the same first windows, each once: one loader, rewound before each evaluation.
        self.val_loader = (self.build_loader("validation", cfg.training.global_batch_size, self.micro_batch)
                           if cfg.eval.every else None)
        if self.val_loader is not None:
            seq_len = cfg.training.seq_len
            wanted = cfg.eval.steps * cfg.training.global_batch_size * seq_len
            asked = "eval.steps x training.global_batch_size x training.seq_len"
            budget = validation_budget(self.val_loader, seq_len, wanted, asked, warn=self.rank == 0)
            self.val_windows = budget // seq_len
        self.run = RunFolder(self.run_dir)
        ckpt_dir = self.run_dir / "checkpoints"
        self.meta = {"tokenizer": self.tokenizer.fingerprint, "vocab_size": self.tokenizer.vocab_size}

        def plan() -> tuple[int | None, dict[int, str], list[str]]:
            """Read-only checks of the run folder: nothing is created before the model is built."""
            self.run.check_free()
            check_writable(self.run_dir, "run folder")
            if not cfg.checkpoint.enable:
                return None, {}, []
            check_writable(ckpt_dir, "checkpoint folder")
            step, unreadable = select_checkpoint(ckpt_dir, cfg.checkpoint.load_step, cfg.checkpoint.verify)
            notes = (check_resume(ckpt_dir / f"step-{step}", self.config_toml, self.meta,
                                  cfg.checkpoint.allow_config_change) if step is not None else [])
            return step, unreadable, notes

        self.resumed_step, unreadable, notes = on_rank0(plan, self._cpu_group())
        for note in notes:
            self.log0(note)
        self._build(device_type)

        def take() -> list[str]:
            note = self.run.acquire()
            return ([note] if note else []) + move_aside(ckpt_dir, unreadable, self.resumed_step)

        for note in on_rank0(take, self._cpu_group()):
            self.log0(note)
        try:
            self._restore()
        except BaseException:
            if self.rank == 0:
                self.run.abandon()
            raise

    def _build(self, device_type: str) -> None:
        """Model (meta -> parallelize -> materialise), optimizer, LR schedule, checkpointer; writes nothing."""
        cfg = self.cfg
        checked_optimizer(cfg.optimizer)  # a registered name and its own checks, before any model is built
        validate_remedies(cfg.remedies)
        self.spec, self.args, self.model = build_meta_model(cfg.model, self.tokenizer.vocab_size, cfg.training.seq_len)
        self.n_params = count_params(self.model)
        self.flops_per_token = flops_per_token(self.model, cfg.training.seq_len)
        self.lowprec_modules = parallelize(self.model, self.spec, self.args, cfg, self.dims, self.mesh, device_type,
                                           log=self.log0)
        check_optimizer_layout(self.model, cfg.optimizer)  # before materialising
        self.model.to_empty(device=self.device)
        self.model.init_weights(Initializer(cfg.training.seed, self.device))
        if cfg.checkpoint.initial_load_path:
            load_model_state(self.model, cfg.checkpoint.initial_load_path)
        elif self.spec.post_step is not None:
            self.spec.post_step(self.model)
        self.model.train()

        self.optimizer = build_optimizer(self.model, cfg.optimizer, seed=cfg.training.seed)
        line = after_build(self.optimizer, cfg.optimizer, cfg.compile.enable)
        if line:
            self.log0(line)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler, cfg.training.steps)
        self.remedies = Remedies(self.model, cfg, RemedyContext(
            dp_group=self.dims.dp_mesh.get_group() if self.dims.dp > 1 else None,
            tp_group=self.mesh["tp"].get_group() if self.dims.tp > 1 else None,
            tokens_per_step=cfg.training.global_batch_size * cfg.training.seq_len))
        self.train_iter = iter(self.train_loader)
        self.state = TrainState()
        self.checkpointer = Checkpointer(
            self.run_dir / "checkpoints", cfg.checkpoint.keep_latest_k,
            {"model": ModelState(self.model), "optimizer": OptimizerState(self.model, self.optimizer),
             "lr_scheduler": self.lr_scheduler, "dataloader": self.train_loader, "train_state": self.state},
            self.config_toml, self.meta)

    def _restore(self) -> None:
        """Checkpoint load, then the run's config record (check first, write after), logger and step state."""
        cfg = self.cfg
        resume_step = self.resumed_step
        if resume_step is not None:
            owned = config_owned_hyperparameters(cfg.optimizer)
            configured = [{k: g[k] for k in owned if k in g} for g in self.optimizer.param_groups]
            base_lrs = list(self.lr_scheduler.base_lrs)
            self.checkpointer.load(resume_step)
            # The optimizer and LR-schedule states carry the saved hyperparameters; this run's config wins
            # (changes were reported, and refused where they break the run).
            for group, values, base, factor in zip(self.optimizer.param_groups, configured, base_lrs,
                                                   self.lr_scheduler.lr_lambdas):
                group.update(values)
                lr = base * factor(self.lr_scheduler.last_epoch)
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lr)
                else:
                    group["lr"] = lr
            self.lr_scheduler.base_lrs = base_lrs
            self.train_iter = iter(self.train_loader)

        def record() -> None:
            kept = self.run.write_config(self.config_toml, resume_step or 0)
            if kept:
                print(f"config changed: the previous record is kept as {self.run_dir / kept}", flush=True)

        on_rank0(record, self._cpu_group())
        if cfg.checkpoint.enable and self.state.step < cfg.training.steps:
            interval = cfg.checkpoint.interval
            self.checkpointer.check_space(min((self.state.step // interval + 1) * interval, cfg.training.steps))
        self.logger = MetricsLogger(self.run_dir, self.rank, cfg.metrics.tensorboard, self._start_wandb())
        if resume_step is not None:
            self.logger.mark_resume(resume_step)
            self.log0(f"resumed from {self.checkpointer.folder / f'step-{resume_step}'}")
        self.throughput = Throughput(self.flops_per_token, self.device, self.world_size)
        self.probe = None
        self.preempted = False  # some rank received a stop signal (reduced over ranks)
        self.saved_steps: list[int] = []  # the checkpoints this session saved
        self.tokens_per_step = cfg.training.global_batch_size * cfg.training.seq_len
        self.cross_entropy = torch.compile(cross_entropy_sum) if cfg.compile.enable else cross_entropy_sum

    def _start_wandb(self):
        """Rank 0's W&B run with ``metrics.wandb`` (None elsewhere, when off, or when it cannot start)."""
        if not (self.cfg.metrics.wandb and self.rank == 0):
            return None
        from outlier_titan.config.manager import tomllib
        from outlier_titan.observe.wandb_logger import start_wandb

        return start_wandb(self.run_dir, self.cfg.metrics, self.cfg.job.name, tomllib.loads(self.config_toml),
                           resuming=self.resumed_step is not None)

    def build_loader(self, split: str, global_batch_size: int, micro_batch_size: int):
        """This DP rank's loader of ``split`` (see ``data.build_dataloader``)."""
        return build_dataloader(self.cfg.data, self.tokenizer, split=split, seq_len=self.cfg.training.seq_len,
                                global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                                dp_rank=self.dp_rank, dp_degree=self.dims.dp, seed=self.cfg.training.seed)

    def log0(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    # ---------------------------------------------------------------- step

    def loss_sum(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Token-summed cross entropy (labels -100 are ignored); compiled with ``compile.enable``, except on
        vocab-sharded logits, which take the loss-parallel path."""
        ce = cross_entropy_sum if isinstance(logits, DTensor) else self.cross_entropy
        return ce(logits, labels)

    def loss_fn(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Token-summed cross entropy divided by the global number of target tokens."""
        return self.loss_sum(logits, labels) / self.tokens_per_step

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum_steps):
            if self.lowprec_modules:  # the casts' random numbers: the same for this micro-batch in every layout
                set_rng_position(self.cfg.training.seed, self.state.step, self.dp_rank * self.accum_steps + micro)
            inputs, labels = next(self.train_iter)
            inputs, labels = inputs.to(self.device), labels.to(self.device)
            logits = self.model(inputs)
            term = self.remedies.loss_term()  # a remedy's share of this micro-batch (the same on every TP rank)
            with loss_context(logits):
                loss = self.loss_fn(logits, labels)
                if term is not None and isinstance(loss, DTensor):
                    term = DTensor.from_local(term, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim,
                                              run_check=False)
                (loss if term is None else loss + term).backward()
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
            self.remedies.after_step()
        else:
            self.state.skipped_steps += 1
            self.log0(f"step {self.state.step}: non-finite gradient norm, update skipped on all ranks")
        self.lr_scheduler.step()
        return loss_sum, norm

    def global_loss(self, local: torch.Tensor) -> float:
        """Sum of the ranks' normalised losses over the data-parallel ranks = the global mean loss."""
        dist.all_reduce(local, group=self.dims.dp_mesh.get_group())
        return local.item()

    @torch.no_grad()
    def validate(self) -> tuple[float, int]:
        """(mean loss, tokens) over the first ``val_windows`` validation windows, each scored once.

        Whole global batches are read; rows past ``val_windows`` (a split smaller than eval.steps batches) are
        masked out of the loss, so every rank still runs the same forwards (FSDP collectives)."""
        g = self.cfg.training.global_batch_size
        self.val_loader.load_state_dict({"position": 0})
        self.model.eval()
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss sum, tokens
        it = iter(self.val_loader)
        for step in range(-(-self.val_windows // g)):
            for micro in range(self.accum_steps):
                inputs, labels = next(it)
                first = step * g + self.dp_rank * self.local_batch + micro * self.micro_batch
                keep = torch.arange(first, first + self.micro_batch) < self.val_windows
                labels = labels.masked_fill(~keep[:, None], -100).to(self.device)
                logits = self.model(inputs.to(self.device))
                with loss_context(logits):
                    sums[0] += replicated_value(self.loss_sum(logits, labels)).double()
                sums[1] += int(keep.sum()) * labels.shape[1]
        self.model.train()
        dist.all_reduce(sums, group=self.dims.dp_mesh.get_group())
        return float(sums[0] / sums[1]), int(sums[1])

    # ---------------------------------------------------------------- loop

    def train(self) -> None:
        cfg = self.cfg
        total = cfg.training.steps
        if self.resumed_step is not None and self.resumed_step >= total:
            self.log0(f"{self.run_dir}: already complete ({self.resumed_step}/{total} steps); nothing to do "
                      f"(raise training.steps to train further)")
            return
        if self.resumed_step is None and cfg.checkpoint.initial_load_path:
            self.log0(f"weights from {cfg.checkpoint.initial_load_path}")
        self.log0(f"model {cfg.model.name}/{cfg.model.flavor}: {self.n_params / 1e6:.2f}M params, "
                  f"{self.flops_per_token / 1e6:.1f} MFLOP/token | world {self.world_size} "
                  f"(dp_replicate {self.dims.dp_replicate}, dp_shard {self.dims.dp_shard}, tp {self.dims.tp}) "
                  f"| batch {cfg.training.global_batch_size}x{cfg.training.seq_len}, "
                  f"micro {self.micro_batch} x {self.accum_steps} | {self.device}")
        self.log0(self._hosts_line())
        self.log0(self._data_line())
        mismatch = tokenizer_mismatch(cfg.data.source, cfg.data.tokenizer)
        if mismatch and self.rank == 0:
            print(f"warning: {mismatch}", file=sys.stderr, flush=True)
        if self.probe is None and cfg.observe.every > 0:
            self._build_probe()
        self.throughput.reset()
        self.t_start, self.step_start = time.perf_counter(), self.state.step
        self.last_loss = self.last_val = None
        self.health = Health(self.tokenizer.vocab_size)
        if self._preempt_now():  # a stop signal during start-up: the step reached is already saved
            self.log0(f"{self.preempted} received during start-up: stopped before step {self.state.step + 1}")
            return
        while self.state.step < total:
            self.state.step += 1
            step = self.state.step
            lr = self.optimizer.param_groups[0]["lr"]
            save_due = cfg.checkpoint.enable and (step % cfg.checkpoint.interval == 0 or step == total)
            norm_before = float(param_norm(self.model.parameters())) if save_due else None  # for the guard
            loss, norm = self.train_step()
            loss = self.global_loss(loss)
            self.throughput.add(self.tokens_per_step)
            last = step == total
            if step % cfg.metrics.log_every == 0 or last or step == 1:
                self._log(step, loss, norm, lr)
            if cfg.eval.every and (step % cfg.eval.every == 0 or last):
                val, n = self.validate()
                self.last_val = val
                self.logger.log(step, {"val_loss": val, "val_ppl": perplexity(val), "val_tokens": float(n)},
                                console=f"step {step:>6}/{total}  val_loss {val:.4f}  val_ppl {perplexity(val):.2f}"
                                        f"  ({n:,} tokens)")
                self.throughput.reset()
            if self.probe is not None and (step % cfg.observe.every == 0 or last):
                self._run_probe(step)
            stop = self._preempt_now()
            saved = False
            problem = self._step_problem(step, loss, norm)
            if problem:
                self._check_divergence(step, problem, last)
            if save_due or (cfg.checkpoint.enable and stop):
                ruined = None if problem else self._weights_problem(norm_before)
                if problem or ruined:
                    self.log0(f"step {step}: checkpoint not saved: "
                              + (f"this step diverged ({problem})" if problem else
                                 f"the weights its update produced are ruined ({ruined})"))
                    if ruined and last and cfg.training.max_skipped_steps:
                        raise self._diverged(f"step {step}'s update left ruined weights ({ruined})")
                else:
                    path = self.checkpointer.save(step)
                    self.saved_steps.append(step)
                    saved = True
                    self.log0(f"checkpoint saved: {path}")
                    stop = stop or self._preempt_now()  # a stop signal during the save ends the run here
                self.throughput.reset()
            if self.rank == 0:
                self.run.heartbeat()
            if stop:
                what = ("checkpoint saved" if saved else "its weights not saved, resume from the newest checkpoint"
                        if cfg.checkpoint.enable else "checkpointing disabled, nothing saved")
                self.log0(f"{self.preempted} received: stopped after step {step} ({what})")
                break
        self.log0(self._summary())

    def _build_probe(self) -> None:
        from outlier_titan.observe.probe import OutlierProbe

        cfg = self.cfg
        # observe.batch_size is the global probe batch: the same first windows of the split at any layout
        loader = self.build_loader("validation", cfg.observe.batch_size, self.probe_local_batch)
        self.probe_tokens = next(iter(loader))[0].to(self.device)
        self.probe = OutlierProbe(self.model, cfg.observe, self.mesh)

    def _run_probe(self, step: int) -> None:
        from outlier_titan.observe.metrics import headline

        t0 = time.perf_counter()
        scalars, images = self.probe.run(self.probe_tokens)
        scalars["outliers/probe_seconds"] = time.perf_counter() - t0
        self.logger.log(step, scalars, images, console=headline(step, scalars))
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
            real_gpu = self.device.type == "cuda" and not fake_world()
            self._gloo = dist.new_group(backend="gloo") if real_gpu else dist.group.WORLD
        return self._gloo

    def close(self) -> None:
        """Waits for every rank, then tears the process groups down (a rank that exits while a peer's gloo
        threads still talk to it can abort the peer at exit)."""
        self.logger.close()
        if dist.is_initialized():
            dist.barrier()
        if self.rank == 0:
            self.run.release()
        if dist.is_initialized():
            dist.destroy_process_group()

    def abort(self) -> None:
        """After an error during training: closes the record and releases the run folder (no collectives)."""
        self.logger.close(exit_code=1)
        if self.rank == 0:
            self.run.release()


def main(argv: list[str]) -> int:
    from outlier_titan import exit_codes
    from outlier_titan.config.manager import parse_args
    from outlier_titan.errors import RunFailure, UserError

    trainer = None
    try:
        cfg = parse_args(argv)
        apply_initial_model(cfg)
        preempt.configure(cfg.checkpoint.stop_signals)
        if cfg.job.dry_run:
            from outlier_titan.training.planning import dry_run

            dry_run(cfg)
            return 0
        trainer = Trainer(cfg)
        trainer.train()
        trainer.close()
        # Stopped on request before the last step: resumable, and not "finished" (batch scripts requeue on it).
        return exit_codes.STOPPED if trainer.preempted and trainer.state.step < cfg.training.steps else 0
    except (RunFailure, RuntimeError) as e:
        if not isinstance(e, RunFailure):
            if trainer is None or not _peer_failure(e):
                if trainer is not None:
                    trainer.abort()
                raise
            e = RunFailure(f"a collective failed ({_peer_failure(e)}): a peer rank died, froze or cannot be "
                           f"reached (parallelism.collective_timeout_s = {cfg.parallelism.collective_timeout_s}); "
                           "resume from the newest complete checkpoint")
        preempt.report_failure(f"failure: {e}")
        if trainer is not None:
            trainer.abort()
        return e.exit_code
    except UserError as e:
        preempt.report_user_error(f"error: {e}")
        if trainer is not None:
            trainer.abort()
        if dist.is_initialized():
            dist.destroy_process_group()
        return e.exit_code
    except BaseException:
        if trainer is not None:
            trainer.abort()
        raise


# What gloo and NCCL say when a peer is gone or silent (their errors are plain RuntimeErrors / DistErrors).
PEER_FAILURE = ("Timed out", "timed out", "Connection closed by peer", "Connection reset by peer", "Broken pipe",
                "NCCL communicator was aborted", "Watchdog caught collective operation timeout")


def _peer_failure(e: BaseException) -> str | None:
    """The first line of a collective's error that says a peer died or froze, else None."""
    text = str(e).strip()
    if not (isinstance(e, dist.DistError) or any(p in text for p in PEER_FAILURE)):
        return None
    line = text.splitlines()[0] if text else type(e).__name__
    return line.split("] ", 1)[-1].split(". ")[0][:200]
