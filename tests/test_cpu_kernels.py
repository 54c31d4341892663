"""Collaborative heads decode on the CPU through two kernels (``collab_attn.nn.cpu_kernels``; issue 55): the scores
against the shared keys, and (keys only) each head's weighted values. The kernels equal PyTorch's products on odd
sizes, strided views and two threads, and pass ``torch.library.opcheck``; a decoding step through them gives the
explicit path's outputs (keys only and shared values, CP and Tucker, content bias, padding); a converted GPT-2's
dynamic and static caches equal recomputation through them; a static cache under
``torch.compile(fullgraph=True)`` decodes as eager in one graph; prefill, attention maps and training keep the
explicit path; the switch and a failed build fall back with the reason. Skipped where the kernels cannot build (not
x86 with AVX2)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import causal_pass_and_cached_steps, with_cache
from test_common_model import HEAD_DIM, HEADS, config_of, token_ids
from test_static_cache import assert_compiled_static_decoding_equals_eager
from transformers import DynamicCache, GPT2LMHeadModel, StaticCache

from collab_attn import reparametrize
from collab_attn.kinds.collaborative.collaborative_attention import CollaborativeAttention
from collab_attn.nn import cpu_kernels

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(not cpu_kernels.available(), reason="the CPU kernels need x86 with AVX2 and FMA")]
D = HEADS * HEAD_DIM


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times a layer scored through ``cpu_kernels.shared_key_scores``."""
    calls = []

    def spy(*args):
        calls.append(args[0].shape)
        return scores(*args)

    scores = cpu_kernels.shared_key_scores
    monkeypatch.setattr(cpu_kernels, "shared_key_scores", spy)
    return calls


@pytest.mark.parametrize("width", [1, 7, 8, 13, 204])
@pytest.mark.parametrize("rows", [1, 2, 3, 12, 13])
@pytest.mark.parametrize("keys", [1, 5, 258, 1031])
def test_the_scores_equal_a_matrix_product_on_a_strided_view(width, rows, keys):
    """The keys as a cache packs them (content columns after the shared key): a view with a row stride of its own."""
    generator = torch.Generator().manual_seed(width * rows + keys)
    queries = torch.randn(2, rows, width, generator=generator)
    packed = torch.randn(2, keys, width + 5, generator=generator)
    shared = packed[..., :width]
    # against the exact products (float64), within float32's rounding bound for a sum of `width` terms: its order is
    # the kernel's (and bmm's, which differs between machines), so near-cancelling sums differ by more than 1e-5
    exact = torch.bmm(queries.double(), shared.double().transpose(1, 2))
    bound = 2 * width * torch.finfo(torch.float32).eps * torch.bmm(queries.double().abs(), shared.double().abs().mT)
    error = (cpu_kernels.shared_key_scores(queries, shared).double() - exact).abs()
    assert bool((error <= bound + 1e-7).all()), float((error - bound).max())


@pytest.mark.parametrize("width", [3, 8, 64, 72, 136])
@pytest.mark.parametrize("rows", [1, 3])
def test_the_weighted_values_equal_a_matrix_product(width, rows):
    """Values as a layer makes them without a cache: (B, S, H, D) seen as (B, H, S, D), not contiguous."""
    generator = torch.Generator().manual_seed(width + rows)
    weights = torch.rand(2, 3, rows, 301, generator=generator).softmax(-1)
    values = torch.randn(2, 301, 3, width, generator=generator).transpose(1, 2)
    expected = torch.matmul(weights, values)
    torch.testing.assert_close(cpu_kernels.weighted_values(weights, values), expected, atol=1e-5, rtol=1e-5)


def test_two_threads_give_the_same_numbers_as_one():
    generator = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(3, 12, 52, generator=generator), torch.randn(3, 2000, 52, generator=generator)
    weights, values = torch.rand(3, 12, 1, 2000, generator=generator), torch.randn(3, 12, 2000, 64, generator=generator)
    one = cpu_kernels.shared_key_scores(queries, keys), cpu_kernels.weighted_values(weights, values)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        two = cpu_kernels.shared_key_scores(queries, keys), cpu_kernels.weighted_values(weights, values)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])


def test_the_operators_pass_opcheck():
    """Schema, shape functions (fake tensors) and tracing, as ``torch.compile`` needs them."""
    torch.library.opcheck(torch.ops.collab_attn.shared_key_scores.default,
                          (torch.randn(2, 5, 13), torch.randn(2, 9, 20)[..., :13]))
    torch.library.opcheck(torch.ops.collab_attn.weighted_values.default,
                          (torch.rand(2, 3, 1, 9), torch.randn(2, 3, 9, 8)))


@pytest.mark.parametrize("bad, message", [
    ((torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 5, 4)), "queries must be a float32 CPU tensor"),
    ((torch.randn(2, 3, 4), torch.randn(2, 5, 6)), "must agree on B and W"),
    ((torch.randn(3, 4), torch.randn(2, 5, 4)), "queries must have 3 dimensions"),
])
def test_bad_inputs_say_what_is_wrong(bad, message):
    with pytest.raises(RuntimeError, match=message):
        cpu_kernels.shared_key_scores(*bad)


