"""The Triton decoding kernels (``collab_attn.nn.triton_kernels``; issue 67), run where CI runs: on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is imported; on a machine with a GPU the same
tests run the compiled kernels on it). The two operators equal a float64 softmax at small odd sizes (widths 1 to 33,
3 heads, 1 to 130 keys, chunks that split the keys unevenly), float32 and bfloat16, with and without content logits
and padding (a row with every key blocked: uniform weights, as on the explicit path), and pass
``torch.library.opcheck``; the kernels compile for an H100 (sm_90) without one, bfloat16 tensor-core products included
(the interpreter runs those products in float32: its bfloat16 ``tl.dot`` multiplies raw bits). Collaborative layers
(keys only and shared values, CP and Tucker) decode through them as through the explicit path; a converted GPT-2 and
rotary models (``cp`` with grouped or shared values, ``key-svd``, ``kv-svd`` absorbed) with ``COLLAB_ATTN_TRITON=1``:
cached decoding equals recomputation, greedy generation with dynamic and static caches is the same, and a static
cache's step compiles into one graph (``fullgraph=True``). The switch: ``0`` keeps the kernels off, a bad value is
refused naming the variable, ``1`` where they cannot run is an error. Skipped without triton.

Tolerances: float32 1e-5 absolute and relative against float64 (every sum in float32); bfloat16 2e-2 (the output's own
rounding: 2^-9 relative on a GPU, which rounds to nearest, 2^-8 in the interpreter, which truncates; and on a GPU the
probabilities enter the second product in bfloat16)."""

from __future__ import annotations

import copy
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # before triton is imported: the kernels run in its interpreter on the CPU (tests/conftest.py sets it already,
    # before torch._dynamo imports triton)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from conftest import with_cache  # noqa: E402
from test_common_model import HEAD_DIM, HEADS, config_of, token_ids  # noqa: E402
from test_static_cache import generated  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402
from transformers import CompileConfig, DynamicCache, GPT2LMHeadModel, StaticCache  # noqa: E402

from collab_attn import reparametrize  # noqa: E402
from collab_attn.kinds.collaborative.collaborative_attention import CollaborativeAttention  # noqa: E402
from collab_attn.nn import triton_kernels  # noqa: E402


def _interpreted_too_late() -> bool:
    """Whether triton was imported before ``TRITON_INTERPRET=1`` was set (its language is then compiled-only)."""
    if torch.cuda.is_available() or "triton" not in sys.modules:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return not isinstance(sys.modules["triton.language"].max, InterpretedFunction)


