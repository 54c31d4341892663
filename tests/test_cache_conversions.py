"""The cache-shrinking conversions of issue 43 beside collaborative values: ``key-svd`` (one shared key, thin keys),
``kv-svd`` (a latent from a joint SVD of keys and values, MLA), SVD-truncated heads with narrow values
(``svd`` with ``value_rank``) and activation-aware shared values. What every family must do with them (exact at full
rank, attention maps, save/load of every head class, generate with and without dynamic and static caches) is in
``test_common_model.py`` and ``test_static_cache.py``; here: what each caches, how its error falls, what the
calibration buys, and the sizes the cache race picks."""

import copy

import pytest
import torch
import transformers
from conftest import random_batch, small_model

import collab_attn
from collab_attn.char_lm.models import cache_bytes
from collab_attn.fitting.calibration import collect_calibration
from collab_attn.kinds.concatenated.concatenated_attention import MultiHeadAttention
from collab_attn.kinds.shared_key.shared_key_attention import SharedKeyAttention
from collab_attn.models.methods import METHODS
from collab_attn.models.sizing import conversion_at, conversion_sizes, original_size
from collab_attn.nn.attention import cache_numbers_per_token

GPT2 = transformers.GPT2Config(n_embd=48, n_head=4, n_layer=2, vocab_size=100, n_positions=64, bos_token_id=0,
                               eos_token_id=0, pad_token_id=0)


def gpt2() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(copy.deepcopy(GPT2)).eval()


def token_ids(seed=1, shape=(2, 9)) -> torch.Tensor:
    return torch.randint(3, 100, shape, generator=torch.Generator().manual_seed(seed))


def relative_error(model, reference_logits, ids) -> float:
    with torch.no_grad():
        return float((model(ids).logits - reference_logits).norm() / reference_logits.norm())


def test_shared_key_attention_is_multi_head_attention_whose_heads_share_one_key():
    torch.manual_seed(0)
    shared = SharedKeyAttention(24, 3, 8, head_dim=8).eval()
    plain = MultiHeadAttention(24, 3, head_dim=8).eval()
    with torch.no_grad():
        plain.query.load_state_dict(shared.query.state_dict())
        plain.key.weight.copy_(shared.key.weight.repeat(3, 1))
        plain.key.bias.zero_()
        plain.value.load_state_dict(shared.value.state_dict())
        plain.output.load_state_dict(shared.output.state_dict())
    x = torch.randn(2, 5, 24)
    for causal in (False, True):
        expected, expected_weights = plain(x, is_causal=causal, need_weights=True)
        output, weights = shared(x, is_causal=causal, need_weights=True)
        torch.testing.assert_close(output, expected)
        torch.testing.assert_close(weights, expected_weights)
    assert cache_numbers_per_token(shared) == 8 + 3 * 8
    stored = []

    def cache(keys, values):
        stored.append((keys.shape, values.shape))
        return keys, values
    shared(x, kv_cache=cache)
    assert stored == [((2, 1, 5, 8), (2, 3, 5, 8))]


@pytest.mark.parametrize("method", ["key-svd", "kv-svd"])
def test_the_error_falls_with_the_rank_and_vanishes_at_full_rank(method):
    ids = token_ids()
    with torch.no_grad():
        expected = gpt2()(ids).logits
    errors = []
    for rank in (6, 18, 30, 48):
        model = gpt2()
        report = collab_attn.reparametrize(model, rank, method=method, progress=False)
        errors.append(relative_error(model, expected, ids))
        assert report.method == method and model.config.collab_ranks == [rank, rank]
    assert errors[0] > errors[1] > errors[2] > errors[3] and errors[3] < 1e-5, errors


def test_kv_svd_is_exact_at_half_the_cache_when_heads_span_the_width():
    """The latent of width d_in can hold X itself: keys and values of every head are exact at d_in = heads x
    head_dim numbers per token, half of the original's 2 heads x head_dim."""
    model, ids = gpt2(), token_ids()
    with torch.no_grad():
        expected = model(ids).logits
    collab_attn.reparametrize(model, 48, method="kv-svd", progress=False)
    assert relative_error(model, expected, ids) < 1e-5
    assert cache_bytes(model) == cache_bytes(gpt2()) // 2 == 2 * 48 * 2  # 2 layers, 48 numbers of 2 bytes


