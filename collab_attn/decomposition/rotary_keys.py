"""Thin rotary keys: one key shared by every head, from an SVD of the key forms of each rotary frequency band
(TransMLA's per-frequency PCA of the keys; docs/design.md, "Rotary positions"). The layout of the bands and pairs is
``collab_attn.decomposition.rotary_cp``'s.

In band ``i`` (frequency ``theta_i``) key group ``g`` has the complex key vector ``b_gi`` (d entries: row ``i`` +
j row ``i + d_h/2`` of ``Wk_g``; a bias is one more input column) and query head ``h`` the vector ``a_hi``; head ``h``
(group ``g = g(h)``) scores band ``i`` as ``Re((a_hi^T x) conj(b_gi^T y) e^{j (p - s) theta_i})``.

Per band, stack the G key vectors as the columns of ``K_i = [b_1i ... b_Gi]`` (d x G complex) and keep the ``R_i``
leading left singular vectors ``U_i`` (d x R_i) of its SVD. With ``c_gi = U_i^H b_gi`` (R_i numbers), ``U_i c_gi``
is ``b_gi`` projected onto those directions (``b_gi`` itself when ``R_i`` >= the rank of ``K_i``, at most G), so

    b_gi^T y ~= sum_r c_gir (U_ir^T y)      and
    logit_h band i ~= Re( sum_r [conj(c_gir) a_hi^T x] e^{j p theta_i} conj([U_ir^T y] e^{j s theta_i}) ).

Every token's shared key is ``k_ir(y) = U_ir^T y`` (R_i complex numbers per band, rotating with ``theta_i``: what
is cached); head ``h``'s query for that pair is ``q_hir(x) = (conj(c_gir) a_hi)^T x``: a complex row of its own.
Pairs are stacked band by band (``pair_bands`` ascending) and laid out as real rows ``[real parts of the R pairs ;
imaginary parts]``, so that ``rotate_pairs`` rotates pair ``r`` by its band's angle and the real dot product of a
head's 2R-vector with the key's is ``Re(q conj(k))``.

Error: head ``h``'s band-``i`` form ``a_hi conj(b_gi)^T`` becomes ``a_hi conj(U_i U_i^H b_gi)^T``, so the relative
error of the logit forms (the measure of ``collab_attn.kinds.forms.BandForms``) is

    sqrt( sum_i sum_h ||a_hi||^2 ||b_gi - U_i U_i^H b_gi||^2  /  sum_i sum_h ||a_hi||^2 ||b_gi||^2 ).

Activation-aware (``whitening``, as ``collab_attn.decomposition.rotary_cp.whiten_forms``): the SVD is of the whitened
key forms ``S_y b_gi``, and the shared key maps back, ``U_i = S_y^{-1} U'_i`` with ``c_gi = U'^H_i S_y b_gi``; the
error is then that of the logits on inputs with the calibration's statistics (``weighted_error``, the queries'
whitened norms ``||S_x a_hi||^2`` as the weights), while ``relative_error`` stays that of the forms themselves.

Exact at ``R_i = G`` in every band (rank = 2 x G x d_h/2 = G d_h, the original key cache's width) and wherever
``R_i`` reaches the band's key rank. How the pairs are split among the bands of a layer at a given rank:
``allocate_key_pairs``, greedily by the singular values' energy across all bands (the largest remaining
``sigma^2`` first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from collab_attn.decomposition.rotary_cp import band_forms, whiten_forms


@dataclass
class ThinRotaryKeys:
    """The thin rotary keys of one layer (module doc). ``query_weight``: (heads, 2R, d) real, head ``h``'s rows
    ``[Re q_h1 .. Re q_hR ; Im q_h1 .. Im q_hR]``; ``key_weight``: (2R, d) real, ``[Re U^T ; Im U^T]``;
    ``pair_bands``: (R,) ascending; ``singular_values``: (bands, min(G, d)) of each band's key forms, descending;
    ``relative_error``: of the logit forms over all bands (energy-weighted), ``band_errors`` per band (1 for a band
    with no pairs); ``weighted_error``: of the whitened forms, for an activation-aware fit (None otherwise)."""

    query_weight: torch.Tensor
    key_weight: torch.Tensor
    pair_bands: torch.Tensor
    singular_values: torch.Tensor
    relative_error: float
    band_errors: list[float]
    weighted_error: float | None = None


def key_band_svd(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per band the SVD of the stacked key forms ``K_i = keys[i]^T`` (``keys``: (bands, G, d) complex): the left
    singular vectors (bands, d, k) and the singular values (bands, k), descending, ``k = min(G, d)``."""
    u, s, _ = torch.linalg.svd(keys.to(torch.complex128).mT, full_matrices=False)
    return u, s