def layer(tucker: int | None = None, content_bias: bool = True, value_rank: int | None = None
          ) -> CollaborativeAttention:
    torch.manual_seed(0)
    module = CollaborativeAttention(96, 6, 40, tucker_core_size=tucker, mixing_init="random", bias=content_bias,
                                    value_rank=value_rank)
    with torch.no_grad():  # a content bias and value mixing far from their initial values
        if content_bias:
            module.content_bias.weight.normal_()
        if value_rank:
            module.value_mixing.normal_()
    return module.eval()


@pytest.mark.parametrize("value_rank", [None, 44], ids=["keys only", "shared values"])
@pytest.mark.parametrize("tucker", [None, 3], ids=["cp", "tucker"])
@pytest.mark.parametrize("content_bias", [True, False], ids=["content bias", "no bias"])
@pytest.mark.parametrize("padding", [False, True], ids=["no mask", "padding"])
def test_a_decoding_step_through_the_kernels_gives_the_explicit_paths_outputs(value_rank, tucker, content_bias,
                                                                               padding, kernel_calls):
    module, query, keys = layer(tucker, content_bias, value_rank), torch.randn(3, 1, 96), torch.randn(3, 11, 96)
    mask = {}
    if padding:
        mask = {"attention_mask": torch.ones(3, 11, dtype=torch.long)}
        mask["attention_mask"][0, :4] = 0
    with torch.no_grad():
        through_kernels, none = module(query, keys, **mask)
        assert len(kernel_calls) == 1 and none is None
        explicit, weights = module(query, keys, need_weights=True, **mask)  # attention maps: the explicit path
    assert len(kernel_calls) == 1 and weights.shape == (3, 6, 1, 11)
    torch.testing.assert_close(through_kernels, explicit, atol=1e-5, rtol=1e-5)


def test_prefill_training_and_other_dtypes_keep_the_explicit_path(kernel_calls):
    module = layer()
    with torch.no_grad():
        module(torch.randn(2, 5, 96), is_causal=True)  # a prompt: five query rows
        module.double()(torch.randn(2, 1, 96, dtype=torch.float64), torch.randn(2, 4, 96, dtype=torch.float64))
    module.float().train()(torch.randn(2, 1, 96), torch.randn(2, 4, 96))[0].sum().backward()
    assert kernel_calls == [] and module.mixing.grad.abs().sum() > 0


