"""RotaryCollaborativeAttention (collab_attn.nn.rotary): rotary-exact collaborative keys as a plain torch module.

The reference is a Llama-style grouped attention written out here with transformers' formulas (``rotate_half``,
default rope ``theta^(-2i/d)``), so that importing transformers' modeling code (slow) is not needed."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from collab_attn.nn import RotaryCollaborativeAttention, cache_numbers_per_token
from collab_attn.nn.rotary import rotate_pairs

D, H, G, DH = 12, 4, 2, 8  # d_model, heads, key/value heads, head_dim
HALF = DH // 2
DTYPE = torch.float64


def rope(positions: torch.Tensor, dim: int = DH, theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' default rotary embedding: (cos, sin), each (batch, seq, dim), band i at i and i + dim/2."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=DTYPE) / dim)
    freqs = positions[..., None].to(DTYPE) * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def source_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=DTYPE) * 0.5

    return {
        "wq": rand(H * DH, D), "bq": rand(H * DH), "wk": rand(G * DH, D), "bk": rand(G * DH),
        "wv": rand(G * DH, D), "bv": rand(G * DH), "wo": rand(D, H * DH), "bo": rand(D),
    }


def reference(w, x, cos, sin, keep=None):
    """Llama/Qwen2-style causal grouped attention with RoPE; ``keep`` (B, S) is a padding mask (1 = attend)."""
    batch, seq, _ = x.shape
    q = (x @ w["wq"].T + w["bq"]).view(batch, seq, H, DH).transpose(1, 2)
    k = (x @ w["wk"].T + w["bk"]).view(batch, seq, G, DH).transpose(1, 2)
    v = (x @ w["wv"].T + w["bv"]).view(batch, seq, G, DH).transpose(1, 2)
    cos, sin = cos[:, None], sin[:, None]
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    k, v = k.repeat_interleave(H // G, dim=1), v.repeat_interleave(H // G, dim=1)
    logits = q @ k.transpose(-1, -2) / math.sqrt(DH)
    blocked = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    if keep is not None:
        blocked = blocked | ~keep.bool()[:, None, None, :]
    logits = logits.masked_fill(blocked, torch.finfo(DTYPE).min)
    context = (logits.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, H * DH)
    return context @ w["wo"].T + w["bo"]


def exact_module(w) -> RotaryCollaborativeAttention:
    """The source's own layout by hand: R = H * DH/2 pairs, pair (h, i) of band i, mixing 1 + 0j on its own head."""
    pairs = H * HALF
    module = RotaryCollaborativeAttention(D, H, pairs, kv_heads=G, head_dim=DH, mixing_init="random").to(DTYPE)
    query_rows, key_rows, bands = [], [], []
    for h in range(H):
        g = h // (H // G)
        for i in range(HALF):
            query_rows.append((h * DH + i, h * DH + i + HALF))
            key_rows.append((g * DH + i, g * DH + i + HALF))
            bands.append(i)
    real_q, imag_q = zip(*query_rows)
    real_k, imag_k = zip(*key_rows)
    q_rows, k_rows = list(real_q + imag_q), list(real_k + imag_k)
    with torch.no_grad():
        module.query.weight.copy_(w["wq"][q_rows])
        module.query.bias.copy_(w["bq"][q_rows])
        module.key.weight.copy_(w["wk"][k_rows])
        module.key.bias.copy_(w["bk"][k_rows])
        module.pair_bands.copy_(torch.tensor(bands))
        module.mixing.zero_()
        for h in range(H):
            module.mixing[h, h * HALF:(h + 1) * HALF] = 1.0
        module.value.weight.copy_(w["wv"])
        module.value.bias.copy_(w["bv"])
        module.output.weight.copy_(w["wo"])
        module.output.bias.copy_(w["bo"])
    return module.eval()


@pytest.fixture(scope="module")
def exact():
    w = source_weights()
    return w, exact_module(w)


def inputs(batch=2, seq=7, seed=1):
    return torch.randn(batch, seq, D, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


@pytest.mark.parametrize("offset", [0, 1000])
def test_exact_layout_equals_llama_attention(exact, offset):
    w, module = exact
    x = inputs()
    cos, sin = rope(torch.arange(offset, offset + x.shape[1]).expand(x.shape[0], -1))
    expected = reference(w, x, cos, sin)
    out, weights = module(x, is_causal=True, position_embeddings=(cos, sin))
    assert weights is None
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-10)
    out_w, _ = module(x, is_causal=True, need_weights=True, position_embeddings=(cos, sin))
    torch.testing.assert_close(out_w, expected, rtol=0, atol=1e-10)


