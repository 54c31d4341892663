"""The maths of rotary-exact collaborative keys (collab_attn/decomposition/rotary_cp.py), in float64 on small layers."""

import pytest
import torch

from collab_attn.decomposition.rotary_cp import (
    _error_sq,
    _update_key,
    _update_mixing,
    _update_query,
    allocate_pairs,
    band_forms,
    complex_cp,
    rotary_decomposition,
    rotary_logits,
    rotate,
)

HEADS, GROUPS, HEAD_DIM, D = 4, 2, 8, 12


def weights(seed=0, heads=HEADS, groups=GROUPS, head_dim=HEAD_DIM, d=D):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(heads, head_dim, d, generator=gen, dtype=torch.float64),
        torch.randn(groups, head_dim, d, generator=gen, dtype=torch.float64),
    )


def inv_freq(head_dim=HEAD_DIM, base=10000.0):
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def original_logits(w_query, w_key, x, y, q_pos, k_pos):
    """Per-head RoPE logits as transformers computes them: (H, Nq, Nk)."""
    heads, groups = w_query.shape[0], w_key.shape[0]
    theta = inv_freq(w_query.shape[1])
    q = rotate(torch.einsum("hed,nd->hne", w_query, x), q_pos, theta)
    k = rotate(torch.einsum("ged,nd->gne", w_key, y), k_pos, theta).repeat_interleave(heads // groups, 0)
    return q @ k.transpose(1, 2)


def inputs(seed=1, n=5):
    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randn(n, D, generator=gen, dtype=torch.float64) for _ in range(2))
    return x, y, torch.tensor([0, 3, 7, 20, 41]), torch.tensor([0, 1, 5, 19, 33])


