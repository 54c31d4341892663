"""Tensor product attention (collab_attn.kinds.rotary_tpa): the
factored queries, keys and values compute the attention of
the heads they make, rotary positions act on the key factors before the cache, and the cache holds the factors."""

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from collab_attn.kinds.rotary_tpa.rotary_tpa_attention import TensorProductAttention
from collab_attn.nn import cache_numbers_per_token

HEADS, HEAD_DIM, D = 3, 6, 10


def rotary(positions: torch.Tensor):
    config = transformers.LlamaConfig(hidden_size=HEADS * HEAD_DIM, num_attention_heads=HEADS,
                                      max_position_embeddings=64)
    x = torch.zeros(1, dtype=torch.float64)
    return LlamaRotaryEmbedding(config)(x, positions)


def module(query_rank=2, **kwargs):
    torch.manual_seed(0)
    return TensorProductAttention(D, HEADS, 2, value_rank=3, query_rank=query_rank, head_dim=HEAD_DIM,
                                  **kwargs).double().eval()


def heads_of(a_proj, b_proj, x, rank):
    """(B, H, T, d_h) from the factor projections, written out: (1 / R) sum_r a_r b_r^T."""
    a = a_proj(x).view(*x.shape[:2], rank, HEADS)
    b = b_proj(x).view(*x.shape[:2], rank, HEAD_DIM)
    return sum(a[:, :, r, :, None] * b[:, :, r, None, :] for r in range(rank)).transpose(1, 2) / rank


@pytest.mark.parametrize("query_rank", [2, None])
def test_the_factors_make_the_heads_that_attend_as_multi_head_attention_with_rope(query_rank):
    layer = module(query_rank)
    x = torch.randn(2, 7, D, dtype=torch.float64)
    cos, sin = rotary(torch.arange(7)[None].expand(2, -1))
    out, weights = layer(x, is_causal=True, need_weights=True, position_embeddings=(cos, sin))
    if query_rank is None:
        q = layer.query(x).view(2, 7, HEADS, HEAD_DIM).transpose(1, 2)
    else:
        q = heads_of(layer.query_heads, layer.query_dims, x, 2)
    k = heads_of(layer.key_heads, layer.key_dims, x, 2)
    v = heads_of(layer.value_heads, layer.value_dims, x, 3)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out, layer.output(expected.transpose(1, 2).flatten(2)))
    logits = (q @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
    mask = torch.ones(7, 7, dtype=torch.bool).tril()
    torch.testing.assert_close(weights, logits.masked_fill(~mask, float("-inf")).softmax(-1))


def test_only_relative_positions_matter():
    layer = module()
    x = torch.randn(1, 6, D, dtype=torch.float64)
    at_zero = layer(x, is_causal=True, position_embeddings=rotary(torch.arange(6)[None]))[0]
    shifted = layer(x, is_causal=True, position_embeddings=rotary(torch.arange(6)[None] + 11))[0]
    torch.testing.assert_close(at_zero, shifted)
    unrotated = layer(x, is_causal=True, position_embeddings=(torch.ones(1, 6, HEAD_DIM, dtype=torch.float64),
                                                             torch.zeros(1, 6, HEAD_DIM, dtype=torch.float64)))[0]
    assert (at_zero - unrotated).abs().max() > 1e-3  # the positions do act


def test_the_cache_holds_the_factors_and_decoding_from_it_equals_recomputation():
    layer = module()
    x = torch.randn(2, 8, D, dtype=torch.float64)
    stored = {}

    def cache(keys, values):
        for name, new in (("keys", keys), ("values", values)):
            stored[name] = new if name not in stored else torch.cat([stored[name], new], dim=2)
        return stored["keys"], stored["values"]

    full = layer(x, is_causal=True, position_embeddings=rotary(torch.arange(8)[None]))[0]
    steps = [layer(x[:, :5], is_causal=True, kv_cache=cache, position_embeddings=rotary(torch.arange(5)[None]))[0]]
    for t in range(5, 8):
        steps.append(layer(x[:, t:t + 1], kv_cache=cache, position_embeddings=rotary(torch.tensor([[t]])))[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full)
    assert stored["keys"].shape == (2, 1, 8, 2 * (HEADS + HEAD_DIM))
    assert stored["values"].shape == (2, 1, 8, 3 * (HEADS + HEAD_DIM))
    assert cache_numbers_per_token(layer) == layer.cache_width() == (2 + 3) * (HEADS + HEAD_DIM)


@pytest.mark.parametrize("query_rank", [2, None])
def test_a_decoding_step_scores_against_the_factors_as_the_expanded_heads_do(query_rank):
    layer = module(query_rank)
    x = torch.randn(2, 6, D, dtype=torch.float64)
    cos, sin = rotary(torch.arange(6)[None].expand(2, -1))
    stored = []

    def cache(keys, values):
        stored.append((keys, values))
        return tuple(torch.cat(parts, dim=2) for parts in zip(*stored))

    layer(x[:, :5], is_causal=True, kv_cache=cache, position_embeddings=(cos[:, :5], sin[:, :5]))
    padding = torch.ones(2, 6)
    padding[0, 1] = 0  # batch row 0 does not see position 1
    out, weights = layer(x[:, 5:], attention_mask=padding, kv_cache=cache, need_weights=True,
                         position_embeddings=(cos[:, 5:], sin[:, 5:]))
    if query_rank is None:
        q = layer.query(x).view(2, 6, HEADS, HEAD_DIM).transpose(1, 2)
    else:
        q = heads_of(layer.query_heads, layer.query_dims, x, 2)
    q, k = apply_rotary_pos_emb(q, heads_of(layer.key_heads, layer.key_dims, x, 2), cos, sin)
    v = heads_of(layer.value_heads, layer.value_dims, x, 3)
    logits = (q[:, :, 5:] @ k.transpose(-1, -2)) / HEAD_DIM ** 0.5
    expected = logits.masked_fill(padding[:, None, None] == 0, float("-inf")).softmax(-1)
    torch.testing.assert_close(weights, expected)
    assert weights[0, :, 0, 1].abs().max() < 1e-12 and weights[1, :, 0, 1].min() > 0
    torch.testing.assert_close(out, layer.output((expected @ v).transpose(1, 2).flatten(2)))


def test_parameters_and_refusals():
    layer = module(query_rank=None)
    assert not hasattr(layer, "value") and not hasattr(layer, "query_heads")
    assert layer.query_key_params() == D * HEADS * HEAD_DIM + 2 * D * (HEADS + HEAD_DIM)
    with pytest.raises(ValueError, match="key_rank must be a positive integer, got 0"):
        TensorProductAttention(D, HEADS, 0, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="query_rank must be a positive integer or None, got 1.5"):
        TensorProductAttention(D, HEADS, 1, query_rank=1.5, head_dim=HEAD_DIM)
    with pytest.raises(ValueError, match="head_dim \\(5\\) must be even"):
        TensorProductAttention(D, HEADS, 1, head_dim=5)
    with pytest.raises(ValueError, match="needs position_embeddings"):
        module()(torch.randn(1, 3, D, dtype=torch.float64))
    with pytest.raises(ValueError, match="position_embeddings must be"):
        module()(torch.randn(1, 3, D, dtype=torch.float64), position_embeddings=rotary(torch.arange(4)[None]))