def test_exact_layout_with_padding_mask(exact):
    w, module = exact
    x = inputs()
    keep = torch.ones(2, x.shape[1], dtype=torch.long)
    keep[1, :3] = 0  # left padding of the second sequence
    positions = (keep.cumsum(-1) - 1).clamp(min=0) + 1000
    cos, sin = rope(positions)
    expected = reference(w, x, cos, sin, keep)
    for mask in (keep, keep.bool()[:, None, None, :].expand(-1, 1, x.shape[1], -1)):
        out, _ = module(x, attention_mask=mask, is_causal=True, position_embeddings=(cos, sin))
        real = keep.bool()  # padded query rows attend to nothing: compare the real ones
        torch.testing.assert_close(out[real], expected[real], rtol=0, atol=1e-10)


def test_rotation_convention():
    """rotate_pairs is transformers' ``z cos + rotate_half(z) sin`` on the [re ; im] layout, and a complex product."""
    z, angle = torch.randn(3, 10, dtype=DTYPE), torch.randn(3, 5, dtype=DTYPE)
    cos, sin = angle.cos(), angle.sin()
    rotated = rotate_pairs(z, cos, sin)
    torch.testing.assert_close(rotated, z * torch.cat([cos, cos], -1) + rotate_half(z) * torch.cat([sin, sin], -1))
    as_complex = torch.complex(*z.chunk(2, -1)) * torch.polar(torch.ones_like(angle), angle)
    torch.testing.assert_close(rotated, torch.cat([as_complex.real, as_complex.imag], -1))


def random_module(value_rank=None, pairs=6, seed=0, dropout=0.0) -> RotaryCollaborativeAttention:
    torch.manual_seed(seed)
    module = RotaryCollaborativeAttention(
        D, H, pairs, kv_heads=G, head_dim=DH, bias=True, output_bias=False, mixing_init="random", value_rank=value_rank,
        pair_bands=torch.randint(0, HALF, (pairs,)), dropout=dropout,
    )
    return module.to(DTYPE).eval()


def complex_weights(module, x, cos, sin):
    """Head h's weights computed with complex numbers: Re(sum_r q_r m_hr e^(j p theta) conj(k_r e^(j s theta)))."""
    bands = module.pair_bands
    angle_cos, angle_sin = cos[..., bands], sin[..., bands]
    phase = torch.complex(angle_cos, angle_sin)  # (B, S, R)
    q = torch.complex(*module.query(x).chunk(2, -1)) * phase
    k = torch.complex(*module.key(x).chunk(2, -1)) * phase
    m = torch.complex(*module.mixing.chunk(2, -1))  # (H, R)
    logits = torch.einsum("btr,hr,bsr->bhts", q, m, k.conj()).real * module.scale
    causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
    return logits.masked_fill(causal, torch.finfo(DTYPE).min).softmax(-1)


