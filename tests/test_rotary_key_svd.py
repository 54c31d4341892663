"""``key-svd`` on rotary-position decoders (Llama, Qwen2, Mistral; grouped and ungrouped key/value heads): thin keys
per rotary frequency band (the ``rotary-shared-key`` layer). Exact at ``kv_heads x head_dim`` (and wherever each band
keeps its key rank), also at later positions; the pairs go to the largest singular values of the layer; the reported
error is the installed layer's and a dense recomputation's and grows as the key narrows; shared values exact at
``kv_heads x head_dim``; cache, generation (no cache, dynamic, static), padding, saving and loading through the Auto
classes, attention maps, sizing, and what is refused."""

import copy

import pytest
import torch
import transformers
from conftest import with_cache
from test_rotary_models import (  # the tiny rotary models of every rotary test
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    ROTARY,
    D,
    config_of,
    ids,
    original,
)

import collab_attn
from collab_attn.kinds import RotarySharedKeySelfAttention
from collab_attn.kinds.rotary_shared_key.rotary_shared_key_attention import RotarySharedKeyAttention
from collab_attn.models.conversion import check_request
from collab_attn.models.methods import METHODS
from collab_attn.models.sizing import conversion_at, conversion_sizes, original_size
from collab_attn.nn import cache_numbers_per_token

pytestmark = pytest.mark.usefixtures("one_thread")

BANDS = HEAD_DIM // 2
EXACT = KV_HEADS * HEAD_DIM  # the original key cache's width: every band keeps its G key forms


def converted(model, rank, **options):
    model = copy.deepcopy(model)
    report = collab_attn.reparametrize(model, rank, method="key-svd", progress=False, **options)
    return model, report


def logits_at(model, tokens, shift=0):
    positions = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1) + shift
    with torch.no_grad():
        return model(tokens, position_ids=positions).logits


def relative(got, expected) -> float:
    return float((got - expected).norm() / expected.norm())


def with_bias(linear) -> torch.Tensor:
    weight = linear.weight.detach().double()
    return weight if linear.bias is None else torch.cat([weight, linear.bias.detach().double()[:, None]], 1)


def band_keys(attention, kv_heads) -> torch.Tensor:
    """(bands, G, d') complex key forms of an original layer, by hand: row i + j row i + d_h/2 of each group."""
    k = with_bias(attention.k_proj).view(kv_heads, HEAD_DIM, -1)
    return torch.complex(k[:, :BANDS], k[:, BANDS:]).transpose(0, 1)


