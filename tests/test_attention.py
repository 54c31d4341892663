import pytest
import torch
from conftest import growing_cache

from collab_attn import CollaborativeAttention, MultiHeadAttention
from collab_attn.nn.attention import additive_mask, cache_numbers_per_token

D_MODEL, HEADS = 32, 4


def collaborative_copy(mha: MultiHeadAttention) -> CollaborativeAttention:
    """A full-rank collaborative layer holding exactly the weights of ``mha`` (concatenate mixing)."""
    full = mha.num_heads * mha.head_dim
    layer = CollaborativeAttention(mha.d_model, mha.num_heads, full, kv_dim=mha.kv_dim, mixing_init="concatenate")
    with torch.no_grad():
        layer.query.weight.copy_(mha.query.weight)
        layer.key.weight.copy_(mha.key.weight)
        w_key = mha.key.weight.view(mha.num_heads, mha.head_dim, -1)
        b_query = mha.query.bias.view(mha.num_heads, mha.head_dim)
        layer.content_bias.weight.copy_(torch.einsum("hai,ha->hi", w_key, b_query))
    layer.value.load_state_dict(mha.value.state_dict())
    layer.output.load_state_dict(mha.output.state_dict())
    return layer


@pytest.fixture
def pair():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D_MODEL, HEADS).eval()
    return mha, collaborative_copy(mha).eval()


def padding_mask(lengths, max_len):
    return (torch.arange(max_len)[None] < torch.tensor(lengths)[:, None]).long()


@pytest.mark.parametrize("heads", [1, 2, 4, 8, 16])
def test_concatenated_parameter_count_does_not_depend_on_heads(heads):
    counts = MultiHeadAttention(64, heads).parameter_counts()
    assert counts["total"] == 4 * 64 * 64 + 4 * 64
    assert counts["query"] == counts["key"] == 64 * 64 + 64


def test_collaborative_parameter_counts():
    counts = CollaborativeAttention(64, 8, 24, mixing_init="ones").parameter_counts()
    assert counts["query"] == counts["key"] == 64 * 24
    assert counts["mixing"] == 8 * 24
    assert counts["content_bias"] == 64 * 8
    assert counts["value"] == counts["output"] == 64 * 64 + 64
    assert counts["total"] == sum(v for k, v in counts.items() if k != "total")


@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("is_causal", [False, True])
def test_full_rank_concatenate_matches_concatenated_heads(pair, need_weights, is_causal):
    mha, collab = pair
    x = torch.randn(3, 7, D_MODEL)
    mask = padding_mask([7, 5, 2], 7)
    expected, expected_weights = mha(x, attention_mask=mask, is_causal=is_causal, need_weights=need_weights)
    got, weights = collab(x, attention_mask=mask, is_causal=is_causal, need_weights=need_weights)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    if need_weights:
        torch.testing.assert_close(weights, expected_weights, atol=1e-5, rtol=0)
    else:
        assert weights is None


def test_cross_attention_matches_with_other_key_width():
    torch.manual_seed(1)
    mha = MultiHeadAttention(D_MODEL, HEADS, kv_dim=20).eval()
    collab = collaborative_copy(mha).eval()
    x, memory = torch.randn(2, 5, D_MODEL), torch.randn(2, 9, 20)
    mask = padding_mask([9, 4], 9)
    expected, _ = mha(x, memory, attention_mask=mask)
    got, weights = collab(x, memory, attention_mask=mask, need_weights=True)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    assert weights.shape == (2, HEADS, 5, 9)


@pytest.mark.parametrize("module_name", ["mha", "collab"])
def test_output_without_weights_equals_explicit_softmax(pair, module_name):
    """Without weights asked for (MultiHeadAttention: the fused kernel), both modules give the output they give with
    them."""
    module = dict(zip(["mha", "collab"], pair))[module_name]
    x = torch.randn(2, 6, D_MODEL)
    mask = padding_mask([6, 3], 6)
    without_weights, _ = module(x, attention_mask=mask, is_causal=True)
    explicit, _ = module(x, attention_mask=mask, is_causal=True, need_weights=True)
    torch.testing.assert_close(without_weights, explicit, atol=1e-5, rtol=0)