@pytest.mark.parametrize("value_rank", [None, 5])
def test_need_weights_match_complex_softmax(value_rank):
    module = random_module(value_rank)
    x = inputs()
    cos, sin = rope(torch.arange(3, 3 + x.shape[1]).expand(2, -1))
    out, weights = module(x, is_causal=True, need_weights=True, position_embeddings=(cos, sin))
    plain, none = module(x, is_causal=True, position_embeddings=(cos, sin))
    assert none is None and weights.shape == (2, H, x.shape[1], x.shape[1])
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, H, x.shape[1], dtype=DTYPE), rtol=0, atol=1e-12)
    expected = complex_weights(module, x, cos, sin)
    torch.testing.assert_close(weights, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-12)
    values = module.value(x)
    if value_rank is None:  # head h reads value group h // (H / G)
        values = values.view(2, -1, G, DH).transpose(1, 2).repeat_interleave(H // G, dim=1)
        context = (expected @ values).transpose(1, 2).flatten(2)
    else:  # sum_h P_h V diag(n_h)
        context = torch.einsum("bhts,bsv,hv->btv", expected, values, module.value_mixing)
    torch.testing.assert_close(out, module.output(context), rtol=0, atol=1e-12)


def list_cache():
    store = {}

    def hook(keys, values):
        if store:
            keys, values = torch.cat([store["k"], keys], dim=2), torch.cat([store["v"], values], dim=2)
        store["k"], store["v"] = keys, values
        return keys, values

    return hook, store


@pytest.mark.parametrize("value_rank", [None, 5])
def test_cache_equals_recomputation(value_rank):
    module = random_module(value_rank)
    x = inputs(seq=8)
    cos, sin = rope(torch.arange(10, 18).expand(2, -1))
    full, _ = module(x, is_causal=True, position_embeddings=(cos, sin))
    hook, store = list_cache()
    steps = [module(x[:, :5], is_causal=True, kv_cache=hook, position_embeddings=(cos[:, :5], sin[:, :5]))[0]]
    for t in range(5, 8):
        step = (cos[:, t:t + 1], sin[:, t:t + 1])
        steps.append(module(x[:, t:t + 1], is_causal=True, kv_cache=hook, position_embeddings=step)[0])
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=0, atol=1e-10)
    values_width = G * DH if value_rank is None else value_rank
    assert store["k"].shape == (2, 1, 8, module.rank)
    assert store["v"].shape == ((2, G, 8, DH) if value_rank is None else (2, 1, 8, value_rank))
    # the cache holds the rotated keys, as transformers caches them
    rotated = rotate_pairs(module.key(x), *(e[..., module.pair_bands] for e in (cos, sin)))
    torch.testing.assert_close(store["k"][:, 0], rotated, rtol=0, atol=1e-12)
    assert cache_numbers_per_token(module) == module.cache_width() == module.rank + values_width


@pytest.mark.parametrize("value_rank", [None, 5])
def test_gradients_reach_every_part(value_rank):
    module = random_module(value_rank).train()
    x = inputs()
    cos, sin = rope(torch.arange(x.shape[1]).expand(2, -1))
    out, _ = module(x, is_causal=True, position_embeddings=(cos, sin))
    out.square().sum().backward()
    names = ["query.weight", "query.bias", "key.weight", "key.bias", "mixing", "value.weight", "output.weight"]
    if value_rank is not None:
        names.append("value_mixing")
    params = dict(module.named_parameters())
    for name in names:
        assert params[name].grad is not None and params[name].grad.abs().sum() > 0, name
    assert "pair_bands" not in params


def test_layout_and_counts():
    module = RotaryCollaborativeAttention(
        D, H, 6, kv_heads=G, head_dim=DH, bias=True, output_bias=False, mixing_init="ones"
    )
    shapes = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    assert shapes == {
        "value.weight": (G * DH, D), "value.bias": (G * DH,), "output.weight": (D, H * DH),
        "query.weight": (12, D), "query.bias": (12,), "key.weight": (12, D), "key.bias": (12,),
        "mixing": (H, 12), "pair_bands": (6,),
    }
    assert module.pair_bands.dtype == torch.int64 and module.pair_bands.tolist() == [0, 1, 2, 3, 0, 1]
    assert module.mixing[:, :6].eq(1).all() and module.mixing[:, 6:].eq(0).all()
    counts = module.parameter_counts()
    assert counts["mixing"] == H * 12 and counts["total"] == sum(p.numel() for p in module.parameters())
    assert module.query_key_params() == counts["query"] + counts["key"] + counts["mixing"]
    shared = RotaryCollaborativeAttention(D, H, 8, head_dim=DH, value_rank=5, bias=False)
    assert {n: tuple(t.shape) for n, t in shared.state_dict().items()} == {
        "value.weight": (5, D), "output.weight": (D, 5), "query.weight": (16, D), "key.weight": (16, D),
        "mixing": (H, 16), "pair_bands": (8,), "value_mixing": (H, 5),
    }
    concatenated = RotaryCollaborativeAttention(D, H, 8, head_dim=DH)
    assert concatenated.mixing[:, :8].equal(torch.eye(H).repeat_interleave(2, dim=1))


def test_keys_from_other_states_at_their_own_positions():
    """key_value_states with key_position_embeddings: the keys rotate at their own positions."""
    module = random_module()
    x, y = inputs(seq=3), inputs(seq=5, seed=2)
    q_pos, k_pos = rope(torch.arange(5, 8)[None]), rope(torch.arange(5)[None])
    out, weights = module(x, y, need_weights=True, position_embeddings=q_pos, key_position_embeddings=k_pos)
    assert weights.shape == (2, H, 3, 5)
    # the same as self-attention over [y ; x] at positions 0..7, the last three queries looking at the first five keys
    both = torch.cat([y, x], dim=1)
    keep = torch.zeros(8, 8, dtype=torch.bool)
    keep[:, :5] = True
    full, full_weights = module(both, attention_mask=keep[None].expand(2, -1, -1), need_weights=True,
                                position_embeddings=rope(torch.arange(8)[None]))
    torch.testing.assert_close(out, full[:, 5:], rtol=0, atol=1e-12)
    torch.testing.assert_close(weights, full_weights[:, :, 5:, :5], rtol=0, atol=1e-12)


