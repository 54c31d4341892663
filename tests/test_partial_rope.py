"""``kv-svd`` on rotary-position decoders (Llama, Qwen2, Mistral; grouped key/value heads) as MHA2MLA builds it:
partial RoPE (per key/value group, the rotary pairs the 2-norm criterion names keep rotating, cached as they are)
and one joint SVD of the other key dimensions and the values into a latent (the ``rotary-mla`` layer). Exact where
every pair is kept and the values are whole, also at later positions; without pairs, the original without
rotation; the reported error is the installed layer's and a dense recomputation's; cache, generation (no cache,
dynamic, static), saving and loading through the Auto classes, attention maps, sizing and refusals."""

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
from collab_attn.kinds import PartialRotaryLatentSelfAttention
from collab_attn.kinds.rotary_mla.rotary_mla_attention import PartialRotaryLatentAttention
from collab_attn.models.conversion import check_request
from collab_attn.models.methods import METHODS
from collab_attn.models.methods.rotary_kv_svd import default_rope_pairs, pair_scores
from collab_attn.models.sizing import conversion_at, conversion_sizes, original_size
from collab_attn.nn import cache_numbers_per_token

pytestmark = pytest.mark.usefixtures("one_thread")

BANDS = HEAD_DIM // 2
VALUES = KV_HEADS * HEAD_DIM  # the latent that holds the values whole when every pair is kept


def converted(model, rank, rope_pairs):
    model = copy.deepcopy(model)
    report = collab_attn.reparametrize(model, rank, method="kv-svd", rope_pairs=rope_pairs, progress=False)
    return model, report


def logits_at(model, tokens, shift=0, position_ids=None):
    if position_ids is None:
        position_ids = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1) + shift
    with torch.no_grad():
        return model(tokens, position_ids=position_ids).logits


def relative(got, expected) -> float:
    return float((got - expected).norm() / expected.norm())


@pytest.mark.parametrize("family, kv_heads", [(family, KV_HEADS) for family in ROTARY] + [("llama", HEADS)])
def test_every_pair_kept_and_the_values_whole_is_exact_also_at_later_positions(family, kv_heads):
    model = original(family, num_key_value_heads=kv_heads)
    exact, report = converted(model, kv_heads * HEAD_DIM, BANDS)
    assert [layer.relative_error for layer in report.layers] == [0.0, 0.0]
    assert [layer.products_error for layer in report.layers] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert [layer.value_products_error for layer in report.layers] == pytest.approx([0.0, 0.0], abs=1e-6)
    layers = [m for m in exact.modules() if isinstance(m, PartialRotaryLatentSelfAttention)]
    assert len(layers) == 2 and exact.config.collab_layer == "rotary-mla" and exact.config.collab_rope_pairs == [6, 6]
    tokens = ids()
    for shift in (0, 300):
        assert relative(logits_at(exact, tokens, shift), logits_at(model, tokens, shift)) < 1e-5


