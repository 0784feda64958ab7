"""QuaRot-style rotation of a model before quantisation (Ashkboos et al. 2024, arXiv 2404.00456).

:func:`rotate` returns a rotated *copy* of a model whose full-precision function is the original's:

1. Untie the head (a tied head becomes an ``output`` linear holding a copy of the embedding matrix), and fold the
   embedding projections (``model.embed_proj``) into the token embedding and the head, ``E <- E P1^T``,
   ``W <- W P2``, as export does.
2. OP's per-channel residual scales (LayerScale) fold into the writer before them, ``W <- diag(s) W``; scalar
   scales (OP's beta, the MLP's alpha, the embedding multiplier) commute with a rotation and stay.
3. Fold every norm's gain (vector, or the single-scale RMSNorm's scalar) and LayerNorm bias into the linear layers
   that read its output (``wq wk wv`` and a variant's input readers, ``w1 w3``, the head: ``W <- W diag(g)``,
   ``b <- b + W beta``); the norms become gain-less RMSNorms. LayerNorm: when every read of the residual stream is
   a LayerNorm, subtract the mean from everything that writes into the stream (token and learned position
   embeddings, the outputs of ``wo`` and ``w2`` with their biases), so the stream is exactly zero-mean and every
   LayerNorm equals an RMSNorm of the same eps (QuaRot's handling of LayerNorm models); when something reads the
   stream without one (OP's raw reads, a Pre-RMS block before a final LayerNorm), each LayerNorm becomes a
   :class:`CenteredRMSNorm` that removes the rotated all-ones direction instead.
4. Rotate the residual stream by ``Q = diag(s) H / sqrt(d)``, random signs ``s`` (seeded) times a Hadamard
   matrix: embeddings ``E <- E Q``, readers ``W <- W Q``, writers ``W <- Q^T W`` and ``b <- Q^T b``. A
   gain-less RMSNorm commutes with ``Q`` (``rms(x Q) = rms(x)``), so the function is unchanged.
5. Online Hadamards (any spec): the inputs of every ``wo`` (the attention output, all heads) and ``w2`` (the MLP's
   down projection) are multiplied by ``D H`` in a forward pre-hook and the weight by ``W <- W D H``. K and V get a
   per-head ``D H`` inside the KV quantiser (``quant/ptq.py``: ``k^ = Q(k D H) (D H)^T``; ``q k^T`` and ``P v`` are
   unchanged in full precision, the cache is quantised in the rotated basis). ``D`` are seeded random signs:
   QuaRot's online Hadamards are plain, but a plain Hadamard's first row (all ones) collects an input's mean into
   one coordinate, which for a GELU MLP (outputs mostly positive) creates an outlier instead of removing one
   (measured in docs/quantisation.md); the signs make the mean vanish in expectation.

Hadamard matrices: Sylvester's for powers of two, Paley's construction I for ``m`` with ``m - 1`` a prime
``= 3 (mod 4)`` (12, 20, 24, 44, 48, 60, ...), and Kronecker products of the two; a size with no such factorisation
(e.g. 3, 6, 36, 5, 7, 9) gets a seeded random orthogonal matrix instead, which keeps the function exact but
spreads outliers less evenly; :func:`rotate` reports which was used.

Residual rotation is implemented for the ``pre_ln`` spec (LayerNorm, RMSNorm, single-scale RMSNorm, gain-less
RMSNorm, no norm; biases; tied or untied heads; learned or rotary positions; QK-norm acts per head on ``wq`` /
``wk`` outputs and is unaffected) and the ``op`` spec with every block but ``post_ln`` (the OP block reads and adds
to the stream without norms; its Pre-Norm baselines are Pre-Norm blocks). Not for ``post_ln`` (its norms, gains
included, sit on the stream itself) nor nGPT / anGPT (they interpolate the normalised stream with per-channel
rates): those get only step 5, and the report says so.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn

from outlier_titan.linalg import haar_from_gaussian, hadamard
from outlier_titan.models.embed_proj import fold_embed_proj
from outlier_titan.models.layers import Attention, LayerNorm, RMSNorm


def orthogonal(n: int, seed: int, randomise: bool) -> tuple[torch.Tensor, str]:
    """(matrix, kind): the Hadamard of order n (with random signs on its rows if ``randomise``), or a seeded
    random orthogonal matrix where no Hadamard of that order is constructed here; ``kind`` names no seed (the
    caller records the seeds it used)."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n)
    if h is None:
        a = torch.randn(n, n, generator=g, dtype=torch.float64)
        return haar_from_gaussian(a), f"random orthogonal {n} (no Hadamard of order {n} here)"
    if not randomise:
        return h, f"Hadamard {n}"
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    return signs[:, None] * h, f"randomised Hadamard {n}"