@pytest.mark.parametrize("is_causal", [False, True])
def test_narrow_query_key_heads_at_inference_take_the_flash_kernel(is_causal):
    """SVD-truncated heads (queries and keys narrower than values): at inference on the CPU they are padded to the
    value width for the flash kernel, with the same output as the explicit softmax; with gradients they are not."""
    from torch.profiler import profile

    torch.manual_seed(0)
    layer = MultiHeadAttention(D_MODEL, HEADS, query_key_head_dim=3).eval()
    x = torch.randn(2, 6, D_MODEL)
    mask = padding_mask([6, 3], 6)
    explicit, _ = layer(x, attention_mask=mask, is_causal=is_causal, need_weights=True)
    for grad in (False, True):
        with torch.set_grad_enabled(grad), profile() as prof:
            fused, _ = layer(x, attention_mask=mask, is_causal=is_causal)
        torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
        flash = any("flash_attention" in event.key for event in prof.key_averages())
        assert flash is not grad


def test_mask_alike_for_every_query_is_reduced_to_one_row():
    """On the CPU, a 4-D mask that repeats one row for every query (how transformers passes padding) becomes one row,
    which the blocked path can carry in the keys; a causal one keeps its rows."""
    padding = padding_mask([4, 2], 4).bool()[:, None, None, :].expand(2, 1, 4, 4)
    reduced = additive_mask(padding.contiguous(), False, 4, 4, torch.float32, torch.device("cpu"))
    assert reduced.shape == (2, 1, 1, 4)
    assert torch.equal(reduced[1, 0, 0] < 0, torch.tensor([False, False, True, True]))
    causal = torch.ones(4, 4, dtype=torch.bool).tril()[None, None].expand(2, 1, 4, 4) & padding
    assert additive_mask(causal, False, 4, 4, torch.float32, torch.device("cpu")).shape == (2, 1, 4, 4)


def run_blocked(monkeypatch, block, layer, *args, **kwargs):
    """``layer(*args, **kwargs)`` at inference with ``CPU_LOGITS_BLOCK = block``, and how many times the blocked
    path ran."""
    import collab_attn.kinds.collaborative.collaborative_attention as collaborative_attention

    monkeypatch.setattr(collaborative_attention, "CPU_LOGITS_BLOCK", block)
    calls, blocked = [], layer._in_cpu_blocks
    monkeypatch.setattr(layer, "_in_cpu_blocks", lambda *a: calls.append(1) or blocked(*a))
    with torch.inference_mode():
        output = layer(*args, **kwargs)[0]
    monkeypatch.undo()
    return output, len(calls)


@pytest.mark.parametrize("tucker", [None, 3])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(
    "masking", ["padding", "causal", "both", "none", "float-4d", "padding-4d", "-inf-padding", "causal-blocked-row"]
)
def test_inference_in_cpu_blocks_equals_one_piece(monkeypatch, masking, bias, tucker):
    """At inference on the CPU the explicit path runs one batch element and a few query rows at a time
    (CPU_LOGITS_BLOCK), with the content logits and a padding mask carried by extra key columns: the same output
    as all logits at once, whatever the mask, with or without content bias, CP or Tucker mixing."""
    torch.manual_seed(0)
    layer = CollaborativeAttention(D_MODEL, HEADS, 12, bias=bias, tucker_core_size=tucker, mixing_init="random")
    layer.eval()
    x = torch.randn(5, 7, D_MODEL)
    mask = padding_mask([7, 5, 2, 6, 1], 7) if masking in ("padding", "both") else None
    if masking == "float-4d":  # per query row: cannot ride in the keys
        mask = torch.randn(5, 1, 7, 7)
    if masking == "padding-4d":  # padding as transformers passes it, one row per query
        mask = padding_mask([7, 5, 2, 6, 1], 7).bool()[:, None, None, :].expand(5, 1, 7, 7).contiguous()
    if masking == "-inf-padding":  # a float mask added as it is: -inf must not meet the other heads' zeros
        mask = torch.zeros(5, 1, 1, 7).masked_fill(padding_mask([7, 5, 2, 6, 1], 7)[:, None, None] == 0, -torch.inf)
    if masking == "causal-blocked-row":  # a row that may see no key keeps uniform weights over all of them
        mask = torch.ones(7, 7).tril().bool().expand(5, 1, 7, 7).clone()
        mask[0, 0, 3] = False
    is_causal = masking in ("causal", "both")
    whole, calls = run_blocked(monkeypatch, 1 << 40, layer, x, attention_mask=mask, is_causal=is_causal)
    assert calls == 0
    # a whole element per block; three query rows (the last block one row); one row
    for block in (HEADS * 7 * 7, HEADS * 3 * 7, 1):
        blocked, calls = run_blocked(monkeypatch, block, layer, x, attention_mask=mask, is_causal=is_causal)
        assert calls == 1
        torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # with no gradient to keep, the blocks run outside inference mode too
        torch.testing.assert_close(layer(x, attention_mask=mask, is_causal=is_causal)[0], whole, atol=1e-6, rtol=1e-5)


