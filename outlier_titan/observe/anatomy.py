"""Where a model's large residual-stream activations sit: in which blocks, at which positions, on which tokens
and in which channels; over a run's checkpoints, when they appear and whether they stay.

An entry ``x[b, t, c]`` of a block's output (the residual stream, where the probe measures) is *large* when
``|x|`` exceeds ``factor`` times the median ``|x|`` of its sequence at that block: Sun et al. 2024's rule for
massive activations (arXiv 2402.17762), the same as the probe's ``massive_count``
(:data:`outlier_titan.observe.sinks.MASSIVE_FACTOR` = 100 by default).

Per block the anatomy counts the large entries and attributes them: the share at position 0, per channel (the
channels that carry them: He et al. 2024's outlier features are channels), per token id at positions > 0 (which
tokens carry them; Sun et al. find delimiters and the first token), and keeps the ``top_k`` largest entries with
their sequence, position, token and channel. Counts are over the analysed sequences, so ``share`` values compare
across checkpoints of one run; ``per_sequence`` divides the count by the number of sequences (the probe's unit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from outlier_titan.observe.hooks import measuring
from outlier_titan.observe.sinks import MASSIVE_FACTOR, massive_mask


@dataclass
class LayerAnatomy:
    """Running counts of one block's large activations (see the module docstring)."""

    dim: int
    vocab: int
    factor: float = MASSIVE_FACTOR
    top_k: int = 10
    sequences: int = 0
    tokens: int = 0
    count: int = 0
    first_position: int = 0
    max_abs: float = 0.0
    per_channel: torch.Tensor = field(init=False)
    channel_max: torch.Tensor = field(init=False)
    per_token: torch.Tensor = field(init=False)
    top: list[tuple[float, int, int, int, int]] = field(default_factory=list)  # |x|, sequence, position, token, ch

    def __post_init__(self):
        self.per_channel = torch.zeros(self.dim, dtype=torch.int64)
        self.channel_max = torch.zeros(self.dim, dtype=torch.float64)
        self.per_token = torch.zeros(self.vocab, dtype=torch.int64)

    @torch.no_grad()
    def add(self, x: torch.Tensor, tokens: torch.Tensor) -> None:
        """One batch: ``x`` [B, T, D] (a block's output), ``tokens`` [B, T] (the input ids)."""
        a, _, large = massive_mask(x.detach(), self.factor)
        b, t, d = a.shape
        self.per_channel += large.sum(dim=(0, 1)).cpu()
        self.channel_max = torch.maximum(self.channel_max, a.amax(dim=(0, 1)).cpu())
        per_pos = large.sum(-1)  # [B, T]: large entries at each (sequence, position)
        ids = tokens[:, 1:].reshape(-1).cpu()
        self.per_token.index_add_(0, ids, per_pos[:, 1:].reshape(-1).cpu())
        self.count += int(large.sum())
        self.first_position += int(per_pos[:, 0].sum())
        self.max_abs = max(self.max_abs, float(a.max()))
        k = min(self.top_k, a.numel())
        values, flat = a.reshape(-1).topk(k)
        for v, i in zip(values.tolist(), flat.tolist()):
            seq, rem = divmod(i, t * d)
            pos, ch = divmod(rem, d)
            self.top.append((v, self.sequences + seq, pos, int(tokens[seq, pos]), ch))
        self.top = sorted(self.top, reverse=True)[:self.top_k]
        self.sequences += b
        self.tokens += b * t

    def summary(self, decode: Callable[[int], str] | None = None, n: int = 5) -> dict[str, Any]:
        """The block's numbers: counts, shares, the ``n`` busiest channels and tokens, the largest entries."""
        decode = decode or str
        total = max(self.count, 1)
        ch_counts, ch_idx = self.per_channel.topk(min(n, self.dim))
        tok_counts, tok_idx = self.per_token.topk(min(n, self.vocab))
        channels = [{"channel": int(c), "count": int(k), "share": int(k) / total,
                     "max_abs": float(self.channel_max[c])} for k, c in zip(ch_counts, ch_idx) if k > 0]
        tokens = [{"token_id": int(i), "token": decode(int(i)), "count": int(k), "share": int(k) / total}
                  for k, i in zip(tok_counts, tok_idx) if k > 0]
        return {"sequences": self.sequences, "tokens": self.tokens, "max_abs": self.max_abs, "large": self.count,
                "per_sequence": self.count / max(self.sequences, 1),
                "first_position_share": self.first_position / total if self.count else 0.0,
                "channels": channels, "top_channel_share": sum(c["share"] for c in channels[:3]),
                "busiest_tokens": tokens,
                "top": [{"abs": v, "sequence": s, "position": p, "token_id": tok, "token": decode(tok), "channel": c}
                        for v, s, p, tok, c in self.top]}


