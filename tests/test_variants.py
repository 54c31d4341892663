"""Grouped-query, multi-query and latent attention (collab_attn.kinds.gqa, .mla and .shared_key): the call contract of
MultiHeadAttention, exact equivalences, and what each hands its key/value cache."""

import math

import pytest
import torch
from conftest import growing_cache
from transformers import DynamicCache

from collab_attn.nn import (
    CollaborativeAttention,
    GroupedQueryAttention,
    LatentAttention,
    MultiHeadAttention,
    MultiQueryAttention,
    cache_numbers_per_token,
)

D_MODEL, HEADS, HEAD_DIM, LATENT = 32, 4, 8, 12
TOL = dict(atol=1e-5, rtol=1e-5)
MASKINGS = ["none", "padding", "causal", "padding+causal", "bool-3d", "bool-4d-heads", "float-4d", "float-4d-heads"]


def make(kind: str, **kwargs) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "gqa":
        return GroupedQueryAttention(D_MODEL, HEADS, 2, **kwargs)
    if kind == "mqa":
        return MultiQueryAttention(D_MODEL, HEADS, **kwargs)
    if kind == "mla":
        return LatentAttention(D_MODEL, HEADS, LATENT, **kwargs)
    if kind == "mla-absorbed":
        layer = LatentAttention(D_MODEL, HEADS, LATENT, **kwargs)
        layer.absorb = True
        return layer
    raise ValueError(kind)


KINDS = ["gqa", "mqa", "mla", "mla-absorbed"]


def padding_mask(lengths, max_len):
    return (torch.arange(max_len)[None] < torch.tensor(lengths)[:, None]).long()


def mask_for(masking: str, batch: int, tgt: int, src: int):
    """(attention_mask, is_causal) for one of MASKINGS."""
    gen = torch.Generator().manual_seed(1)
    lengths = [src - (i % 3) for i in range(batch)]
    if masking == "none":
        return None, False
    if masking == "padding":
        return padding_mask(lengths, src), False
    if masking == "causal":
        return None, True
    if masking == "padding+causal":
        return padding_mask(lengths, src), True
    if masking == "bool-3d":
        return torch.rand(batch, tgt, src, generator=gen) > 0.3, False
    if masking == "bool-4d-heads":
        return torch.rand(batch, HEADS, tgt, src, generator=gen) > 0.3, False
    if masking == "float-4d":
        return torch.randn(batch, 1, tgt, src, generator=gen), False
    if masking == "float-4d-heads":
        return torch.randn(batch, HEADS, tgt, src, generator=gen), False
    raise ValueError(masking)


def mha_copy(layer: GroupedQueryAttention) -> MultiHeadAttention:
    """Concatenated heads holding the weights of ``layer``, each key/value head repeated for its query heads."""
    mha = MultiHeadAttention(layer.d_model, layer.num_heads, head_dim=layer.head_dim, kv_dim=layer.kv_dim)
    group = layer.num_heads // layer.kv_heads
    with torch.no_grad():
        for name in ("query", "output"):
            getattr(mha, name).load_state_dict(getattr(layer, name).state_dict())
        for name in ("key", "value"):
            source = getattr(layer, name)
            weight = source.weight.view(layer.kv_heads, layer.head_dim, -1).repeat_interleave(group, dim=0)
            getattr(mha, name).weight.copy_(weight.flatten(0, 1))
            getattr(mha, name).bias.copy_(source.bias.view(layer.kv_heads, -1).repeat_interleave(group, 0).flatten())
    return mha.eval()