pytestmark = [pytest.mark.usefixtures("one_thread", "switched_on"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
              pytest.mark.skipif(_interpreted_too_late(), reason="triton was imported before TRITON_INTERPRET=1 was "
                                 "set (tests/conftest.py sets it): no interpreter, and no GPU")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.fixture(scope="module")
def switched_on():
    """``COLLAB_ATTN_TRITON=1`` for this module (read once: the cached reading is cleared before and after)."""
    before = os.environ.get(triton_kernels.SWITCH)
    os.environ[triton_kernels.SWITCH] = "1"
    triton_kernels._state.pop("switch", None)
    yield
    if before is None:
        os.environ.pop(triton_kernels.SWITCH)
    else:
        os.environ[triton_kernels.SWITCH] = before
    triton_kernels._state.pop("switch", None)


@pytest.fixture
def kernel_calls(monkeypatch):
    """The operators the layers called, by name."""
    calls = []

    def spying_on(name):
        call = getattr(triton_kernels, name)

        def spy(*args, **kwargs):
            calls.append(name)
            return call(*args, **kwargs)

        return spy

    for name in ("keys_only", "shared_kv"):
        monkeypatch.setattr(triton_kernels, name, spying_on(name))
    return calls


def softmax_reference(queries, keys, values, content, mask, scale, shared):
    """The explicit computation in float64: queries (B, H, R), keys (B, S, R), values (B, G, S, Dv) or (B, S, Dv)."""
    logits = torch.einsum("bhr,bsr->bhs", queries.double(), keys.double()) * scale
    if content is not None:
        logits = logits + content.double()
    if mask is not None:
        logits = logits + mask.double()[:, None]
    weights = logits.softmax(-1)
    if shared:
        return torch.einsum("bhs,bsd->bhd", weights, values.double())
    grouped = values.double().repeat_interleave(queries.shape[1] // values.shape[1], dim=1)
    return torch.einsum("bhs,bhsd->bhd", weights, grouped)


SMALL = [(1, 5, 1, 0), (5, 17, 7, 3), (17, 1, 7, 2), (33, 5, 7, 5)]  # (R, Dv, keys S, keys per program: 0 = one chunk)
CASES = [(*size, dtype, extras) for size in SMALL for dtype in (torch.float32, torch.bfloat16)
         for extras in (True, False)]
CASES += [(17, 33, 130, 50, torch.float32, True), (33, 1, 130, 0, torch.bfloat16, True)]  # several tiles per chunk


@pytest.mark.parametrize("width, value_width, keys, chunk, dtype, extras", CASES, ids=[
    f"R{r}-Dv{v}-S{s}-chunk{c}-{str(d)[6:]}-{'content and padding' if e else 'plain'}" for r, v, s, c, d, e in CASES])
def test_the_kernels_equal_the_softmax_at_odd_sizes(width, value_width, keys, chunk, dtype, extras):
    """The keys and content logits as a cache packs them (one row per token: the shared key, then a logit per head),
    so both are strided views; values per head, per group of 3 heads, and shared."""
    generator = torch.Generator().manual_seed(width * 1000 + keys)
    batch, heads = 2, 3

    def randn(*shape):
        return torch.randn(*shape, generator=generator).to(DEVICE, dtype)

    queries, packed = randn(batch, heads, width), randn(batch, keys, width + heads)
    shared_keys, content = packed[..., :width], (packed[..., width:].transpose(1, 2) if extras else None)
    mask = None
    if extras:  # element 0: its first half blocked; element 1: every key blocked (uniform weights)
        mask = torch.zeros(batch, keys, dtype=dtype, device=DEVICE)
        mask[0, : keys // 2] = torch.finfo(dtype).min
        mask[1] = torch.finfo(dtype).min
    per_head, per_group, shared = randn(batch, heads, keys, value_width), randn(batch, 1, keys, value_width), \
        randn(batch, keys, value_width)
    tolerance = TOLERANCE[dtype]
    for values, call, is_shared in ((per_head, triton_kernels.keys_only, False),
                                    (per_group, triton_kernels.keys_only, False),
                                    (shared, triton_kernels.shared_kv, True)):
        got = call(queries, shared_keys, values, content, mask, 0.7, chunk, content_scale=0.3)
        assert got.dtype == dtype and got.shape == (batch, heads, value_width)
        expected = softmax_reference(queries, shared_keys, values, None if content is None else 0.3 * content.double(),
                                     mask, 0.7, is_shared)
        torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)


def test_the_operators_pass_opcheck():
    """Schema, shape functions (fake tensors) and tracing, as ``torch.compile`` needs them."""
    def randn(*shape):
        return torch.randn(*shape, device=DEVICE)

    queries, keys = randn(1, 2, 5), randn(1, 9, 8)[..., :5]
    content, mask = randn(1, 2, 9), torch.zeros(1, 9, device=DEVICE)
    torch.library.opcheck(torch.ops.collab_attn.triton_keys_only_decode.default,
                          (queries, keys, randn(1, 2, 9, 3), content, mask, 0.5, 4, 0.25))
    torch.library.opcheck(torch.ops.collab_attn.triton_shared_kv_decode.default,
                          (queries, keys, randn(1, 9, 3), None, None, 1.0, 0, 1.0))


@pytest.mark.parametrize("bad, message", [
    ((torch.randn(2, 3, 4), torch.randn(2, 5, 6), torch.randn(2, 3, 5, 2)), "keys must be"),
    ((torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 2, 5, 2)), "3 heads cannot share 2 value groups"),
    ((torch.randn(2, 3, 4), torch.randn(2, 0, 4), torch.randn(2, 3, 0, 2)), "no keys"),
])
def test_bad_inputs_say_what_is_wrong(bad, message):
    with pytest.raises(ValueError, match=message):
        triton_kernels.keys_only(*bad)


def test_the_chunks_fill_an_h100_without_much_extra_traffic(monkeypatch):
    """On a GPU (an H100's 132 multiprocessors, pretended) a step splits into about four programs per
    multiprocessor; with shared keys and values at most S / (20 H) chunks (their float32 partial results cost about
    2 C H / S of the cache's traffic); on the CPU one chunk; a chunk given is kept."""
    class H100:
        multi_processor_count = 132

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: H100)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert triton_kernels._chunk_size(0, 8192, 12, cuda) == 187  # keys only, batch 1: 44 chunks x 12 heads
    assert triton_kernels._chunk_size(0, 8192, 32 * 12, cuda) == 4096  # batch 32: two chunks
    assert triton_kernels._chunk_size(0, 8192, 1, cuda, most_chunks=8192 // (20 * 12)) == 241  # shared, batch 1: 34
    assert triton_kernels._chunk_size(0, 8192, 32, cuda, most_chunks=34) == 482  # shared, batch 32: 17 chunks
    assert triton_kernels._chunk_size(0, 100, 1, cuda) == 50  # at least 4 tiles of keys per chunk
    assert triton_kernels._chunk_size(0, 8192, 1, cpu) == 8192 and triton_kernels._chunk_size(7, 8192, 1, cpu) == 7


AHEAD_OF_TIME = """
import importlib.util, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
spec = importlib.util.spec_from_file_location("triton_kernels", sys.argv[1])
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
kernels = module._kernels()
# keys only split into chunks (float32 partial results), shared keys and values in one chunk (the output), the combine
for name, dtype, split in (("keys_only", "bf16", True), ("shared_kv", "bf16", False), ("combine", "bf16", False)):
    fn = kernels[name]
    names = fn.arg_names
    values = dict(HAS_CONTENT=True, HAS_MASK=True, SPLIT=split, FLOAT32_DOT=dtype == "fp32", BLOCK_H=16, BLOCK_S=32,
                  BLOCK_R=256, BLOCK_DV=64, BLOCK_C=16)
    pointers = dict.fromkeys("QKVCM", "*" + dtype) | dict.fromkeys(("PART", "MAX", "SUM"), "*fp32")
    pointers["OUT"] = "*fp32" if split else "*" + dtype
    signature = {p: pointers[p] if p in pointers else "fp32" if "scale" in p else "constexpr" if p in values
                 else "i32" for p in names}
    constants = {(names.index(p),): v for p, v in values.items() if p in names}
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    print(name, dtype, len(compiled.asm["cubin"]), compiled.asm["ptx"].count("mma."))
"""


def test_the_kernels_compile_for_an_h100_without_one():
    """Triton's compiler and ptxas (shipped with triton) build the kernels for sm_90 in a process without the
    interpreter: the path a GPU runs, including the bfloat16 tensor-core products the interpreter cannot run."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    source = Path(triton_kernels.__file__)
    done = subprocess.run([sys.executable, "-c", AHEAD_OF_TIME, str(source)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [line.split() for line in done.stdout.splitlines()]
    assert [line[:2] for line in lines] == [["keys_only", "bf16"], ["shared_kv", "bf16"], ["combine", "bf16"]]
    assert all(int(line[2]) > 0 for line in lines)  # a cubin each
    assert int(lines[1][3]) > 0  # shared keys and values in bfloat16: tensor-core products


# Layers -------------------------------------------------------------------------------------------------------------


def layer(tucker=None, content_bias=True, value_rank=None) -> CollaborativeAttention:
    torch.manual_seed(0)
    module = CollaborativeAttention(30, 3, 17, tucker_core_size=tucker, mixing_init="random", bias=content_bias,
                                    value_rank=value_rank)
    with torch.no_grad():
        if content_bias:
            module.content_bias.weight.normal_()
        if value_rank:
            module.value_mixing.normal_()
    return module.eval().to(DEVICE)


@pytest.mark.parametrize("value_rank, tucker, content_bias, padding", [
    (None, None, True, True), (None, 2, False, False), (7, None, True, True), (7, 2, True, False),
], ids=["keys only, cp, content, padding", "keys only, tucker", "shared values, cp, content, padding",
        "shared values, tucker, content"])
def test_a_collaborative_decoding_step_through_the_kernels_gives_the_explicit_paths_outputs(
        value_rank, tucker, content_bias, padding, kernel_calls):
    module = layer(tucker, content_bias, value_rank)
    query, keys = torch.randn(2, 1, 30, device=DEVICE), torch.randn(2, 7, 30, device=DEVICE)
    mask = {}
    if padding:
        mask = {"attention_mask": torch.ones(2, 7, dtype=torch.long, device=DEVICE)}
        mask["attention_mask"][0, :3] = 0
    with torch.no_grad():
        through_kernels, none = module(query, keys, **mask)
        assert kernel_calls == ["shared_kv" if value_rank else "keys_only"] and none is None
        explicit, weights = module(query, keys, need_weights=True, **mask)  # attention maps: the explicit path
    assert len(kernel_calls) == 1 and weights.shape == (2, 3, 1, 7)
    torch.testing.assert_close(through_kernels, explicit, atol=1e-5, rtol=1e-5)


def test_prefill_training_dropout_and_per_head_masks_keep_the_present_paths(kernel_calls):
    module = layer()
    with torch.no_grad():
        module(torch.randn(2, 5, 30, device=DEVICE), is_causal=True)  # a prompt: five query rows
        per_head = torch.ones(2, 3, 1, 4, dtype=torch.bool, device=DEVICE)
        per_head[0, 1, 0, 0] = False
        query, keys = torch.randn(2, 1, 30, device=DEVICE), torch.randn(2, 4, 30, device=DEVICE)
        present, _ = module(query, keys, attention_mask=per_head)  # the content logits scaled on this path too
        explicit, _ = module(query, keys, attention_mask=per_head, need_weights=True)
        torch.testing.assert_close(present, explicit, atol=1e-5, rtol=1e-5)
        module.dropout = 0.5
        module.train()(torch.randn(2, 1, 30, device=DEVICE), torch.randn(2, 4, 30, device=DEVICE))
    module.dropout = 0.0
    module(torch.randn(2, 1, 30, device=DEVICE), torch.randn(2, 4, 30, device=DEVICE))[0].sum().backward()
    assert kernel_calls == [] and module.mixing.grad.abs().sum() > 0


# Models -------------------------------------------------------------------------------------------------------------


def assert_cached_decoding_equals_recomputation(model, ids, prompt: int, caches) -> None:
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        for cache in caches:
            steps = [model(ids[:, :prompt], use_cache=True, **with_cache(model, cache)).logits]
            steps += [model(ids[:, t:t + 1], use_cache=True, **with_cache(model, cache)).logits
                      for t in range(prompt, ids.shape[1])]
            torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-4, rtol=1e-4)


def assert_greedy_generation_is_the_same_with_dynamic_and_static_caches(model, ids) -> None:
    dynamic = generated(model, ids, new_tokens=3)
    static = generated(model, ids, new_tokens=3, cache_implementation="static")
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.logits, dynamic.logits):
        assert (a - b).abs().max() < 1e-4


GPT2_MODELS: dict = {}


def gpt2(method: str = "cp", value_rank=None) -> GPT2LMHeadModel:
    """The tests' small GPT-2 (4 heads of 12, two layers) converted at 24: keys (values per head or shared at 24),
    thin keys (``key-svd``) or an MLA latent (``kv-svd``)."""
    if (method, value_rank) not in GPT2_MODELS:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config_of("gpt2")).eval()
        options = {"n_iter_max": 5} if method == "cp" else {}
        reparametrize(model, HEADS * HEAD_DIM // 2, method, value_rank=value_rank, progress=False, **options)
        GPT2_MODELS[method, value_rank] = model.eval().to(DEVICE)
    return GPT2_MODELS[method, value_rank]


@pytest.mark.parametrize("method, value_rank, layer_class, operator", [
    ("cp", None, "CollaborativeSelfAttention", "keys_only"), ("cp", 24, "CollaborativeSelfAttention", "shared_kv"),
    ("key-svd", None, "SharedKeySelfAttention", "keys_only"), ("kv-svd", None, "LatentSelfAttention", "shared_kv"),
], ids=["cp keys only", "cp shared values", "key-svd", "kv-svd"])
def test_a_converted_gpt2_decodes_through_the_kernels_as_it_recomputes(method, value_rank, layer_class, operator,
                                                                       kernel_calls):
    model = gpt2(method, value_rank)
    assert {type(m).__name__ for m in model.modules() if hasattr(m, "num_heads") and hasattr(m, "scale")} == {
        layer_class}
    ids = token_ids(batch=1, length=7).to(DEVICE)
    static = StaticCache(config=model.config, max_cache_len=12)
    assert_cached_decoding_equals_recomputation(model, ids, prompt=5, caches=[DynamicCache(), static])
    assert kernel_calls == [operator] * (2 * 2 * 2)  # 2 caches, 2 steps, 2 layers
    assert_greedy_generation_is_the_same_with_dynamic_and_static_caches(model, ids[:, :4])


def test_a_static_cache_step_through_the_kernels_compiles_into_one_graph(kernel_calls, monkeypatch):
    """``torch.compile(fullgraph=True)`` traces the operators (aot_eager: the graph without generating kernels): the
    decoding steps in one graph, never recompiled, the tokens and logits of eager decoding."""
    model = copy.deepcopy(gpt2())
    model.set_attn_implementation("sdpa")
    ids = token_ids(batch=1, length=4).to(DEVICE)
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager")
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    torch._dynamo.reset()
    counters.clear()
    try:
        eager = generated(model, ids, new_tokens=4, cache_implementation="static", disable_compile=True)
        calls = len(kernel_calls)
        monkeypatch.undo()  # the spy out of the way: the compiler would guard on its list
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = generated(model, ids, new_tokens=4, cache_implementation="static", compile_config=compile_config)
        assert counters["stats"]["unique_graphs"] == 1
    finally:
        torch._dynamo.reset()
    assert calls == 2 * 3  # eager: 3 decoding steps, 2 layers
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        assert (a - b).abs().max() < 1e-4


ROTARY_CONVERSIONS = {  # method, rank and options -> the layer class it makes and the operator it decodes through
    "cp": ((24, {}), "RotaryCollaborativeSelfAttention", "keys_only"),
    "cp shared values": ((24, {"value_rank": 20}), "RotaryCollaborativeSelfAttention", "shared_kv"),
    "key-svd": ((12, {}), "RotarySharedKeySelfAttention", "keys_only"),
    "kv-svd": ((24, {}), "PartialRotaryLatentSelfAttention", "shared_kv"),
}


@pytest.mark.parametrize("conversion", ROTARY_CONVERSIONS)
def test_rotary_models_decode_through_the_kernels_as_they_recompute(conversion, kernel_calls):
    from test_rotary_models import ids as rotary_ids
    from test_rotary_models import original

    (rank, options), layer_class, operator = ROTARY_CONVERSIONS[conversion]
    model = original("llama")
    reparametrize(model, rank, method=conversion.split()[0], progress=False, **options)
    model = model.eval().to(DEVICE)
    assert {type(m).__name__ for m in model.modules() if hasattr(m, "cache_width")} == {layer_class}
    ids = rotary_ids(batch=1, length=7).to(DEVICE)
    assert_cached_decoding_equals_recomputation(model, ids, prompt=5, caches=[DynamicCache()])
    assert kernel_calls == [operator] * (2 * 2)  # 2 steps, 2 layers
    assert_greedy_generation_is_the_same_with_dynamic_and_static_caches(model, ids[:, :4])


# The switch ---------------------------------------------------------------------------------------------------------


@pytest.fixture
def switch(monkeypatch):
    """Set ``COLLAB_ATTN_TRITON`` for one test (``None``: unset), the cached reading cleared."""
    def set_to(value):
        if value is None:
            monkeypatch.delenv(triton_kernels.SWITCH, raising=False)
        else:
            monkeypatch.setenv(triton_kernels.SWITCH, value)
        triton_kernels._state.pop("switch", None)

    yield set_to
    triton_kernels._state.pop("switch", None)


def test_the_switch(switch, monkeypatch, kernel_calls):
    """0 keeps the kernels off; unset takes them for CUDA tensors only (of compute capability 8.0 or newer); a bad
    value is refused, naming the variable; 1 where they cannot run (no triton, or a CPU tensor outside the
    interpreter) is an error, not a quiet fallback."""
    cpu = torch.zeros(1)
    module = layer()
    switch("0")
    with torch.no_grad():
        module(torch.randn(2, 1, 30, device=DEVICE), torch.randn(2, 4, 30, device=DEVICE))
    assert kernel_calls == [] and not triton_kernels.applies(cpu)
    switch(None)
    assert not triton_kernels.applies(cpu)
    switch("yes")
    with pytest.raises(ValueError, match="COLLAB_ATTN_TRITON='yes': set it to 1 .* 0 .* unset"):
        triton_kernels.applies(cpu)
    switch("1")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match="COLLAB_ATTN_TRITON=1 on a CPU tensor.*TRITON_INTERPRET=1"):
        triton_kernels.applies(cpu)
    monkeypatch.setitem(triton_kernels._state, "installed", False)
    with pytest.raises(RuntimeError, match="COLLAB_ATTN_TRITON=1 asks for the Triton kernels, but triton is not"):
        triton_kernels.applies(cpu)
    switch(None)
    assert not triton_kernels.applies(torch.zeros(1, device="meta"))  # not CUDA: the present paths
    for capability, on in (((7, 5), False), ((8, 0), True), ((9, 0), True)):  # unset: on from Ampere
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, _c=capability: _c)
        monkeypatch.delitem(triton_kernels._state, ("capable", 5), raising=False)
        assert triton_kernels._capable(5) is on


# The benchmarks ------------------------------------------------------------------------------------------------------


def test_decode_kernels_times_the_triton_rows_against_the_measured_copy(tmp_path):
    """benchmarks/decode_kernels.py: where the kernels run, ``collab triton`` and ``collab kv triton`` compute the
    explicit forms' attention and report their GB/s as a share of the copy measured in the same run."""
    from test_benchmarks import load

    kernels = load("decode_kernels")
    result = kernels.main(["--batch", "1", "--context", "40", "--rank", "7", "--value-rank", "9", "--repeats", "1",
                           "--warmup", "0", "--threads", "1", "--compile-backend", "aot_eager", "--device", DEVICE,
                           "--triton-tiles", "32:2", "--out", str(tmp_path / "k")])
    rows = {row["variant"]: row for row in result["rows"]}
    for name in ("collab triton", "collab kv triton", "collab triton 32:2", "collab kv triton 32:2"):
        assert rows[name]["max_abs_difference"] < 1e-4
        assert rows[name]["of_copy"] == pytest.approx(rows[name]["gb_per_s"] / result["copy"]["gb_per_s"])
    assert "| collab kv triton |" in (tmp_path / "k.md").read_text()
    assert (triton_kernels.BLOCK_KEYS, triton_kernels.WARPS) == (16, None)  # the sweep's settings undone
    with pytest.raises(SystemExit):
        kernels.main(["--triton-tiles", "24:4", "--out", str(tmp_path / "bad")])


def test_decode_times_the_triton_kernels_against_the_present_path(tmp_path):
    """benchmarks/decode.py --triton: every collaborative model beside a twin on its present path, taking turns; an
    eager step shows the kernels in the one (a call per layer) and not in the other."""
    from test_benchmarks import TINY, load

    decode = load("decode")
    rows = decode.main([*TINY, "--contexts", "16", "--batches", "1", "--repeats", "1", "--warmup", "0", "--triton",
                        "--device", DEVICE, "--out", str(tmp_path / "d")])
    twin = "collab D~=24" + decode.PRESENT
    assert [row["model"] for row in rows] == ["original", "collab D~=24", twin]
    original, kernels, present = rows
    assert (original["kernel_calls"], kernels["kernel_calls"], present["kernel_calls"]) == (0, 2, 0)
    assert kernels["vs_present"] == pytest.approx(kernels["ms_per_step"] / present["ms_per_step"])
    assert "vs_present" not in present and "| vs present path | verdict |" in (tmp_path / "d.md").read_text()
    with pytest.raises(SystemExit):
        decode.main([*TINY, "--triton", "--prefill", "--out", str(tmp_path / "p")])
