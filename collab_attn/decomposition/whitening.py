"""Whitening for activation-aware fits: ``S = (C + eps * mean_eig * I)^{1/2}`` of an input second-moment matrix.

Decomposing the whitened products ``S_q T_h S_k`` and mapping the factors back with ``S^{-1}`` minimizes the error
of the attention logits on the calibration inputs rather than of the raw weights (see
``collab_attn.fitting.calibration`` for where the statistics come from).
"""

from __future__ import annotations

import torch

DEFAULT_EPS = 0.1


def whitening_matrices(covariance: torch.Tensor, eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``S = (C + eps * mean_eig * I)^{1/2}`` and ``S^{-1}`` (float64, symmetric)."""
    eps = DEFAULT_EPS if eps is None else eps
    if eps < 0:
        raise ValueError(f"whitening_eps must be >= 0, got {eps}")
    cov = covariance.detach().to("cpu", torch.float64)
    cov = (cov + cov.T) / 2
    values, vectors = torch.linalg.eigh(cov)
    values = values.clamp_min(0)
    values = values + eps * values.mean()
    if not (values > 0).all():
        raise ValueError("the input covariance is singular; use whitening_eps > 0 or more calibration data")
    root = values.sqrt()
    return (vectors * root) @ vectors.T, (vectors / root) @ vectors.T


def whitening_pair(covariance, d_in: int, eps: float | None = None):
    """``((S_q, S_q^-1), (S_k, S_k^-1))`` from one (d_in, d_in) covariance (both sides) or a (query, key) pair."""
    pair = covariance if isinstance(covariance, (tuple, list)) else (covariance, covariance)
    if len(pair) != 2 or any(c.shape != (d_in, d_in) for c in pair):
        raise ValueError(f"covariance must be a ({d_in}, {d_in}) tensor or a (query, key) pair of them")
    for c in pair:
        if not torch.isfinite(c).all():
            raise ValueError("the input covariance contains NaN or Inf")
    query = whitening_matrices(pair[0], eps)
    key = query if pair[1] is pair[0] else whitening_matrices(pair[1], eps)
    return query, key
