"""``collab_attn.allocate_cache`` (collab_attn/fitting/allocation.py): the key/value split of each layer and the budget
across layers chosen by the output error each candidate size leaves after a short fit. On a tiny grouped-head Llama
and GPT-2: the chosen sizes fit the budget and are what the dynamic programme says is best over the measured table,
they beat the even split on the measured errors, and the converted model caches what was chosen."""

import copy
import itertools

import pytest
import torch
from test_fitting import FIT, gpt2, kl, llama

import collab_attn
from collab_attn.fitting.allocation import candidate_sizes, choose
from collab_attn.pretrained.race import mean_cache_numbers

pytestmark = pytest.mark.usefixtures("one_thread")


def test_candidate_sizes_split_each_total_at_each_share():
    assert candidate_sizes(192) == [(42, 86), (64, 64), (86, 42), (64, 128), (96, 96), (128, 64), (86, 170),
                                    (128, 128), (170, 86)]
    assert all(k % 2 == 0 and k + v in (16, 24, 32) for k, v in candidate_sizes(24))
    for bad in ({"key_shares": (0.5, 1.0)}, {"key_shares": ()}, {"scales": (1.5, 2.0)}, {"scales": (-1, 1)}):
        with pytest.raises(ValueError, match="key_shares must be fractions|scales must be positive"):
            candidate_sizes(192, **bad)
    with pytest.raises(ValueError, match="budget must be at least 4"):
        candidate_sizes(3)


def test_choose_is_the_best_choice_within_the_capacity():
    """Exhaustive search over 4 layers x 3 candidates agrees with the dynamic programme."""
    generator = torch.Generator().manual_seed(0)
    errors = torch.rand(4, 3, generator=generator).tolist()
    costs = [2, 3, 5]
    for capacity in (8, 12, 14, 20):
        picks = choose(errors, costs, capacity)
        fits = [p for p in itertools.product(range(3), repeat=4) if sum(costs[c] for c in p) <= capacity]
        best = min(sum(errors[i][c] for i, c in enumerate(p)) for p in fits)
        assert sum(costs[c] for c in picks) <= capacity
        assert sum(errors[i][c] for i, c in enumerate(picks)) == pytest.approx(best)
    with pytest.raises(ValueError, match="no choice of the candidates fits 7 numbers"):
        choose(errors, costs, 7)


@pytest.mark.parametrize("make, method, budget", [(llama, "key-svd", 24), (gpt2, "cp", 40)],
                         ids=["llama-key-svd", "gpt2-cp"])
def test_the_allocation_fits_the_budget_and_beats_the_even_split_on_its_measurements(make, method, budget):
    original = make()
    kept = {k: v.clone() for k, v in original.state_dict().items()}
    allocation = collab_attn.allocate_cache(original, method, budget, FIT, steps=5, progress=False)
    for key, value in original.state_dict().items():  # the original is left as it was
        torch.testing.assert_close(value, kept[key], rtol=0, atol=0)
    assert len(allocation.ranks) == len(allocation.value_ranks) == 2 == len(allocation.errors)
    assert sum(allocation.ranks + allocation.value_ranks) <= 2 * budget
    assert allocation.uniform == (budget // 2, budget // 2)
    assert allocation.error <= allocation.uniform_error
    picks = [allocation.candidates.index(size) for size in zip(allocation.ranks, allocation.value_ranks)]
    assert picks == choose(allocation.errors, [k + v for k, v in allocation.candidates], 2 * budget)
    assert "| keys | values |" in allocation.table() and allocation.to_dict()["error"] == allocation.error
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, allocation.ranks, method=method, value_rank=allocation.value_ranks,
                              progress=False)
    content = 0 if make is llama else 4  # GPT-2's query bias: one content logit per head on top (not a width)
    assert mean_cache_numbers(model) == sum(allocation.ranks + allocation.value_ranks) / 2 + content
    assert kl(original, model) > 0


def test_methods_without_a_key_value_split_are_refused():
    with pytest.raises(ValueError, match="method='kv-svd' has no key/value split to choose on a llama model"):
        collab_attn.allocate_cache(llama(), "kv-svd", 24, FIT)
    with pytest.raises(ValueError, match="method='key-svd' has no key/value split to choose on a gpt2 model"):
        collab_attn.allocate_cache(gpt2(), "key-svd", 24, FIT)


def test_bad_arguments_are_refused_before_the_first_candidate(monkeypatch):
    monkeypatch.setattr(collab_attn.models.conversion, "reparametrize", lambda *a, **k: pytest.fail("converted"))
    for arguments, message in [
        ({"budget": "24"}, "budget must be a number >= 4, got '24'"),
        ({"budget": float("nan")}, "budget must be a number >= 4, got nan"),
        ({"steps": 0}, "steps must be a positive integer, got 0"),
        ({"steps": "5"}, "steps must be a positive integer, got '5'"),
        ({"seed": 1.5}, "seed must be an integer, got 1.5"),
        ({"batches": None}, "batches must be a list of tokenized batches"),
        ({"batches": FIT[0]}, "got one dict: pass \\[batch\\]"),
        ({"batches": [{"input_ids": FIT[0]["input_ids"] + 1000}]}, "outside the model's vocabulary of 100"),
        ({"method": 3}, "method must be a conversion method's name"),
    ]:
        given = {"method": "key-svd", "budget": 24, "batches": FIT} | arguments
        with pytest.raises(ValueError, match=message):
            collab_attn.allocate_cache(llama(), given.pop("method"), given.pop("budget"), given.pop("batches"),
                                       progress=False, **given)


def test_sizes_the_method_refuses_are_never_chosen_and_say_why():
    """The tiny Llama's shared rotary key and shared value hold at most 2 groups x 12 = 24 numbers each: the
    candidates wider than that at a budget of 36 are refused with the method's reason, the rest measured and chosen
    from."""
    allocation = collab_attn.allocate_cache(llama(), "key-svd", 36, FIT, steps=2, progress=False)
    wide = [size for size in allocation.candidates if max(size) > 24]
    assert wide and set(allocation.refused) == {f"k{k} v{v}" for k, v in wide}
    assert all("of at most 24" in why for why in allocation.refused.values())
    assert max(allocation.ranks + allocation.value_ranks) <= 24 and "refused (" in allocation.table()
    with pytest.raises(ValueError, match="key-svd refused every candidate size at budget 120"):
        collab_attn.allocate_cache(llama(), "key-svd", 120, FIT, steps=2, scales=(1.0,), key_shares=(0.5,))
