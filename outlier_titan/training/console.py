"""What a run prints: the start-up lines (hosts, data), the step line with progress and ETA, the end-of-run summary.
:class:`RunConsole` is a part of the trainer (it reads the trainer's state)."""

from __future__ import annotations

import datetime
import math
import socket
import time

import torch
import torch.distributed as dist

from outlier_titan.observe.logger import peak_memory_gib
from outlier_titan.parallel.dims import fake_world


def hms(seconds: float) -> str:
    """Seconds as H:MM:SS."""
    return str(datetime.timedelta(seconds=int(round(max(seconds, 0.0)))))


def count(n: float) -> str:
    """A token count for the console: 950, 12.3k, 4.56M, 1.23B."""
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return f"{n:.0f}"


def perplexity(loss: float) -> float:
    """exp(loss), inf when it overflows."""
    return math.exp(loss) if loss < 700 else math.inf


class RunConsole:
    """The trainer's console lines (mixed into ``outlier_titan.trainer.Trainer``)."""

    def _hosts_line(self) -> str:
        """Which host each rank runs on (``hosts: node1 ranks 0-1 | node2 ranks 2-3``), from every rank."""
        if fake_world():  # no other rank to ask
            return f"hosts: {socket.gethostname()} rank 0 of a fake world of {self.world_size} (collectives do nothing)"
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, socket.gethostname(), group=self._cpu_group())
        ranges: list[list] = []
        for rank, host in enumerate(hosts):
            if ranges and ranges[-1][0] == host and ranges[-1][2] == rank - 1:
                ranges[-1][2] = rank
            else:
                ranges.append([host, rank, rank])
        return "hosts: " + " | ".join(f"{h} rank{'s' if a != b else ''} {a}{f'-{b}' if a != b else ''}"
                                      for h, a, b in ranges)

    def _data_line(self) -> str:
        """Sizes of the splits and how many passes over the training split this run makes."""
        cfg = self.cfg
        t = cfg.training.seq_len
        planned = cfg.training.steps * self.tokens_per_step
        train_w = self.train_loader.num_windows
        line = f"data {self.train_loader.description}: train "
        if train_w is None:
            line += f"endless (streamed or generated); this run reads {planned:,} tokens"
        else:
            line += (f"{train_w * t:,} tokens; this run reads {planned:,} tokens = "
                     f"{planned / (train_w * t):.3g} epochs")
        if self.val_loader is not None:
            line += f" | validation {self.val_windows * t:,} tokens per evaluation"
            if self.val_loader.num_windows is not None:
                line += f" (split: {self.val_loader.num_windows * t:,})"
        return line

    def _progress(self, step: int) -> str:
        """``step N/total``, tokens seen, elapsed time and the ETA from this session's step rate."""
        total = self.cfg.training.steps
        elapsed = time.perf_counter() - self.t_start
        done = step - self.step_start
        eta = elapsed / done * (total - step) if done > 0 else 0.0
        return (f"step {step:>6}/{total}  tokens {count(step * self.tokens_per_step)}  "
                f"elapsed {hms(elapsed)}  eta {hms(eta)}")

    def _summary(self) -> str:
        """The end-of-run line: steps, final losses and perplexities, wall time, tokens, run folder."""
        step, total = self.state.step, self.cfg.training.steps
        head = "finished" if step >= total else "stopped"
        parts = [f"{head} {step}/{total} steps in {hms(time.perf_counter() - self.t_start)}",
                 f"{count(step * self.tokens_per_step)} tokens"]
        if self.last_loss is not None:
            parts.append(f"train loss {self.last_loss:.4f} (ppl {perplexity(self.last_loss):.2f})")
        if self.last_val is not None:
            parts.append(f"val loss {self.last_val:.4f} (ppl {perplexity(self.last_val):.2f})")
        parts.append(f"run folder {self.run_dir}")
        return " | ".join(parts)

    def _log(self, step: int, loss_v: float, norm: torch.Tensor, lr: float) -> None:
        self.last_loss = loss_v
        scalars = {"loss": loss_v, "lr": lr, "grad_norm": float(norm), **self.throughput.read(),
                   "memory_gib": peak_memory_gib(self.device), "skipped_steps": float(self.state.skipped_steps),
                   "tokens": float(step * self.tokens_per_step), **self.remedies.scalars()}
        mfu = f"  mfu {scalars['mfu']:.1f}%" if "mfu" in scalars else ""
        line = (f"{self._progress(step)}  loss {loss_v:.4f}  lr {lr:.2e}  gnorm {scalars['grad_norm']:.3f}  "
                f"tok/s {scalars['tokens_per_second']:,.0f}{mfu}  mem {scalars['memory_gib']:.2f}GiB")
        self.logger.log(step, scalars, console=line)
