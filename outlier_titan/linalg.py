"""Orthogonal matrices the stack builds in float64: Haar-random ones (weight init, OrthoAdam's bases, the rotation's
fallback) and Hadamard matrices (OrthoAdam's bases, QuaRot's rotation). One place, so every user draws the same."""

from __future__ import annotations

import math

import torch


def haar_from_gaussian(a: torch.Tensor) -> torch.Tensor:
    """The Haar-distributed orthogonal matrix of a square Gaussian ``a``: its QR's Q, columns times sign(diag R)
    (a zero diagonal entry, probability 0, counts as +1)."""
    q, r = torch.linalg.qr(a)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    return q * signs


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


def sylvester(n: int) -> torch.Tensor:
    """Sylvester's ±1 Hadamard matrix of order ``n`` (a power of two), float64, unnormalised."""
    if not is_power_of_two(n):
        raise ValueError(f"a Sylvester Hadamard matrix needs a power-of-two size, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sylvester_hadamard(size: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix H/sqrt(n) (float64); ``size`` must be a power of two."""
    return sylvester(size) / (size ** 0.5)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % p for p in range(2, int(math.isqrt(n)) + 1))


def paley(m: int) -> torch.Tensor:
    """Paley construction I: a ±1 Hadamard matrix of order m for a prime q = m - 1 = 3 (mod 4)."""
    q = m - 1
    squares = {(i * i) % q for i in range(1, q)}
    chi = [0] + [1 if i in squares else -1 for i in range(1, q)]
    jac = torch.tensor([[chi[(j - i) % q] for j in range(q)] for i in range(q)], dtype=torch.float64)
    s = torch.zeros(m, m, dtype=torch.float64)
    s[0, 1:] = 1
    s[1:, 0] = -1
    s[1:, 1:] = jac
    return torch.eye(m, dtype=torch.float64) + s


def hadamard(n: int) -> torch.Tensor | None:
    """An orthonormal Hadamard matrix ``H / sqrt(n)`` (float64) of order n, or None when n is not of the form
    2^k or m 2^k with a Paley order m."""
    k = (n & -n).bit_length() - 1  # the power of two in n
    for j in range(k, -1, -1):
        m = n >> j
        if m == 1 or (m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3):
            h = sylvester(1 << j) if m == 1 else torch.kron(paley(m), sylvester(1 << j))
            return h / math.sqrt(n)
    return None
