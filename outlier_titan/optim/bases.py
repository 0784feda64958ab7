"""Fixed orthogonal tile bases for OrthoAdam, regenerated from a seed.

Every basis is a function of (global seed, parameter FQN, axis, tile index) only: the seed is a blake2b
digest of those four values (never Python's salted ``hash()``, never the parameter's position in the
optimizer), and the matrix is drawn on a CPU generator in float64. So any rank rebuilds exactly the bases
of the tiles it owns, at any world size, and bases never need to be checkpointed.

Representations (``optimizer.basis``):
  haar      Q of the QR decomposition of a Gaussian matrix, columns sign-fixed by diag(R) (Haar measure).
  hadamard  randomized Hadamard P·D·H/sqrt(n): a Sylvester Hadamard matrix, random signs D and a random
            row permutation P. Every rotated coordinate spreads +-1/sqrt(n) over the whole tile.
            Needs power-of-two tile sizes (``needs_pow2``).
  haar_kron Kronecker-factored Haar: Q_1 ⊗ ... ⊗ Q_m with each Q_i Haar of size <= 16 (``kron_factor_sizes``).
            Applying it costs 2·(f_1 + ... + f_m) FLOP per element instead of 2·n, and every rotated coordinate
            still mixes the whole tile, but the mixing is structured: a basis vector is a product of m small
            random vectors, not a uniformly random direction (a Haar basis draws from all of O(n)).
            Needs power-of-two tile sizes (``needs_pow2``).
  identity  the identity (no rotation): OrthoAdam becomes AdamW. For tests and ablations only.

``hadamard`` and ``haar_kron`` are also available factored (``structured_basis``): a permutation, signs
and Kronecker factors, which OrthoAdam applies as small batched matmuls on a reshaped view instead of a
dense tile product (H_256 = H_16 ⊗ H_16).

A signed permutation (or diagonal signs alone) is rejected: Adam is exactly equivariant to it, so such a
"rotation" changes nothing (Adam's element-wise square, root and division commute with it).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable

import torch

from outlier_titan.linalg import haar_from_gaussian, is_power_of_two, sylvester_hadamard

BasisFn = Callable[[int, int], torch.Tensor]
"""(size, seed) -> a float64 [size, size] orthogonal matrix whose columns are the new basis vectors."""

_SEED_BITS = 63


def tile_seed(global_seed: int, fqn: str, axis: int, tile_index: int) -> int:
    """A 63-bit seed from (global seed, FQN, axis, tile index), stable across processes and machines."""
    key = f"outlier_titan.tile_basis|{int(global_seed)}|{fqn}|{int(axis)}|{int(tile_index)}".encode()
    digest = hashlib.blake2b(key, digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _SEED_BITS) - 1)


def _generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def haar_basis(size: int, seed: int) -> torch.Tensor:
    """A Haar-distributed orthogonal matrix from a float64 Gaussian drawn with ``seed``."""
    return haar_from_gaussian(torch.randn(size, size, generator=_generator(seed), dtype=torch.float64))


def _hadamard_perm_signs(size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = _generator(seed)
    signs = torch.randint(0, 2, (size,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1
    perm = torch.randperm(size, generator=g)
    return perm, signs


def hadamard_basis(size: int, seed: int) -> torch.Tensor:
    """Randomized Hadamard P·D·H/sqrt(n): random signs on the rows of H, then a random row permutation."""
    perm, signs = _hadamard_perm_signs(size, seed)
    return (signs[:, None] * sylvester_hadamard(size))[perm]


def kron_factor_sizes(size: int, max_factor: int = 16) -> list[int]:
    """Powers of two, each <= ``max_factor`` and as equal as possible, whose product is ``size`` (a power of
    two): 256 -> [16, 16], 128 -> [16, 8], 32 -> [8, 4], 2 -> [2]."""
    if not is_power_of_two(size):
        raise ValueError(f"a Kronecker-factored basis needs a power-of-two size, got {size}")
    k, kmax = size.bit_length() - 1, max_factor.bit_length() - 1
    m = max(1, -(-k // kmax))
    return [1 << (k // m + (1 if i < k % m else 0)) for i in range(m)]


def _kron_all(factors: list[torch.Tensor]) -> torch.Tensor:
    out = factors[0]
    for f in factors[1:]:
        out = torch.kron(out, f)
    return out


def _haar_kron_factors(size: int, seed: int) -> list[torch.Tensor]:
    return [haar_basis(f, tile_seed(seed, "kron", 0, i)) for i, f in enumerate(kron_factor_sizes(size))]


def haar_kron_basis(size: int, seed: int) -> torch.Tensor:
    """Kronecker product of Haar factors of sizes ``kron_factor_sizes(size)`` (see the module docstring)."""
    return _kron_all(_haar_kron_factors(size, seed))


def structured_basis(name: str, size: int, seed: int):
    """The factored form (perm or None, signs or None, [factors]) of basis ``name`` with
    B = P·D·(K_1 ⊗ ... ⊗ K_m), (P y)[r] = y[perm[r]], D = diag(signs); None for dense-only bases.
    Equal to the dense ``REPRESENTATIONS[name].dense(size, seed)`` up to float rounding."""
    if name == "hadamard" and is_power_of_two(size):
        perm, signs = _hadamard_perm_signs(size, seed)
        return perm, signs, [sylvester_hadamard(f) for f in kron_factor_sizes(size)]
    if name == "haar_kron" and is_power_of_two(size):
        return None, None, _haar_kron_factors(size, seed)
    return None


def identity_basis(size: int, seed: int) -> torch.Tensor:
    return torch.eye(size, dtype=torch.float64)


@dataclass(frozen=True)
class Basis:
    """A representation and the facts the rest of the optimizer reads from it.

    ``dense``: (size, seed) -> the float64 orthogonal matrix. ``needs_pow2``: every tile edge (and a ragged last
    tile) must be a power of two; the tile plan checks it (``tiles.plan.plan_param``), at construction and in the
    meta-model pre-check, and names the basis in its error. ``factored``: ``structured_basis`` gives a factored
    form, which OrthoAdam applies by default. ``trusted``: orthogonal and mixing by construction, so the
    per-tile ``check_basis`` is skipped (a custom function is checked).
    """

    name: str
    dense: BasisFn
    needs_pow2: bool = False
    factored: bool = False
    trusted: bool = False


REPRESENTATIONS: dict[str, Basis] = {b.name: b for b in (
    Basis("hadamard", hadamard_basis, needs_pow2=True, factored=True, trusted=True),
    Basis("haar", haar_basis, trusted=True),
    Basis("haar_kron", haar_kron_basis, needs_pow2=True, factored=True, trusted=True),
    Basis("identity", identity_basis),
)}


def is_signed_permutation(basis: torch.Tensor, tol: float = 1e-9) -> bool:
    """True when every column is +-1 at one entry and 0 elsewhere (such a basis is a no-op for Adam)."""
    b = basis.abs().to(torch.float64)
    ones = (b - 1.0).abs() <= tol
    zeros = b <= tol
    return bool(((ones | zeros).all() and (ones.sum(0) == 1).all()).item())


def check_basis(basis: torch.Tensor, size: int, where: str, allow_trivial: bool = False) -> None:
    """Raises ValueError unless ``basis`` is a finite orthogonal [size, size] matrix that really mixes."""
    if tuple(basis.shape) != (size, size):
        raise ValueError(f"{where}: basis has shape {tuple(basis.shape)}, expected ({size}, {size})")
    if not torch.isfinite(basis).all():
        raise ValueError(f"{where}: basis has non-finite entries")
    b = basis.to(torch.float64)
    err = (b.T @ b - torch.eye(size, dtype=torch.float64)).abs().max().item()
    if err > 1e-8:
        raise ValueError(f"{where}: basis is not orthogonal (max |B^T B - I| = {err:.2e})")
    if size >= 2 and not allow_trivial and is_signed_permutation(b):
        raise ValueError(f"{where}: basis is a signed permutation, which Adam is equivariant to (a no-op "
                         f"rotation); use a mixing basis such as 'hadamard' or 'haar'")


def resolve_representation(basis: str | BasisFn) -> Basis:
    """The ``Basis`` of a representation name, or of a custom (size, seed) -> matrix function (no tile rule,
    checked per tile)."""
    if callable(basis):
        return Basis(getattr(basis, "__name__", "custom"), basis)
    if basis not in REPRESENTATIONS:
        raise ValueError(f"optimizer.basis = {basis!r} is not known; choose one of: {', '.join(REPRESENTATIONS)}")
    return REPRESENTATIONS[basis]


def basis_checksum(name: str, fn: BasisFn, global_seed: int, sizes: list[int]) -> str:
    """A short digest of probe bases (one per tile size in use), rounded to 2^-24 so that BLAS-level
    differences between machines do not change it, while a different seed, representation, seed hash
    or generator does."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{name}|{int(global_seed)}".encode())
    for size in sorted(set(sizes)):
        probe = fn(size, tile_seed(global_seed, "__checksum__", 0, size)).to(torch.float64)
        h.update(f"|{size}|".encode())
        h.update(torch.round(probe * (1 << 24)).to(torch.int64).numpy().tobytes())
    return h.hexdigest()
