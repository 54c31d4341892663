"""Static caches for converted decoders: preallocated shared keys (collaborative heads), narrow keys (SVD-truncated
heads) and fewer heads (pruning), as transformers' generation tests use them: static = dynamic for every family and
method, a passed-in ``StaticCache`` equals recomputation, the buffers hold the bytes the accounting says, and a
compiled decoding step (``torch.compile(fullgraph=True)``, inductor on the CPU) equals eager without recompiling as
the sequence grows."""

from __future__ import annotations

import pytest
import torch
from conftest import with_cache
from test_common_model import DECODERS, FULL, HALF, HEAD_DIM, HEADS, METHODS, original_and_converted, token_ids
from torch._dynamo.utils import counters
from transformers import CompileConfig, StaticCache
from transformers.cache_utils import StaticSlidingWindowLayer

from collab_attn.analysis.accounting import cache_bytes_per_token
from collab_attn.kinds import ConvertedSelfAttention
from collab_attn.kinds import converted as layers
from collab_attn.kinds.converted import _static_causal_mask as static_causal_mask

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: a second thread only waits on the busy cores
D = HEADS * HEAD_DIM
STATIC_CASES = [(family, method, HALF) for family in DECODERS for method in METHODS]
STATIC_CASES += [(family, "cp", FULL) for family in DECODERS]


def generated(model, ids, new_tokens: int = 6, **settings):
    return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=0, return_dict_in_generate=True, output_logits=True, **settings)


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
@pytest.mark.parametrize("family, method, rank", STATIC_CASES)
def test_static_cache_generates_what_the_dynamic_cache_does(family, method, rank, attention):
    _, model = original_and_converted(family, method, rank)
    model.set_attn_implementation(attention)
    try:
        ids = token_ids(length=5)
        dynamic = generated(model, ids)
        static = generated(model, ids, cache_implementation="static")
    finally:
        model.set_attn_implementation("eager")
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.logits, dynamic.logits):
        assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("with_mask", [True, False])
def test_a_static_cache_passed_in_equals_recomputation(family, method, with_mask, monkeypatch):
    """The prompt in two pieces, then one token at a time, into a StaticCache longer than the text: the unwritten
    positions never count. With the model's mask (eager attention: transformers always passes one, and the layers
    build none), or without one: in sdpa mode transformers passes no mask with the prompt, and the layers build their
    own causal mask over the filled part (``_static_causal_mask``, spied on to be sure it ran); then every converted
    layer alone, given no mask at any step, decodes the same way (its own mask at every step)."""
    calls = []

    def spy(layer, new_tokens, device):
        calls.append(new_tokens)
        return static_causal_mask(layer, new_tokens, device)

    monkeypatch.setattr(layers, "_static_causal_mask", spy)
    _, model = original_and_converted(family, method, HALF)
    ids = token_ids(length=9)
    cache = StaticCache(config=model.config, max_cache_len=16)
    pieces = [(0, 4)] + [(i, i + 1) for i in range(4, 9)]
    logits = []
    model.set_attn_implementation("eager" if with_mask else "sdpa")
    try:
        with torch.no_grad():
            full = model(ids, use_cache=False).logits
            for start, end in pieces:
                mask = {"attention_mask": torch.ones(2, end, dtype=torch.long)} if with_mask else {}
                logits.append(model(ids[:, start:end], use_cache=True, **mask, **with_cache(model, cache)).logits)
    finally:
        model.set_attn_implementation("eager")
    assert cache.get_seq_length() == 9
    assert (torch.cat(logits, dim=1) - full).abs().max() < 1e-4
    converted = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    if with_mask:
        assert calls == []
        return
    # the prompt, in every layer (transformers masks the single tokens after it itself, as far as 5.24 goes)
    assert calls[: len(converted)] == [4] * len(converted) and set(calls[len(converted):]) <= {1}, calls

    calls.clear()
    hidden = torch.randn(2, 9, D, generator=torch.Generator().manual_seed(0))
    cache = StaticCache(config=model.config, max_cache_len=16)
    for layer in converted:
        assert layer.is_causal
        with torch.no_grad():
            whole, _ = layer(hidden)  # causal over the whole sequence, no cache
            steps = [layer(hidden[:, start:end], cache=cache)[0] for start, end in pieces]
        assert (torch.cat(steps, dim=1) - whole).abs().max() < 1e-5, layer.layer_idx
    assert calls == [end - start for start, end in pieces] * len(converted)