def test_the_encoders_latent_layer_folds_the_value_bias_into_the_output():
    model, batch = small_model("bert"), random_batch()
    with torch.no_grad():
        model.encoder.layer[0].attention.self.value.bias.normal_()  # a value bias that matters
        expected = model(**batch).last_hidden_state
    collab_attn.reparametrize(model, 48, method="kv-svd", progress=False)
    assert model.encoder.layer[0].attention.self.latent.bias.abs().max() == 0
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).last_hidden_state, expected, atol=1e-5, rtol=1e-5)


def calibration_of(model, ids):
    return collect_calibration(model, [{"input_ids": ids[i:i + 8]} for i in range(0, len(ids), 8)])


@pytest.mark.parametrize("method, options", [
    ("key-svd", {}), ("kv-svd", {}), ("cp", {"value_rank": 16, "n_iter_max": 50}),
    ("tucker", {"value_rank": 16, "n_iter_max": 50}),
])
def test_activation_aware_fits_are_closer_on_the_calibration_inputs(method, options):
    """On inputs that visit few directions (a skewed token distribution), fitting to the inputs' statistics beats
    fitting the raw weights on those inputs."""
    original = gpt2()
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 15, (32, 16), generator=generator)  # 12 of the 100 tokens
    with torch.no_grad():
        expected = original(ids).logits
    errors = {}
    for aware in (False, True):
        model = gpt2()
        calibration = {"calibration": calibration_of(model, ids)} if aware else {}
        collab_attn.reparametrize(model, 16, method=method, progress=False, **options, **calibration)
        errors[aware] = relative_error(model, expected, ids)
    assert errors[True] < errors[False], errors


def test_svd_cuts_the_values_of_each_head_and_caches_them_narrow(tmp_path):
    model, ids = gpt2(), token_ids()
    with torch.no_grad():
        expected = model(ids).logits
    exact = gpt2()
    collab_attn.reparametrize(exact, 48, method="svd", value_rank=48, progress=False)
    assert relative_error(exact, expected, ids) < 1e-5
    collab_attn.reparametrize(model, 24, method="svd", value_rank=16, progress=False)
    assert 0 < relative_error(model, expected, ids) < 1
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    for layer in cache.layers:  # 4 heads: keys of 6 plus a content logit, values of 4
        assert layer.keys.shape == (2, 4, 9, 7) and layer.values.shape == (2, 4, 9, 4)
    assert cache_bytes(model, 1) == 2 * (4 * 7 + 16)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.collab_value_ranks == [16, 16]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
    settings = {"max_new_tokens": 4, "do_sample": False, "pad_token_id": 0}
    greedy = model.generate(ids[:, :5], **settings)
    assert torch.equal(model.generate(ids[:, :5], use_cache=False, **settings), greedy)
    assert torch.equal(model.generate(ids[:, :5], cache_implementation="static", **settings), greedy)
    with pytest.raises(ValueError, match="value_rank: rank 18 for layer 0 is not a multiple of the 4 heads"):
        collab_attn.reparametrize(gpt2(), 24, method="svd", value_rank=18, progress=False)


def test_value_rank_is_refused_by_methods_that_keep_the_values():
    with pytest.raises(ValueError, match="value_rank does not apply to method='kv-svd'.*cut the values"):
        collab_attn.reparametrize(gpt2(), 24, method="kv-svd", value_rank=24, progress=False)
    with pytest.raises(ValueError, match="method='key-svd' shares the values on rotary models only"):
        collab_attn.reparametrize(gpt2(), 24, method="key-svd", value_rank=24, progress=False)


