"""Budgets on rotary models (collab_attn/decomposition/rotary_budget.py): the pairs of a "mean:R" budget go where the
spectra say across the bands of all layers, at the total cache of width R everywhere; "energy:E" keeps a fraction of
each layer's energy; the conversions install (their measured error equals the fit's), keep the cache they were
given and are refused with the reason where a budget cannot apply."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_rotary_calibration import narrow_batches
from test_rotary_models import HEAD_DIM, HEADS, KV_HEADS, converted, original

from collab_attn.decomposition.rotary_budget import allocate_budget, relative_spectra
from collab_attn.fitting.calibration import collect_calibration
from collab_attn.pretrained.race import mean_cache_numbers

pytestmark = pytest.mark.usefixtures("one_thread")


def spectra(layers=3, bands=4, width=3, seed=0) -> list[torch.Tensor]:
    """Descending rows of different scales per layer and band."""
    g = torch.Generator().manual_seed(seed)
    return [(torch.rand(bands, width, generator=g, dtype=torch.float64) * 10 ** torch.rand(bands, 1, generator=g))
            .sort(dim=1, descending=True).values for _ in range(layers)]


def bound(spectra, allocation) -> float:
    """The sum over layers of the relative energy the allocation leaves out."""
    return sum(float(s[i, n:].sum()) for s, pairs in zip(relative_spectra(spectra), allocation)
               for i, n in enumerate(pairs))


def every_allocation(bands: int, width: int, total: int):
    return [list(c) for c in itertools.product(range(width + 1), repeat=bands) if sum(c) == total]


def test_mean_budget_spends_the_total_where_the_spectra_say_and_beats_every_other_split():
    layers = spectra(layers=2, bands=3, width=2)
    chosen = allocate_budget(layers, "mean:6")  # 3 pairs per layer on average: 6 in all
    assert sum(map(sum, chosen)) == 6 and all(sum(pairs) >= 1 for pairs in chosen)
    best = min(bound(layers, [a, b]) for total in range(1, 6) for a in every_allocation(3, 2, total)
               for b in every_allocation(3, 2, 6 - total))
    assert bound(layers, chosen) == pytest.approx(best, rel=1e-12)
    assert bound(layers, chosen) <= bound(layers, [allocate_budget([s], "mean:6")[0] for s in layers]) + 1e-12


def test_every_layer_keeps_a_pair_even_where_its_spectrum_is_tiny():
    layers = spectra(layers=3)
    layers[1] = layers[1] * 1e-9  # relative spectra do not see the scale: still its share
    layers[2] = torch.tensor([[1.0, 0.0, 0.0]] + [[0.0, 0.0, 0.0]] * 3, dtype=torch.float64)  # one pair holds all
    chosen = allocate_budget(layers, "mean:4")
    assert chosen[2] == [1, 0, 0, 0] and all(sum(pairs) >= 1 for pairs in chosen) and sum(map(sum, chosen)) == 6


def test_energy_budget_keeps_the_fewest_pairs_that_hold_the_fraction():
    layers = spectra(layers=2)
    for fraction in (0.5, 0.9, 1.0):
        for layer, pairs in zip(relative_spectra(layers), allocate_budget(layers, f"energy:{fraction}")):
            kept = sum(float(layer[i, :n].sum()) for i, n in enumerate(pairs))
            assert kept >= fraction - 1e-12
            fewer = layer.flatten().sort(descending=True).values[: sum(pairs) - 1].sum()
            assert float(fewer) < fraction


@pytest.mark.parametrize("budget, message", [
    ("params:0.5", "a params:0.5 budget does not apply to rotary models"),
    ("mean:7", "give an even width"),
    ("mean:40", "every layer holds at most 12 pairs"),
])
def test_budgets_that_cannot_apply_are_refused_with_the_reason(budget, message):
    with pytest.raises(ValueError, match=message):
        allocate_budget(spectra(), budget)


@pytest.mark.parametrize("method, width, exact", [("cp", 16, HEADS * HEAD_DIM), ("key-svd", 8, KV_HEADS * HEAD_DIM)])
@pytest.mark.parametrize("calibrated", [False, True])
def test_a_budget_converts_a_rotary_model_at_the_cache_it_was_given(method, width, exact, calibrated):
    model = original("qwen2", num_hidden_layers=3)
    calibration = collect_calibration(model, narrow_batches(seed=0, batches=2)) if calibrated else None
    spread, report = converted(model, f"mean:{width}", method=method, calibration=calibration)  # checks the fit
    uniform, _ = converted(model, width, method=method, calibration=calibration)
    ranks = [layer.rank for layer in report.layers]
    assert sum(ranks) == 3 * width and len(set(ranks)) > 1 and all(rank % 2 == 0 for rank in ranks)
    assert mean_cache_numbers(spread) == pytest.approx(mean_cache_numbers(uniform))
    full, full_report = converted(model, "energy:1.0", method=method, calibration=calibration)
    assert [layer.rank for layer in full_report.layers] == [exact] * 3
    tokens = narrow_batches(seed=1, batches=1)[0]["input_ids"]
    with torch.no_grad():
        got, expected = full(tokens).logits, model(tokens).logits
    assert (got - expected).norm() / expected.norm() < 1e-4


@pytest.mark.parametrize("method, budget, message", [
    ("cp", "params:0.5", "does not apply to rotary models: it counts query/key parameters"),
    ("kv-svd", "mean:16", "takes one rank or one per layer, not a budget"),
    ("cp", "mean:15", "counts each shared pair twice; give an even width"),
])
def test_a_rotary_conversion_refuses_a_budget_it_cannot_honour(method, budget, message):
    model = original("llama")
    with pytest.raises(ValueError, match=message):
        converted(model, budget, method=method)