@pytest.mark.parametrize("method", METHODS)
def test_static_buffers_hold_the_bytes_the_accounting_counts(method):
    _, model = original_and_converted("gpt2", method, HALF)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        model(token_ids(length=5), use_cache=True, **with_cache(model, cache))
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    for layer, cached in zip(layers, cache.layers):
        per_token = sum(t[0, :, 0].numel() * t.element_size() for t in (cached.keys, cached.values))
        if method in ("cp", "tucker"):
            expected = cache_bytes_per_token(D, HEADS, HALF, dtype_bytes=4)["total"]
        elif method == "svd":  # each head's key narrowed to HALF / HEADS plus its content logit, full values
            expected = (HEADS * (HALF // HEADS + 1) + D) * 4
        elif method == "key-svd":  # one shared key of HALF, full values
            expected = (HALF + D) * 4
        elif method == "kv-svd":  # the latent alone
            expected = HALF * 4
        else:  # pruned: the kept heads' keys and values
            expected = cache_bytes_per_token(layer.num_heads * HEAD_DIM, layer.num_heads, dtype_bytes=4)["total"]
        assert per_token == expected
        value_heads = 1 if method == "kv-svd" else layer.num_heads
        assert cached.keys.shape[2] == cached.values.shape[2] == 16 and cached.values.shape[1] == value_heads


# one per cache layout (shared key, narrow keys, fewer heads), and Tucker, whose per-head matrices eager decoding
# builds once and keeps (collab_attn.nn.attention) while a compiled graph builds them itself
@pytest.mark.parametrize("method", ["cp", "svd", "prune", "tucker"])
def test_compiled_static_decoding_equals_eager_and_does_not_recompile(method):
    _, model = original_and_converted("gpt2", method, HALF)
    model.set_attn_implementation("sdpa")
    try:
        assert_compiled_static_decoding_equals_eager(model)
    finally:
        model.set_attn_implementation("eager")


def assert_compiled_static_decoding_equals_eager(model, backend: str = "inductor") -> None:
    """9 tokens generated with a static cache, eager and under ``torch.compile(fullgraph=True)``: one graph for the 8
    decoding steps (no recompilation), the same tokens, logits within 1e-4. ``backend="aot_eager"`` checks the graph
    (no breaks, no recompiles) in seconds, without generating C++ code."""
    ids = token_ids(length=5)
    settings = {"cache_implementation": "static", "new_tokens": 9}
    compile_config = CompileConfig(fullgraph=True, backend=backend)
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    torch._dynamo.reset()
    counters.clear()
    try:
        eager = generated(model, ids, disable_compile=True, **settings)
        with torch._dynamo.config.patch(error_on_recompile=True):  # 8 decoding steps, one graph
            compiled = generated(model, ids, compile_config=compile_config, **settings)
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        assert (a - b).abs().max() < 1e-4


def test_sliding_window_layers_are_refused_where_the_model_has_no_window():
    _, model = original_and_converted("gpt2", "cp", HALF)
    cache = StaticCache(config=model.config, max_cache_len=16)
    cache.layers[0] = StaticSlidingWindowLayer(max_cache_len=16, sliding_window=4)
    with pytest.raises(NotImplementedError, match="attends to every position.*keeps only a sliding window"):
        model(token_ids(length=3), use_cache=True, **with_cache(model, cache))
