"""The batched blocked Householder QR tried as SOAP's refresh QR on the GPU (2026-11-27; not adopted: in eager
torch it is launch-bound, ~107 ms a call on an H200 whatever the batch, against torch.linalg.qr's 46-139 ms;
see BENCHMARKS.md, GPU). Kept with the measurement that rejected it; Q matched LAPACK's to 7e-14."""
import torch


def householder_q(a: torch.Tensor, block: int = 32) -> torch.Tensor:
    """Q of the reduced QR of each matrix of a batch [k, m, n] (m >= n): LAPACK's algorithm and sign convention,
    panels of ``block`` columns accumulated in the compact WY form with T⁻¹ = striu(VᵀV) + diag(1/τ)
    (Joffrain et al. 2006)."""
    k, m, n = a.shape
    r = a.clone()
    panels = []
    for j0 in range(0, n, block):
        jb = min(block, n - j0)
        v = a.new_zeros(k, m - j0, jb)
        inv_tau = a.new_ones(k, jb)
        for c in range(jb):
            j = j0 + c
            x = r[:, j:, j]
            alpha = x[:, 0]
            below = torch.linalg.vector_norm(x[:, 1:], dim=-1)
            beta = -torch.copysign(torch.hypot(alpha, below), alpha)
            reflect = below > 0
            vc = x / torch.where(reflect, alpha - beta, 1.0)[:, None]
            vc[:, 0] = 1.0
            vc = vc * reflect[:, None]
            inv_tau[:, c] = torch.where(reflect, 0.5 * (vc * vc).sum(-1), 1.0)
            v[:, c:, c] = vc
            if c + 1 < jb:
                rest = r[:, j:, j + 1:j0 + jb]
                w = (vc / inv_tau[:, c:c + 1])[:, None, :] @ rest
                rest -= vc[:, :, None] * w
        t_inv = torch.triu(v.transpose(1, 2) @ v, diagonal=1) + torch.diag_embed(inv_tau)
        eye = torch.eye(jb, dtype=a.dtype, device=a.device).expand(k, jb, jb)
        t = torch.linalg.solve_triangular(t_inv, eye, upper=True)
        if j0 + jb < n:
            trail = r[:, j0:, j0 + jb:]
            trail -= v @ (t.transpose(1, 2) @ (v.transpose(1, 2) @ trail))
        panels.append((j0, v, t))
    q = torch.eye(m, n, dtype=a.dtype, device=a.device).repeat(k, 1, 1)
    for j0, v, t in reversed(panels):
        sub = q[:, j0:, j0:]
        sub -= v @ (t @ (v.transpose(1, 2) @ sub))
    return q