@pytest.mark.parametrize("family", ROTARY)
def test_no_pair_kept_and_the_whole_latent_is_the_original_without_rotation(family):
    """r = 0 drops RoPE: with the latent at the rank of [Wk; Wv] the converted model is the original with every
    token at position 0 (no rotation), at any positions; against the original it is not exact."""
    model = original(family)
    no_rope, report = converted(model, D, 0)
    assert all(0.3 < layer.relative_error < 1 for layer in report.layers)
    assert no_rope.model.layers[0].self_attn.cache_width() == D
    tokens = ids()
    unrotated = logits_at(model, tokens, position_ids=torch.zeros(2, 7, dtype=torch.long))
    for shift in (0, 300):
        assert relative(logits_at(no_rope, tokens, shift), unrotated) < 1e-5
    assert relative(logits_at(no_rope, tokens), logits_at(model, tokens)) > 1e-3


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_criterion_keeps_the_pairs_that_contribute_most_to_each_group(family):
    """Planted: a band whose key rows (and key bias) are zero in one group contributes nothing there and is never
    kept; a band with large query and key rows in the other group is kept first."""
    model = original(family)
    attention = model.model.layers[0].self_attn
    with torch.no_grad():
        for dim in (2, 2 + BANDS):  # group 0, band 2: zero key rows
            attention.k_proj.weight[dim] = 0
            if attention.k_proj.bias is not None:
                attention.k_proj.bias[dim] = 0
        for dim in (4, 4 + BANDS):  # group 1 (heads 2 and 3), band 4: large rows
            attention.k_proj.weight[HEAD_DIM + dim] *= 20
            attention.q_proj.weight[2 * HEAD_DIM + dim] *= 20
    small, _ = converted(model, 20, BANDS - 1)
    bands = small.model.layers[0].self_attn.rope_bands
    assert 2 not in bands[0].tolist() and bands[0].tolist() == [0, 1, 3, 4, 5]
    assert len(bands[1]) == BANDS - 1
    one, _ = converted(model, 20, 1)
    assert one.model.layers[0].self_attn.rope_bands[1].tolist() == [4]
    # the scores are the 2-norm products of the weights, biases as an input column
    q = torch.cat([attention.q_proj.weight, attention.q_proj.bias[:, None]], 1) if attention.q_proj.bias is not None \
        else attention.q_proj.weight
    k = torch.cat([attention.k_proj.weight, attention.k_proj.bias[:, None]], 1) if attention.k_proj.bias is not None \
        else attention.k_proj.weight
    q, k = q.detach().view(HEADS, HEAD_DIM, -1), k.detach().view(KV_HEADS, HEAD_DIM, -1)
    by_hand = torch.zeros(KV_HEADS, BANDS)
    for h in range(HEADS):
        g = h // (HEADS // KV_HEADS)
        for i in range(BANDS):
            by_hand[g, i] += q[h, [i, i + BANDS]].norm() * k[g, [i, i + BANDS]].norm()
    torch.testing.assert_close(pair_scores(q, k), by_hand)
    assert by_hand[0, 2] == 0 and int(by_hand[1].argmax()) == 4


def dense_error(model, converted_model) -> float:
    """The relative error of the per-band logit forms (methods/rotary_kv_svd.py), from dense d x d complex forms: a
    kept band ``a conj(b)^T`` with the installed key rows, a dropped one ``q1 k1^T + q2 k2^T`` (real) with the key
    rows the latent gives back; biases as an input column."""
    total, distance = 0.0, 0.0
    for old, new in zip(model.model.layers, converted_model.model.layers):
        old, new = old.self_attn, new.self_attn

        def rows(linear, weight):
            return weight if linear.bias is None else torch.cat([weight, linear.bias[:, None]], 1)

        q = rows(old.q_proj, old.q_proj.weight).double().view(HEADS, HEAD_DIM, -1)
        k = rows(old.k_proj, old.k_proj.weight).double().view(KV_HEADS, HEAD_DIM, -1)
        rope = rows(new.rope_key, new.rope_key.weight).double()
        nope = rows(new.nope_key, new.nope_key.weight @ new.latent.weight).double()
        installed = torch.zeros_like(k)
        r = new.rope_pairs
        for g in range(KV_HEADS):  # rebuild each group's key rows in the source's order by hand
            kept_dims = new.rope_bands[g].tolist() + [b + BANDS for b in new.rope_bands[g].tolist()]
            other = [dim for dim in range(HEAD_DIM) if dim not in kept_dims]
            installed[g, kept_dims] = rope[g * 2 * r:(g + 1) * 2 * r]
            installed[g, other] = nope[g * (HEAD_DIM - 2 * r):(g + 1) * (HEAD_DIM - 2 * r)]
        for h in range(HEADS):
            g = h // (HEADS // KV_HEADS)
            for i in range(BANDS):
                a = torch.complex(q[h, i], q[h, i + BANDS])
                b = torch.complex(k[g, i], k[g, i + BANDS])
                form = torch.outer(a, b.conj())
                if i in new.rope_bands[g].tolist():
                    approx = torch.outer(a, torch.complex(installed[g, i], installed[g, i + BANDS]).conj())
                else:
                    approx = (torch.outer(q[h, i], installed[g, i]) + torch.outer(q[h, i + BANDS],
                                                                                   installed[g, i + BANDS])) + 0j
                total += float(form.abs().square().sum())
                distance += float((form - approx).abs().square().sum())
    return (distance / total) ** 0.5


