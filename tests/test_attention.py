import pytest
import torch

from collab_attn import CollaborativeAttention, MultiHeadAttention
from collab_attn.nn.attention import additive_mask

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
def test_fused_path_equals_explicit_softmax(pair, module_name):
    module = dict(zip(["mha", "collab"], pair))[module_name]
    x = torch.randn(2, 6, D_MODEL)
    mask = padding_mask([6, 3], 6)
    fused, _ = module(x, attention_mask=mask, is_causal=True)
    explicit, _ = module(x, attention_mask=mask, is_causal=True, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)


@pytest.mark.parametrize("rank, tucker", [(12, None), (4, None), (8, 3)])  # rank above, below, at head_dim
@pytest.mark.parametrize("masking", ["padding", "causal", "both"])
def test_fused_and_explicit_paths_agree(rank, tucker, masking):
    """CollaborativeAttention picks a path per call (use_fused); both must compute the same function."""
    torch.manual_seed(0)
    layer = CollaborativeAttention(D_MODEL, HEADS, rank, tucker_core_size=tucker, mixing_init="random", dropout=0.3)
    layer.eval()
    x = torch.randn(3, 7, D_MODEL)
    mask = padding_mask([7, 5, 2], 7) if masking != "causal" else None
    is_causal = masking != "padding"
    outputs, grads = {}, {}
    for fused in (True, False):
        layer.fused = fused
        layer.zero_grad()
        outputs[fused], _ = layer(x, attention_mask=mask, is_causal=is_causal)
        outputs[fused].square().sum().backward()
        grads[fused] = {name: p.grad.clone() for name, p in layer.named_parameters()}
    torch.testing.assert_close(outputs[True], outputs[False], atol=1e-5, rtol=0)
    for name in grads[True]:
        torch.testing.assert_close(grads[True][name], grads[False][name], atol=1e-4, rtol=1e-4, msg=name)


@pytest.mark.parametrize("masking", ["padding", "causal", "both", "none"])
def test_inference_in_cpu_blocks_equals_one_piece(monkeypatch, masking):
    """At inference on the CPU the explicit path runs a few batch elements at a time (CPU_LOGITS_BLOCK): the
    same output as all at once, with padding, causal and content-bias logits, and the same cached decoding."""
    import collab_attn.nn.attention as attention

    torch.manual_seed(0)
    layer = CollaborativeAttention(D_MODEL, HEADS, 12, mixing_init="random").eval()
    layer.fused = False
    x = torch.randn(5, 7, D_MODEL)
    mask = padding_mask([7, 5, 2, 6, 1], 7) if masking in ("padding", "both") else None
    is_causal = masking in ("causal", "both")
    calls, explicit = [], layer._explicit
    layer._explicit = lambda queries, *rest: calls.append(len(queries)) or explicit(queries, *rest)
    with torch.inference_mode():
        whole, _ = layer(x, attention_mask=mask, is_causal=is_causal)
        pieces = []
        for block in (HEADS * 7 * 7, 2 * HEADS * 7 * 7 + 1):  # one element per block, then two (the last alone)
            monkeypatch.setattr(attention, "CPU_LOGITS_BLOCK", block)
            pieces.append(layer(x, attention_mask=mask, is_causal=is_causal)[0])
    assert calls == [5, 1, 1, 1, 1, 1, 2, 2, 1]
    for blocked in pieces:
        torch.testing.assert_close(blocked, whole, atol=1e-6, rtol=1e-5)
    with torch.no_grad():  # with no gradient to keep, the blocks run outside inference mode too
        torch.testing.assert_close(layer(x, attention_mask=mask, is_causal=is_causal)[0], whole, atol=1e-6, rtol=1e-5)


def test_fused_path_choice():
    layer = CollaborativeAttention(768, 12, 192, mixing_init="ones")  # rank = 3 head widths
    wide = CollaborativeAttention(768, 12, 384, mixing_init="ones")
    assert layer.eval().use_fused(need_weights=False, src_len=512)
    assert not layer.use_fused(need_weights=False, src_len=512, device_type="cuda")  # GPU: explicit is faster
    assert not layer.use_fused(need_weights=False, src_len=128)  # short: explicit logits are faster
    assert not layer.use_fused(need_weights=False, src_len=4096, tgt_len=1)  # decoding: never pad the cached values
    assert not layer.use_fused(need_weights=True, src_len=512)  # weights need the explicit path
    assert not layer.train().use_fused(need_weights=False, src_len=512)  # training: explicit path
    assert not wide.eval().use_fused(need_weights=False, src_len=512)  # values padded to a wide rank cost more
    layer.fused = True
    assert layer.use_fused(need_weights=False, src_len=16) and not layer.use_fused(need_weights=True, src_len=16)


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
    fused, _ = layer(x)
    explicit, weights = layer(x, need_weights=True)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=0)
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
