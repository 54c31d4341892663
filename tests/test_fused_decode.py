"""Collaborative heads with shared values (``value_rank``) at inference run as multi-query attention through the fused
kernel (``collab_attn.nn.attention.grouped_attend``; issue 55): the same outputs as the explicit path (1e-5 in
float32) for CP and Tucker mixing, every kind of mask and unequal widths; a cache equals recomputation; a static
cache under ``torch.compile(fullgraph=True)`` decodes as eager without recompiling; attention maps, asked for, come
from the explicit path; training keeps the explicit path. A spy on ``grouped_attend`` says which path ran. The CPU
decoding kernels are switched off here (``cpu_kernels``; they take the decoding steps on the CPU where they build, and
``tests/test_cpu_kernels.py`` tests them): this is the path of a GPU, and of a CPU without them."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import causal_pass_and_cached_steps, growing_cache, with_cache
from test_common_model import HEAD_DIM, HEADS, config_of, token_ids
from test_static_cache import assert_compiled_static_decoding_equals_eager
from transformers import DynamicCache, GPT2LMHeadModel, StaticCache

from collab_attn import reparametrize
from collab_attn.kinds.collaborative import collaborative_attention
from collab_attn.kinds.collaborative.collaborative_attention import CollaborativeAttention
from collab_attn.nn import attention, cpu_kernels

pytestmark = pytest.mark.usefixtures("one_thread", "without_cpu_kernels")
D = HEADS * HEAD_DIM


@pytest.fixture
def without_cpu_kernels(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "_loaded", {"ok": False})


@pytest.fixture
def fused_calls(monkeypatch):
    """How many times the fused path ran (calls of ``grouped_attend`` from the collaborative layer)."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return grouped_attend(*args, **kwargs)

    grouped_attend = collaborative_attention.grouped_attend
    monkeypatch.setattr(collaborative_attention, "grouped_attend", spy)
    return calls


def layer(rank: int, value_rank: int, tucker: int | None = None, seed: int = 0) -> CollaborativeAttention:
    torch.manual_seed(seed)
    module = CollaborativeAttention(96, 6, rank, value_rank=value_rank, tucker_core_size=tucker,
                                    mixing_init="random").eval()
    with torch.no_grad():  # a content bias and value mixing far from their initial values
        module.content_bias.weight.normal_()
        module.value_mixing.normal_()
    return module


def masks(batch: int, length: int) -> dict[str, dict]:
    padding = torch.ones(batch, length, dtype=torch.long)
    padding[0, :3] = 0
    allowed = torch.rand(batch, 1, length, length, generator=torch.Generator().manual_seed(1)) > 0.3
    allowed[..., 0] = True
    return {"none": {}, "causal": {"is_causal": True}, "padding": {"attention_mask": padding},
            "padding and causal": {"attention_mask": padding, "is_causal": True},
            "4-D boolean": {"attention_mask": allowed}}


@pytest.mark.parametrize("tucker", [None, 3], ids=["cp", "tucker"])
@pytest.mark.parametrize("rank, value_rank", [(48, 48), (40, 48)])
@pytest.mark.parametrize("mask", list(masks(3, 9)))
def test_the_fused_path_gives_the_explicit_paths_outputs(tucker, rank, value_rank, mask, fused_calls):
    module, x = layer(rank, value_rank, tucker), torch.randn(3, 9, 96)
    inputs = masks(3, 9)[mask]
    with torch.no_grad():
        fused, none = module(x, **inputs)
        assert len(fused_calls) == 1 and none is None
        explicit, weights = module(x, need_weights=True, **inputs)  # weights asked for: the explicit path
    assert len(fused_calls) == 1 and weights.shape == (3, 6, 9, 9)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


def test_shared_keys_wider_than_the_values_stay_explicit(fused_calls):
    """The fused kernels want the keys no wider than the values (the CPU pads narrower ones): wider ones stay on the
    explicit path, except in a causal prompt (below), which pads both to one width."""
    padding = torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad():
        layer(48, 40)(torch.randn(2, 5, 96), attention_mask=padding, is_causal=True)
    assert fused_calls == []


