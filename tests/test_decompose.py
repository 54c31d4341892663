import math

import pytest
import tensorly as tl
import torch

from collab_attn import decompose_heads
from collab_attn.decomposition.decompose import head_products


def planted_cp(heads=6, head_dim=8, d_in=24, rank=5, seed=0):
    """Head weights whose products have exact CP rank ``rank``: Wq_h^T Wk_h = Q diag(m_h) K^T."""
    g = torch.Generator().manual_seed(seed)
    shared_query, shared_key = torch.randn(d_in, rank, generator=g), torch.randn(d_in, rank, generator=g)
    mixing = torch.randn(heads, rank, generator=g)
    w_query = torch.zeros(heads, head_dim, d_in)
    w_key = torch.zeros(heads, head_dim, d_in)
    for h in range(heads):
        w_query[h, :rank] = (shared_query * mixing[h]).T
        w_key[h, :rank] = shared_key.T
    return w_query, w_key


def random_heads(heads=4, head_dim=6, d_in=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(heads, head_dim, d_in, generator=g), torch.randn(heads, head_dim, d_in, generator=g)


def test_cp_recovers_a_planted_low_rank_structure():
    w_query, w_key = planted_cp()
    result = decompose_heads(w_query, w_key, rank=5, n_iter_max=500, tol=1e-12)
    assert result.relative_error < 1e-3
    assert result.shared_query.shape == (24, 5) and result.shared_key.shape == (24, 5)
    assert result.mixing.shape == (6, 5) and result.core is None


def test_contract_products_match_the_factors_within_the_reported_error():
    w_query, w_key = random_heads()
    result = decompose_heads(w_query, w_key, rank=12, method="cp", seed=0)
    products = head_products(w_query, w_key)
    approx = torch.stack(
        [result.shared_query @ torch.diag(result.mixing[h]) @ result.shared_key.T for h in range(4)]
    )
    assert torch.allclose(products[2], w_query[2].T @ w_key[2], atol=1e-5)
    error = float(torch.linalg.norm(products - approx) / torch.linalg.norm(products))
    assert math.isclose(error, result.relative_error, rel_tol=1e-4)
    assert 0 < result.relative_error < 1
    assert result.seconds > 0


def test_error_falls_as_rank_grows():
    w_query, w_key = random_heads()
    errors = [decompose_heads(w_query, w_key, rank=r).relative_error for r in (2, 6, 12, 20)]
    assert errors == sorted(errors, reverse=True)


def test_tucker_is_exact_at_full_size_and_gives_mixing_matrices():
    w_query, w_key = random_heads()
    full = decompose_heads(w_query, w_key, rank=20, method="tucker")
    assert full.relative_error < 1e-5
    small = decompose_heads(w_query, w_key, rank=8, method="tucker", tucker_core_size=2)
    assert small.mixing.shape == (4, 2) and small.core.shape == (2, 8, 8)
    assert small.mixing_matrices().shape == (4, 8, 8)
    assert 0 < small.relative_error < 1


def test_tucker_fits_at_least_as_well_as_cp_at_the_same_rank():
    w_query, w_key = random_heads(seed=3)
    cp = decompose_heads(w_query, w_key, rank=8, method="cp")
    tucker = decompose_heads(w_query, w_key, rank=8, method="tucker")
    assert tucker.relative_error <= cp.relative_error + 1e-6


@pytest.mark.parametrize("init", ["svd", "random"])
def test_same_seed_same_result(init):
    w_query, w_key = random_heads()
    first = decompose_heads(w_query, w_key, rank=7, seed=3, init=init)
    second = decompose_heads(w_query, w_key, rank=7, seed=3, init=init)
    assert torch.equal(first.shared_query, second.shared_query) and torch.equal(first.mixing, second.mixing)


def test_random_init_depends_on_the_seed():
    w_query, w_key = random_heads()
    first = decompose_heads(w_query, w_key, rank=7, seed=0, init="random", n_iter_max=3)
    second = decompose_heads(w_query, w_key, rank=7, seed=1, init="random", n_iter_max=3)
    assert not torch.allclose(first.shared_query, second.shared_query)


def test_global_tensorly_backend_is_left_alone():
    before = tl.get_backend()
    decompose_heads(*random_heads(), rank=4)
    assert tl.get_backend() == before


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"rank": 0}, "rank must be an integer"),
        ({"rank": 21}, "rank must be an integer"),
        ({"rank": 4, "method": "svd"}, "unknown decomposition method"),
    ],
)
def test_bad_arguments_are_explained(kwargs, error):
    with pytest.raises(ValueError, match=error):
        decompose_heads(*random_heads(), **kwargs)


