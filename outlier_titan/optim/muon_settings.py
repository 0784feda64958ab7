"""Muon's ``[optimizer]`` options, declared once (defaults, help, choices); the config composes them into
``[optimizer]`` under the owner ``muon`` and ``optim/builder.py`` registers Muon with them. ``optimizer.lr`` /
``weight_decay`` are Muon's; the embeddings, the output head and 1-D parameters go to AdamW with the ``muon_adamw_*``
settings (docs/muon.md). This module imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass

from outlier_titan.config.job_config import add_option_group
from outlier_titan.options import OptionGroup, opt


@dataclass
class MuonOptions:
    muon_momentum: float = opt(0.95, "muon: momentum of the momentum buffer.")
    muon_nesterov: bool = opt(True, "muon: Nesterov momentum (the orthogonalised matrix is g + mu * buf).")
    muon_ns_steps: int = opt(5, "muon: Newton-Schulz iterations.")
    muon_ns_coefficients: list = opt(["3.4445", "-4.775", "2.0315"], "muon: quintic Newton-Schulz coefficients "
                                                                     "(a, b, c).")
    muon_eps: float = opt(1e-7, "muon: the Frobenius norm is clamped to at least eps before Newton-Schulz.")
    muon_adjust_lr_fn: str = opt("original", "muon: per-matrix lr scale: sqrt(max(1, rows/cols)) (original) or "
                                             "0.2 * sqrt(max(rows, cols)) (match_rms_adamw).",
                                 ("original", "match_rms_adamw"))
    muon_ns_dtype: str = opt("bfloat16", "muon: dtype of the Newton-Schulz iteration (torch.optim.Muon: bfloat16).",
                             ("bfloat16", "float32", "float64"))
    muon_layout: str = opt("full", "muon: a sharded matrix is orthogonalised whole (full: all-to-all to an owner "
                                   "rank and back), in shard-local tiles of the global tile grid (block), or in "
                                   "tiles with a full step every muon_full_every steps (block_periodic, MuonBP).",
                           ("full", "block", "block_periodic"))
    muon_full_every: int = opt(5, "muon: block_periodic: a full step on steps 1, 1 + k, 1 + 2k, ... (k >= 1).")
    muon_per_head: bool = opt(False, "muon: orthogonalise each head's rows of wq/wk/wv separately.")
    muon_adamw_lr: float = opt(3e-3, "muon: AdamW lr of the embeddings, the output head and 1-D parameters.")
    muon_adamw_beta1: float = opt(0.9, "muon: AdamW beta1 of the non-Muon parameters.")
    muon_adamw_beta2: float = opt(0.95, "muon: AdamW beta2 of the non-Muon parameters.")
    muon_adamw_weight_decay: float = opt(0.1, "muon: AdamW decoupled weight decay of the non-Muon parameters "
                                              "outside optimizer.no_decay.")


def option_groups() -> list[OptionGroup]:
    return [OptionGroup("optimizer", "optimizer", "muon", MuonOptions)]


for _group in option_groups():
    add_option_group(_group)