@pytest.fixture
def sdpa_calls(monkeypatch):
    """The keyword arguments and the query shape of every ``scaled_dot_product_attention`` call."""
    calls, sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append({"query": tuple(query.shape), **kwargs})
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("tucker", [None, 3], ids=["cp", "tucker"])
@pytest.mark.parametrize("rank, value_rank", [(48, 48), (40, 48), (48, 40), (13, 11)])
def test_a_causal_prompt_gives_the_causal_mask_to_the_kernel(tucker, rank, value_rank, fused_calls, sdpa_calls):
    """A causal prompt (issue 67, item 3): no (T, S) mask is handed to the kernel, which is told the pass is causal
    and so skips the keys a block of rows cannot see; the content logits ride in the product (one column per
    head), the widths are padded to one multiple of 8. The outputs are the explicit path's."""
    module, x = layer(rank, value_rank, tucker), torch.randn(3, 9, 96)
    with torch.no_grad():
        fused, _ = module(x, is_causal=True)
        explicit, _ = module(x, is_causal=True, need_weights=True)
    assert len(fused_calls) == 1 and len(sdpa_calls) == 1
    call = sdpa_calls[0]
    assert call["is_causal"] is True and call.get("attn_mask") is None
    assert call["query"] == (3, 6, 9, -(-max(rank + 6, value_rank) // 8) * 8)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("bias", ["none", "per key"])
def test_grouped_attention_told_it_is_causal_equals_the_causal_mask(groups, bias):
    """``grouped_attend(causal=True)`` against the same call with the causal mask in the bias, with and without
    weights, for one and two key/value heads and unequal widths."""
    torch.manual_seed(0)
    queries, keys, values = torch.randn(2, 4, 7, 5), torch.randn(2, groups, 7, 5), torch.randn(2, groups, 7, 3)
    per_key = None if bias == "none" else torch.randn(2, 4, 1, 7)
    causal = attention.additive_mask(None, True, 7, 7, torch.float32, torch.device("cpu"))
    masked = causal if per_key is None else per_key + causal
    expected, weights = attention.grouped_attend(queries, keys, values, masked, 0.4, 0.0, True)
    told, none = attention.grouped_attend(queries, keys, values, per_key, 0.4, 0.0, False, causal=True)
    told_weights = attention.grouped_attend(queries, keys, values, per_key, 0.4, 0.0, True, causal=True)[1]
    assert none is None
    torch.testing.assert_close(told, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(told_weights, weights)
    with pytest.raises(ValueError, match="no cached positions"):
        attention.grouped_attend(queries, keys[:, :, :6], values[:, :, :6], None, 0.4, 0.0, False, causal=True)


def test_a_prompt_after_cached_positions_or_with_padding_keeps_the_mask(sdpa_calls):
    """Only a prompt into an empty cache with no other mask is causal from its first row: a chunk after cached
    positions and a padded prompt hand the mask to the kernel, as before."""
    module, x = layer(48, 48), torch.randn(2, 8, 96)
    padding = torch.ones(2, 8, dtype=torch.long)
    padding[0, :2] = 0
    with torch.no_grad():
        whole = module(x, is_causal=True)[0]
        module(x, attention_mask=padding, is_causal=True)
        cache = growing_cache()
        chunks = torch.cat([module(x[:, :5], is_causal=True, kv_cache=cache)[0],
                            module(x[:, 5:], is_causal=True, kv_cache=cache)[0]], dim=1)
    assert [call.get("is_causal", False) for call in sdpa_calls] == [True, False, True, False]
    torch.testing.assert_close(chunks, whole, atol=1e-5, rtol=1e-5)


def test_training_keeps_the_explicit_path_and_its_gradients(fused_calls):
    module = layer(48, 48).train()
    x = torch.randn(2, 5, 96)
    out, _ = module(x, is_causal=True)
    out.square().sum().backward()
    assert fused_calls == []
    assert module.content_bias.weight.grad.abs().sum() > 0 and module.value_mixing.grad.abs().sum() > 0
    with torch.no_grad():  # the same layer in eval mode: the fused path, the same outputs
        torch.testing.assert_close(module.eval()(x, is_causal=True)[0], out.detach(), atol=1e-5, rtol=1e-5)
    assert len(fused_calls) == 1


def test_a_cache_fed_step_by_step_equals_recomputation(fused_calls):
    """The layer's own ``kv_cache`` hook: the prompt, then one token at a time, as one causal pass."""
    module, x = layer(48, 48, tucker=3), torch.randn(2, 8, 96)
    whole, stepwise = causal_pass_and_cached_steps(module, x, prompt=5)
    assert len(fused_calls) == 5
    torch.testing.assert_close(stepwise, whole, atol=1e-5, rtol=1e-5)


def gpt2_with_shared_values(method: str = "cp") -> GPT2LMHeadModel:
    """The tests' small GPT-2 (4 heads of 12), keys and values at rank 24 (a quarter-sized cache with the content
    logits)."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config_of("gpt2")).eval()
    reparametrize(model, D // 2, method, value_rank=D // 2, progress=False, n_iter_max=5)
    return model.eval()


@pytest.mark.parametrize("method", ["cp", "tucker"])
def test_a_converted_gpt2_decodes_through_the_fused_path_as_it_recomputes(method, fused_calls):
    model = gpt2_with_shared_values(method)
    ids = token_ids(length=9)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        calls = len(fused_calls)
        cache = DynamicCache()
        steps = [model(ids[:, :5], use_cache=True, **with_cache(model, cache)).logits]
        steps += [model(ids[:, t:t + 1], use_cache=True, **with_cache(model, cache)).logits for t in range(5, 9)]
    assert calls == 2 and len(fused_calls) == 2 + 2 * 5  # two layers, every call
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
    static = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        steps = [model(ids[:, :5], use_cache=True, **with_cache(model, static)).logits]
        steps += [model(ids[:, t:t + 1], use_cache=True, **with_cache(model, static)).logits for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def test_attention_maps_come_from_the_explicit_path_with_the_same_outputs(fused_calls):
    model = gpt2_with_shared_values()
    ids = token_ids(length=6)
    with torch.no_grad():
        fused = model(ids).logits
        calls = len(fused_calls)
        mapped = model(ids, output_attentions=True)
    assert calls == 2 and len(fused_calls) == 2
    assert len(mapped.attentions) == 2 and mapped.attentions[0].shape == (2, HEADS, 6, 6)
    torch.testing.assert_close(mapped.attentions[0].sum(-1), torch.ones(2, HEADS, 6))
    torch.testing.assert_close(mapped.logits, fused, atol=1e-5, rtol=1e-5)


def test_compiled_static_decoding_through_the_fused_path_equals_eager_without_recompiling():
    model = copy.deepcopy(gpt2_with_shared_values())
    model.set_attn_implementation("sdpa")
    assert_compiled_static_decoding_equals_eager(model)


def test_a_mask_that_is_exactly_causal_counts_as_a_causal_prompt():
    """transformers' eager attention hands the layers the causal mask where sdpa hands them none: on the CPU both are
    a causal prompt, and a mask that blocks anything else (padding), or a chunk after cached positions, is not."""
    below = torch.ones(5, 5, dtype=torch.bool).tril()
    blocked = torch.finfo(torch.float32).min
    as_floats = torch.zeros(5, 5).masked_fill(~below, blocked)
    padded = below.clone()
    padded[:, 0] = False
    assert attention.causal_prompt(None, True, 5, 5) and not attention.causal_prompt(None, False, 5, 5)
    assert attention.causal_prompt(below[None, None].expand(2, 1, 5, 5), False, 5, 5)
    assert attention.causal_prompt(as_floats[None], False, 5, 5)
    assert not attention.causal_prompt(padded[None, None], False, 5, 5)
    assert not attention.causal_prompt(as_floats.masked_fill(~below, -1.0)[None], False, 5, 5)
    assert not attention.causal_prompt(None, True, 3, 5) and not attention.causal_prompt(None, True, 1, 1)


def test_the_causal_mask_check_reads_a_mask_once_and_again_when_it_changes(monkeypatch):
    """Every layer gets the model's one mask: it is read once, and read again once it is changed in place or is
    another tensor; an inference-mode mask (no version counter) is read every time."""
    from collab_attn.nn import attention

    reads = []
    read = attention._reads_causal
    monkeypatch.setattr(attention, "_reads_causal", lambda *args: reads.append(1) or read(*args))
    mask = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    assert all(attention.causal_prompt(mask, False, 6, 6) for _ in range(4)) and len(reads) == 1
    mask[..., 0, 1] = True  # no longer causal
    assert not attention.causal_prompt(mask, False, 6, 6) and len(reads) == 2
    assert attention.causal_prompt(mask.clone().tril_(), False, 6, 6) and len(reads) == 3
    with torch.inference_mode():
        frozen = torch.ones(6, 6, dtype=torch.bool).tril()[None, None]
    assert attention.causal_prompt(frozen, False, 6, 6) and attention.causal_prompt(frozen, False, 6, 6)
    assert len(reads) == 5


def test_a_causal_prompt_with_shared_values_never_builds_the_mask(monkeypatch):
    from collab_attn.nn import attention

    torch.manual_seed(0)
    layer = CollaborativeAttention(16, 4, 8, value_rank=6, mixing_init="random").eval()
    x = torch.randn(2, 9, 16)
    with torch.no_grad():
        expected = layer(x, is_causal=True, need_weights=True)[0]  # weights asked for: the explicit path
        built = []
        monkeypatch.setattr(attention, "additive_mask", lambda *a, **k: built.append(a) or None)
        out = layer(x, is_causal=True)[0]
    assert not built
    torch.testing.assert_close(out, expected)