def test_cpu_blocks_score_only_the_keys_their_rows_see():
    """Under a causal mask, query row i needs keys 0..i: a block of rows stops at its last row's key; a row that
    sees no key, and a per-query float bias that blocks nothing, keep every key."""
    from collab_attn.kinds.collaborative.collaborative_attention import _keys_seen

    causal = torch.zeros(7, 7).masked_fill(torch.ones(7, 7).triu(1).bool(), torch.finfo(torch.float32).min)
    assert _keys_seen(causal[None, None], 7).tolist() == [[1, 2, 3, 4, 5, 6, 7]]
    causal[2] = -torch.inf
    assert _keys_seen(causal[None, None], 7).tolist() == [[1, 2, 7, 4, 5, 6, 7]]
    assert _keys_seen(torch.randn(2, 3, 7, 7), 7).tolist() == [[7] * 7] * 2


def test_cached_decoding_in_cpu_blocks_equals_one_piece(monkeypatch):
    """Decoding with a cache: the causal mask of one new query is a key-side bias and rides in the key columns."""
    torch.manual_seed(0)
    layer = CollaborativeAttention(D_MODEL, HEADS, 12, mixing_init="random").eval()
    x = torch.randn(3, 9, D_MODEL)
    outputs = {}
    for block in (1 << 40, 1):
        cache = growing_cache()
        steps = [run_blocked(monkeypatch, block, layer, x[:, :6], is_causal=True, kv_cache=cache)[0]]
        steps += [run_blocked(monkeypatch, block, layer, x[:, t : t + 1], is_causal=True, kv_cache=cache)[0]
                  for t in range(6, 9)]
        outputs[block] = torch.cat(steps, dim=1)
    torch.testing.assert_close(outputs[1], outputs[1 << 40], atol=1e-6, rtol=1e-5)
    with torch.inference_mode():  # and both equal the causal pass over the whole sequence
        torch.testing.assert_close(outputs[1], layer(x, is_causal=True)[0], atol=1e-6, rtol=1e-5)