@torch.no_grad()
def residual_anatomy(model: nn.Module, batches: Iterable[torch.Tensor], vocab_size: int, *,
                     factor: float = MASSIVE_FACTOR, top_k: int = 10, decode: Callable[[int], str] | None = None,
                     n: int = 5) -> dict[str, dict[str, Any]]:
    """The anatomy of every block's output (``model.layers``) over ``batches`` of token ids [B, T]; a dict
    ``{block name: summary}`` (:meth:`LayerAnatomy.summary`)."""
    layers: dict[str, LayerAnatomy] = {}
    current: list[torch.Tensor] = []

    def hook(name):
        def fn(_module, _inputs, output):
            x = output[0] if isinstance(output, (tuple, list)) else output
            if name not in layers:
                layers[name] = LayerAnatomy(x.shape[-1], vocab_size, factor, top_k)
            layers[name].add(x, current[0])
        return fn

    with measuring(model, [block.register_forward_hook(hook(name)) for name, block in model.layers.items()]):
        for tokens in batches:
            current[:] = [tokens]
            model(tokens)
    if not layers:
        raise ValueError("residual_anatomy needs at least one batch")
    return {name: a.summary(decode, n) for name, a in layers.items()}


def persistence(by_step: dict[int, dict[str, dict[str, Any]]], min_share: float = 0.05
                ) -> dict[str, list[dict[str, Any]]]:
    """Per block, each channel that carries at least ``min_share`` of the large entries at some checkpoint: its
    share at every checkpoint (0 where it is not among the listed channels), the first step where it reaches
    ``min_share``, and whether it still does at the last one."""
    steps = sorted(by_step)
    out: dict[str, list[dict[str, Any]]] = {}
    for block in by_step[steps[-1]]:
        shares: dict[int, dict[int, float]] = {}
        for s in steps:
            for c in by_step[s].get(block, {}).get("channels", []):
                shares.setdefault(c["channel"], {})[s] = c["share"]
        rows = []
        for ch, per in shares.items():
            reached = [s for s in steps if per.get(s, 0.0) >= min_share]
            if reached:
                rows.append({"channel": ch, "first_step": reached[0], "at_last": per.get(steps[-1], 0.0) >= min_share,
                             "shares": [per.get(s, 0.0) for s in steps]})
        out[block] = sorted(rows, key=lambda r: (r["first_step"], -r["shares"][-1]))
    return out


def markdown(by_step: dict[int, dict[str, dict[str, Any]]], factor: float, min_share: float = 0.05) -> str:
    """The anatomy as markdown: per checkpoint and block a row, then the channels' persistence."""
    steps = sorted(by_step)
    lines = [f"Large = |x| > {factor:g} × the sequence's median |x| at that block (Sun et al. 2024).", "",
             "| step | block | max \\|x\\| at (position, token, channel) | large / sequence | at position 0 | "
             "busiest channels (share) | busiest tokens at positions > 0 (share) |", "|---|---|---|---|---|---|---|"]
    for s in steps:
        for block, a in by_step[s].items():
            top = a.get("top", [])
            where = f" at ({top[0]['position']}, {top[0]['token']!r}, {top[0]['channel']})" if top else ""
            chans = ", ".join(f"{c['channel']} ({c['share']:.0%})" for c in a["channels"][:3]) or "—"
            toks = ", ".join(f"{t['token']!r} ({t['share']:.0%})" for t in a["busiest_tokens"][:3]) or "—"
            lines.append(f"| {s} | {block} | {a['max_abs']:.4g}{where} | {a['per_sequence']:.3g} | "
                         f"{a['first_position_share']:.0%} | {chans} | {toks} |")
    if len(steps) > 1:
        lines += ["", f"Channels carrying ≥ {min_share:.0%} of a block's large entries at some checkpoint; their "
                      f"share at steps {', '.join(map(str, steps))}:", "",
                  "| block | channel | first reached | still at the last step | shares |", "|---|---|---|---|---|"]
        rows = [(block, r) for block, per in persistence(by_step, min_share).items() for r in per]
        for block, r in rows:
            lines.append(f"| {block} | {r['channel']} | {r['first_step']} | {'yes' if r['at_last'] else 'no'} | "
                         + " / ".join(f"{v:.0%}" for v in r["shares"]) + " |")
        if not rows:
            lines.append("| — | none | | | |")
    return "\n".join(lines) + "\n"
