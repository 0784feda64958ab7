"""QuaRot-style rotation of a model before quantisation (Ashkboos et al. 2024, arXiv 2404.00456).

:func:`rotate` returns a rotated *copy* of a model whose full-precision function is the original's:

1. Untie the head (a tied head becomes an ``output`` linear holding a copy of the embedding matrix), and fold the
   embedding projections (``model.embed_proj``) into the token embedding and the head, ``E <- E P1^T``,
   ``W <- W P2``, as export does.
2. LayerNorm only: subtract the mean from everything that writes into the residual stream (token and learned
   position embeddings, the outputs of ``wo`` and ``w2`` with their biases), so the stream is exactly zero-mean
   and every LayerNorm equals an RMSNorm of the same eps (QuaRot's handling of LayerNorm models).
3. Fold every norm's gain (vector, or the single-scale RMSNorm's scalar) and LayerNorm bias into the linear layers
   that read its output (``wq wk wv`` and a gate's ``wg``, ``w1 w3``, the head: ``W <- W diag(g)``,
   ``b <- b + W beta``); the norms become gain-less RMSNorms.
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
``wk`` outputs and is unaffected). Other specs get only step 5: OP's Outlier Protected block scales the residual
stream elementwise between its sub-layers and nGPT / anGPT interpolate the stream with per-channel rates, which do
not commute with a rotation; folding those is not attempted here.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn

from outlier_titan.models.embed_proj import fold_embed_proj
from outlier_titan.models.layers import Attention, LayerNorm, RMSNorm


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(math.isqrt(n)) + 1))


def _paley(m: int) -> torch.Tensor:
    """Paley construction I: a Hadamard matrix of order m for a prime q = m - 1 = 3 (mod 4)."""
    q = m - 1
    squares = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if i in squares else -1 for i in range(1, q)]
    jac = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    s = torch.zeros(m, m, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return torch.eye(m, dtype=torch.float64) + s


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard(n: int) -> torch.Tensor | None:
    """An orthonormal Hadamard matrix ``H / sqrt(n)`` (float64) of order n, or None when n is not of the form
    2^k or m 2^k with a Paley order m."""
    k = (n & -n).bit_length() - 1  # the power of two in n
    for j in range(k, -1, -1):
        m = n >> j
        if m == 1 or (m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3):
            h = _sylvester(1 << j) if m == 1 else torch.kron(_paley(m), _sylvester(1 << j))
            return h / math.sqrt(n)
    return None


def orthogonal(n: int, seed: int, randomise: bool) -> tuple[torch.Tensor, str]:
    """(matrix, kind): the Hadamard of order n (with random signs on its rows if ``randomise``), or a seeded
    random orthogonal matrix where no Hadamard of that order is constructed here."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n)
    if h is None:
        a = torch.randn(n, n, generator=g, dtype=torch.float64)
        q, r = torch.linalg.qr(a)
        return q * torch.sign(torch.diagonal(r)), f"random orthogonal {n} (no Hadamard of order {n} here)"
    if not randomise:
        return h, f"Hadamard {n}"
    signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.float64) * 2 - 1
    return signs[:, None] * h, f"randomised Hadamard {n} (seed {seed})"


def _set(p: torch.Tensor, value: torch.Tensor) -> None:
    p.copy_(value.to(p.dtype))


def _add_bias(lin: nn.Linear, extra: torch.Tensor) -> None:
    if lin.bias is None:
        lin.bias = nn.Parameter(torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device))
    _set(lin.bias, lin.bias.double() + extra)


def _fold_norm(norm: nn.Module, readers: list[nn.Linear]) -> nn.Module:
    """Folds a norm's gain (and LayerNorm bias) into the linears reading it; returns the gain-less RMSNorm (or
    the norm itself when it is an identity)."""
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
    dim = readers[0].in_features
    out = RMSNorm(dim, norm.eps, "none")
    return out.to(readers[0].weight.device)


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


@torch.no_grad()
def rotate(model: nn.Module, seed: int = 0) -> tuple[nn.Module, dict[str, Any]]:
    """A rotated copy of ``model`` (see the module docstring) and a description of what was applied."""
    from outlier_titan.models.pre_ln import PreLNTransformer

    rot = copy.deepcopy(model)
    info: dict[str, Any] = {}
    if isinstance(rot, PreLNTransformer):
        info["residual_rotation"] = _rotate_pre_ln(rot, seed)
    else:
        info["residual_rotation"] = (
            f"not applied to {type(model).__name__}: implemented for pre_ln only (OP scales the residual stream "
            f"elementwise, nGPT / anGPT interpolate it per channel; neither commutes with a rotation); only the "
            f"online Hadamards, which are exact, are applied")
    info["online"] = _online_hadamards(rot, seed)
    return rot, info


def _gate(att: nn.Module) -> list[nn.Linear]:
    """The gated attention variants' gate matrix ``wg``: it reads the block's normalised input, as wq / wk / wv do."""
    return [att.wg] if getattr(att, "wg", None) is not None else []


def _rotate_pre_ln(m: nn.Module, seed: int) -> str:
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
    embeds = [e for e in (m.tok_embeddings, m.pos_embeddings) if e is not None]
    writers = [lin for b in blocks for lin in (b.attention.wo, b.feed_forward.w2)]
    if isinstance(m.norm, LayerNorm):
        for e in embeds:
            w = e.weight.double()
            _set(e.weight, w - w.mean(1, keepdim=True))
        for lin in writers:
            w = lin.weight.double()
            _set(lin.weight, w - w.mean(0, keepdim=True))
            if lin.bias is not None:
                _set(lin.bias, lin.bias.double() - lin.bias.double().mean())
        notes.append("LayerNorm: residual writes mean-subtracted, norms as RMSNorm")
    for b in blocks:
        att, ff = b.attention, b.feed_forward
        b.attention_norm = _fold_norm(b.attention_norm, [att.wq, att.wk, att.wv] + _gate(att))
        b.ffn_norm = _fold_norm(b.ffn_norm, [ff.w1] + ([ff.w3] if ff.w3 is not None else []))
    m.norm = _fold_norm(m.norm, [m.output])
    q, kind = orthogonal(dim, seed, randomise=True)
    q = q.to(dev)
    for e in embeds:
        _set(e.weight, e.weight.double() @ q)
    readers = [m.output] + [lin for b in blocks for lin in (b.attention.wq, b.attention.wk, b.attention.wv,
                                                            *_gate(b.attention), b.feed_forward.w1,
                                                            b.feed_forward.w3) if lin is not None]
    for lin in readers:
        _set(lin.weight, lin.weight.double() @ q)
    for lin in writers:
        _set(lin.weight, q.t() @ lin.weight.double())
        if lin.bias is not None:
            _set(lin.bias, lin.bias.double() @ q)
    return "; ".join([f"residual stream: {kind}", "norm gains folded"] + notes)