def test_collaborative_attention_never_takes_the_fused_kernel(monkeypatch):
    """The fused kernel (values padded to the rank) was slower than explicit logits everywhere measured and was
    removed: no call runs ``scaled_dot_product_attention``, at inference or in training."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention
    counted = lambda *args, **kwargs: calls.append(1) or sdpa(*args, **kwargs)  # noqa: E731
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    layer = CollaborativeAttention(D_MODEL, HEADS, 12, mixing_init="ones").eval()
    x = torch.randn(2, 300, D_MODEL)
    with torch.inference_mode():
        layer(x)
        layer(x, need_weights=True)
        layer.train()(x)
    assert calls == []


@pytest.mark.parametrize("module_name", ["mha", "collab"])
def test_causal_mask_blocks_the_future(pair, module_name):
    module = dict(zip(["mha", "collab"], pair))[module_name]
    x = torch.randn(1, 6, D_MODEL)
    out, weights = module(x, is_causal=True, need_weights=True)
    assert torch.all(weights.triu(diagonal=1) == 0)
    assert torch.all(weights[..., torch.ones(6, 6, dtype=torch.bool).tril()] > 0)
    changed = x.clone()
    changed[:, 4:] = torch.randn(1, 2, D_MODEL)
    out_changed, _ = module(changed, is_causal=True)
    torch.testing.assert_close(out_changed[:, :4], out[:, :4], atol=1e-6, rtol=0)
    assert not torch.allclose(out_changed[:, 4:], out[:, 4:])


@pytest.mark.parametrize("module_name", ["mha", "collab"])
def test_padded_keys_get_zero_weight(pair, module_name):
    module = dict(zip(["mha", "collab"], pair))[module_name]
    x = torch.randn(2, 6, D_MODEL)
    mask = padding_mask([6, 4], 6)
    out, weights = module(x, attention_mask=mask, need_weights=True)
    assert torch.all(weights[1, :, :, 4:] == 0)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, HEADS, 6))
    changed = x.clone()
    changed[1, 4:] = torch.randn(2, D_MODEL)
    out_changed, _ = module(changed, attention_mask=mask)
    torch.testing.assert_close(out_changed[1, :4], out[1, :4], atol=1e-6, rtol=0)


def test_mask_formats_agree(pair):
    _, collab = pair
    x = torch.randn(2, 5, D_MODEL)
    mask2d = padding_mask([5, 3], 5)
    bool4d = mask2d.bool()[:, None, None, :].expand(2, 1, 5, 5)
    float4d = torch.zeros(2, 1, 5, 5).masked_fill(~bool4d, torch.finfo(torch.float32).min)
    reference, _ = collab(x, attention_mask=mask2d)
    for mask in (bool4d, float4d, bool4d[:, 0]):
        got, _ = collab(x, attention_mask=mask)
        torch.testing.assert_close(got, reference, atol=1e-6, rtol=0)


def test_fully_masked_rows_stay_finite():
    mask = additive_mask(torch.zeros(1, 4, dtype=torch.long), True, 4, 4, torch.float32, torch.device("cpu"))
    assert torch.isfinite(mask).all()
    layer = CollaborativeAttention(D_MODEL, HEADS, 16)
    out, weights = layer(torch.randn(1, 4, D_MODEL), attention_mask=torch.zeros(1, 4), need_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()


def test_gradients_reach_mixing_and_content_bias():
    torch.manual_seed(0)
    layer = CollaborativeAttention(D_MODEL, HEADS, 12, mixing_init="random")
    out, _ = layer(torch.randn(2, 5, D_MODEL), attention_mask=padding_mask([5, 3], 5))
    out.square().sum().backward()
    for name in ("mixing", "query", "key", "content_bias", "value", "output"):
        grad = layer.get_parameter("mixing" if name == "mixing" else f"{name}.weight").grad
        assert grad is not None and grad.abs().sum() > 0, name


def test_mixing_inits():
    concatenate = CollaborativeAttention(D_MODEL, HEADS, 8, mixing_init="concatenate").mixing
    assert torch.equal(concatenate, torch.eye(HEADS).repeat_interleave(2, dim=1))
    assert torch.equal(CollaborativeAttention(D_MODEL, HEADS, 6, mixing_init="ones").mixing, torch.ones(HEADS, 6))
    torch.manual_seed(0)
    random = CollaborativeAttention(D_MODEL, HEADS, 6, mixing_init="random").mixing
    assert random.std() > 0.5 and not torch.equal(random[0], random[1])


def test_tucker_mixing_uses_full_matrices():
    torch.manual_seed(0)
    layer = CollaborativeAttention(D_MODEL, HEADS, 8, tucker_core_size=3, mixing_init="random")
    assert layer.mixing.shape == (HEADS, 3) and layer.mixing_core.shape == (3, 8, 8)
    assert layer.mixing_matrices().shape == (HEADS, 8, 8)
    x = torch.randn(2, 5, D_MODEL)
    without_weights, _ = layer(x)
    explicit, weights = layer(x, need_weights=True)
    torch.testing.assert_close(without_weights, explicit, atol=1e-5, rtol=0)
    # The logits of head h are x Q M_h K^T x^T: check them against the weights.
    q, k = layer.query(x), layer.key(x)
    logits = torch.einsum("btr,hrs,bus->bhtu", q, layer.mixing_matrices(), k) * layer.scale
    logits = logits + (layer.content_bias(x).transpose(1, 2)[:, :, None, :] * layer.scale)
    torch.testing.assert_close(weights, logits.softmax(-1), atol=1e-5, rtol=0)


def test_dropout_only_in_training():
    layer = CollaborativeAttention(D_MODEL, HEADS, 8, dropout=0.5)
    x = torch.randn(2, 5, D_MODEL)
    layer.eval()
    torch.testing.assert_close(layer(x)[0], layer(x)[0])
    layer.train()
    torch.manual_seed(0)
    a = layer(x)[0]
    torch.manual_seed(1)
    assert not torch.allclose(a, layer(x)[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"rank": 0}, "rank must be a positive integer"),
        ({"rank": 10}, "multiple of num_heads"),
        ({"rank": 8, "mixing_init": "zeros"}, "unknown mixing_init"),
    ],
)
def test_bad_arguments_are_explained(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CollaborativeAttention(D_MODEL, HEADS, **kwargs)


def test_bad_mask_shape_is_explained():
    with pytest.raises(ValueError, match="attention_mask must be"):
        MultiHeadAttention(D_MODEL, HEADS)(torch.randn(1, 3, D_MODEL), attention_mask=torch.ones(3))
    with pytest.raises(ValueError, match="not a multiple of num_heads"):
        MultiHeadAttention(30, 4)


# ---------------------------------------------------------------------------------------------------------------
# Shared values (value_rank): one value per token for all heads, a value mixing vector per head


def _with_shared_values(per_head: CollaborativeAttention) -> CollaborativeAttention:
    """The same layer with value_rank = heads x head_dim: the shared value is every head's value side by side and
    head h's value mixing the indicator of its block, so ``sum_h (P_h V) diag(n_h) Wo`` is the per-head output."""
    heads, head_dim = per_head.num_heads, per_head.head_dim
    shared = CollaborativeAttention(per_head.d_model, heads, per_head.rank, value_rank=heads * head_dim,
                                    mixing_init="ones").eval()
    state = per_head.state_dict()
    state["value_mixing"] = torch.eye(heads).repeat_interleave(head_dim, dim=1)
    shared.load_state_dict(state)
    return shared