def _set(p: torch.Tensor, value: torch.Tensor) -> None:
    p.copy_(value.to(p.dtype))


def _add_bias(lin: nn.Linear, extra: torch.Tensor) -> None:
    if lin.bias is None:
        lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device))
    _set(lin.bias, lin.bias.double() + extra)


def _fold_norm(norm: nn.Module, readers: list[nn.Linear], centre: torch.Tensor | None = None) -> nn.Module:
    """Folds a norm's gain (and LayerNorm bias) into the linears reading it; returns the gain-less norm that
    stays: an RMSNorm, a :class:`CenteredRMSNorm` about ``centre`` for a LayerNorm when ``centre`` is given (the
    stream is not zero-mean), or the norm itself when it is an identity."""
    if isinstance(norm, nn.Identity):
        return norm
    if isinstance(norm, LayerNorm):
        gain, beta = norm.weight, norm.bias
        if not norm.elementwise_affine:
            gain = None
    elif isinstance(norm, RMSNorm):
        gain, beta = norm.weight, None
    else:
        raise TypeError(f"cannot fold a {type(norm).__name__}")
    for lin in readers:
        w = lin.weight.double()
        if beta is not None:
            _add_bias(lin, w @ beta.double())
        if gain is not None:
            _set(lin.weight, w * gain.double())
    if centre is not None and isinstance(norm, LayerNorm):
        return CenteredRMSNorm(centre, norm.eps)
    return RMSNorm(readers[0].in_features, norm.eps, "none").to(readers[0].weight.device)


def _online_hadamards(model: nn.Module, seed: int) -> list[str]:
    """Step 5 for wo and w2 of every block; returns descriptions of the matrices used."""
    kinds = set()
    for mod in list(model.modules()):
        for name in ("wo", "w2"):
            lin = getattr(mod, name, None)
            if not isinstance(lin, nn.Linear) or getattr(lin, "_online_hadamard", False):
                continue
            h, kind = orthogonal(lin.in_features, seed, randomise=True)
            kinds.add(f"{name}: {kind}")
            h = h.to(lin.weight.device)
            _set(lin.weight, lin.weight.double() @ h)
            lin.register_forward_pre_hook(
                lambda _m, args, h=h: ((args[0].double() @ h).to(args[0].dtype),) + tuple(args[1:]))
            lin._online_hadamard = True
    return sorted(kinds)


def kv_rotations(model: nn.Module, seed: int) -> dict[Attention, torch.Tensor]:
    """The per-head randomised Hadamard for K and V of every attention module (float64, order head_dim)."""
    return {m: orthogonal(m.head_dim, seed, randomise=True)[0].to(m.wq.weight.device)
            for m in model.modules() if isinstance(m, Attention)}