@pytest.mark.parametrize("family", ROTARY)
def test_the_reported_error_is_the_installed_layers_and_grows_as_pairs_and_latent_shrink(family):
    model = original(family)
    errors = {}
    for pairs, rank in ((BANDS, VALUES), (4, 32), (2, 32), (2, 20), (0, 20), (0, 8)):
        _, report = converted(model, rank, pairs)
        for layer in report.layers:
            assert layer.products_error == pytest.approx(layer.relative_error, abs=1e-6)
            assert layer.value_products_error == pytest.approx(layer.value_error, abs=1e-6)
        errors[pairs, rank] = [(layer.relative_error, layer.value_error) for layer in report.layers]
    for layer in range(2):
        keys = {size: errors[size][layer][0] for size in errors}
        values = {size: errors[size][layer][1] for size in errors}
        assert keys[BANDS, VALUES] == 0 < keys[4, 32] < keys[2, 32] < keys[2, 20] < keys[0, 20] < keys[0, 8]
        assert values[BANDS, VALUES] < 1e-6 and values[4, 32] < 1e-6  # the whole latent holds the values
        assert 0 < values[2, 32] < values[2, 20] and 0 < values[0, 20] < values[0, 8] < 1


@pytest.mark.parametrize("family", ROTARY)
def test_each_layers_reported_error_equals_a_dense_recomputation(family):
    model = original(family, num_hidden_layers=1)
    for pairs, rank in ((3, 30), (1, 12)):
        small, report = converted(model, rank, pairs)
        with torch.no_grad():
            assert dense_error(model, small) == pytest.approx(report.layers[0].relative_error, abs=1e-6)


@pytest.mark.parametrize("family", ROTARY)
def test_the_cache_holds_the_kept_keys_and_the_latent_and_equals_recomputation(family):
    """One packed row per token (every group's rotated kept keys, then the latent), read by the absorbed form."""
    model = original(family)
    small, _ = converted(model, 20, 2)
    tokens = ids(length=9)
    with torch.no_grad():
        full = small(tokens).logits
        out = small(tokens[:, :5], use_cache=True)
        steps = [out.logits]
        cache = out.past_key_values
        for t in range(5, 9):
            out = small(tokens[:, t:t + 1], **with_cache(small, cache), use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    layer = small.model.layers[0].self_attn
    assert cache.layers[0].keys.shape == (2, 1, 9, 2 * 2 * KV_HEADS + 20)  # 2 r per group, rotated; the latent
    assert cache.layers[0].values.shape == (2, 1, 9, 0)
    assert layer.cache_width() == cache_numbers_per_token(layer) == 2 * 2 * KV_HEADS + 20


@pytest.mark.parametrize("family", ROTARY)
def test_generation_without_cache_with_a_dynamic_and_a_static_cache_agree(family):
    model = original(family)
    for pairs, rank in ((2, 20), (0, 16), (BANDS, VALUES)):  # kept keys and latent; latent alone; kept keys alone
        small, _ = converted(model, rank, pairs)
        tokens = ids(length=5)
        settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
        greedy = small.generate(tokens, **settings)
        assert greedy.shape == (2, 11)
        assert torch.equal(small.generate(tokens, use_cache=False, **settings), greedy)
        assert torch.equal(small.generate(tokens, cache_implementation="static", **settings), greedy)


@pytest.mark.parametrize("family", ROTARY)
def test_saves_and_loads_through_the_auto_classes(family, tmp_path):
    model, _ = converted(original(family), 20, 2)
    model.save_pretrained(tmp_path)
    # the same attention implementation: the same computation, bit for bit (the default, sdpa, hands the layers no
    # mask for an unpadded prompt, which then runs the plain form with the causal mask in the kernel: 1e-6)
    implementation = model.config._attn_implementation
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation=implementation).eval()
    assert loaded.config.collab_layer == "rotary-mla" and loaded.config.collab_rope_pairs == [2, 2]
    for mine, theirs in zip(model.model.layers, loaded.model.layers):
        assert torch.equal(mine.self_attn.rope_bands, theirs.self_attn.rope_bands)
    inputs = {"input_ids": ids(), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    by_default = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, model(**inputs).logits, rtol=0, atol=0)
        torch.testing.assert_close(by_default(**inputs).logits, model(**inputs).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ROTARY)
def test_attention_maps_equal_the_original_when_exact_and_are_distributions_otherwise(family):
    model = original(family)
    exact, _ = converted(model, VALUES, BANDS)
    small, _ = converted(model, 20, 2)
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