@pytest.mark.parametrize("need_weights", [False, True])
def test_shared_values_at_full_value_rank_equal_per_head_values(need_weights):
    torch.manual_seed(0)
    per_head = CollaborativeAttention(48, 4, 20, mixing_init="random").eval()
    shared = _with_shared_values(per_head)
    x = torch.randn(3, 9, 48)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.no_grad():
        expected, expected_weights = per_head(x, attention_mask=mask, is_causal=True, need_weights=need_weights)
        out, weights = shared(x, attention_mask=mask, is_causal=True, need_weights=need_weights)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(weights, expected_weights)


def test_shared_values_compute_the_mixed_sum_and_cache_one_value_per_token():
    torch.manual_seed(1)
    layer = CollaborativeAttention(32, 4, 8, value_rank=6, mixing_init="random").eval()
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        out, weights = layer(x, is_causal=True, need_weights=True)
        # by hand: sum over heads of (weights_h @ (x A)) diag(n_h), then the output projection
        values = x @ layer.value.weight.T + layer.value.bias
        mixed = sum((weights[:, h] @ values) * layer.value_mixing[h] for h in range(4))
        torch.testing.assert_close(out, mixed @ layer.output.weight.T + layer.output.bias, atol=1e-6, rtol=1e-5)
        stored = {}

        def cache(keys, values):
            for name, new in (("keys", keys), ("values", values)):
                stored[name] = new if name not in stored else torch.cat([stored[name], new], dim=2)
            return stored["keys"], stored["values"]

        pieces = [layer(x[:, :3], is_causal=True, kv_cache=cache)[0]]
        pieces += [layer(x[:, i : i + 1], is_causal=True, kv_cache=cache)[0] for i in range(3, 7)]
    torch.testing.assert_close(torch.cat(pieces, dim=1), out, atol=1e-6, rtol=1e-5)
    assert stored["values"].shape == (2, 1, 7, 6)  # one value of width 6 per token, not 4 heads x 8
    assert stored["keys"].shape == (2, 1, 7, 8 + 4)  # the shared key and the heads' content logits
    assert cache_numbers_per_token(layer) == 8 + 4 + 6
    counts = layer.parameter_counts()
    assert (counts["value"], counts["value_mixing"], counts["output"]) == (32 * 6 + 6, 4 * 6, 6 * 32 + 32)