def mla_by_hand(layer: LatentAttention, x, y, additive):
    """Latent attention from its weights, one head at a time: c = y W_dkv + b, k_h = c W_uk_h, v_h = c W_uv_h."""
    latent = y @ layer.latent.weight.T + layer.latent.bias
    heads = []
    for h in range(layer.num_heads):
        rows = slice(h * layer.head_dim, (h + 1) * layer.head_dim)
        q = x @ layer.query.weight[rows].T + layer.query.bias[rows]
        k = latent @ layer.key.weight[rows].T
        v = latent @ layer.value.weight[rows].T
        logits = q @ k.transpose(1, 2) / math.sqrt(layer.head_dim)
        if additive is not None:
            logits = logits + additive[:, min(h, additive.shape[1] - 1)]
        heads.append(logits.softmax(-1) @ v)
    return torch.cat(heads, dim=-1) @ layer.output.weight.T + layer.output.bias


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cross", [False, True])
def test_shapes(kind, cross):
    layer = make(kind, kv_dim=20 if cross else None).eval()
    x = torch.randn(3, 5, D_MODEL)
    y = torch.randn(3, 7, 20) if cross else None
    output, weights = layer(x, y, need_weights=True)
    src = 7 if cross else 5
    assert output.shape == (3, 5, D_MODEL) and weights.shape == (3, HEADS, 5, src)
    output2, none = layer(x, y)
    assert none is None
    torch.testing.assert_close(output2, output, **TOL)  # the fused path without weights, the explicit one with
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, HEADS, 5), **TOL)


def test_head_dim_and_no_output_projection():
    layer = GroupedQueryAttention(D_MODEL, HEADS, 2, head_dim=6, output_projection=False)
    assert layer(torch.randn(2, 3, D_MODEL))[0].shape == (2, 3, HEADS * 6)
    layer = LatentAttention(D_MODEL, HEADS, LATENT, head_dim=6, output_projection=False)
    layer.absorb = True
    assert layer(torch.randn(2, 3, D_MODEL))[0].shape == (2, 3, HEADS * 6)