def allocate_key_pairs(singular_values: torch.Tensor, total_pairs: int) -> list[int]:
    """Pairs per band for ``singular_values`` (bands, k) of each band's key forms: greedily, the next pair goes to the
    band whose next singular value is largest (the largest remaining ``sigma^2`` of the layer first; ties to the
    lower band). Each spectrum is descending, so this keeps the ``total_pairs`` largest of all of them: the split
    that keeps the most key energy (the error of the keys themselves, not weighted by the queries that read them).

    Weighting each key by the norm of its queries before the SVD would minimise the reported error of the logit forms
    exactly (Eckart-Young), but on SmolLM2 it measured worse where it matters: calibrated, at a quarter of the cache,
    19.0x / 21.6x the original's perplexity against 9.8x / 5.2x unweighted (a tie at 1/2, mixed at 1/8;
    ``experiments/smollm2/query_weighted/``, made at commit 355604a). The form error weighs the loud bands most;
    the model needs the quiet ones too."""
    bands, width = singular_values.shape
    if not 0 <= total_pairs <= bands * width:
        raise ValueError(f"total_pairs must be in 0..{bands * width}, got {total_pairs}")
    chosen = singular_values.flatten().argsort(descending=True, stable=True)[:total_pairs] // width
    return torch.bincount(chosen, minlength=bands).tolist()


def _relative(residuals: torch.Tensor, energies: torch.Tensor) -> float:
    return float((residuals.sum() / energies.sum().clamp_min(1e-300)).sqrt())


def thin_rotary_keys(w_query: torch.Tensor, w_key: torch.Tensor, pairs: int | list[int],
                     whitening=None) -> ThinRotaryKeys:
    """Thin rotary keys (module doc) of the per-head weights ``w_query`` (H, d_h, d) and grouped ``w_key`` (G, d_h,
    d) (biases appended as an input column by the caller). ``pairs``: the shared pairs in all, split among the bands
    by ``allocate_key_pairs``, or one count per band (0 .. min(G, d); 0 drops the band); ``whitening``: fitted to
    the inputs' statistics (module doc). Computed in float64."""
    heads, groups = w_query.shape[0], w_key.shape[0]
    a, b = band_forms(w_query, w_key)  # (bands, H, d); b expanded to the heads
    keys = b[:, :: heads // groups]  # (bands, G, d): one per group
    seen_a, seen_keys = (a, keys) if whitening is None else whiten_forms(a, keys, whitening)
    key_inverse = None if whitening is None else whitening[1][1].to(keys.dtype)
    u, s = key_band_svd(seen_keys)
    pairs_per_band = allocate_key_pairs(s, pairs) if isinstance(pairs, int) else list(pairs)
    if len(pairs_per_band) != a.shape[0]:
        raise ValueError(f"pairs_per_band needs {a.shape[0]} entries, got {len(pairs_per_band)}")
    if any(not 0 <= pairs <= s.shape[1] for pairs in pairs_per_band):
        raise ValueError(f"each band holds 0..{s.shape[1]} pairs (its key forms' rank bound), got {pairs_per_band}")
    group = torch.arange(heads) // (heads // groups)

    def norms(vectors):  # (bands, H or G, d) -> (bands, H): ||v||^2 per head
        squares = vectors.abs().square().sum(-1)
        return squares if squares.shape[1] == heads else squares[:, group]

    query_norms, seen_query_norms = norms(a), norms(seen_a)
    energies = (query_norms * norms(keys)).sum(-1)  # (bands,): sum_h ||a_hi||^2 ||b_gi||^2
    seen_energies = (seen_query_norms * norms(seen_keys)).sum(-1)
    queries, shared, bands, residuals, seen_residuals = [], [], [], [], []
    for band, pairs in enumerate(pairs_per_band):
        seen_basis = u[band, :, :pairs]  # (d, R_i): U'_i (U_i itself unwhitened)
        coefficients = seen_basis.mH @ seen_keys[band].T  # (R_i, G): c_gi
        basis = seen_basis if key_inverse is None else key_inverse @ seen_basis
        lost = (keys[band] - (basis @ coefficients).T).abs().square().sum(-1)  # (G,): ||b_gi - U c_gi||^2
        seen_lost = (seen_keys[band] - (seen_basis @ coefficients).T).abs().square().sum(-1)
        residuals.append((query_norms[band] * lost[group]).sum())
        seen_residuals.append((seen_query_norms[band] * seen_lost[group]).sum())
        queries.append(coefficients.conj().T[group][:, :, None] * a[band][:, None, :])  # (H, R_i, d)
        shared.append(basis.T)  # (R_i, d): U_ir^T
        bands += [band] * pairs
    query, key = torch.cat(queries, 1), torch.cat(shared, 0)
    residual = torch.stack(residuals)
    return ThinRotaryKeys(
        query_weight=torch.cat([query.real, query.imag], 1),
        key_weight=torch.cat([key.real, key.imag], 0),
        pair_bands=torch.tensor(bands, dtype=torch.long),
        singular_values=s,
        relative_error=_relative(residual, energies),
        band_errors=(residual / energies.clamp_min(1e-300)).sqrt().tolist(),
        weighted_error=None if whitening is None else _relative(torch.stack(seen_residuals), seen_energies),
    )
