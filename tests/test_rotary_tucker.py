"""``tucker`` on rotary models (collab_attn/decomposition/rotary_tucker.py): a complex Tucker per frequency band, one
core slice per head. Exact at heads x head_dim (also at later positions, with Tucker values too); below it the
installed layer's error is the fit's and never above CP's at the same pairs; the HOOI steps never raise the error
and the error it reports is the dense one; the converted model generates the same with and without a cache
(dynamic, static, assisted), gives attention maps, and every head class saves and loads back through the Auto
classes."""

from __future__ import annotations

import pytest
import torch
from conftest import with_cache
from test_rotary_models import (
    FULL,
    HALF,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    ROTARY,
    assert_generates_alike,
    assert_loads_back,
    converted,
    ids,
    original,
)
from test_static_cache import assert_compiled_static_decoding_equals_eager

from collab_attn.decomposition.rotary_cp import rotary_logits, rotate
from collab_attn.decomposition.rotary_tucker import complex_tucker, rotary_tucker
from collab_attn.models.families import FAMILIES
from collab_attn.models.hf import head_classes

pytestmark = pytest.mark.usefixtures("one_thread")


def complex_randn(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.view_as_complex(torch.randn(*shape, 2, generator=g, dtype=torch.float64))


def dense_error(a, b, fit) -> float:
    forms = torch.einsum("hi,hj->hij", a, b.conj())
    approx = torch.einsum("ir,hrs,js->hij", fit.A, fit.core, fit.B.conj())
    return float((forms - approx).norm() / forms.norm())


@pytest.mark.parametrize("rank", [1, 2, 4])
def test_hooi_never_raises_the_error_and_reports_the_dense_one(rank):
    a, b = complex_randn(5, 9, seed=1), complex_randn(5, 9, seed=2)
    fit = complex_tucker(a, b, rank, tol=0, n_iter_max=30)
    assert all(later <= earlier + 1e-12 for earlier, later in zip(fit.errors, fit.errors[1:]))
    assert fit.relative_error == pytest.approx(dense_error(a, b, fit), abs=1e-10)
    assert torch.allclose(fit.A.mH @ fit.A, torch.eye(rank, dtype=fit.A.dtype), atol=1e-10)


def test_exact_at_as_many_pairs_as_heads_and_at_the_keys_rank_when_queries_repeat():
    a, b = complex_randn(4, 9, seed=3), complex_randn(4, 9, seed=4)
    assert complex_tucker(a, b, 4).relative_error < 1e-7
    shared = complex_randn(1, 9, seed=5).expand(4, -1)  # every head reads one key: rank 1 on that side...
    two = complex_randn(2, 9, seed=6).repeat_interleave(2, 0)  # ...and two distinct queries
    assert complex_tucker(two, shared, 2).relative_error < 1e-7


def test_full_size_decomposition_gives_the_rope_logits_at_every_position():
    g = torch.Generator().manual_seed(0)
    w_query = torch.randn(HEADS, HEAD_DIM, 10, generator=g, dtype=torch.float64)
    w_key = torch.randn(KV_HEADS, HEAD_DIM, 10, generator=g, dtype=torch.float64)
    fit = rotary_tucker(w_query, w_key, [HEADS] * (HEAD_DIM // 2))
    theta = 1.0 / 10000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    x, y = torch.randn(6, 10, generator=g, dtype=torch.float64), torch.randn(6, 10, generator=g, dtype=torch.float64)
    for shift in (0, 500):
        q_pos, k_pos = torch.arange(6) + shift + 3, torch.arange(6) + shift
        q = rotate(torch.einsum("hed,nd->hne", w_query, x), q_pos, theta)
        k = rotate(torch.einsum("ged,nd->gne", w_key, y), k_pos, theta).repeat_interleave(HEADS // KV_HEADS, 0)
        torch.testing.assert_close(rotary_logits(fit, x, y, q_pos, k_pos, theta), q @ k.transpose(1, 2))
    assert fit.relative_error < 1e-7 and fit.core.shape == (HEADS, 2, FULL // 2, FULL // 2)


@pytest.mark.parametrize("family", ROTARY)
def test_full_size_is_exact_also_at_later_positions_with_tucker_values(family):
    model = original(family)
    exact, report = converted(model, FULL, method="tucker", value_rank=FULL)
    assert all(layer.relative_error < 1e-7 and layer.value_error < 1e-6 for layer in report.layers)
    for shift in (0, 300):
        positions = torch.arange(7)[None].expand(2, -1) + shift
        with torch.no_grad():
            expected = model(ids(), position_ids=positions).logits
            got = exact(ids(), position_ids=positions).logits
        assert float((got - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("family", ROTARY)
def test_below_full_size_the_installed_error_is_the_fit_and_at_most_cps(family):
    model = original(family)
    for rank in (HALF, 12):
        _, tucker = converted(model, rank, method="tucker")
        _, cp = converted(model, rank, method="cp")
        for mine, theirs in zip(tucker.layers, cp.layers):
            assert mine.products_error == pytest.approx(mine.relative_error, abs=1e-6)
            assert 0 < mine.relative_error <= theirs.relative_error + 1e-9


def test_generation_with_and_without_a_cache_static_and_assisted():
    model = original("qwen2")
    small, _ = converted(model, HALF, method="tucker", value_rank=HALF)
    layer = small.model.layers[0].self_attn
    assert layer.mixing_core.shape == (HEADS, 2, HALF // 2, HALF // 2) and layer.value_core.shape == (HEADS, HALF, HALF)
    tokens = ids(length=5)
    assert_generates_alike(small, model, tokens)
    with torch.no_grad():
        full = small(tokens).logits
        cache = small(tokens[:, :4], use_cache=True).past_key_values
        step = small(tokens[:, 4:], **with_cache(small, cache)).logits
    torch.testing.assert_close(step[:, -1], full[:, -1], atol=1e-5, rtol=1e-5)
    assert cache.layers[0].keys.shape == (2, 1, 5, HALF) and cache.layers[0].values.shape == (2, 1, 5, HALF)


def test_compiled_static_decoding_equals_eager():
    small, _ = converted(original("llama", vocab_size=128), HALF, method="tucker", value_rank=HALF)
    assert_compiled_static_decoding_equals_eager(small, backend="aot_eager")  # the helper's token ids reach 119


def test_attention_maps_equal_the_original_at_full_size():
    model = original("llama")
    exact, _ = converted(model, FULL, method="tucker")
    with torch.no_grad():
        expected = model(ids(), output_attentions=True).attentions
        got = exact(ids(), output_attentions=True).attentions
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_every_head_class_converts_saves_and_loads_back(tmp_path):
    inputs = {"input_ids": ids(), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    for model_class in head_classes(FAMILIES["llama"]):
        model, _ = converted(original("llama", model_class), HALF, method="tucker", value_rank=HALF)
        for loaded in assert_loads_back(model, "llama", model_class, tmp_path / model_class.__name__, inputs):
            assert loaded.config.collab_tucker_core_size == HEADS


def test_what_rotary_tucker_cannot_honour_is_refused():
    model = original("llama")
    with pytest.raises(ValueError, match="every head its own core slice .* leave it out"):
        converted(model, HALF, method="tucker", tucker_core_size=2)
    with pytest.raises(ValueError, match="complex HOOI started from SVDs"):
        converted(model, HALF, method="tucker", init="random")

