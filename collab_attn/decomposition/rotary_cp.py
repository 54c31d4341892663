"""Rotary-exact collaborative keys: a complex CP per rotary frequency band (docs/design.md, "Rotary positions").

Layout: transformers' ``rotate_half`` RoPE pairs row ``i`` of a head with row ``i + d_h/2`` (``i < d_h/2`` is the
band). Per band write the two rows as one complex vector, ``a_hi = Wq[h, i] + j Wq[h, i + d_h/2]`` for query head
``h`` and ``b_gi`` likewise for key group ``g``. Head ``h`` (group ``g = h // (H/G)``) then scores a query input
``x`` at position ``p`` against a key input ``y`` at position ``s`` as

    sum_i Re( (a_hi^T x) conj(b_gi^T y) e^{j (p - s) theta_i} ),

so per band the head is the complex rank-1 form ``M_hi = a_hi conj(b_gi)^T`` (d x d), and since the real parts for
all angles determine ``M_hi``, reproducing the logits at every position means reproducing every ``M_hi``. Mixing
heads within one band, and scaling a pair by a complex number, commute with the rotation. A complex CP per band,

    M_h ~= A diag(m_h) conj(B)^T          (A, B: d x R complex, m: H x R complex),

therefore gives ``R`` shared query/key pairs that rotate with ``theta_i``; every head keeps one complex mixing
number per pair. It is exact at ``R = H`` (``A = [a_h]``, ``B = [b_h]``, ``m = I``).

Head ``h``'s logit from a ``RotaryDecomposition``: ``z = Wq~ x`` and ``w = Wk~ y`` read as ``R`` complex numbers
(first ``R`` entries real parts, last ``R`` imaginary parts); the head's query is ``m_h * z`` (complex, per pair);
rotate it and ``w`` by the angle of each pair's band (``rotate_half`` on the 2R-vector with ``theta[pair_bands]``);
the logit is the real dot product of the two 2R-vectors, ``sum_r Re(m_hr z_r e^{j p theta} conj(w_r e^{j s theta}))``
(``rotary_logits`` is this reference computation).

Bias: the caller appends a constant-1 input column.

Activation-aware fits (``whitening``): with query inputs of second moment ``C_x = S_x^2`` and key inputs of ``C_y =
S_y^2`` (``S`` symmetric), the mean square of a band's logit error ``x^T E y`` over independent inputs is ``||S_x E
S_y||^2``. So each band's forms are whitened, ``a_h -> S_x a_h`` and ``b_h -> S_y b_h``, decomposed, and the shared
weights mapped back, ``A = S_x^{-1} A'`` and ``B = S_y^{-1} B'``; the mixing is unchanged and the rotation, which
acts on the shared pairs and not on the inputs, is still kept exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

RIDGE = 1e-12  # relative to the mean diagonal of each Gram matrix solved with


@dataclass
class ComplexCP:
    """``M_h ~= A diag(mixing[h]) conj(B)^T`` for one band; ``relative_error`` = ``sqrt(sum_h ||M_h - .||^2 / sum_h
    ||M_h||^2)``; ``errors`` per iteration (the first is the initialization's)."""

    A: torch.Tensor  # (d, rank) complex
    B: torch.Tensor  # (d, rank) complex
    mixing: torch.Tensor  # (heads, rank) complex
    relative_error: float
    n_iter: int
    errors: list[float]


@dataclass
class RotaryDecomposition:
    """Shared rotary query/key weights of one layer. ``query_weight``, ``key_weight``: (2R, d) real, rows [real parts
    of the R pairs; imaginary parts]; ``pair_bands``: (R,) band of each pair (ascending); ``mixing``: (heads, 2R) real,
    [real parts; imaginary parts] of the complex mixing; errors relative as in ``ComplexCP``, the overall one over
    all bands together (energy-weighted), of the forms themselves; a band with no pairs has error 1.
    ``weighted_error``: the overall error of the whitened forms, for an activation-aware fit (None otherwise).
    Tucker mixing (``collab_attn.decomposition.rotary_tucker``): ``core`` (heads, 2, R, R), each head's complex
    matrix over the pairs [real; imaginary], and ``mixing`` the (heads, heads) weights of those slices."""

    query_weight: torch.Tensor
    key_weight: torch.Tensor
    pair_bands: torch.Tensor
    mixing: torch.Tensor
    relative_error: float
    band_errors: list[float]
    weighted_error: float | None = None
    core: torch.Tensor | None = None


def band_forms(w_query: torch.Tensor, w_key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The complex vectors ``a`` (bands, H, d) and ``b`` (bands, H, d) (keys expanded from the G groups to the H heads)
    of the per-head weights ``w_query`` (H, d_h, d) and ``w_key`` (G, d_h, d)."""
    heads, head_dim, _ = w_query.shape
    groups = w_key.shape[0]
    if head_dim % 2 or w_key.shape[1:] != w_query.shape[1:] or heads % groups:
        raise ValueError(f"incompatible query {tuple(w_query.shape)} and key {tuple(w_key.shape)} weights")
    half = head_dim // 2
    wq, wk = w_query.detach().double(), w_key.detach().double().repeat_interleave(heads // groups, dim=0)
    a = torch.complex(wq[:, :half], wq[:, half:]).transpose(0, 1)
    b = torch.complex(wk[:, :half], wk[:, half:]).transpose(0, 1)
    return a.contiguous(), b.contiguous()


def _solve_right(rhs: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``rhs (gram + ridge)^{-1}``."""
    ridge = RIDGE * gram.diagonal().real.mean().clamp_min(1e-300)
    return torch.linalg.solve(gram + ridge * torch.eye(len(gram), dtype=gram.dtype), rhs, left=False)


def _fit_terms(a, b, A, B):
    """``G = (A^H A) * conj(B^H B)`` (R, R) and the rows ``c_h = (A^H a_h) * conj(B^H b_h)`` (H, R): the inner products
    ``<A_r B_r^H, A_s B_s^H> = (A_r^H A_s)(B_s^H B_r)`` and ``<A_r B_r^H, a_h b_h^H> = (A_r^H a_h)(b_h^H B_r)``."""
    return (A.mH @ A) * (B.mH @ B).conj(), (a @ A.conj()) * (b @ B.conj()).conj()


def _update_mixing(a, b, A, B, terms=None):
    """``m_h = G^{-1} c_h`` (``_fit_terms``): the normal equations of ``min_m ||a_h b_h^H - sum_r m_r A_r B_r^H||``."""
    gram, c = _fit_terms(a, b, A, B) if terms is None else terms
    return _solve_right(c, gram.T)  # m G^T = C  <=>  G m_h = c_h


def _update_query(a, b, B, m):
    """``A = sum_h a_h (m_h * u_h)^H [(B^H B) * (m^T conj(m))]^{-1}``, ``u_h = B^H b_h``: the normal equations of
    ``min_A sum_h ||a_h b_h^H - A N_h||^2`` with ``N_h = diag(m_h) B^H`` are ``A sum_h N_h N_h^H = sum_h M_h N_h^H``."""
    u = b @ B.conj()
    return _solve_right(a.T @ (m * u).conj(), (B.mH @ B) * (m.T @ m.conj()))


def _update_key(a, b, A, m):
    """The query update on the conjugate transposes ``b_h a_h^H ~= B diag(conj(m_h)) A^H``."""
    return _update_query(b, a, A, m.conj())


def _error_sq(a, b, A, B, m, terms=None) -> float:
    """``sum_h ||a_h b_h^H - A diag(m_h) B^H||^2 = sum_h ||a_h||^2 ||b_h||^2 - 2 Re sum_h m_h . conj(c_h)
    + sum_h m_h^H G m_h`` (``_fit_terms``): never forms a d x d matrix."""
    gram, c = _fit_terms(a, b, A, B) if terms is None else terms
    energy = (a.abs().square().sum(1) * b.abs().square().sum(1)).sum()
    cross = (m * c.conj()).sum().real
    approx = torch.einsum("hr,rs,hs->", m.conj(), gram, m).real
    return float((energy - 2 * cross + approx).clamp_min(0))


def _normalize_columns(factor, m):
    """Unit columns of ``factor``, the norms moved into the mixing (the approximation is unchanged)."""
    norms = factor.abs().square().sum(0).sqrt().clamp_min(1e-300)
    return factor / norms, m * norms


def _leading_vectors(vectors: torch.Tensor, rank: int, generator: torch.Generator) -> torch.Tensor:
    """The top ``rank`` left singular vectors of ``vectors^T`` (d x H), random columns beyond its rank."""
    u = torch.linalg.svd(vectors.T, full_matrices=False)[0][:, :rank]
    extra = rank - u.shape[1]
    if extra > 0:
        fill = torch.randn(u.shape[0], extra, 2, dtype=torch.float64, generator=generator)
        u = torch.cat([u, torch.view_as_complex(fill)], 1)
    return u


def complex_cp(
    a: torch.Tensor, b: torch.Tensor, rank: int, n_iter_max: int = 200, tol: float = 1e-7, seed: int = 0
) -> ComplexCP:
    """Complex CP ``a_h conj(b_h)^T ~= A diag(m_h) conj(B)^T`` of one band (``a``, ``b``: (H, d) complex).

    ``rank = H`` is exact (``A = a^T``, ``B = b^T``, ``m = I``). Below, ``A`` and ``B`` start from the top left
    singular vectors of ``a^T`` and ``b^T`` (random columns beyond their rank, drawn with ``seed``), ``m`` by least
    squares, then ALS (query, key, mixing, each a closed-form least-squares step: the error never increases) until
    ``n_iter_max`` iterations or a relative improvement of the error below ``tol`` (``tol=0``: every iteration).
    """
    heads = a.shape[0]
    if not 1 <= rank <= heads:
        raise ValueError(f"rank must be in 1..{heads} (the heads), got {rank}")
    a, b = a.to(torch.complex128), b.to(torch.complex128)
    if rank == heads:
        return ComplexCP(a.T.clone(), b.T.clone(), torch.eye(heads, dtype=a.dtype), 0.0, 0, [0.0])
    scale_a, scale_b = a.norm().clamp_min(1e-300), b.norm().clamp_min(1e-300)
    a, b = a / scale_a, b / scale_b  # unit energy: the fit does not depend on the scale of the weights
    generator = torch.Generator().manual_seed(seed)
    A, B = _leading_vectors(a, rank, generator), _leading_vectors(b, rank, generator)
    terms = _fit_terms(a, b, A, B)
    m = _update_mixing(a, b, A, B, terms)
    energy = float((a.abs().square().sum(1) * b.abs().square().sum(1)).sum())
    errors = [(_error_sq(a, b, A, B, m, terms) / energy) ** 0.5]
    best = (A, B, m)
    for _ in range(n_iter_max):
        A, m = _normalize_columns(_update_query(a, b, B, m), m)
        B, m = _normalize_columns(_update_key(a, b, A, m), m)
        terms = _fit_terms(a, b, A, B)
        m = _update_mixing(a, b, A, B, terms)
        errors.append((_error_sq(a, b, A, B, m, terms) / energy) ** 0.5)
        if errors[-1] <= min(errors[:-1]):
            best = (A, B, m)
        if tol and errors[-2] - errors[-1] < tol * errors[-2]:
            break
    A, B, m = best
    return ComplexCP(A * scale_a, B * scale_b, m, min(errors), len(errors) - 1, errors)


def band_spectra(
    a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None
) -> torch.Tensor:
    """(bands, H) eigenvalues, descending, of each band's Gram ``<M_h, M_k> = (a_k^H C_x a_h)(b_h^H C_y b_k)`` (``C =
    I`` unweighted; ``weights`` = ``C`` or ``(C_x, C_y)``: input second moments, so that the Gram is the expected
    ``x^T M_h y conj(x^T M_k y)`` for independent query and key inputs)."""
    if weights is None:
        gram_a, gram_b = a.conj() @ a.mT, b.conj() @ b.mT  # [i, k, h] = a_k^H a_h
    else:
        c_x, c_y = weights if isinstance(weights, tuple | list) else (weights, weights)
        gram_a = a.conj() @ c_x.to(a.dtype) @ a.mT
        gram_b = b.conj() @ c_y.to(b.dtype) @ b.mT
    gram = gram_a.transpose(1, 2) * gram_b  # [i, h, k] = (a_k^H a_h)(b_h^H b_k)
    return torch.linalg.eigvalsh(gram).flip(-1).clamp_min(0)


def allocate_pairs(
    a: torch.Tensor,
    b: torch.Tensor,
    total_pairs: int,
    weights: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
) -> list[int]:
    """Pairs per band (each 0..H, summing to ``total_pairs``) for the forms ``a``, ``b`` (bands, H, d).

    Greedy on the spectra of ``band_spectra``: the next pair goes to the band whose next eigenvalue is largest. This
    is a surrogate for the CP error: the eigenvalues are the squared singular values of each band's head (mode-3)
    unfolding, and the energy beyond the first ``R`` of them is the error of the best rank-``R`` subspace of head
    forms, a lower bound on the error of a rank-``R`` CP (equal at ``R = H`` and for planted low-rank bands). Since
    each spectrum is descending, the greedy choice minimizes the sum of these bounds.
    """
    bands, heads, _ = a.shape
    if not 0 <= total_pairs <= bands * heads:
        raise ValueError(f"total_pairs must be in 0..{bands * heads}, got {total_pairs}")
    spectra = band_spectra(a, b, weights)
    chosen = spectra.flatten().argsort(descending=True, stable=True)[:total_pairs] // heads
    return torch.bincount(chosen, minlength=bands).tolist()


def whiten_forms(a: torch.Tensor, b: torch.Tensor, whitening) -> tuple[torch.Tensor, torch.Tensor]:
    """The band forms ``a``, ``b`` (bands, H, d) seen through the inputs' statistics: ``S_x a_h`` and ``S_y b_h`` for
    ``whitening = ((S_x, S_x^-1), (S_y, S_y^-1))`` (``collab_attn.decomposition.whitening.whitening_pair``, d x d)."""
    (s_query, _), (s_key, _) = whitening
    return a @ s_query.to(a.dtype), b @ s_key.to(b.dtype)  # S symmetric: S a_h is a row a_h^T S


def _overall(errors: list[float], energies: torch.Tensor) -> float:
    residual = (torch.tensor(errors, dtype=torch.float64).square() * energies).sum()
    return float(residual / energies.sum().clamp_min(1e-300)) ** 0.5


def _energies(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.abs().square().sum(-1) * b.abs().square().sum(-1)).sum(-1)  # (bands,): sum_h ||M_h||^2


def rotary_decomposition(
    w_query: torch.Tensor,
    w_key: torch.Tensor,
    pairs_per_band: list[int],
    n_iter_max: int = 200,
    tol: float = 1e-7,
    seed: int = 0,
    whitening=None,
) -> RotaryDecomposition:
    """Shared rotary query/key weights for per-head weights ``w_query`` (H, d_h, d) and ``w_key`` (G, d_h, d), with
    ``pairs_per_band[i]`` pairs for band ``i`` (0: the band is dropped): ``complex_cp`` per band, stacked (module
    doc for the layout and how a head's logit is computed); with ``whitening`` (``whiten_forms``) fitted to the
    inputs' statistics."""
    raw_a, raw_b = band_forms(w_query, w_key)
    a, b = (raw_a, raw_b) if whitening is None else whiten_forms(raw_a, raw_b, whitening)
    if len(pairs_per_band) != a.shape[0]:
        raise ValueError(f"pairs_per_band needs {a.shape[0]} entries, got {len(pairs_per_band)}")
    A, B, m, bands, errors, raw_errors = [], [], [], [], [], []
    raw_energies = _energies(raw_a, raw_b)
    for band, pairs in enumerate(pairs_per_band):
        if pairs == 0:
            errors.append(1.0), raw_errors.append(1.0)
            continue
        fit = complex_cp(a[band], b[band], pairs, n_iter_max=n_iter_max, tol=tol, seed=seed)
        query, key = fit.A, fit.B
        if whitening is not None:
            (_, query_inverse), (_, key_inverse) = whitening
            query, key = query_inverse.to(query.dtype) @ query, key_inverse.to(key.dtype) @ key
            raw_error = _error_sq(raw_a[band], raw_b[band], query, key, fit.mixing)
            raw_errors.append((raw_error / float(raw_energies[band].clamp_min(1e-300))) ** 0.5)
        else:
            raw_errors.append(fit.relative_error)
        A.append(query), B.append(key), m.append(fit.mixing), errors.append(fit.relative_error)
        bands += [band] * pairs
    d, heads = a.shape[-1], a.shape[1]
    A = torch.cat(A, 1) if A else torch.zeros(d, 0, dtype=torch.complex128)
    B = torch.cat(B, 1) if B else torch.zeros(d, 0, dtype=torch.complex128)
    m = torch.cat(m, 1) if m else torch.zeros(heads, 0, dtype=torch.complex128)
    return RotaryDecomposition(
        query_weight=torch.cat([A.real, A.imag], 1).T.contiguous(),
        key_weight=torch.cat([B.real, B.imag], 1).T.contiguous(),
        pair_bands=torch.tensor(bands, dtype=torch.long),
        mixing=torch.cat([m.real, m.imag], 1),
        relative_error=_overall(raw_errors, raw_energies),
        band_errors=raw_errors,
        weighted_error=None if whitening is None else _overall(errors, _energies(a, b)),
    )


def rotate(vectors: torch.Tensor, positions: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """transformers' RoPE: ``v cos + rotate_half(v) sin`` on (..., N, 2P) vectors with one angle per pair (``theta``:
    (P,)), i.e. the complex pair ``v[r] + j v[r + P]`` times ``e^{j p theta_r}`` at position ``p``."""
    angles = positions.to(theta.dtype)[:, None] * theta[None, :]
    cos, sin = angles.cos().repeat(1, 2), angles.sin().repeat(1, 2)
    first, second = vectors.chunk(2, dim=-1)
    return vectors * cos + torch.cat([-second, first], -1) * sin


def rotary_logits(
    dec: RotaryDecomposition,
    x: torch.Tensor,
    y: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor,
    inv_freq: torch.Tensor,
) -> torch.Tensor:
    """(H, Nq, Nk) logits of every head from the shared weights (reference computation of the module doc):
    ``x`` (Nq, d), ``y`` (Nk, d), ``inv_freq`` (bands,) the rotary frequencies ``theta_i``."""
    pairs = len(dec.pair_bands)
    z, w = x @ dec.query_weight.T, y @ dec.key_weight.T  # (N, 2R)
    if dec.core is not None:  # Tucker: head h's pair s is sum_r z_r C_h[r, s]
        core = torch.einsum("hg,gcrs->hcrs", dec.mixing, dec.core)
        queries = torch.einsum("nr,hrs->hns", torch.complex(z[:, :pairs], z[:, pairs:]).to(torch.complex128),
                               torch.complex(core[:, 0], core[:, 1]).to(torch.complex128))
        queries = torch.cat([queries.real, queries.imag], -1)
    else:
        zr, zi, mr, mi = z[:, :pairs], z[:, pairs:], dec.mixing[:, None, :pairs], dec.mixing[:, None, pairs:]
        queries = torch.cat([zr * mr - zi * mi, zr * mi + zi * mr], -1)  # (H, Nq, 2R): m_h * z
    theta = inv_freq.to(z.dtype)[dec.pair_bands]
    return rotate(queries, q_positions, theta) @ rotate(w, k_positions, theta).T