def dense_error(model, small, kv_heads=KV_HEADS) -> list[float]:
    """Per layer, the relative error of the per-band logit forms from dense d' x d' complex matrices built by hand:
    the original's ``a_hi conj(b_gi)^T`` against the installed ``sum_{r in band i} q_hr conj(k_r)^T`` (each pair's
    complex rows read from the installed query and key weights, biases as an input column)."""
    errors = []
    for old, new in zip(model.model.layers, small.model.layers):
        old, new = old.self_attn, new.self_attn
        q = with_bias(old.q_proj).view(HEADS, HEAD_DIM, -1)
        keys = band_keys(old, kv_heads)
        pairs = new.pairs
        new_q = with_bias(new.query).view(HEADS, 2 * pairs, -1)
        new_k = with_bias(new.key)
        total = distance = 0.0
        for h in range(HEADS):
            for i in range(BANDS):
                a = torch.complex(q[h, i], q[h, i + BANDS])
                form = torch.outer(a, keys[i, h // (HEADS // kv_heads)].conj())
                approx = torch.zeros_like(form)
                for r in range(pairs):
                    if int(new.pair_bands[r]) == i:
                        query = torch.complex(new_q[h, r], new_q[h, r + pairs])
                        key = torch.complex(new_k[r], new_k[r + pairs])
                        approx += torch.outer(query, key.conj())
                total += float(form.abs().square().sum())
                distance += float((form - approx).abs().square().sum())
        errors.append((distance / total) ** 0.5)
    return errors


@pytest.mark.parametrize("family, kv_heads", [(family, KV_HEADS) for family in ROTARY] + [("llama", HEADS),
                                                                                          ("qwen2", HEADS)])
def test_kv_heads_x_head_dim_is_exact_also_at_later_positions(family, kv_heads):
    model = original(family, num_key_value_heads=kv_heads)
    exact, report = converted(model, kv_heads * HEAD_DIM)
    assert all(layer.relative_error < 1e-12 and layer.products_error < 1e-6 for layer in report.layers)
    layers = [m for m in exact.modules() if isinstance(m, RotarySharedKeyAttention)]
    assert len(layers) == 2 and all(type(m) is RotarySharedKeySelfAttention for m in layers)
    assert torch.equal(layers[0].pair_bands, torch.arange(BANDS).repeat_interleave(kv_heads))  # G pairs per band
    assert exact.config.collab_method == "key-svd" and exact.config.collab_layer == "rotary-shared-key"
    tokens = ids()
    for shift in (0, 1000):
        assert relative(logits_at(exact, tokens, shift), logits_at(model, tokens, shift)) < 1e-5


def test_exact_wherever_each_band_keeps_its_key_rank():
    """Two key/value groups with the same key: one key form per band, so one pair per band (rank head_dim) is exact,
    with the greedy split giving every band its one nonzero singular value."""
    model = original("qwen2")
    with torch.no_grad():
        for layer in model.model.layers:
            projection = layer.self_attn.k_proj
            projection.weight[HEAD_DIM:] = projection.weight[:HEAD_DIM]
            projection.bias[HEAD_DIM:] = projection.bias[:HEAD_DIM]
    exact, report = converted(model, HEAD_DIM)
    assert all(layer.relative_error < 1e-6 for layer in report.layers)
    assert torch.equal(exact.model.layers[0].self_attn.pair_bands, torch.arange(BANDS))
    tokens = ids()
    for shift in (0, 1000):
        assert relative(logits_at(exact, tokens, shift), logits_at(model, tokens, shift)) < 1e-5


@pytest.mark.parametrize("family", ROTARY)
def test_the_pairs_go_to_the_largest_singular_values_of_the_layer(family):
    model = original(family)
    for rank in (2, 10, 16):
        small, _ = converted(model, rank)
        for old, new in zip(model.model.layers, small.model.layers):
            spectra = torch.linalg.svdvals(band_keys(old.self_attn, KV_HEADS).mT)  # (bands, G)
            threshold = spectra.flatten().sort(descending=True).values[rank // 2 - 1]
            expected = (spectra >= threshold).sum(1)
            assert torch.bincount(new.self_attn.pair_bands, minlength=BANDS).tolist() == expected.tolist()


@pytest.mark.parametrize("family", ROTARY)
def test_the_reported_error_is_the_installed_layers_and_a_dense_recomputation_and_grows_as_the_key_narrows(family):
    model = original(family)
    errors = []
    for rank in (EXACT, 18, 12, 6, 2):
        small, report = converted(model, rank)
        for layer, dense in zip(report.layers, dense_error(model, small)):
            assert layer.products_error == pytest.approx(layer.relative_error, abs=1e-6)
            assert dense == pytest.approx(layer.relative_error, abs=1e-6)
        errors.append([layer.relative_error for layer in report.layers])
    for layer in range(2):
        column = [errors[size][layer] for size in range(5)]
        assert column[0] < 1e-12 < column[1] < column[2] < column[3] < column[4] < 1


@pytest.mark.parametrize("family", ROTARY)
def test_shared_values_are_exact_at_kv_heads_x_head_dim_and_approximate_below(family):
    model = original(family)
    exact, report = converted(model, EXACT, value_rank=EXACT)
    assert all(layer.value_error < 1e-6 and layer.value_products_error < 1e-6 for layer in report.layers)
    tokens = ids()
    for shift in (0, 1000):
        assert relative(logits_at(exact, tokens, shift), logits_at(model, tokens, shift)) < 1e-5
    layer = exact.model.layers[0].self_attn
    assert layer.value.weight.shape == (EXACT, D) and layer.value.bias is None
    assert layer.value_up.weight.shape == (KV_HEADS * HEAD_DIM, EXACT)
    assert (layer.output.bias is not None) == (family == "qwen2")  # Qwen2's value bias, folded into the output's
    value_errors = []
    for value_rank in (16, 8):
        small, report = converted(model, EXACT, value_rank=value_rank)
        for entry in report.layers:
            assert entry.value_products_error == pytest.approx(entry.value_error, abs=1e-6)
        value_errors.append([entry.value_error for entry in report.layers])
        assert relative(logits_at(small, tokens), logits_at(model, tokens)) > 1e-4
    assert all(0 < wide < narrow < 1 for wide, narrow in zip(*value_errors))


@pytest.mark.parametrize("family, value_rank", [("llama", None), ("qwen2", None), ("mistral", 10), ("qwen2", 10)])
def test_the_cache_holds_the_rotated_shared_key_and_equals_recomputation(family, value_rank):
    model = original(family)
    small, _ = converted(model, 10, value_rank=value_rank)
    tokens = ids(length=9)
    with torch.no_grad():
        full = small(tokens).logits
        cache = transformers.DynamicCache(config=small.config)
        steps = [small(tokens[:, t:t + 1], **with_cache(small, cache), use_cache=True).logits for t in range(9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    values = (KV_HEADS, HEAD_DIM) if value_rank is None else (1, value_rank)
    assert cache.layers[0].keys.shape == (2, 1, 9, 10)  # one rotated shared key of rank numbers for every head
    assert cache.layers[0].values.shape == (2, values[0], 9, values[1])
    layer = small.model.layers[0].self_attn
    assert layer.cache_width() == cache_numbers_per_token(layer) == 10 + values[0] * values[1]


@pytest.mark.parametrize("family, value_rank", [(family, None) for family in ROTARY] + [("qwen2", 12)])
def test_generation_without_cache_with_a_dynamic_and_a_static_cache_agree(family, value_rank):
    model = original(family)
    small, _ = converted(model, 12, value_rank=value_rank)
    tokens = ids(length=5)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    greedy = small.generate(tokens, **settings)
    assert greedy.shape == (2, 11)
    assert torch.equal(small.generate(tokens, use_cache=False, **settings), greedy)
    assert torch.equal(small.generate(tokens, cache_implementation="static", **settings), greedy)
    exact, _ = converted(model, EXACT)
    assert torch.equal(exact.generate(tokens, **settings), model.generate(tokens, **settings))


@pytest.mark.parametrize("family, value_rank", [(family, None) for family in ROTARY] + [("qwen2", 12)])
def test_saves_and_loads_through_the_auto_classes(family, value_rank, tmp_path):
    model, _ = converted(original(family), 14, value_rank=value_rank)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.collab_layer == "rotary-shared-key" and loaded.config.collab_ranks == [14, 14]
    assert loaded.config.collab_value_ranks == (None if value_rank is None else [value_rank] * 2)
    for mine, theirs in zip(model.model.layers, loaded.model.layers):
        assert torch.equal(mine.self_attn.pair_bands, theirs.self_attn.pair_bands)
    inputs = {"input_ids": ids(), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", ROTARY)
def test_attention_maps_equal_the_original_when_exact_and_are_distributions_otherwise(family):
    model = original(family)
    exact, _ = converted(model, EXACT)
    small, _ = converted(model, 8)
    with torch.no_grad():
        expected = model(ids(), output_attentions=True).attentions
        got = exact(ids(), output_attentions=True).attentions
        cut = small(ids(), output_attentions=True).attentions
    assert len(got) == len(cut) == 2
    for a, b, c in zip(got, expected, cut):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        assert c.shape == b.shape == (2, HEADS, 7, 7)
        torch.testing.assert_close(c.sum(-1), torch.ones(2, HEADS, 7))
        assert float(c.triu(1).abs().max()) == 0  # causal
        assert not torch.allclose(c, b, atol=1e-3)


@pytest.mark.parametrize("value_rank", [None, 12])
def test_padding_gives_the_unpadded_logits(value_rank):
    model, _ = converted(original("qwen2"), 12, value_rank=value_rank)
    tokens = ids(batch=1, length=6)
    padded = torch.cat([torch.zeros(1, 2, dtype=torch.long), tokens], 1)
    mask = torch.cat([torch.zeros(1, 2, dtype=torch.long), torch.ones(1, 6, dtype=torch.long)], 1)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    with torch.no_grad():
        alone = model(tokens).logits
        got = model(padded, attention_mask=mask, position_ids=positions).logits[:, 2:]
    torch.testing.assert_close(got, alone, atol=1e-5, rtol=1e-5)


def test_the_sizes_of_the_cache_race_are_the_converted_models():
    config = config_of("llama")
    original_cache = original_size(config).cache_bytes
    assert original_cache == 2 * 2 * KV_HEADS * HEAD_DIM * 2  # layers x (keys + values) x bf16
    sizes = conversion_sizes(config, METHODS["key-svd"])
    assert [s.rank for s in sizes] == list(range(2, EXACT + 1, 2))
    assert all(s.value_rank is None and s.cache_bytes == 2 * 2 * (s.rank + KV_HEADS * HEAD_DIM) for s in sizes)
    chosen = conversion_at(sizes, original_size(config), 0.75)
    assert chosen.rank == 12 and chosen.cache_bytes == 0.75 * original_cache
    assert conversion_at(sizes, original_size(config), 0.5) is None  # every value stays: never at half
    model, _ = converted(original("llama"), chosen.rank)
    with torch.no_grad():
        cache = model(ids(), use_cache=True).past_key_values
    measured = sum(t[0, :, 0].numel() * 2 for layer in cache.layers for t in (layer.keys, layer.values))
    assert measured == chosen.cache_bytes


def test_what_it_cannot_honour_is_refused_with_the_reason():
    model = original("llama")
    with pytest.raises(ValueError, match="rank 13 is odd: a rotary shared key counts each of its pairs twice"):
        converted(model, 13)
    with pytest.raises(ValueError, match=r"rank 36 for layer 0: a shared key holds at most 2 pairs per band .* "
                                         r"choose an even rank of at most 24"):
        converted(model, 36)
    with pytest.raises(ValueError, match=r"rank 50 for layer 0 is invalid: it must be an integer in \[1, 48\]"):
        converted(model, 50)
    with pytest.raises(ValueError, match="value_rank 30 for layer 0: .* choose a value_rank of at most 24"):
        converted(model, 12, value_rank=30)
    with pytest.raises(ValueError, match="a params:0.5 budget does not apply to rotary models"):
        converted(model, "params:0.5")
    with pytest.raises(ValueError, match="calibration must be a fitting.calibration.Calibration"):
        converted(model, 12, calibration={"layers": []})
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                                          intermediate_size=32, vocab_size=30))
    with pytest.raises(ValueError, match="'key-svd' shares the values on rotary models only.*pass value_rank=None"):
        collab_attn.reparametrize(bert, 8, method="key-svd", value_rank=8, progress=False)
    check_request(config_of("qwen2"), "key-svd", 12, value_rank=12)  # passes
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"  # nothing was changed


def test_the_module_refuses_bands_it_cannot_rotate_and_needs_positions():
    with pytest.raises(ValueError, match="head_dim \\(7\\) must be even"):
        RotarySharedKeyAttention(14, 2, 3, head_dim=7)
    with pytest.raises(ValueError, match="kv_heads must be a positive divisor of num_heads"):
        RotarySharedKeyAttention(16, 4, 3, kv_heads=3, head_dim=8)
    layer = RotarySharedKeyAttention(16, 4, 3, kv_heads=2, head_dim=8)
    state = layer.state_dict()
    with pytest.raises(ValueError, match=r"pair_bands must lie in 0 \.\. 3"):
        layer.load_state_dict(state | {"pair_bands": torch.tensor([0, 1, 4])})
    with pytest.raises(ValueError, match="needs position_embeddings"):
        layer(torch.randn(1, 3, 16))
    cos, sin = torch.ones(1, 3, 8), torch.zeros(1, 3, 8)
    output, weights = layer(torch.randn(1, 3, 16), position_embeddings=(cos, sin), is_causal=True, need_weights=True)
    assert output.shape == (1, 3, 16) and weights.shape == (1, 4, 3, 3)
    with pytest.raises(ValueError, match="cover 3 positions but the input has 4 tokens"):
        layer(torch.randn(1, 4, 16), position_embeddings=(cos, sin))
