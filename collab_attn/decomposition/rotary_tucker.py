"""Rotary-exact collaborative keys with Tucker mixing: per frequency band, every head's complex form (the layout and
the notation of ``collab_attn.decomposition.rotary_cp``) is

    M_h = a_h conj(b_h)^T  ~=  A C_h conj(B)^T        (A, B: d x R complex, orthonormal columns; C_h: R x R complex)

so the heads share R query/key pairs of the band and each mixes them with a matrix of its own instead of CP's
diagonal (``C_h`` diagonal is CP). Mixing inside one band commutes with its rotation: RoPE is kept exactly. For
fixed ``A`` and ``B`` the best core is ``C_h = (A^H a_h) conj(B^H b_h)^T``, leaving the error

    sum_h ||a_h||^2 ||b_h||^2  -  sum_h ||A^H a_h||^2 ||B^H b_h||^2,

so HOOI alternates ``A`` = the R leading eigenvectors of ``sum_h ||B^H b_h||^2 a_h a_h^H`` and ``B`` likewise
(each step lowers the error), started from the leading singular vectors of the stacked ``a_h`` and ``b_h``. The
vectors of one band span at most H dimensions, so the eigenproblems are solved in those coordinates (H x H). Exact
at ``R = H`` (and wherever ``R`` reaches the rank of both the queries and the keys). With ``whitening`` the forms
are whitened first and the shared weights mapped back, as for CP.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collab_attn.decomposition.rotary_cp import RotaryDecomposition, _energies, _overall, band_forms, whiten_forms


@dataclass
class ComplexTucker:
    """``M_h ~= A core[h] conj(B)^T`` for one band; ``relative_error`` as ``ComplexCP``'s; ``errors`` per
    iteration (the first is the initialization's)."""

    A: torch.Tensor  # (d, rank) complex
    B: torch.Tensor  # (d, rank) complex
    core: torch.Tensor  # (heads, rank, rank) complex
    relative_error: float
    errors: list[float]


def _leading(vectors: torch.Tensor, weights: torch.Tensor, rank: int) -> torch.Tensor:
    """The ``rank`` leading eigenvectors of ``sum_h weights_h v_h v_h^H`` for columns ``vectors`` (k, H)."""
    gram = (vectors * weights) @ vectors.mH
    return torch.linalg.eigh((gram + gram.mH) / 2).eigenvectors.flip(-1)[:, :rank]


def _tucker_error_sq(a, b, A, B, core) -> float:
    """``sum_h ||a_h b_h^H - A C_h B^H||^2`` for any ``A``, ``B`` (never a d x d matrix)."""
    qa, qb = a.conj() @ A, b.conj() @ B  # (H, R): a_h^H A, b_h^H B
    cross = torch.einsum("hr,hrs,hs->", qa, core, qb.conj()).real
    approx = torch.einsum("hrs,rt,htu,us->", core.conj(), A.mH @ A, core, B.mH @ B).real
    energy = (a.abs().square().sum(1) * b.abs().square().sum(1)).sum()
    return float((energy - 2 * cross + approx).clamp_min(0))


def complex_tucker(a: torch.Tensor, b: torch.Tensor, rank: int, n_iter_max: int = 200,
                   tol: float = 1e-7) -> ComplexTucker:
    """Complex Tucker ``a_h conj(b_h)^T ~= A C_h conj(B)^T`` of one band (``a``, ``b``: (H, d) complex; module
    doc): HOOI until ``n_iter_max`` iterations or a relative improvement below ``tol``."""
    heads = a.shape[0]
    if not 1 <= rank <= heads:
        raise ValueError(f"rank must be in 1..{heads} (the heads), got {rank}")
    a, b = a.to(torch.complex128), b.to(torch.complex128)
    basis_a, alpha = torch.linalg.qr(a.T)  # a_h = basis_a alpha_h: coordinates (k, H), k = min(d, H)
    basis_b, beta = torch.linalg.qr(b.T)
    if rank > min(alpha.shape[0], beta.shape[0]):
        raise ValueError(f"rank {rank} exceeds the dimension of the band's inputs ({a.shape[1]})")
    norms_a, norms_b = alpha.abs().square().sum(0), beta.abs().square().sum(0)
    energy = float((norms_a * norms_b).sum().clamp_min(1e-300))
    ones = torch.ones(heads, dtype=torch.float64)
    U, V = _leading(alpha, ones, rank), _leading(beta, ones, rank)

    def error(U, V) -> float:
        kept = (U.mH @ alpha).abs().square().sum(0) * (V.mH @ beta).abs().square().sum(0)
        return max(0.0, 1 - float(kept.sum()) / energy) ** 0.5

    errors = [error(U, V)]
    for _ in range(n_iter_max):
        U = _leading(alpha, (V.mH @ beta).abs().square().sum(0), rank)
        V = _leading(beta, (U.mH @ alpha).abs().square().sum(0), rank)
        errors.append(error(U, V))
        if tol and errors[-2] - errors[-1] < tol * max(errors[-2], 1e-300):
            break
    core = torch.einsum("rh,sh->hrs", U.mH @ alpha, (V.mH @ beta).conj())  # C_h = (U^H alpha_h)(V^H beta_h)^H
    return ComplexTucker(basis_a @ U, basis_b @ V, core, errors[-1], errors)


def rotary_tucker(w_query: torch.Tensor, w_key: torch.Tensor, pairs_per_band: list[int], n_iter_max: int = 200,
                  tol: float = 1e-7, whitening=None) -> RotaryDecomposition:
    """Shared rotary query/key weights with Tucker mixing for per-head weights ``w_query`` (H, d_h, d) and ``w_key``
    (G, d_h, d), ``pairs_per_band[i]`` pairs for band ``i`` (0: dropped): ``complex_tucker`` per band, stacked as
    ``rotary_decomposition`` stacks CP. ``mixing`` is the identity (heads, heads): head ``h`` reads core slice
    ``h``; ``core`` (heads, 2, R, R): each head's complex mixing over the pairs, zero across bands."""
    raw_a, raw_b = band_forms(w_query, w_key)
    a, b = (raw_a, raw_b) if whitening is None else whiten_forms(raw_a, raw_b, whitening)
    if len(pairs_per_band) != a.shape[0]:
        raise ValueError(f"pairs_per_band needs {a.shape[0]} entries, got {len(pairs_per_band)}")
    heads, d = a.shape[1], a.shape[2]
    total = sum(pairs_per_band)
    A = torch.zeros(d, total, dtype=torch.complex128)
    B = torch.zeros(d, total, dtype=torch.complex128)
    core = torch.zeros(heads, total, total, dtype=torch.complex128)
    bands, errors, raw_errors, start = [], [], [], 0
    raw_energies = _energies(raw_a, raw_b)
    for band, pairs in enumerate(pairs_per_band):
        if pairs == 0:
            errors.append(1.0), raw_errors.append(1.0)
            continue
        fit = complex_tucker(a[band], b[band], pairs, n_iter_max=n_iter_max, tol=tol)
        query, key = fit.A, fit.B
        if whitening is not None:
            (_, query_inverse), (_, key_inverse) = whitening
            query, key = query_inverse.to(query.dtype) @ query, key_inverse.to(key.dtype) @ key
        block = slice(start, start + pairs)
        A[:, block], B[:, block], core[:, block, block] = query, key, fit.core
        errors.append(fit.relative_error)
        if whitening is None:
            raw_errors.append(fit.relative_error)
        else:
            raw_error = _tucker_error_sq(raw_a[band], raw_b[band], query, key, fit.core)
            raw_errors.append((raw_error / float(raw_energies[band].clamp_min(1e-300))) ** 0.5)
        bands += [band] * pairs
        start += pairs
    return RotaryDecomposition(
        query_weight=torch.cat([A.real, A.imag], 1).T.contiguous(),
        key_weight=torch.cat([B.real, B.imag], 1).T.contiguous(),
        pair_bands=torch.tensor(bands, dtype=torch.long),
        mixing=torch.eye(heads, dtype=torch.float64),
        relative_error=_overall(raw_errors, raw_energies),
        band_errors=raw_errors,
        weighted_error=None if whitening is None else _overall(errors, _energies(a, b)),
        core=torch.stack([core.real, core.imag], 1),
    )
