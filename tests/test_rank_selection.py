"""Per-layer ranks under a global budget."""

import copy

import pytest
import torch
from conftest import small_model

from collab_attn import reparametrize
from collab_attn.decomposition.cp_als import HeadProducts
from collab_attn.decomposition.rank_selection import RankBudget, _allocate, _lower_hull, query_key_params, select_ranks

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny problems


def layers(seed=0, heads=4, head_dim=6, d_in=24):
    """Three layers of increasing difficulty: a planted rank-4 CP, a mildly structured one, pure noise."""
    g = torch.Generator().manual_seed(seed)
    easy_q, easy_k = torch.zeros(heads, head_dim, d_in), torch.zeros(heads, head_dim, d_in)
    query, key, mixing = torch.randn(d_in, 4, generator=g), torch.randn(d_in, 4, generator=g), torch.randn(
        heads, 4, generator=g
    )
    for h in range(heads):
        easy_q[h, :4], easy_k[h, :4] = (query * mixing[h]).T, key.T
    shared = torch.randn(1, head_dim, d_in, generator=g)
    medium_q = shared + 0.3 * torch.randn(heads, head_dim, d_in, generator=g)
    medium_k = shared + 0.3 * torch.randn(heads, head_dim, d_in, generator=g)
    hard_q, hard_k = torch.randn(heads, head_dim, d_in, generator=g), torch.randn(heads, head_dim, d_in, generator=g)
    return [HeadProducts(q, k) for q, k in ((easy_q, easy_k), (medium_q, medium_k), (hard_q, hard_k))]


@pytest.mark.parametrize(
    "spec, expected",
    [("params:0.35", RankBudget("params", 0.35)), ("mean:128", RankBudget("mean", 128)),
     (" energy : 0.9 ", RankBudget("energy", 0.9))],
)
def test_budget_specs_parse(spec, expected):
    assert RankBudget.parse(spec) == expected
    assert RankBudget.parse(str(expected)) == expected


@pytest.mark.parametrize(
    "spec, message",
    [("params:1.5", "fraction"), ("mean:12.5", "integer rank"), ("energy:0", "fraction"), ("ranks:3", "unknown"),
     ("128", "a rank budget is"), ("mean:x", "not a number")],
)
def test_bad_budgets_are_explained(spec, message):
    with pytest.raises(ValueError, match=message):
        RankBudget.parse(spec)


def test_parameter_budgets_are_respected_and_more_budget_never_fits_worse():
    tensors = layers()
    full = 24
    original = 2 * (24 * 24 + 24)
    previous = None
    for fraction in (0.3, 0.35, 0.5, 0.7, 0.9, 1.0):
        selection = select_ranks(tensors, f"params:{fraction}", full_rank=full, original_params=[original] * 3)
        assert selection.query_key_params <= selection.budget_params == int(fraction * (3 * original))
        assert selection.query_key_params == sum(query_key_params(r, 24, 4) for r in selection.ranks)
        assert all(r % 4 == 0 and 4 <= r <= full for r in selection.ranks)
        objective = sum(e**2 for e in selection.predicted_errors)
        if previous is not None:
            assert objective <= previous + 1e-12
        previous = objective
    # the planted rank-4 layer needs rank 4 and gets no more; the hard layer gets the most
    selection = select_ranks(tensors, "mean:12", full_rank=full)
    assert selection.ranks[0] == 4 and selection.ranks[2] >= selection.ranks[1]
    assert selection.query_key_params <= 3 * query_key_params(12, 24, 4)


def test_energy_threshold_per_layer():
    tensors = layers()
    loose, tight = (select_ranks(tensors, f"energy:{e}", full_rank=24) for e in (0.5, 0.9))
    for selection, energy in ((loose, 0.5), (tight, 0.9)):
        assert all(1 - e**2 >= energy - 1e-9 for e in selection.predicted_errors)
        assert selection.budget_params is None
    assert all(a <= b for a, b in zip(loose.ranks, tight.ranks))
    assert select_ranks(tensors, "energy:1", full_rank=24).ranks[1:] == [24, 24]


def test_too_small_a_budget_is_explained():
    with pytest.raises(ValueError, match="raise the budget"):
        select_ranks(layers(), "params:0.01", full_rank=24)
    with pytest.raises(ValueError, match="mean rank must be"):
        select_ranks(layers(), "mean:48", full_rank=24)


def test_hull_and_greedy_allocation():
    costs = torch.arange(5, dtype=torch.float64).numpy()
    values = torch.tensor([10.0, 9.0, 3.0, 2.5, 0.0]).numpy()
    assert _lower_hull(costs, values) == [0, 2, 4]
    # two layers, one much steeper: it gets the budget first
    steep, flat = torch.tensor([10.0, 2.0, 1.0]).numpy(), torch.tensor([10.0, 9.0, 8.0]).numpy()
    assert _allocate([costs[:3], costs[:3]], [steep, flat], budget=1) == [1, 0]
    assert _allocate([costs[:3], costs[:3]], [steep, flat], budget=2) == [2, 0]
    assert _allocate([costs[:3], costs[:3]], [steep, flat], budget=4) == [2, 2]


def test_reparametrize_with_a_budget():
    model = small_model("bert", num_hidden_layers=3)
    batch = {"input_ids": torch.randint(5, 120, (2, 9)), "attention_mask": torch.ones(2, 9, dtype=torch.long)}
    uniform = reparametrize(copy.deepcopy(model), 24, n_iter_max=20, progress=False)
    budgeted_model = copy.deepcopy(model)
    report = reparametrize(budgeted_model, "mean:24", n_iter_max=20, progress=False)
    ranks = [layer.rank for layer in report.layers]
    assert ranks == report.rank_selection.ranks and budgeted_model.config.collab_ranks == ranks
    after = sum(layer.query_key_params_after for layer in report.layers)
    assert after <= sum(layer.query_key_params_after for layer in uniform.layers)
    assert after == report.rank_selection.query_key_params
    payload = report.to_dict()
    assert payload["rank_selection"]["budget"] == "mean:24" and "rank_selection" not in uniform.to_dict()
    with torch.no_grad():
        assert torch.isfinite(budgeted_model(**batch).last_hidden_state).all()
    more = reparametrize(copy.deepcopy(model), "params:0.9", n_iter_max=20, progress=False)
    assert sum(layer.query_key_params_after for layer in more.layers) <= 0.9 * sum(
        layer.query_key_params_before for layer in more.layers
    )
    assert more.mean_relative_error <= report.mean_relative_error + 0.02
    with pytest.raises(ValueError, match="rank budget"):
        reparametrize(copy.deepcopy(model), "mean:7.5", progress=False)


def test_budget_with_tucker_counts_the_core():
    model = small_model("bert", num_hidden_layers=3)
    report = reparametrize(model, "params:0.6", method="tucker", n_iter_max=5, progress=False)
    after = sum(layer.query_key_params_after for layer in report.layers)
    before = sum(layer.query_key_params_before for layer in report.layers)
    assert after == report.rank_selection.query_key_params <= 0.6 * before