@pytest.mark.parametrize("kind", KINDS)
def test_padding_mask_equals_rows_run_separately(kind):
    layer = make(kind).eval()
    x = torch.randn(3, 6, D_MODEL)
    lengths = [6, 4, 2]
    for is_causal in (False, True):
        batched = layer(x, attention_mask=padding_mask(lengths, 6), is_causal=is_causal)[0]
        for i, n in enumerate(lengths):
            alone = layer(x[i : i + 1, :n], is_causal=is_causal)[0]
            torch.testing.assert_close(batched[i, :n], alone[0], **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_every_form_of_a_padding_mask_agrees(kind):
    """2-D 1/0, 3-D and 4-D booleans, a 4-D float mask: the same padding, the same output."""
    layer = make(kind).eval()
    x = torch.randn(3, 6, D_MODEL)
    pad = padding_mask([6, 4, 2], 6)
    keep = pad.bool()[:, None, :].expand(3, 6, 6)
    floats = torch.zeros(3, 1, 1, 6).masked_fill(~pad.bool()[:, None, None], -1e9)
    reference = layer(x, attention_mask=pad)[0]
    for mask in (keep, keep[:, None], keep[:, None].expand(3, HEADS, 6, 6), floats):
        torch.testing.assert_close(layer(x, attention_mask=mask)[0], reference, **TOL)


@pytest.mark.parametrize("kind", KINDS)
def test_causal_output_depends_only_on_the_past(kind):
    layer = make(kind).eval()
    x = torch.randn(2, 7, D_MODEL)
    whole = layer(x, is_causal=True)[0]
    for t in (1, 4, 7):
        torch.testing.assert_close(layer(x[:, :t], is_causal=True)[0], whole[:, :t], **TOL)
    weights = layer(x, is_causal=True, need_weights=True)[1]
    assert torch.all(weights.triu(1) == 0)


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("kv_heads", [HEADS, 2, 1])
def test_gqa_equals_concatenated_heads_with_repeated_key_value_heads(kv_heads, masking):
    """kv_heads = num_heads is MultiHeadAttention with the same weights; fewer key/value heads are
    MultiHeadAttention whose heads of a group share (copies of) one key and one value head."""
    torch.manual_seed(0)
    layer = GroupedQueryAttention(D_MODEL, HEADS, kv_heads).eval()
    mha = mha_copy(layer)
    if kv_heads == HEADS:
        assert set(mha.state_dict()) == set(layer.state_dict())
        for name, tensor in layer.state_dict().items():
            assert torch.equal(mha.state_dict()[name], tensor)
    x = torch.randn(3, 6, D_MODEL)
    mask, is_causal = mask_for(masking, 3, 6, 6)
    for need_weights in (False, True):
        ours = layer(x, attention_mask=mask, is_causal=is_causal, need_weights=need_weights)
        theirs = mha(x, attention_mask=mask, is_causal=is_causal, need_weights=need_weights)
        torch.testing.assert_close(ours[0], theirs[0], **TOL)
        if need_weights:
            torch.testing.assert_close(ours[1], theirs[1], **TOL)


def test_gqa_cross_attention_equals_concatenated_heads():
    torch.manual_seed(0)
    layer = GroupedQueryAttention(D_MODEL, HEADS, 2, kv_dim=20).eval()
    mha = mha_copy(layer)
    x, y = torch.randn(2, 5, D_MODEL), torch.randn(2, 7, 20)
    mask = padding_mask([7, 3], 7)
    torch.testing.assert_close(layer(x, y, mask)[0], mha(x, y, mask)[0], **TOL)


def test_mqa_is_gqa_with_one_key_value_head():
    mqa = make("mqa").eval()
    assert isinstance(mqa, GroupedQueryAttention) and mqa.kv_heads == 1
    assert mqa.key.weight.shape == mqa.value.weight.shape == (HEAD_DIM, D_MODEL)
    gqa = GroupedQueryAttention(D_MODEL, HEADS, 1).eval()
    gqa.load_state_dict(mqa.state_dict())
    x = torch.randn(2, 5, D_MODEL)
    torch.testing.assert_close(gqa(x, is_causal=True)[0], mqa(x, is_causal=True)[0], atol=0, rtol=0)


@pytest.mark.parametrize("kv_heads", [0, 3, 5, 2.0])
def test_gqa_refuses_key_value_heads_that_do_not_divide(kv_heads):
    with pytest.raises(ValueError, match="kv_heads"):
        GroupedQueryAttention(D_MODEL, HEADS, kv_heads)


@pytest.mark.parametrize("masking", MASKINGS)
def test_mla_absorbed_equals_plain_and_the_weights_by_hand(masking):
    torch.manual_seed(0)
    layer = LatentAttention(D_MODEL, HEADS, LATENT).eval()
    x = torch.randn(3, 6, D_MODEL)
    mask, is_causal = mask_for(masking, 3, 6, 6)
    results = {}
    for absorb in (False, True):
        layer.absorb = absorb
        results[absorb] = layer(x, attention_mask=mask, is_causal=is_causal, need_weights=True)
        fused = layer(x, attention_mask=mask, is_causal=is_causal)[0]
        torch.testing.assert_close(fused, results[absorb][0], **TOL)
    torch.testing.assert_close(results[True][0], results[False][0], **TOL)
    torch.testing.assert_close(results[True][1], results[False][1], **TOL)
    from collab_attn.nn.attention import additive_mask

    additive = additive_mask(mask, is_causal, 6, 6, torch.float32, torch.device("cpu"))
    if additive is not None:
        additive = additive.reshape((1,) * (4 - additive.dim()) + tuple(additive.shape))
    with torch.no_grad():
        torch.testing.assert_close(results[True][0], mla_by_hand(layer, x, x, additive), **TOL)


def test_mla_cross_attention_by_hand():
    torch.manual_seed(0)
    layer = LatentAttention(D_MODEL, HEADS, LATENT, kv_dim=20).eval()
    x, y = torch.randn(2, 5, D_MODEL), torch.randn(2, 7, 20)
    with torch.no_grad():
        expected = mla_by_hand(layer, x, y, None)
    for absorb in (False, True):
        layer.absorb = absorb
        torch.testing.assert_close(layer(x, y)[0], expected, **TOL)


def test_mla_absorbs_only_when_decoding_by_default(monkeypatch):
    layer = make("mla").eval()
    seen = []
    up = layer._up_projections
    monkeypatch.setattr(layer, "_up_projections", lambda: seen.append(1) or up())
    x = torch.randn(1, 3, D_MODEL)
    layer(x)
    assert not seen
    layer(x, kv_cache=growing_cache())
    assert seen


ALL_KINDS = KINDS + ["mla-plain-with-cache", "mha", "mha-content-narrow", "collab"]


def make_any(kind):
    torch.manual_seed(0)
    if kind == "mla-plain-with-cache":
        layer = LatentAttention(D_MODEL, HEADS, LATENT)
        layer.absorb = False
        return layer
    if kind == "mha":
        return MultiHeadAttention(D_MODEL, HEADS)
    if kind == "mha-content-narrow":
        return MultiHeadAttention(D_MODEL, HEADS, query_key_head_dim=3, content_bias=True)
    if kind == "collab":
        return CollaborativeAttention(D_MODEL, HEADS, 12, mixing_init="random")
    return make(kind)


@pytest.mark.parametrize("cache_kind", ["list", "dynamic"])
@pytest.mark.parametrize("kind", ALL_KINDS)
def test_token_by_token_decoding_with_a_cache_equals_recomputation(kind, cache_kind):
    """A prefill of 3 positions, then one token at a time: the causal pass over the whole sequence; the cache holds
    exactly ``cache_numbers_per_token`` numbers per token, measured from the tensors it stored."""
    layer = make_any(kind).eval()
    x = torch.randn(2, 8, D_MODEL)
    if cache_kind == "list":
        update = growing_cache()

        def stored():
            return list(update.store.values())
    else:
        cache = DynamicCache()

        def update(keys, values):
            return cache.update(keys, values, 0)

        def stored():
            return [cache.layers[0].keys, cache.layers[0].values]

    with torch.no_grad():
        steps = [layer(x[:, :3], is_causal=True, kv_cache=update)[0]]
        steps += [layer(x[:, t : t + 1], is_causal=True, kv_cache=update)[0] for t in range(3, 8)]
        whole = layer(x, is_causal=True)[0]
    torch.testing.assert_close(torch.cat(steps, dim=1), whole, **TOL)
    tensors = stored()
    assert all(t.shape[0] == 2 and t.shape[2] == 8 for t in tensors)
    per_token = sum(t.numel() * t.element_size() for t in tensors) / (2 * 8)
    assert per_token == cache_numbers_per_token(layer) * torch.finfo(torch.float32).bits // 8


def test_cache_numbers_per_token_formulas():
    assert cache_numbers_per_token(GroupedQueryAttention(D_MODEL, HEADS, 2)) == 2 * 2 * HEAD_DIM
    assert cache_numbers_per_token(MultiQueryAttention(D_MODEL, HEADS)) == 2 * HEAD_DIM
    assert cache_numbers_per_token(GroupedQueryAttention(D_MODEL, HEADS, HEADS)) == 2 * HEADS * HEAD_DIM
    assert cache_numbers_per_token(LatentAttention(D_MODEL, HEADS, LATENT)) == LATENT
    assert cache_numbers_per_token(MultiHeadAttention(D_MODEL, HEADS)) == 2 * HEADS * HEAD_DIM
    assert cache_numbers_per_token(CollaborativeAttention(D_MODEL, HEADS, 12)) == 12 + HEADS + HEADS * HEAD_DIM
    with pytest.raises(TypeError):
        cache_numbers_per_token(torch.nn.Linear(2, 2))


def test_cache_layouts():
    """GQA/MQA: keys and values (B, kv_heads, S, head_dim); MLA: the latent (B, 1, S, latent) and empty values."""
    x = torch.randn(2, 5, D_MODEL)
    for layer, keys, values in (
        (make("gqa"), (2, 2, 5, HEAD_DIM), (2, 2, 5, HEAD_DIM)),
        (make("mqa"), (2, 1, 5, HEAD_DIM), (2, 1, 5, HEAD_DIM)),
        (make("mla"), (2, 1, 5, LATENT), (2, 1, 5, 0)),
    ):
        update = growing_cache()
        layer(x, kv_cache=update)
        assert update.store["packed"].shape == keys and update.store["values"].shape == values


def test_parameter_counts():
    d, h, k = D_MODEL, HEADS, HEAD_DIM
    gqa = GroupedQueryAttention(d, h, 2).parameter_counts()
    assert gqa == {
        "query": d * h * k + h * k, "key": d * 2 * k + 2 * k, "value": d * 2 * k + 2 * k,
        "output": h * k * d + d, "total": gqa["total"],
    }
    mla = LatentAttention(d, h, LATENT).parameter_counts()
    assert mla == {
        "query": d * h * k + h * k, "latent": d * LATENT + LATENT, "key": LATENT * h * k, "value": LATENT * h * k,
        "output": h * k * d + d, "total": mla["total"],
    }
    for kind in KINDS:
        layer = make(kind)
        counts = layer.parameter_counts()
        assert counts["total"] == sum(p.numel() for p in layer.parameters())
        assert counts["total"] == sum(v for name, v in counts.items() if name != "total")
    assert make("mqa").parameter_counts()["total"] == d * h * k + h * k + 2 * (d * k + k) + h * k * d + d
    nobias = LatentAttention(d, h, LATENT, bias=False, output_projection=False).parameter_counts()
    assert nobias["total"] == d * h * k + d * LATENT + 2 * LATENT * h * k


@pytest.mark.parametrize("kind", KINDS)
def test_gradients_flow_in_training(kind):
    layer = make(kind, dropout=0.1).train()
    x = torch.randn(2, 5, D_MODEL, requires_grad=True)
    output, weights = layer(x, attention_mask=padding_mask([5, 3], 5), is_causal=True, need_weights=True)
    (output.square().sum() + weights.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0
    for name, param in layer.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


@pytest.mark.parametrize("kind", KINDS)
def test_dropout_on_the_weights_in_training_only(kind):
    layer = make(kind, dropout=0.5)
    x = torch.randn(2, 5, D_MODEL)
    layer.eval()
    reference = layer(x, need_weights=True)
    torch.testing.assert_close(reference[0], layer(x)[0], **TOL)
    layer.train()
    torch.manual_seed(1)
    dropped = layer(x, need_weights=True)[0]
    assert not torch.allclose(dropped, reference[0], atol=1e-4)
    torch.manual_seed(1)
    assert not torch.allclose(layer(x)[0], reference[0], atol=1e-4)  # the fused path too


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize("kind", KINDS)
def test_weights_rows_sum_to_one_under_every_mask(kind, masking):
    layer = make(kind).eval()
    x = torch.randn(3, 6, D_MODEL)
    mask, is_causal = mask_for(masking, 3, 6, 6)
    output, weights = layer(x, attention_mask=mask, is_causal=is_causal, need_weights=True)
    assert weights.shape == (3, HEADS, 6, 6)
    torch.testing.assert_close(weights.sum(-1), torch.ones(3, HEADS, 6), **TOL)
    torch.testing.assert_close(layer(x, attention_mask=mask, is_causal=is_causal)[0], output, **TOL)
    if masking in ("bool-3d", "bool-4d-heads"):
        keep = mask[:, None] if mask.dim() == 3 else mask
        blocked = ~keep.expand_as(weights) & keep.expand_as(weights).any(-1, keepdim=True)
        assert torch.all(weights[blocked] == 0)