def test_dropout_in_training_mode_without_gradients_still_drops():
    """A layer in training mode under ``no_grad`` (a decoding step with dropout on) drops weights on the kernels' path
    as on the explicit one: the same outputs under the same random numbers."""
    module = layer()
    module.dropout = 0.5
    module.train()
    query, keys = torch.randn(2, 1, 96), torch.randn(2, 9, 96)
    with torch.no_grad():
        torch.manual_seed(3)
        through_kernels, _ = module(query, keys)
        torch.manual_seed(3)
        explicit, _ = module(query, keys, need_weights=True)
        undropped, _ = module.eval()(query, keys)
    torch.testing.assert_close(through_kernels, explicit, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(through_kernels, undropped, atol=1e-3)


@pytest.mark.parametrize("value_rank", [None, 44], ids=["keys only", "shared values"])
def test_a_cache_fed_step_by_step_equals_recomputation(value_rank, kernel_calls):
    module, x = layer(tucker=3, value_rank=value_rank), torch.randn(2, 8, 96)
    whole, stepwise = causal_pass_and_cached_steps(module, x, prompt=5)
    assert len(kernel_calls) == 3  # the decoding steps, not the prompt
    torch.testing.assert_close(stepwise, whole, atol=1e-5, rtol=1e-5)


def gpt2_with_shared_keys(method: str = "cp", value_rank: int | None = None) -> GPT2LMHeadModel:
    """The tests' small GPT-2 (4 heads of 12, two layers), keys at rank 24, values per head or shared."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config_of("gpt2")).eval()
    reparametrize(model, D // 2, method, value_rank=value_rank, progress=False, n_iter_max=5)
    return model.eval()


@pytest.mark.parametrize("value_rank", [None, D // 2], ids=["keys only", "shared values"])
@pytest.mark.parametrize("method", ["cp", "tucker"])
def test_a_converted_gpt2_decodes_through_the_kernels_as_it_recomputes(method, value_rank, kernel_calls):
    model = gpt2_with_shared_keys(method, value_rank)
    ids = token_ids(length=9)
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        cache = DynamicCache()
        steps = [model(ids[:, :5], use_cache=True, **with_cache(model, cache)).logits]
        steps += [model(ids[:, t:t + 1], use_cache=True, **with_cache(model, cache)).logits for t in range(5, 9)]
        assert len(kernel_calls) == 2 * 4  # two layers, every decoding step
        torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)
        static = StaticCache(config=model.config, max_cache_len=16)
        steps = [model(ids[:, :5], use_cache=True, **with_cache(model, static)).logits]
        steps += [model(ids[:, t:t + 1], use_cache=True, **with_cache(model, static)).logits for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("value_rank", [None, D // 2], ids=["keys only", "shared values"])
def test_compiled_static_decoding_through_the_kernels_equals_eager_without_recompiling(value_rank):
    model = copy.deepcopy(gpt2_with_shared_keys(value_rank=value_rank))
    model.set_attn_implementation("sdpa")
    assert_compiled_static_decoding_equals_eager(model)


def test_a_compiled_decoding_step_calls_the_operators_in_its_graph():
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    module, query, keys = layer(), torch.randn(2, 1, 96), torch.randn(2, 7, 96)
    shared = layer(value_rank=44)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled, _ = torch.compile(module, backend=recording, fullgraph=True)(query, keys)
            eager, _ = module(query, keys)
            torch.compile(shared, backend=recording, fullgraph=True)(query, keys)
    finally:
        torch._dynamo.reset()
    called = [{str(node.target) for node in graph.graph.nodes if node.op == "call_function"} for graph in graphs]
    assert {"collab_attn.shared_key_scores", "collab_attn.weighted_values"} <= called[0]
    assert "collab_attn.shared_key_scores" in called[1] and "collab_attn.weighted_values" not in called[1]
    torch.testing.assert_close(compiled, eager)


def test_the_reference_path_is_switched_at_call_time(kernel_calls):
    """``reference_path()`` (what ``benchmarks/decode.py --kernels-against-reference`` times the kernels against):
    eager steps inside it skip the kernels, and give the same outputs."""
    module, query, keys = layer(), torch.randn(2, 1, 96), torch.randn(2, 7, 96)
    with torch.no_grad():
        with cpu_kernels.reference_path():
            assert not cpu_kernels.available()
            reference, _ = module(query, keys)
        assert cpu_kernels.available() and not kernel_calls
        through, _ = module(query, keys)
    assert len(kernel_calls) == 1
    torch.testing.assert_close(through, reference, rtol=1e-5, atol=1e-5)


def test_a_step_compiled_on_one_path_is_not_reused_on_the_other():
    """The switch is a guard of a compiled step: traced outside ``reference_path()``, a step called inside it gets
    one more graph, without the operators, and the first graph serves again outside."""
    graphs = []

    def recording(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    module, query, keys = layer(), torch.randn(2, 1, 96), torch.randn(2, 7, 96)
    torch._dynamo.reset()
    try:
        step = torch.compile(module, backend=recording, fullgraph=True)
        with torch.no_grad():
            step(query, keys)
            with cpu_kernels.reference_path():
                step(query, keys)
            step(query, keys)
    finally:
        torch._dynamo.reset()
    called = [{str(node.target) for node in graph.graph.nodes if node.op == "call_function"} for graph in graphs]
    assert len(called) == 2 and "collab_attn.shared_key_scores" in called[0]
    assert not any(target.startswith("collab_attn.") for target in called[1])


def test_the_switch_a_bad_switch_and_a_failed_build(monkeypatch):
    """0 keeps the reference path; a value other than 0 or 1 is refused, naming the variable; a failed build
    warns and keeps the reference path."""
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(cpu_kernels.SWITCH, "0")
    assert not cpu_kernels.available()

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(cpu_kernels.SWITCH, "off")
    with pytest.raises(ValueError, match="COLLAB_ATTN_CPU_KERNELS='off': set it to 0 .* or 1"):
        cpu_kernels.available()

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv(cpu_kernels.SWITCH, "1")
    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", no_compiler)
    with pytest.warns(UserWarning, match="did not build .*no C\\+\\+ compiler.*reference path"):
        assert not cpu_kernels.available()
    module = layer()
    with torch.no_grad():  # the layer still decodes, through the explicit path
        out, _ = module(torch.randn(2, 1, 96), torch.randn(2, 4, 96))
    assert out.shape == (2, 1, 96)


def test_the_build_is_the_same_from_any_copy_of_the_package(monkeypatch, tmp_path):
    """What the build is given (its name, source text and flags) does not name where collab_attn lies, so another
    checkout or a test's copy (tests/mutate.py) reuses the environment's build instead of compiling again."""
    builds = []
    monkeypatch.setattr("torch.utils.cpp_extension.load_inline", lambda **kwargs: builds.append(kwargs))
    monkeypatch.setattr(torch.library, "register_fake", lambda name: lambda function: function)
    monkeypatch.setenv(cpu_kernels.SWITCH, "1")
    copy = tmp_path / "elsewhere" / "cpu_kernels.cpp"
    copy.parent.mkdir()
    copy.write_text(cpu_kernels.SOURCE.read_text())
    for source in (cpu_kernels.SOURCE, copy):
        monkeypatch.setattr(cpu_kernels, "SOURCE", source)
        monkeypatch.setattr(cpu_kernels, "_loaded", {})
        assert cpu_kernels.available()
    assert len(builds) == 2 and builds[0] == builds[1]
    assert str(tmp_path) not in repr(builds[1]) and "collab_attn/nn" not in repr(builds[1])