def test_bad_weights_are_explained():
    w_query, w_key = random_heads()
    w_query[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        decompose_heads(w_query, w_key, rank=4)
    with pytest.raises(ValueError, match=r"\(heads, head_dim, d_in\)"):
        decompose_heads(w_key[0], w_key[0], rank=4)


# ---------------------------------------------------------------------------------------------------------------
# Scale invariance (issue 41)


def _covariance(d_in=32, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(256, d_in, generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, d_in, dtype=torch.float64)
    return x.T @ x / len(x)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("whitened", [False, True], ids=["plain", "whitened"])
@pytest.mark.parametrize("solver", ["implicit", "tensorly"])
@pytest.mark.parametrize("method", ["cp", "tucker"])
def test_the_fit_does_not_depend_on_the_scale_of_the_weights(method, solver, whitened):
    """Weights at 1e-10, 1 and 1e4 (float64, so that scaling them rounds at 1e-16 only): the same relative error
    to ~1e-9 (it is measured on the float32 factors) and factors that reconstruct scale^2 times the unit-scale
    products (to float32 rounding). Whitened fits: the weighted error agrees to double rounding, also with the
    covariance scaled (the whitening is relative to its mean eigenvalue)."""
    g = torch.Generator().manual_seed(21)
    w_query, w_key = (torch.randn(4, 8, 32, generator=g, dtype=torch.float64) for _ in range(2))
    covariance = _covariance() if whitened else None
    options = dict(method=method, solver=solver, covariance=covariance, n_iter_max=30)
    unit = decompose_heads(w_query, w_key, 12, **options)
    unit_products = unit.head_products().double()
    assert 0.1 < unit.relative_error < 1
    for scale in (1e-10, 1e4):
        if whitened:
            options["covariance"] = covariance * scale  # the activations' scale does not matter either
        fit = decompose_heads(w_query * scale, w_key * scale, 12, **options)
        assert fit.relative_error == pytest.approx(unit.relative_error, rel=1e-7)
        products = fit.head_products().double() / scale**2
        assert float((products - unit_products).norm() / unit_products.norm()) < 1e-5
        if whitened:
            assert fit.weighted_error == pytest.approx(unit.weighted_error, rel=1e-10)


@pytest.mark.usefixtures("one_thread")
def test_reparametrize_a_bert_at_tiny_and_large_weight_scales():
    """Issue 41: a BERT with initializer_range=1e-10 stopped with 'CP-ALS diverged' at half rank. One tiny model,
    its query/key weights scaled by 1e-10 and 1e4: the same mean relative error. The weights are float32, so
    scaling them rounds each at ~6e-8 and ALS (stopped early by its tolerance) carries that to ~1e-6."""
    import copy

    import transformers

    import collab_attn

    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        max_position_embeddings=16,
    )
    base = transformers.BertModel(config).eval()
    errors = {}
    for scale in (1.0, 1e-10, 1e4):
        model = copy.deepcopy(base)
        with torch.no_grad():
            for layer in model.encoder.layer:
                layer.attention.self.query.weight.mul_(scale)
                layer.attention.self.key.weight.mul_(scale)
        report = collab_attn.reparametrize(model, rank=32, method="cp", progress=False)
        errors[scale] = [layer.relative_error for layer in report.layers]
        assert all(math.isfinite(e) for e in errors[scale])
    assert 0.1 < report.mean_relative_error < 1
    for scale in (1e-10, 1e4):
        assert errors[scale] == pytest.approx(errors[1.0], rel=1e-5)