class CenteredRMSNorm(nn.Module):
    """A gain-less LayerNorm in a rotated basis: removes the component along ``u`` (the image of the all-ones
    direction under the rotation, unit length), then divides by the RMS. With ``y = x Q`` and ``u = 1 Q / sqrt(d)``
    it gives ``LayerNorm(x) Q`` exactly (gain and bias folded into the readers); used where the residual stream
    cannot be made zero-mean because something reads it without a LayerNorm."""

    is_norm = True

    def __init__(self, u: torch.Tensor, eps: float):
        super().__init__()
        self.eps = eps
        self.register_buffer("u", u)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        u = self.u.to(xf.dtype)
        xc = xf - (xf @ u)[..., None] * u
        return (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def _residual_rotation_refusal(model: nn.Module) -> str | None:
    """Why the residual stream of ``model`` cannot be rotated exactly (None when it can): its spec's entry says."""
    from outlier_titan.models.spec import spec_of_model

    spec = spec_of_model(model)
    if spec is None:
        return f"{type(model).__name__} is not the model of a registered model spec"
    return spec.rotation_refusal(model.args)


@torch.no_grad()
def rotate(model: nn.Module, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A rotated copy of ``model`` (see the module docstring) and a description of what was applied."""
    rot = copy.deepcopy(model)
    info: dict[str, Any] = {}
    refusal = _residual_rotation_refusal(rot)
    if refusal is None:
        info["residual_rotation"] = _rotate_stream(rot, seed)
    else:
        info["residual_rotation"] = f"not applied: {refusal}; only the online Hadamards, which are exact, are applied"
    info["online"] = _online_hadamards(rot, seed)
    return rot, info


def _fold_branch_scales(blocks: list[nn.Module]) -> bool:
    """Folds OP's per-channel residual scales (LayerScale, ``residual_scale_mode = "vector"``) into the writer
    before them, ``W <- diag(s) W``, ``b <- s b``; scalar scales commute with a rotation and stay. True when one
    was folded."""
    folded = False
    for b in blocks:
        for scale_name, lin in (("attn_scale", b.attention.wo), ("mlp_scale", b.feed_forward.w2)):
            scale = getattr(b, scale_name, None)
            if scale is None or scale.weight is None or scale.weight.numel() == 1:
                continue
            s = scale.weight.double()
            _set(lin.weight, s[:, None] * lin.weight.double())
            if lin.bias is not None:
                _set(lin.bias, s * lin.bias.double())
            setattr(b, scale_name, None)
            folded = True
    return folded


def _rotate_stream(m: nn.Module, seed: int) -> str:
    """Steps 1-4 on a model whose residual stream is only added to and read (``pre_ln``; ``op`` with any block
    but ``post_ln``)."""
    dim = m.args.dim
    dev = m.tok_embeddings.weight.device
    notes = []
    if m.output is None:
        head = nn.Linear(dim, m.args.vocab_size, bias=False).to(device=dev, dtype=m.tok_embeddings.weight.dtype)
        head.weight.copy_(m.tok_embeddings.weight)
        m.output = head
        notes.append("head untied")
    if fold_embed_proj(m):  # Park et al. 2025's projections: folded as export does
        notes.append("embedding projections folded into the embedding and the head")
    blocks = list(m.layers.values())
    if _fold_branch_scales(blocks):
        notes.append("per-channel residual scales folded into wo / w2")
    embeds = [e for e in (m.tok_embeddings, m.pos_embeddings) if e is not None]
    writers = [lin for b in blocks for lin in (b.attention.wo, b.feed_forward.w2)]
    # (norm or None, the linears reading its output) for every read of the residual stream
    reads = [(b.attention_norm, [b.attention.wq, b.attention.wk, b.attention.wv] + b.attention.input_readers())
             for b in blocks]
    reads += [(b.ffn_norm, [lin for lin in (b.feed_forward.w1, b.feed_forward.w3) if lin is not None])
              for b in blocks]
    reads.append((m.norm, [m.output]))
    layer_norms = [n for n, _ in reads if isinstance(n, LayerNorm)]
    zero_mean = bool(layer_norms) and len(layer_norms) == len(reads)
    if zero_mean:  # QuaRot's way: every read is a LayerNorm, so the stream may be made zero-mean
        for e in embeds:
            w = e.weight.double()
            _set(e.weight, w - w.mean(1, keepdim=True))
        for lin in writers:
            w = lin.weight.double()
            _set(lin.weight, w - w.mean(0, keepdim=True))
            if lin.bias is not None:
                _set(lin.bias, lin.bias.double() - lin.bias.double().mean())
        notes.append("LayerNorm: residual writes mean-subtracted, norms as RMSNorm")
    q, kind = orthogonal(dim, seed, randomise=True)
    q = q.to(dev)
    u = (torch.ones(dim, dtype=torch.float64, device=dev) @ q / math.sqrt(dim)).to(m.tok_embeddings.weight.dtype)
    centre = u if layer_norms and not zero_mean else None
    folded = [_fold_norm(norm, readers, centre) if norm is not None else None for norm, readers in reads]
    if centre is not None:
        notes.append("LayerNorm: read as a centred RMSNorm in the rotated basis (the stream is also read without "
                     "a LayerNorm, so it cannot be made zero-mean)")
    for b, f_att, f_ffn in zip(blocks, folded[:len(blocks)], folded[len(blocks):2 * len(blocks)]):
        b.attention_norm, b.ffn_norm = f_att, f_ffn
    m.norm = folded[-1]
    for e in embeds:
        _set(e.weight, e.weight.double() @ q)
    for _, readers in reads:
        for lin in readers:
            _set(lin.weight, lin.weight.double() @ q)
    for lin in writers:
        _set(lin.weight, q.t() @ lin.weight.double())
        if lin.bias is not None:
            _set(lin.bias, lin.bias.double() @ q)
    return "; ".join([f"residual stream: {kind}", "norm gains folded"] + notes)