def test_clear_errors():
    module = random_module()
    x = inputs()
    with pytest.raises(ValueError, match="needs position_embeddings"):
        module(x)
    with pytest.raises(ValueError, match="last size head_dim"):
        module(x, position_embeddings=rope(torch.arange(7)[None], dim=6))
    with pytest.raises(ValueError, match="cover 6 positions"):
        module(x, position_embeddings=rope(torch.arange(6)[None]))
    for bad in (HALF, -1):
        state = module.state_dict()
        state["pair_bands"] = torch.full((6,), bad)
        with pytest.raises(ValueError, match=r"pair_bands must lie in 0 \.\. 3"):
            module.load_state_dict(state)
    state["pair_bands"] = torch.zeros(6)
    with pytest.raises(ValueError, match="integers"):
        module.load_state_dict(state)
    with pytest.raises(ValueError, match="pair_bands must lie"):
        RotaryCollaborativeAttention(D, H, 4, head_dim=DH, pair_bands=[0, 1, 2, 4])
    with pytest.raises(ValueError, match="head_dim .* must be even"):
        RotaryCollaborativeAttention(D, H, 4, head_dim=7)
    with pytest.raises(ValueError, match="kv_heads"):
        RotaryCollaborativeAttention(D, H, 4, head_dim=DH, kv_heads=3)
    with pytest.raises(ValueError, match="equal blocks"):
        RotaryCollaborativeAttention(D, H, 6, head_dim=DH)
    # a buffer written after loading (e.g. by a loader that bypasses load_state_dict) is caught at the next call
    with torch.no_grad():
        module.pair_bands.fill_(HALF)
    with pytest.raises(ValueError, match="pair_bands must lie"):
        module(x, position_embeddings=rope(torch.arange(7)[None]))


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_decode_step_has_no_graph_breaks(backend):
    """A decoding step over a preallocated fixed-size cache (written with index_copy_) compiles whole
    (``fullgraph=True``) and, with the shapes fixed, once for every step. ``aot_eager`` checks the graph in a few
    seconds; the inductor run (C++ code generation, about 30 s on a loaded CPU) is marked slow."""
    if backend == "inductor":
        try:
            importlib.import_module("torch._inductor")
        except Exception as err:  # pragma: no cover - depends on the installation
            pytest.skip(f"torch inductor is unavailable: {err}")
    torch._dynamo.reset()
    module = random_module(pairs=4).float()
    batch, max_len = 1, 8
    keys = torch.zeros(batch, 1, max_len, module.rank)
    values = torch.zeros(batch, G, max_len, DH)
    x = torch.randn(batch, max_len, D)
    cos, sin = (e.float() for e in rope(torch.arange(max_len).expand(batch, -1)))

    def step(token, position, keep):
        def hook(new_keys, new_values):
            keys.index_copy_(2, position, new_keys)
            values.index_copy_(2, position, new_values)
            return keys, values

        embeddings = (cos.index_select(1, position), sin.index_select(1, position))
        return module(token, attention_mask=keep, kv_cache=hook, position_embeddings=embeddings)[0]

    compiled = torch.compile(step, fullgraph=True, dynamic=False, backend=backend)
    eager_hook, _ = list_cache()
    outputs, expected = [], []
    with torch.no_grad(), torch._dynamo.config.patch(error_on_recompile=True):
        for t in range(3):
            keep = (torch.arange(max_len) <= t)[None].expand(batch, -1)
            outputs.append(compiled(x[:, t:t + 1], torch.tensor([t]), keep))
            embeddings = (cos[:, t:t + 1], sin[:, t:t + 1])
            expected.append(module(x[:, t:t + 1], kv_cache=eager_hook, position_embeddings=embeddings)[0])
    torch.testing.assert_close(torch.cat(outputs, 1), torch.cat(expected, 1), rtol=1e-5, atol=1e-5)
