"""The outlier probe: one no-grad forward on a fixed probe batch, with hooks, reduced across ranks.

Usage (trainer)::

    probe = OutlierProbe(model, cfg.observe, mesh)       # once
    scalars, images = probe.run(tokens)                   # every observe.every steps, on every rank

Measurement points: the residual stream at the output of every block (``model.layers[i]``: Kaul et al. 2024's
"after the residual connection") and the final pre-head input (the output of ``model.norm``, He et al. 2024's
unembedding input). In ``full`` mode every :class:`~outlier_titan.models.layers.Attention` also gets a
``prob_hook`` for that forward, so its probabilities are computed explicitly (softmax-1 included).

Each hook reduces its tensor to the float64 sums of every registered metric that reads it
(:mod:`outlier_titan.observe.metrics`; the probe mode and ``[observe]`` options select them), so no activations are
kept. All sums go into one vector, which is all-reduced over the data-parallel dims and
the tensor-parallel dim, then copied to the host once. Under TP the residual stream is gathered
(``full_tensor()``, sequence parallel included) and is then the same on every TP rank, so only TP rank 0
contributes it; attention heads are local to a TP rank, so their sums add up over TP.

Metrics reading the residual stream get every block's output and the pre-head input; those reading attention
weights each Attention's ``prob_hook``, those reading per-head outputs and value states its ``head_hook``, those
reading the MaxLogit its ``logit_hook`` (a training remedy's hook there is put back afterwards); reading the down
projections (the super-weight metric) a hook on every block's ``feed_forward.w2`` (full mode: its input, output and
weight, gathered under TP; the metric max-reduces over DP itself). Sums whose key starts with ``max_`` are maxima
and are reduced by max. Per-head vectors (``head_*`` sums) are laid out at their global head positions before the
TP all-reduce.

Scalars (identical on all ranks): ``outliers/layer_<i>/<name>`` per block, ``outliers/head_input/<name>``
for the pre-head input (residual metrics), and ``outliers/<name>`` = the mean over blocks (the papers' "averaged across
layers"; the head input is not in the mean). Images (full mode, global rank 0 only): ``outliers/attention_map``,
``outliers/hidden_magnitude``, ``outliers/sinks_vs_massive`` (:mod:`outlier_titan.observe.panel`) and
``outliers/lowprec``, labelled HWC
uint8 pictures (:mod:`outlier_titan.observe.pictures`).

With ``observe.gradients`` the forward keeps autograd on, the hooks also keep the residual tensors, and one
``torch.autograd.grad`` of the probe loss gives their gradients, which the ``gradient`` metrics reduce like the
residual stream (gathered under TP, counted on TP rank 0; :mod:`outlier_titan.observe.gradients`). The same
backward gives the gradient of each block's pre-attention norm output (``pre_attention_norm``: what wq / wk / wv
read), the ``attention_input_gradient`` input of Chen, Lin, Yao 2026's gradient-sink ratio.

Low-precision casts (:mod:`outlier_titan.observe.lowprec`): a forward hook on every cast module (``lowprec_recipe``,
or with ``observe.lowprec_recipe`` every linear map of a BF16 model's blocks) reduces its whole input and weight
(gathered under TP, counted once) to the ``casts`` sums of its block; with ``observe.gradients`` the module outputs
join the backward's inputs and their gradients give the ``cast_gradient`` sums. Picture (full mode, rank 0):
``outliers/lowprec``.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from typing import Iterable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from outlier_titan.config.job_config import Observe
from outlier_titan.models.attention_variants import get_variant
from outlier_titan.models.layers import Attention
from outlier_titan.models.smooth_swiglu import recording_scales
from outlier_titan.observe import lowprec, metrics
from outlier_titan.observe.metrics import F64
from outlier_titan.observe import outliers as om
from outlier_titan.observe import panel
from outlier_titan.observe.pictures import (attention_map_image, hidden_magnitude_image, lowprec_image,
                                            sinks_massive_image)
from outlier_titan.observe.super_weights import down_projections, plain_down_io
from outlier_titan.tensors import gathered

PREFIX = "outliers"
ATTENTION_INPUT = "attention_input_gradient"  # the probe input of the blocks' pre-attention norm outputs' gradient


class OutlierProbe:
    """Outlier and attention-sink metrics of ``model`` on a probe batch; see the module docstring."""

    def __init__(self, model: nn.Module, cfg: Observe | None = None, mesh=None):
        self.model = model
        self.cfg = cfg if cfg is not None else Observe()
        self.mesh = mesh
        self.full = self.cfg.mode == "full"
        self.metrics = {reads: metrics.active(self.cfg, reads) for reads in metrics.READS}
        self.layer_names = list(model.layers.keys())
        self.attention: dict[str, list[Attention]] = {
            name: [m for m in block.modules() if isinstance(m, Attention)] for name, block in model.layers.items()}
        self._dp_groups, self._tp_group, self._tp_rank = self._groups(mesh)
        self._tp_mesh = mesh["tp"] if self._tp_group is not None else None
        # the low-precision casts (observe/lowprec.py); a weight is the same on every DP rank: DP rank 0 counts it
        self.casts = lowprec.CastTaps(model, self.cfg.lowprec_recipe, self.metrics["casts"],
                                      self.metrics["cast_gradient"], self._tp_mesh,
                                      all(dist.get_rank(g) == 0 for g in self._dp_groups))

    # ------------------------------------------------------------------------------------------------------
    # public

    def run(self, tokens: torch.Tensor) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """Probe metrics of one batch ``tokens`` [B_local, T] (this DP rank's share)."""
        return self.measure([tokens])

    def measure(self, batches: Iterable[torch.Tensor]) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """Probe metrics pooled over several batches (sums are added, then reduced and finalised once)."""
        acc = None
        for tokens in batches:
            acc = self._add(acc, self.local_sums(tokens))
        if acc is None:
            raise ValueError("OutlierProbe.measure needs at least one batch")
        return self.finalize(self.reduce(acc))

    def local_sums(self, tokens: torch.Tensor) -> dict:
        """One forward with hooks (and, with gradient metrics, one backward to the residual stream); this rank's
        float64 sums: {"res": {layer: {metric: sums}}, "head": {metric: sums}, "attn": {layer: {metric: sums}},
        "rep": {"res": bool, "attn": bool}} (rep: replicated over TP; "attn" holds the attention and per-head
        metrics; "res" and "head" also the gradient metrics; keys starting with "_" are the pictures' sums)."""
        if not any(self.metrics[reads] for reads in metrics.GRADIENTS):
            with torch.no_grad():
                return self._local_sums(tokens, None)
        # layer name (None: the pre-head input; (ATTENTION_INPUT, name): the block's pre-attention norm output)
        # -> the tensor the rest of the forward reads
        streams: dict = {}
        with torch.enable_grad():
            return self._local_sums(tokens, streams)

    def _local_sums(self, tokens: torch.Tensor, streams: dict | None) -> dict:
        """``streams``: None for a no-grad forward; a dict to collect the residual tensors and backpropagate."""
        res: dict[str, dict] = {}
        attn: dict[str, dict] = {}
        head: dict = {}
        rep = {"res": False, "attn": False}
        map_size = max(0, int(self.cfg.map_tokens)) if self.full else 0
        seq_len = tokens.shape[1]

        def residual(output) -> dict:
            x, r = self._full_residual(output, seq_len)
            rep["res"] |= r
            inp = metrics.ResidualInput(x)
            sums = {m.key: m.sums(inp) for m in self.metrics["residual"]}
            if self.full:
                sums["_hidden"] = om.channel_sq(inp)
            return sums

        def stream(name, x):
            if streams is None:
                return x
            streams[name] = x
            return x.detach()

        def block_hook(name):
            def hook(_module, _inputs, output):
                res.setdefault(name, {}).update(
                    residual(stream(name, output[0] if isinstance(output, (tuple, list)) else output)))
            return torch.compiler.disable(hook)

        def down_hook(name):
            def hook(module, inputs, output):
                x_in, x_out, w, r = self._down_proj(module, inputs[0], output, seq_len)
                x_in, x_out = plain_down_io(self.model, name, x_in, x_out)
                rep["res"] |= r
                inp = metrics.DownProjInput(x_in, x_out, w, self._global_max)
                res.setdefault(name, {}).update({m.key: m.sums(inp) for m in self.metrics["down_proj"]})
            return torch.compiler.disable(hook)

        def norm_hook(name):
            def hook(_module, _inputs, output):  # keeps the tensor the attention reads; no sums before the backward
                streams[(ATTENTION_INPUT, name)] = output
            return torch.compiler.disable(hook)

        def head_hook(_module, _inputs, output):
            head.update(residual(stream(None, output)))

        def embed_hook(_module, _inputs, output):  # frozen weights (evaluation): start the graph here
            return output if output.requires_grad else output.detach().requires_grad_()

        def add_attn(name, module, sums, r):
            rep["attn"] |= r
            layer = attn.setdefault(name, {})
            for key, s in sums.items():
                layer[key] = metrics.add_sums(layer.get(key), self._global_heads(s, module, r))

        def prob_hook(name, module):
            def hook(probs):
                p, r = self._probs(probs, module)
                inp = metrics.AttentionInput(p, sink=get_variant(module.variant).with_sink)
                sums = {m.key: m.sums(inp) for m in self.metrics["attention"]}
                if map_size > 0:
                    sums["_map"] = _map_sums(inp, map_size)
                add_attn(name, module, sums, r)
            return torch.compiler.disable(hook)

        def logit_hook(name, module):
            def hook(m):
                r = self._tp_mesh is not None and m.shape[1] == self._n_heads(module)
                inp = metrics.LogitsInput(m)
                add_attn(name, module, {k.key: k.sums(inp) for k in self.metrics["logits"]}, r)
            return torch.compiler.disable(hook)

        def heads_hook(name, module):
            def hook(out, v):
                inp = metrics.HeadsInput(out, v)
                r = self._tp_mesh is not None and out.shape[1] == self._n_heads(module)
                add_attn(name, module, {m.key: m.sums(inp) for m in self.metrics["heads"]}, r)
            return torch.compiler.disable(hook)

        handles = [self.model.layers[n].register_forward_hook(block_hook(n)) for n in self.layer_names]
        handles.append(self.model.norm.register_forward_hook(head_hook))
        if streams is not None:
            handles.append(self.model.tok_embeddings.register_forward_hook(embed_hook))
            if self.metrics[ATTENTION_INPUT]:
                handles += [norm.register_forward_hook(norm_hook(n)) for n, norm in self._pre_attention_norms()]
        if self.metrics["down_proj"]:
            handles += [lin.register_forward_hook(down_hook(n)) for n, lin in down_projections(self.model).items()]
        handles += self.casts.hooks(res, rep, streams, seq_len)
        hooked: list[Attention] = []
        saved: dict[Attention, object] = {}
        try:
            if self.full:
                for name, mods in self.attention.items():
                    for m in mods:
                        m.prob_hook = prob_hook(name, m)
                        m.head_hook = heads_hook(name, m)
                        saved[m] = m.logit_hook  # a training remedy's (QK-Clip), put back after the probe
                        if self.metrics["logits"]:
                            m.logit_hook = logit_hook(name, m)
                        hooked.append(m)
            # eager even where blocks are compiled: Dynamo guards neither the hook attributes nor the forward hooks
            # set above (its guard_nn_modules / skip_nnmodule_hook_guards defaults), so a graph of this forward
            # would later serve a no-grad forward with the hooks gone, and this one could reuse a graph without them
            with recording_scales(self.model), torch.compiler.set_stance("force_eager"):
                logits = self.model(tokens)
        finally:
            for h in handles:
                h.remove()
            for m in hooked:
                m.prob_hook = None
                m.head_hook = None
                m.logit_hook = saved.get(m)
        if streams is not None:
            for key, g in self._stream_gradients(logits, tokens, streams).items():
                if isinstance(key, tuple) and key[0] == lowprec.CASTS:
                    self.casts.gradient(res, key, g, seq_len)
                    continue
                reads, name = key if isinstance(key, tuple) else ("gradient", key)
                x, r = self._full_residual(g, seq_len)
                rep["res"] |= r
                inp = metrics.ResidualInput(x[:, :-1])  # the last position has no target: its gradient is 0
                (head if name is None else res[name]).update({m.key: m.sums(inp) for m in self.metrics[reads]})
        return {"res": res, "head": head, "attn": attn, "rep": rep}

    def _stream_gradients(self, logits: torch.Tensor, tokens: torch.Tensor, streams: dict) -> dict:
        """``dL/dx`` for every collected residual tensor ``x`` (same layout as ``x``), ``L`` the mean next-token
        cross entropy over the in-window targets of the whole probe batch (all DP ranks): each rank's token sum
        over the global count, so every layout backpropagates the same loss. ``torch.autograd.grad`` with the
        residual tensors as inputs: no parameter ``.grad`` is written."""
        b, t = tokens.shape
        labels = torch.cat([tokens[:, 1:], tokens.new_full((b, 1), -100)], 1)  # -100: no target (ignored)
        count = b * (t - 1) * math.prod(dist.get_world_size(g) for g in self._dp_groups)
        names = list(streams)
        with loss_parallel() if isinstance(logits, DTensor) else nullcontext():  # vocab-sharded logits under TP
            wide = logits.to(torch.promote_types(logits.dtype, torch.float32))  # the trainer's fp32 loss; fp64 stays
            loss = F.cross_entropy(wide.flatten(0, 1), labels.flatten(0, 1), reduction="sum") / count
            grads = torch.autograd.grad(loss, [streams[n] for n in names], allow_unused=True)
        return {n: torch.zeros_like(streams[n]) if g is None else g for n, g in zip(names, grads)}

    def reduce(self, sums: dict) -> dict:
        """Adds the sums over all ranks (DP dims and TP) with one flat all-reduce per mesh dim (and one of the
        maxima, ``max_*`` keys, by max); host copy."""
        entries = []  # (section, layer, metric, key, tensor)
        for sec in ("res", "head", "attn"):
            layers = {None: sums[sec]} if sec == "head" else {n: sums[sec].get(n, {}) for n in self.layer_names}
            for name, per_metric in layers.items():
                for metric, s in per_metric.items():
                    entries += [(sec, name, metric, k, v) for k, v in s.items()]
        if not entries:
            return sums
        zero = {"res": sums["rep"]["res"], "head": sums["rep"]["res"], "attn": sums["rep"]["attn"]}
        groups = self._dp_groups + ([self._tp_group] if self._tp_group is not None else [])
        reduced = {}
        for maxima in (False, True):
            part = [e for e in entries if metrics.is_max(e[3]) == maxima]
            if not part:
                continue
            # a TP-replicated sum counts once (TP rank 0); a replicated maximum is the same on every rank
            values = []
            for sec, _, _, _, v in part:
                v = v.to(torch.float64).reshape(-1)
                values.append(torch.zeros_like(v) if self._tp_rank != 0 and zero[sec] and not maxima else v)
            flat = torch.cat(values)
            for group in groups:
                dist.all_reduce(flat, op=dist.ReduceOp.MAX if maxima else dist.ReduceOp.SUM, group=group)
            flat, offset = flat.cpu(), 0
            for sec, name, metric, k, v in part:
                reduced[(sec, name, metric, k)] = flat[offset:offset + v.numel()].reshape(v.shape)
                offset += v.numel()
        out = {"res": {}, "head": {}, "attn": {}, "rep": sums["rep"]}
        for sec, name, metric, k, _ in entries:
            target = out["head"] if sec == "head" else out[sec].setdefault(name, {})
            target.setdefault(metric, {})[k] = reduced[(sec, name, metric, k)]
        return out

    def finalize(self, sums: dict) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """Scalars and images from reduced sums."""
        scalars: dict[str, float] = {}
        per_layer = []
        for name in self.layer_names:
            m = metrics.finalize_layer({**sums["res"].get(name, {}), **sums["attn"].get(name, {})})
            per_layer.append(m)
            for k, v in m.items():
                scalars[f"{PREFIX}/layer_{name}/{k}"] = v
        for k, v in metrics.finalize_layer(sums["head"]).items():
            scalars[f"{PREFIX}/head_input/{k}"] = v
        for k, v in metrics.layer_mean(per_layer).items():
            scalars[f"{PREFIX}/{k}"] = v
        images: dict[str, np.ndarray] = {}
        if self.full and (not dist.is_initialized() or dist.get_rank() == 0):  # only rank 0 logs pictures
            images.update(self._images(sums))
            layers, columns = panel.panel_rows(scalars)
            if columns:
                images[f"{PREFIX}/sinks_vs_massive"] = sinks_massive_image(layers, columns, panel.SHARES)
            layers, columns, table = lowprec.picture_rows(scalars, PREFIX)
            if columns:
                images[f"{PREFIX}/lowprec"] = lowprec_image(layers, columns, table)
        return scalars, images

    # ------------------------------------------------------------------------------------------------------
    # internals

    def _full_residual(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, bool]:
        """The whole residual stream [B, T, D] of this DP rank, and whether it is the same on every TP rank.

        DTensors are gathered. Under TP a plain tensor shorter than the sequence is a sequence-parallel local
        shard (Shard(1)) and is all-gathered over the TP group; a full-length plain tensor is replicated.
        """
        if isinstance(x, DTensor):
            return x.full_tensor(), True
        if self._tp_mesh is None:
            return x, False
        return gathered(x, (x.shape[0], seq_len, x.shape[2]), self._tp_mesh), True

    def _down_proj(self, module: nn.Linear, x_in, x_out, seq_len: int):
        """A down projection's whole input [B, T, F], output [B, T, D] and weight [D, F] of this DP rank, and
        whether they are the same on every TP rank. Under TP (row-wise: the input sharded on its channels, the
        output on the sequence) all three are gathered."""
        x_out, rep = self._full_residual(x_out, seq_len)
        if isinstance(x_in, DTensor):
            x_in = x_in.full_tensor()
        w = module.weight.full_tensor() if isinstance(module.weight, DTensor) else module.weight
        if x_in.shape[-1] != w.shape[1]:
            raise ValueError(f"probe: the down projection's input has {x_in.shape[-1]} of its {w.shape[1]} "
                             "channels (a TP plan whose w2 input is not a DTensor); the super-weight metric "
                             "needs them all")
        return x_in, x_out, w, rep

    def _global_max(self, t: torch.Tensor) -> torch.Tensor:
        """Element-wise max over the data-parallel ranks (after the TP gather the TP ranks agree)."""
        t = t.clone()
        for group in self._dp_groups:
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t

    def _probs(self, probs: torch.Tensor, module: Attention) -> tuple[torch.Tensor, bool]:
        """Attention probabilities, and whether they are the same on every TP rank (all heads everywhere)
        rather than this TP rank's local heads."""
        if isinstance(probs, DTensor):
            return probs.full_tensor(), True
        if self._tp_mesh is None:
            return probs, False
        return probs, probs.shape[1] == self._n_heads(module)

    def _pre_attention_norms(self) -> list[tuple[str, nn.Module]]:
        """(layer name, the norm whose output the block's attention reads) for the blocks that have one (a spec's
        block says so by ``pre_attention_norm``; OP's own block and Post-LN have none)."""
        norms = [(n, getattr(block, "pre_attention_norm", None)) for n, block in self.model.layers.items()]
        return [(n, m) for n, m in norms if m is not None]

    @staticmethod
    def _n_heads(module: Attention) -> int:
        return module.wq.weight.shape[0] // module.head_dim  # DTensor weights report global shapes

    def _global_heads(self, sums: dict, module: Attention, replicated: bool) -> dict:
        """One metric's per-head [H_local] vectors (keys ``head_*``) placed at this TP rank's heads of a zero [H]
        vector, so that the TP all-reduce lays the heads side by side (ColwiseParallel gives each rank a contiguous
        block of heads); unchanged without TP or when all heads are here."""
        if self._tp_mesh is None or replicated:
            return sums
        n = self._n_heads(module)
        out = dict(sums)
        for k, v in sums.items():
            if metrics.is_per_head(k):  # maxima: -inf at the other ranks' heads
                full = v.new_full((n,), float("-inf")) if metrics.is_max(k) else v.new_zeros(n)
                h = v.shape[0]
                full[self._tp_rank * h:(self._tp_rank + 1) * h] = v
                out[k] = full
        return out

    def _images(self, sums: dict) -> dict[str, np.ndarray]:
        images = {}
        maps = [s["_map"] for s in sums["attn"].values() if "_map" in s]
        if maps:
            total = sum(s["map"] for s in maps)
            count = sum(float(s["n_maps"]) for s in maps)
            if count > 0:
                images[f"{PREFIX}/attention_map"] = attention_map_image((total / count).numpy())
        layers = [sums["res"][n]["_hidden"] for n in self.layer_names if "_hidden" in sums["res"].get(n, {})]
        if layers and all(float(s["n_rest"]) > 0 for s in layers):
            first = np.stack([(s["sq_first"] / s["n_seq"]).sqrt().numpy() for s in layers])
            rest = np.stack([(s["sq_rest"] / s["n_rest"]).sqrt().numpy() for s in layers])
            images[f"{PREFIX}/hidden_magnitude"] = hidden_magnitude_image(first, rest)
        return images

    @staticmethod
    def _add(acc: dict | None, new: dict) -> dict:
        if acc is None:
            return new
        rep = {k: acc["rep"][k] or new["rep"][k] for k in acc["rep"]}
        if any(acc[sec].keys() != new[sec].keys() for sec in ("res", "attn")):
            raise ValueError("probe batches measured different layers")
        out = {sec: {name: metrics.pool_layer(acc[sec][name], layer) for name, layer in new[sec].items()}
               for sec in ("res", "attn")}
        return {**out, "head": metrics.pool_layer(acc["head"], new["head"]), "rep": rep}

    @staticmethod
    def _groups(mesh):
        """(DP process groups, TP process group or None, TP local rank) of the trainer's mesh."""
        if mesh is None or not dist.is_available() or not dist.is_initialized():
            return [], None, 0
        names = tuple(mesh.mesh_dim_names or ())
        if not names:  # an unnamed 1-D mesh: all data parallel
            return ([mesh.get_group()] if mesh.size() > 1 else []), None, 0
        dp_meshes = [mesh[n] for n in names if n not in ("tp", "dp")]
        dp_groups = [m.get_group() for m in dp_meshes if m.size() > 1]
        tp_group, tp_rank = None, 0
        if "tp" in names and mesh["tp"].size() > 1:
            tp_group, tp_rank = mesh["tp"].get_group(), mesh["tp"].get_local_rank()
        return dp_groups, tp_group, tp_rank


def _map_sums(a: metrics.AttentionInput, size: int) -> dict[str, torch.Tensor]:
    """The sum over batch and heads of the top-left ``size`` x ``size`` corner of the weights and its count (exact
    for causal maps: the first k queries only see the first k keys)."""
    b, h, t, _ = a.probs.shape
    k = min(size, t)
    return {"map": a.p[:, :, :k, :k].sum((0, 1), dtype=F64), "n_maps": a.p0.new_full((), float(b * h))}