def test_padding_gives_the_unpadded_logits():
    model, _ = converted(original("qwen2"), 20, 2)
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
    method = METHODS["kv-svd"]
    sizes = conversion_sizes(config, method, rope_pairs=2)
    assert [s.rank for s in sizes] == list(range(1, min(KV_HEADS * (2 * HEAD_DIM - 4), D) + 1))
    assert all(s.cache_bytes == 2 * 2 * (2 * 2 * KV_HEADS + s.rank) for s in sizes)
    chosen = conversion_at(sizes, original_size(config), 0.25)
    assert chosen.rank == 4 and chosen.cache_bytes == original_cache / 4  # 2 r G + D_c = 8 + 4 of 48
    model, _ = converted(original("llama"), chosen.rank, 2)
    with torch.no_grad():
        cache = model(ids(), use_cache=True).past_key_values
    measured = sum(t[0, :, 0].numel() * 2 for layer in cache.layers for t in (layer.keys, layer.values))
    assert measured == chosen.cache_bytes
    default = conversion_sizes(config, method)  # the default share: head_dim // 16 pairs, at least one
    assert default[0].cache_bytes == 2 * 2 * (2 * default_rope_pairs(HEAD_DIM) * KV_HEADS + 1)


def test_what_it_cannot_honour_is_refused_with_the_reason():
    model = original("llama")
    with pytest.raises(ValueError, match="rope_pairs=7: a head of 12 dimensions has 6 rotary pairs"):
        converted(model, 20, 7)
    with pytest.raises(ValueError, match="rope_pairs must be a non-negative integer"):
        converted(model, 20, -1)
    with pytest.raises(ValueError, match="rank 25 for layer 0: .* a latent wider than 24 only caches zeros"):
        converted(model, 25, BANDS)
    with pytest.raises(ValueError, match="method='kv-svd' takes one rank or one per layer, not a budget"):
        converted(model, "mean:24", 2)
    with pytest.raises(ValueError, match="value_rank does not apply to method='kv-svd'"):
        collab_attn.reparametrize(copy.deepcopy(model), 20, method="kv-svd", value_rank=20, progress=False)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=20))
    with pytest.raises(ValueError, match="rope_pairs=2 applies to rotary-position models .* only"):
        collab_attn.reparametrize(gpt2, 8, method="kv-svd", rope_pairs=2, progress=False)
    check_request(config_of("qwen2"), "kv-svd", 21, rope_pairs=3)  # an odd latent width is fine
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"


def test_the_module_refuses_bands_it_cannot_rotate_and_needs_positions():
    with pytest.raises(ValueError, match="rope_pairs must be an integer in 0..4"):
        PartialRotaryLatentAttention(16, 4, 8, 5, kv_heads=2, head_dim=8)
    layer = PartialRotaryLatentAttention(16, 4, 8, 2, kv_heads=2, head_dim=8)
    state = layer.state_dict()
    with pytest.raises(ValueError, match="distinct bands in 0..3, in increasing order"):
        layer.load_state_dict(state | {"rope_bands": torch.tensor([[1, 1], [0, 2]])})
    with pytest.raises(ValueError, match="distinct bands in 0..3"):
        layer.load_state_dict(state | {"rope_bands": torch.tensor([[0, 4], [0, 2]])})
    with pytest.raises(ValueError, match="needs position_embeddings"):
        layer(torch.randn(1, 3, 16))


def test_inference_runs_the_absorbed_form_training_the_plain_one_and_they_agree(monkeypatch):
    """Without a gradient to keep the layer scores against the packed cache row (``_absorbed_queries``: one key/value
    head through the fused kernel); with one it expands the nope keys and the values, and so does a causal prompt
    (a prefill: the per-head scores are narrower than the packed row). Same logits, and the plain form trains the
    up-projections."""
    model = original("qwen2")  # biased keys: the nope keys' bias drops out of the absorbed form
    small, _ = converted(model, 20, 2)
    calls = []
    absorbed = PartialRotaryLatentAttention._absorbed_queries
    monkeypatch.setattr(PartialRotaryLatentAttention, "_absorbed_queries",
                        lambda self, queries: calls.append(queries.shape) or absorbed(self, queries))
    tokens = ids(length=9)
    padded = torch.ones_like(tokens)
    padded[0, 0] = 0  # a padded batch: not a causal prompt
    with torch.no_grad():
        inference = small(tokens, attention_mask=padded).logits
        assert len(calls) == 2  # both layers
        prompt = small(tokens).logits
    assert len(calls) == 2
    trained = small(tokens, attention_mask=padded).logits
    assert len(calls) == 2
    torch.testing.assert_close(small(tokens).logits.detach(), prompt, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(trained.detach(), inference, atol=1e-5, rtol=1e-5)
    trained.square().mean().backward()
    layer = small.model.layers[0].self_attn
    assert layer.nope_key.weight.grad.abs().sum() > 0 and layer.value.weight.grad.abs().sum() > 0