def test_tucker_shared_values_mix_each_head_by_a_matrix():
    """With a Tucker core the heads' sums are mixed by N_h = sum_g value_mixing[h, g] value_core[g]; with the core
    made of block indicators (one slice per head, the value_rank split among the heads) this is per-head values."""
    torch.manual_seed(2)
    layer = CollaborativeAttention(32, 4, 8, value_rank=6, tucker_core_size=3, mixing_init="random").eval()
    with torch.no_grad():
        layer.value_core.normal_()
    x = torch.randn(2, 5, 32)
    with torch.no_grad():
        out, weights = layer(x, is_causal=True, need_weights=True)
        values = x @ layer.value.weight.T + layer.value.bias
        mixing = torch.einsum("hg,gvw->hvw", layer.value_mixing, layer.value_core)
        mixed = sum(weights[:, h] @ values @ mixing[h] for h in range(4))
    torch.testing.assert_close(out, mixed @ layer.output.weight.T + layer.output.bias, atol=1e-5, rtol=1e-5)
    per_head = CollaborativeAttention(48, 4, 20, mixing_init="random").eval()
    blocks = torch.eye(4).repeat_interleave(12, dim=1)
    tucker = CollaborativeAttention(48, 4, 20, value_rank=48, tucker_core_size=4, mixing_init="random").eval()
    tucker.load_state_dict(per_head.state_dict() | {
        "mixing": torch.eye(4), "mixing_core": torch.diag_embed(per_head.mixing.detach()),  # M_h = diag(m_h)
        "value_mixing": torch.eye(4), "value_core": torch.diag_embed(blocks),  # N_h: head h's block of the values
    })
    x = torch.randn(3, 9, 48)
    with torch.no_grad():
        torch.testing.assert_close(tucker(x, is_causal=True)[0], per_head(x, is_causal=True)[0], atol=1e-5,
                                   rtol=1e-5)
    with pytest.raises(ValueError, match="keeps a value head per head"):
        per_head.value_mixing_matrices()


def test_tucker_matrices_are_built_once_without_gradients_and_again_when_the_parameters_change():
    """Generation and evaluation reuse the per-head Tucker matrices; an optimizer step, ``load_state_dict``, a new
    tensor in ``.data`` or a dtype change each give what recomputing gives, and training still reaches the cores."""
    torch.manual_seed(4)
    layer = CollaborativeAttention(32, 4, 8, value_rank=6, tucker_core_size=3, mixing_init="random").eval()
    x = torch.randn(2, 5, 32)  # no causal mask: with or without gradients the explicit path, bit for bit

    def fresh():  # with gradients on, the matrices are rebuilt on every call
        return layer(x)[0].detach()

    with torch.no_grad():
        first = layer(x)[0]
        key_matrices, value_matrices = layer.mixing_matrices(), layer.value_mixing_matrices()
    with torch.inference_mode():
        assert layer.mixing_matrices() is key_matrices and layer.value_mixing_matrices() is value_matrices
        torch.testing.assert_close(layer(x)[0], first, rtol=0, atol=0)
    changes = [
        lambda: torch.optim.SGD(layer.parameters(), lr=0.5).step(),
        lambda: layer.load_state_dict(layer.state_dict() | {"value_core": torch.randn(3, 6, 6)}),
        lambda: setattr(layer.mixing_core, "data", torch.randn(3, 8, 8)),
    ]
    for change in changes:
        layer(x)[0].square().sum().backward()  # gradients reach both cores
        assert layer.mixing_core.grad.abs().sum() > 0 and layer.value_core.grad.abs().sum() > 0
        change()
        layer.zero_grad()
        with torch.no_grad():
            after = layer(x)[0]
        assert not torch.allclose(after, first)
        torch.testing.assert_close(after, fresh(), rtol=0, atol=0)
        first = after
    layer.double()  # float32 matrices kept would not multiply float64 queries
    with torch.no_grad():
        doubled = layer(x.double())[0]
    torch.testing.assert_close(doubled, layer(x.double())[0].detach(), rtol=0, atol=0)


def test_shared_values_refuse_a_bad_value_rank():
    with pytest.raises(ValueError, match="value_rank must be a positive integer"):
        CollaborativeAttention(32, 4, 8, value_rank=0)