@pytest.mark.parametrize("fraction", [0.5, 0.25, 0.125])
def test_the_race_sizes_each_method_within_the_budget_measured_from_the_converted_model(fraction):
    config = gpt2().config
    original = original_size(config)
    assert original.cache_bytes == cache_bytes(gpt2())
    for name in ("cp", "tucker", "svd", "kv-svd", "key-svd", "prune"):
        method = METHODS[name]
        sizes = conversion_sizes(config, method)
        chosen = conversion_at(sizes, original, fraction)
        if name == "key-svd":  # every value stays: never at or below half
            assert chosen is None and min(s.cache_bytes for s in sizes) > original.cache_bytes / 2
            continue
        if name == "prune" and fraction == 0.125:  # a head per layer is a quarter of 4 heads
            assert chosen is None
            continue
        assert chosen.cache_bytes <= fraction * original.cache_bytes
        assert not [s for s in sizes if chosen.cache_bytes < s.cache_bytes <= fraction * original.cache_bytes]
        model = gpt2()
        extra = {"importance": [torch.tensor([0.4, 0.9, 0.1, 0.6])] * 2} if name == "prune" else {}
        collab_attn.reparametrize(model, chosen.rank, method=name, value_rank=chosen.value_rank,
                                  progress=False, **extra)
        with torch.no_grad():
            cache = model(token_ids(), use_cache=True).past_key_values
        measured = sum(t[0, :, 0].numel() * 2 for layer in cache.layers for t in (layer.keys, layer.values))
        assert measured == chosen.cache_bytes == cache_bytes(model)


@pytest.mark.parametrize("fraction", [0.5, 0.25])
def test_encoder_sizes_at_an_attention_parameter_budget_are_the_converted_models(fraction):
    """BERT (output projection beside the attention module): the attention parameters a size reports are those of
    the converted model, the new outer output projection included; key-svd and kv-svd keep the queries and the
    output projection whole, so they never reach half."""
    config = small_model("bert").config
    original = original_size(config)
    model = small_model("bert")
    outer = [layer.attention.output.dense for layer in model.encoder.layer]
    assert original.attention_params == sum(
        sum(p.numel() for p in layer.attention.self.parameters()) + sum(p.numel() for p in dense.parameters())
        for layer, dense in zip(model.encoder.layer, outer))
    for name in ("cp", "tucker", "svd", "kv-svd", "key-svd", "prune"):
        sizes = conversion_sizes(config, METHODS[name])
        chosen = conversion_at(sizes, original, fraction, cost="attention_params")
        if name in ("kv-svd", "key-svd") or (name, fraction) == ("prune", 0.25):  # a head per layer: its biases too
            assert chosen is None and min(s.attention_params for s in sizes) > fraction * original.attention_params
            continue
        converted = small_model("bert")
        extra = {"importance": [torch.tensor([0.4, 0.9, 0.1, 0.6])] * 2} if name == "prune" else {}
        collab_attn.reparametrize(converted, chosen.rank, method=name, value_rank=chosen.value_rank,
                                  progress=False, **extra)
        measured = sum(sum(p.numel() for part in (layer.attention.self, layer.attention.output.dense)
                           for p in part.parameters()) for layer in converted.encoder.layer)
        assert measured == chosen.attention_params <= fraction * original.attention_params


def test_the_report_gives_the_value_fit_error_where_values_were_cut():
    model = gpt2()
    report = collab_attn.reparametrize(model, 24, value_rank=12, n_iter_max=20, progress=False)
    errors = [layer.value_error for layer in report.layers]
    assert all(0 < e < 1 for e in errors)
    header, *_, total = report.table().splitlines()
    assert "| value error |" in header and f"| {sum(errors) / 2:.4f} (mean) |" in total
    assert report.to_dict()["layers"][0]["value_error"] == errors[0]
    keys_only = collab_attn.reparametrize(gpt2(), 24, n_iter_max=20, progress=False)
    assert all(layer.value_error is None for layer in keys_only.layers) and "value error" not in keys_only.table()
    exact = collab_attn.reparametrize(gpt2(), 48, method="svd", value_rank=48, progress=False)
    assert all(layer.value_error == pytest.approx(0, abs=1e-6) for layer in exact.layers)
