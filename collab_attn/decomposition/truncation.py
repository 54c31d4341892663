"""SVD truncations: of single heads (the best rank-``k`` approximation of each head product ``Wq_h^T Wk_h``) and of
a whole projection into one subspace that every head reads (``shared_subspace``).

The SVD-truncated-heads baseline keeps concatenated heads but cuts their query/key head size to ``k``; it spends the
same query/key parameters as collaborative attention at ``D~ = heads x k`` (minus the mixing). The shared-key and
latent conversions (``key-svd``, ``kv-svd``) cut the stacked key projection, or keys and values together, to one
subspace cached per token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TruncatedHeads:
    """The rank-``k`` truncation of every head product of one layer."""

    w_query: torch.Tensor  # (heads, k, d_in): w_query[h].T @ w_key[h] is the best rank-k approximation of P_h
    w_key: torch.Tensor  # (heads, k, d_in)
    singular_values: torch.Tensor  # (heads, head_dim), of each original product P_h

    @property
    def k(self) -> int:
        return self.w_query.shape[1]

    @property
    def head_errors(self) -> torch.Tensor:
        """||P_h - P_h,k||_F / ||P_h||_F per head: the norm of the dropped singular values (0 for a zero head)."""
        energy = self.singular_values.square()
        return (energy[:, self.k :].sum(-1) / energy.sum(-1).clamp_min(1e-300)).sqrt()

    @property
    def relative_error(self) -> float:
        """The relative error of the stacked head products, the measure ``decompose_heads`` reports."""
        energy = self.singular_values.square()
        return float((energy[:, self.k :].sum() / energy.sum().clamp_min(1e-300)).sqrt())


def truncate_head_products(w_query: torch.Tensor, w_key: torch.Tensor, k: int) -> TruncatedHeads:
    """Best rank-``k`` approximation of each ``P_h = w_query[h].T @ w_key[h]`` as new (heads, k, d_in) projections.

    ``P_h`` is never formed: with thin QRs ``w_query[h].T = Qa Ra`` and ``w_key[h].T = Qb Rb``,
    ``P_h = Qa (Ra Rb^T) Qb^T``, so the SVD ``U S V^T`` of the head_dim x head_dim core gives ``P_h``'s SVD
    ``(Qa U) S (Qb V)^T``. Each side keeps ``sqrt(S_k)``. Computed in float64.
    """
    heads, head_dim, _ = w_query.shape
    if not 0 < k <= head_dim:
        raise ValueError(f"k must be in [1, {head_dim}] (the head size), got {k}")
    q_basis, q_factor = torch.linalg.qr(w_query.double().transpose(1, 2))  # (H, d_in, hd), (H, hd, hd)
    k_basis, k_factor = torch.linalg.qr(w_key.double().transpose(1, 2))
    left, singular, right_t = torch.linalg.svd(q_factor @ k_factor.transpose(1, 2))
    root = singular[:, :k].sqrt()[:, None, :]  # (H, 1, k)
    new_query = (q_basis @ left[:, :, :k] * root).transpose(1, 2)
    new_key = (k_basis @ right_t[:, :k].transpose(1, 2) * root).transpose(1, 2)
    return TruncatedHeads(new_query.float(), new_key.float(), singular.float())


@dataclass
class SharedSubspace:
    """The best rank-``r`` approximation ``matrix ~= up @ down`` of an (out, d_in) projection (``down``: (r, d_in),
    what every token is mapped to; ``up``: (out, r)), optionally in the norm of the inputs' statistics."""

    up: torch.Tensor
    down: torch.Tensor
    relative_error: float  # ||matrix - up down||_F / ||matrix||_F
    weighted_error: float | None  # the same in the whitened norm ||(matrix - up down) S||_F (with a whitening)


def shared_subspace(matrix: torch.Tensor, rank: int, whitening=None) -> SharedSubspace:
    """Truncated SVD of an (out, d_in) projection with ``sqrt(S_r)`` to each side; with ``whitening = (S, S^-1)``
    (``collab_attn.decomposition.whitening``) the SVD of ``matrix S``, mapped back with ``S^-1``: the rank-``r``
    map whose outputs on the calibration inputs are closest to the original's. Beyond the matrix's rank the extra
    directions are zero (exact). Computed in float64."""
    matrix = matrix.double()
    if not 0 < rank:
        raise ValueError(f"the rank must be positive, got {rank}")
    scale, inverse = (None, None) if whitening is None else (w.double() for w in whitening)
    target = matrix if scale is None else matrix @ scale
    left, singular, right_t = torch.linalg.svd(target, full_matrices=False)
    kept = min(rank, singular.numel())
    root = singular[:kept].sqrt()
    up = matrix.new_zeros(matrix.shape[0], rank)
    down = matrix.new_zeros(rank, matrix.shape[1])
    up[:, :kept] = left[:, :kept] * root
    down[:kept] = root[:, None] * (right_t[:kept] if inverse is None else right_t[:kept] @ inverse)
    energy = singular.square()
    dropped = float((energy[kept:].sum() / energy.sum().clamp_min(1e-300)).sqrt())
    raw = float(torch.linalg.norm(matrix - up @ down) / torch.linalg.norm(matrix).clamp_min(1e-300))
    return SharedSubspace(up.float(), down.float(), raw, None if scale is None else dropped)