def complex_randn(*shape, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.view_as_complex(torch.randn(*shape, 2, generator=gen, dtype=torch.float64))


def dense_error_sq(a, b, A, B, m):
    approx = torch.einsum("ir,hr,jr->hij", A, m, B.conj())
    return float((torch.einsum("hi,hj->hij", a, b.conj()) - approx).abs().square().sum())


def energy_sq(a, b):
    return float(torch.einsum("hi,hj->hij", a, b.conj()).abs().square().sum())


def test_band_forms_give_the_rope_logits():
    w_query, w_key = weights()
    x, y, q_pos, k_pos = inputs()
    a, b = band_forms(w_query, w_key)
    assert a.shape == b.shape == (HEAD_DIM // 2, HEADS, D)
    phase = torch.exp(1j * (q_pos[:, None, None] - k_pos[None, :, None]) * inv_freq())  # (Nq, Nk, bands)
    forms = torch.einsum("ihd,nd,ihe,me,nmi->hnm", a, x.to(a.dtype), b.conj(), y.to(b.dtype), phase).real
    torch.testing.assert_close(forms, original_logits(w_query, w_key, x, y, q_pos, k_pos), rtol=0, atol=1e-10)


def test_als_updates_are_the_dense_least_squares_solutions():
    a, b = complex_randn(5, 7, seed=0), complex_randn(5, 7, seed=1)
    A, B, m = complex_randn(7, 3, seed=2), complex_randn(7, 3, seed=3), complex_randn(5, 3, seed=4)
    targets = torch.einsum("hi,hj->hij", a, b.conj())  # (H, d, d)
    # mixing: vec(M_h) ~= Phi m_h, Phi[:, r] = vec(A_r B_r^H)
    phi = torch.einsum("ir,jr->ijr", A, B.conj()).reshape(49, 3)
    expected = torch.linalg.lstsq(phi, targets.reshape(5, 49).T).solution.T
    torch.testing.assert_close(_update_mixing(a, b, A, B), expected, rtol=1e-8, atol=1e-10)
    # query: [M_1 .. M_H] ~= A [N_1 .. N_H], N_h = diag(m_h) B^H
    n = torch.einsum("hr,jr->rhj", m, B.conj()).reshape(3, 35)
    expected = torch.linalg.lstsq(n.T, targets.permute(1, 0, 2).reshape(7, 35).T).solution.T
    torch.testing.assert_close(_update_query(a, b, B, m), expected, rtol=1e-8, atol=1e-10)
    # key: [M_1^H .. M_H^H] ~= B [diag(conj m_h) A^H]
    n = torch.einsum("hr,jr->rhj", m.conj(), A.conj()).reshape(3, 35)
    expected = torch.linalg.lstsq(n.T, targets.conj().permute(2, 0, 1).reshape(7, 35).T).solution.T
    torch.testing.assert_close(_update_key(a, b, A, m), expected, rtol=1e-8, atol=1e-10)
    assert _error_sq(a, b, A, B, m) == pytest.approx(dense_error_sq(a, b, A, B, m), rel=1e-10)


def test_full_size_is_exact_with_rope_at_shifted_positions():
    w_query, w_key = weights()
    x, y, q_pos, k_pos = inputs()
    dec = rotary_decomposition(w_query, w_key, [HEADS] * (HEAD_DIM // 2))
    assert dec.query_weight.shape == dec.key_weight.shape == (2 * HEADS * HEAD_DIM // 2, D)
    assert dec.mixing.shape == (HEADS, 2 * HEADS * HEAD_DIM // 2) and dec.relative_error == 0
    for shift in (0, 100):
        got = rotary_logits(dec, x, y, q_pos + shift, k_pos + shift, inv_freq())
        expected = original_logits(w_query, w_key, x, y, q_pos + shift, k_pos + shift)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_reported_error_is_the_dense_error_and_falls_with_pairs():
    w_query, w_key = weights(seed=3)
    a, b = band_forms(w_query, w_key)
    bands = HEAD_DIM // 2
    previous = None
    for pairs in range(HEADS + 1):
        dec = rotary_decomposition(w_query, w_key, [pairs] * bands)
        pair_count = dec.query_weight.shape[0] // 2
        A = torch.complex(dec.query_weight[:pair_count], dec.query_weight[pair_count:]).T
        B = torch.complex(dec.key_weight[:pair_count], dec.key_weight[pair_count:]).T
        m = torch.complex(dec.mixing[:, :pair_count], dec.mixing[:, pair_count:])
        residual, energy = 0.0, 0.0
        for band in range(bands):
            cols = dec.pair_bands == band
            residual += dense_error_sq(a[band], b[band], A[:, cols], B[:, cols], m[:, cols])
            energy += energy_sq(a[band], b[band])
        assert dec.relative_error == pytest.approx((residual / energy) ** 0.5, rel=1e-7, abs=1e-7)
        if previous is not None:
            assert dec.relative_error <= previous + 1e-12
        previous = dec.relative_error
    assert previous == 0


def test_als_does_not_increase_the_error_of_its_initialization():
    a, b = complex_randn(6, 10, seed=5), complex_randn(6, 10, seed=6)
    for rank in (1, 3, 5):
        initial = complex_cp(a, b, rank, n_iter_max=0)
        fit = complex_cp(a, b, rank, n_iter_max=30, tol=0)
        assert initial.n_iter == 0 and fit.n_iter == 30
        assert all(after <= before * (1 + 1e-9) for before, after in zip(fit.errors, fit.errors[1:]))
        assert fit.relative_error <= initial.relative_error
        dense = dense_error_sq(a, b, fit.A, fit.B, fit.mixing) / energy_sq(a, b)
        assert fit.relative_error == pytest.approx(dense**0.5, rel=1e-8)


def test_planted_low_rank_band_is_recovered():
    # heads 0..2 and 3..5 read the same three pairs with different complex scales: CP rank 3 across the 6 heads
    A, B = complex_randn(10, 3, seed=7), complex_randn(10, 3, seed=8)
    scales = complex_randn(6, 2, seed=9)
    a = (A.T.repeat(2, 1)) * scales[:, :1]
    b = (B.T.repeat(2, 1)) * scales[:, 1:]
    fit = complex_cp(a, b, 3)
    assert fit.relative_error < 1e-6
    assert dense_error_sq(a, b, fit.A, fit.B, fit.mixing) < 1e-12 * energy_sq(a, b)
    assert complex_cp(a, b, 2).relative_error > 0.1


def test_allocate_pairs_follows_band_energy():
    w_query, w_key = weights(seed=4)
    w_query[:, 1] *= 10  # band 1 (rows 1 and 1 + d_h/2) holds most of the energy
    w_query[:, 1 + HEAD_DIM // 2] *= 10
    a, b = band_forms(w_query, w_key)
    for total in (1, 3, 6):
        pairs = allocate_pairs(a, b, total)
        assert sum(pairs) == total and all(0 <= p <= HEADS for p in pairs)
        assert pairs[1] == max(pairs) and pairs[1] >= min(total, HEADS) - 1
    assert allocate_pairs(a, b, 0) == [0] * 4 and allocate_pairs(a, b, 16) == [HEADS] * 4
    # activation-aware: inputs that only excite the features band 1 does not read move pairs to other bands
    weight = torch.eye(D, dtype=torch.float64)
    weight[:6, :6] *= 1e6
    w_query[:, 1, :6] = 0
    w_query[:, 1 + HEAD_DIM // 2, :6] = 0
    a, b = band_forms(w_query, w_key)
    assert allocate_pairs(a, b, 3, weights=(weight, weight))[1] == 0
    with pytest.raises(ValueError):
        allocate_pairs(a, b, 17)
