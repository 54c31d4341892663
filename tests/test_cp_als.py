"""The implicit CP-ALS / HOOI solvers against tensorly's dense ones, and their own guarantees."""

import math

import pytest
import tensorly as tl
import torch
from tensorly.decomposition import parafac

from collab_attn import decompose_heads
from collab_attn.decomposition.cp_als import (
    HeadProducts,
    cp_als,
    cp_init,
    cp_relative_error,
    tucker_hooi,
    tucker_relative_error,
)
from collab_attn.decomposition.decompose import head_products

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny problems


def random_heads(heads=4, head_dim=6, d_in=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, head_dim, d_in, generator=g), torch.randn(heads, head_dim, d_in, generator=g)


def planted(heads=6, head_dim=8, d_in=24, rank=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    query, key, mixing = torch.randn(d_in, rank, generator=g), torch.randn(d_in, rank, generator=g), torch.randn(
        heads, rank, generator=g
    )
    w_query, w_key = torch.zeros(heads, head_dim, d_in), torch.zeros(heads, head_dim, d_in)
    for h in range(heads):
        w_query[h, :rank] = (query * mixing[h]).T
        w_key[h, :rank] = key.T
    return w_query, w_key


def dense_parafac(tensor, rank, init, n_iter_max, tol=0.0, seed=0):
    with tl.backend_context("pytorch"):
        (weights, factors), errors = parafac(
            tensor, rank, init=init, n_iter_max=n_iter_max, tol=tol, random_state=seed, return_errors=True
        )
    return weights, factors, [float(e) for e in errors]


def test_the_implicit_tensor_agrees_with_the_dense_one():
    w_query, w_key = random_heads()
    tensor = HeadProducts(w_query, w_key)
    dense = head_products(w_query.double(), w_key.double())
    assert torch.allclose(tensor.dense(), dense)
    assert math.isclose(tensor.norm_sq(), float((dense**2).sum()), rel_tol=1e-10)
    for mode, gram in ((1, tensor.query_unfolding_gram()), (2, tensor.key_unfolding_gram())):
        unfolded = tl.unfold(tl.tensor(dense.numpy()), mode)
        assert torch.allclose(gram, torch.from_numpy(unfolded @ unfolded.T))
    unfolded = dense.reshape(4, -1)
    assert torch.allclose(tensor.head_unfolding_gram(), unfolded @ unfolded.T)


@pytest.mark.filterwarnings("ignore:Trying to compute SVD")
@pytest.mark.parametrize("init", ["random", "svd"])
def test_same_init_same_iterations_as_tensorly(init):
    """From the same initialization the implicit ALS takes tensorly's steps: the error curves coincide."""
    w_query, w_key = random_heads(seed=1)
    tensor = HeadProducts(w_query, w_key)
    rank = 7
    _, _, dense_errors = dense_parafac(tensor.dense(), rank, init, n_iter_max=30, seed=3)
    fit = cp_als(w_query, w_key, rank, init=init, n_iter_max=30, tol=0, seed=3)
    assert len(fit.errors) == len(dense_errors) == 30
    assert max(abs(a - b) for a, b in zip(fit.errors, dense_errors)) < 1e-6
    # and the factors it returns have the error it reports
    assert math.isclose(cp_relative_error(tensor, fit.mixing, fit.query, fit.key), fit.errors[-1], rel_tol=1e-8)


def test_explicit_init_factors_match_tensorly():
    w_query, w_key = random_heads(seed=2)
    tensor = HeadProducts(w_query, w_key)
    g = torch.Generator().manual_seed(0)
    init = [torch.randn(size, 6, generator=g, dtype=torch.float64) for size in (4, 20, 20)]
    weights, factors, errors = dense_parafac(tensor.dense(), 6, (torch.ones(6, dtype=torch.float64), init), 20)
    fit = cp_als(w_query, w_key, 6, init=tuple(init), n_iter_max=20, tol=0)
    assert max(abs(a - b) for a, b in zip(fit.errors, errors)) < 1e-8
    assert torch.allclose(fit.query, factors[1], atol=1e-6, rtol=1e-5)


def test_decompose_heads_solvers_give_the_same_fit():
    """The public entry point: same settings, both solvers, same error (tensorly's dense tensor is float32). tol=0:
    the solvers' stopping rules differ (tensorly's: absolute change below tol, once)."""
    w_query, w_key = random_heads(seed=4)
    for init in ("svd", "random"):
        fits = [
            decompose_heads(w_query, w_key, 9, seed=5, solver=solver, init=init, linesearch=False, tol=0)
            for solver in ("implicit", "tensorly")
        ]
        assert abs(fits[0].relative_error - fits[1].relative_error) < 1e-4
        torch.testing.assert_close(fits[0].head_products(), fits[1].head_products(), atol=2e-3, rtol=1e-3)


def test_float32_products_do_not_change_the_fit():
    w_query, w_key = random_heads(seed=6)
    double = cp_als(w_query, w_key, 8, n_iter_max=40, tol=0)
    single = cp_als(w_query, w_key, 8, n_iter_max=40, tol=0, matmul_dtype=torch.float32)
    assert max(abs(a - b) for a, b in zip(double.errors, single.errors)) < 1e-5


def test_linesearch_does_not_hurt():
    w_query, w_key = random_heads(heads=6, head_dim=8, d_in=32, seed=7)
    plain = cp_als(w_query, w_key, 12, n_iter_max=60, tol=0)
    searched = cp_als(w_query, w_key, 12, n_iter_max=60, tol=0, linesearch=True)
    assert searched.relative_error <= plain.relative_error + 1e-4
    assert all(b <= a + 1e-9 for a, b in zip(searched.errors, searched.errors[1:]))  # monotone, jumps included


def test_planted_structure_is_recovered_and_the_stopping_rule_fires():
    w_query, w_key = planted()
    fit = cp_als(w_query, w_key, 5, n_iter_max=1000, tol=1e-10, matmul_dtype=torch.float32, linesearch=True)
    assert fit.converged and fit.n_iter < 1000
    assert fit.relative_error < 1e-6
    result = decompose_heads(w_query, w_key, 5, n_iter_max=1000, tol=1e-10)
    assert result.relative_error < 1e-5 and result.n_iter < 1000


def test_a_rank_above_the_tensors_cp_rank_stays_finite():
    """Rank 8 to 20 on an exact rank-4 CP (4 heads): columns past the fourth get zero mixing, so the Gram matrices
    are singular; Cholesky still "succeeds" on some of them, and its ~1/eps inverse used to overflow the float32
    factors (NaN Grams, then eigh failing to converge). Numerically singular Grams take the minimum-norm solve."""
    w_query, w_key = planted(heads=4, head_dim=6, d_in=24, rank=4)
    tensor = HeadProducts(w_query, w_key)
    for rank in (8, 12, 16, 20):
        for dtype in (torch.float32, torch.float64):
            fit = cp_als(w_query, w_key, rank, n_iter_max=10, tol=0, linesearch=True, matmul_dtype=dtype)
            assert all(math.isfinite(e) for e in fit.errors) and max(fit.errors) < 1
            assert all(torch.isfinite(f).all() for f in (fit.mixing, fit.query, fit.key))
            assert fit.relative_error < 1e-3  # rank 4 itself reaches 2e-5 in these 10 iterations
            dense_error = cp_relative_error(tensor, fit.mixing, fit.query, fit.key)
            assert dense_error == pytest.approx(fit.relative_error, abs=1e-6)


def test_tol_stops_early_and_zero_tol_runs_every_iteration():
    w_query, w_key = random_heads()
    assert cp_als(w_query, w_key, 6, n_iter_max=50, tol=0).n_iter == 50
    loose = cp_als(w_query, w_key, 6, n_iter_max=50, tol=1e-2)
    assert loose.converged and loose.n_iter < 50
    assert abs(loose.errors[-2] - loose.errors[-1]) < 1e-2


@pytest.mark.parametrize("init", ["svd", "random"])
def test_deterministic_under_a_fixed_seed(init):
    w_query, w_key = random_heads()
    first = decompose_heads(w_query, w_key, 7, seed=11, init=init)
    second = decompose_heads(w_query, w_key, 7, seed=11, init=init)
    for name in ("shared_query", "shared_key", "mixing"):
        assert torch.equal(getattr(first, name), getattr(second, name))
    assert first.relative_error == second.relative_error


def test_random_init_is_tensorlys_and_depends_on_the_seed():
    tensor = HeadProducts(*random_heads())
    mixing, query, key = cp_init(tensor, 5, "random", seed=2)
    with tl.backend_context("pytorch"):
        from tensorly.random import random_cp

        expected = random_cp((4, 20, 20), 5, normalise_factors=False, random_state=2, dtype=torch.float64)
    for got, want in zip((mixing, query, key), expected.factors):
        assert torch.allclose(got, torch.as_tensor(want))
    other = cp_init(tensor, 5, "random", seed=3)
    assert not torch.allclose(other[1], query)


def test_reported_error_is_the_dense_error():
    w_query, w_key = random_heads(seed=8)
    result = decompose_heads(w_query, w_key, 10)
    dense = head_products(w_query, w_key)
    error = float(torch.linalg.norm(dense - result.head_products()) / torch.linalg.norm(dense))
    assert math.isclose(error, result.relative_error, rel_tol=1e-4)
    # balanced factors: unit-norm mixing columns, query and key columns of equal norm
    torch.testing.assert_close(result.mixing.norm(dim=0), torch.ones(10))
    torch.testing.assert_close(result.shared_query.norm(dim=0), result.shared_key.norm(dim=0))


def test_tucker_hooi_matches_tensorly_and_reports_the_dense_error():
    w_query, w_key = random_heads(seed=9)
    for core_size in (None, 2):
        fits = [
            decompose_heads(w_query, w_key, 8, method="tucker", solver=solver, tucker_core_size=core_size, tol=0)
            for solver in ("implicit", "tensorly")
        ]
        assert abs(fits[0].relative_error - fits[1].relative_error) < 1e-4
        dense = head_products(w_query, w_key)
        error = float(torch.linalg.norm(dense - fits[0].head_products()) / torch.linalg.norm(dense))
        assert math.isclose(error, fits[0].relative_error, rel_tol=1e-4)
    tensor = HeadProducts(w_query, w_key)
    fit = tucker_hooi(tensor, None, 8, 3, n_iter_max=20)
    assert math.isclose(
        tucker_relative_error(tensor, fit.mixing, fit.query, fit.key, fit.core), fit.relative_error, rel_tol=1e-6
    )
    assert tucker_hooi(tensor, None, 20, n_iter_max=3).relative_error < 1e-6  # full size is exact


def test_bad_solver_and_init_are_explained():
    w_query, w_key = random_heads()
    with pytest.raises(ValueError, match="unknown solver"):
        decompose_heads(w_query, w_key, 4, solver="dense")
    with pytest.raises(ValueError, match="unknown init"):
        decompose_heads(w_query, w_key, 4, init="ones")
    with pytest.raises(ValueError, match="unknown init"):
        decompose_heads(w_query, w_key, 4, method="tucker", init="ones")


# ---------------------------------------------------------------------------------------------------------------
# Scale invariance (issue 41): the solvers fit the unit-norm tensor and scale the factors back


SCALES = (1e-10, 1e4)


def test_normalized_tensor_has_unit_norm_and_ignores_the_scale_of_either_side():
    w_query, w_key = random_heads(seed=12)
    unit, query_scale, key_scale = HeadProducts(w_query, w_key).normalized()
    assert unit.norm_sq() == pytest.approx(1, rel=1e-12)
    assert float(unit.a.abs().max()) == pytest.approx(float(unit.b.abs().max()), rel=1e-12)
    torch.testing.assert_close(unit.dense() / (query_scale * key_scale), HeadProducts(w_query, w_key).dense())
    other, other_query, other_key = HeadProducts(w_query.double() * 1e-12, w_key.double() * 3e5).normalized()
    torch.testing.assert_close(other.a, unit.a, rtol=1e-12, atol=0)
    torch.testing.assert_close(other.b, unit.b, rtol=1e-12, atol=0)
    assert other_query == pytest.approx(query_scale * 1e12, rel=1e-12)
    assert other_key == pytest.approx(key_scale / 3e5, rel=1e-12)


@pytest.mark.parametrize("scale", SCALES)
def test_cp_als_is_scale_invariant(scale):
    """float64 weights, so that scaling them rounds at 1e-16 only: the same iterations, the factors scaled (the
    query and key factors take the scale of their projections). float32 products in ALS, as decompose_heads runs
    it: at 1e-10 the Grams of the unnormalized products (~1e-40) used to underflow and ALS diverged."""
    w_query, w_key = (w.double() for w in random_heads(heads=4, head_dim=8, d_in=32, seed=13))
    options = dict(n_iter_max=25, linesearch=True, matmul_dtype=torch.float32)
    unit = cp_als(w_query, w_key, 12, **options)
    fit = cp_als(w_query * scale, w_key * scale, 12, **options)
    assert fit.n_iter == unit.n_iter
    assert fit.errors == pytest.approx(unit.errors, rel=1e-9)
    torch.testing.assert_close(fit.mixing, unit.mixing, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(fit.query / scale, unit.query, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(fit.key / scale, unit.key, rtol=1e-6, atol=1e-9)
    tensor = HeadProducts(w_query * scale, w_key * scale)
    # float32 products: the error ALS reports is ~1e-7 off the exact one, at any scale
    assert cp_relative_error(tensor, fit.mixing, fit.query, fit.key) == pytest.approx(fit.relative_error, rel=1e-6)


@pytest.mark.parametrize("scale", SCALES)
def test_tucker_hooi_is_scale_invariant(scale):
    w_query, w_key = (w.double() for w in random_heads(heads=4, head_dim=8, d_in=32, seed=14))
    unit = tucker_hooi(w_query, w_key, 12, 3, n_iter_max=10)
    fit = tucker_hooi(w_query * scale, w_key * scale, 12, 3, n_iter_max=10)
    assert fit.errors == pytest.approx(unit.errors, rel=1e-9)
    for name in ("mixing", "query", "key"):  # orthonormal factors: the core takes the scale
        torch.testing.assert_close(getattr(fit, name), getattr(unit, name), rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(fit.core / scale**2, unit.core, rtol=1e-6, atol=1e-9)
    tensor = HeadProducts(w_query * scale, w_key * scale)
    error = tucker_relative_error(tensor, fit.mixing, fit.query, fit.key, fit.core)
    assert error == pytest.approx(fit.relative_error, rel=1e-8)


def test_explicit_init_factors_are_scaled_with_the_tensor():
    """Init factors are given for the tensor itself: scaled with the weights, they give the same path."""
    w_query, w_key = (w.double() for w in random_heads(seed=15))
    g = torch.Generator().manual_seed(1)
    init = [torch.randn(size, 6, generator=g, dtype=torch.float64) for size in (4, 20, 20)]
    unit = cp_als(w_query, w_key, 6, init=tuple(init), n_iter_max=10, tol=0)
    scaled = cp_als(w_query * 1e-10, w_key * 1e-10, 6, init=(init[0], init[1] * 1e-10, init[2] * 1e-10),
                    n_iter_max=10, tol=0)
    assert scaled.errors == pytest.approx(unit.errors, rel=1e-9)
    torch.testing.assert_close(scaled.query * 1e10, unit.query, rtol=1e-6, atol=1e-9)
