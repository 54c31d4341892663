"""What transformers' own model tests ask of a Llama, Qwen2 or Mistral model, asked of the converted ones (written
here): every buffer of a converted layer restored by the model's ``_init_weights`` after a build on the meta device,
and a meta-device load through ``from_pretrained`` the same model; sliding windows (Mistral on every layer, Qwen2 on
its sliding layers) honoured exactly in prefill and decoding, with dynamic and static caches that keep only the
window; padded batches equal to each row alone with its ``position_ids``."""

import contextlib
import copy
import json
import re

import pytest
import torch
import transformers
from test_common_model import token_ids
from test_rotary_models import FULL, HALF, HEAD_DIM, HEADS, KV_HEADS, ROTARY, ids, original
from test_static_cache import generated
from torch._dynamo.utils import counters
from transformers import CompileConfig
from transformers.cache_utils import DynamicSlidingWindowLayer, StaticSlidingWindowLayer

import collab_attn
from collab_attn.kinds import ConvertedSelfAttention, cache_keyword
from collab_attn.models.hf import collab_model_class

pytestmark = pytest.mark.usefixtures("one_thread")

WINDOW = 4
GROUPED = KV_HEADS * HEAD_DIM  # the original key cache's width: exact for key-svd, merge-kv, drop-kv, kv-svd
EXACT = {  # method -> (rank, options) that reproduce the original
    "cp": (FULL, {}), "tucker": (FULL, {}), "key-svd": (GROUPED, {}),
    "kv-svd": (GROUPED, {"rope_pairs": HEAD_DIM // 2}), "merge-kv": (GROUPED, {}), "drop-kv": (GROUPED, {}),
    "cp shared values": (FULL, {"value_rank": FULL}),
}
HALVED = {  # method -> (rank, options) at about half the original's cache
    "cp": (HALF, {"value_rank": HALF}), "tucker": (HALF, {"value_rank": HALF}), "key-svd": (16, {"value_rank": 12}),
    "kv-svd": (HALF, {}),
}
WINDOWED = {  # Mistral: every layer sliding; Qwen2: layer 0 full, layer 1 sliding (max_window_layers)
    "mistral": {"sliding_window": WINDOW},
    "qwen2": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
}


def convert(model, method: str, rank: int, options: dict):
    model = copy.deepcopy(model)
    collab_attn.reparametrize(model, rank, method=method.split()[0], progress=False, **options)
    return model


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def buffers(model) -> dict[str, torch.Tensor]:
    return {name: buffer.clone() for name, buffer in model.named_buffers()}


@pytest.mark.parametrize("family", ROTARY)
@pytest.mark.parametrize("method", list(HALVED))
def test_a_meta_device_build_gets_every_buffer_back_from_init_weights(family, method):
    """transformers' test_init_weights_can_init_buffers: a model built on the meta device, moved to the CPU and
    initialized has the buffers of one built directly; and the config records the bands the conversion chose, so
    a model built from it has them."""
    model = convert(original(family), method, *HALVED[method])
    config, model_class = model.config, collab_model_class(type(original(family)))
    direct = model_class(copy.deepcopy(config))
    with torch.device("meta"):
        on_meta = model_class(copy.deepcopy(config))
    on_meta.to_empty(device="cpu")
    on_meta.init_weights()
    expected, got = buffers(direct), buffers(on_meta)
    bands = [name for name in expected if name.endswith(("pair_bands", "rope_bands"))]
    assert len(bands) == 2 and all(torch.equal(expected[name], model.get_buffer(name)) for name in bands)
    assert sorted(got) == sorted(expected)
    assert [name for name in expected if not torch.equal(got[name], expected[name])] == []


@pytest.mark.parametrize("family", ROTARY)
@pytest.mark.parametrize("method", list(HALVED))
def test_loading_through_the_meta_device_keeps_the_saved_bands_and_outputs(family, method, tmp_path):
    """Loaded with its config, and with a config saved before configs recorded the bands (the weights hold them)."""
    model = convert(original(family), method, *HALVED[method])
    default = collab_model_class(type(original(family)))(copy.deepcopy(model.config).__class__(
        **{**model.config.to_dict(), "collab_bands": None}))
    bands = {name: b for name, b in buffers(model).items() if name.endswith(("pair_bands", "rope_bands"))}
    assert any(not torch.equal(b, default.get_buffer(name)) for name, b in bands.items())  # not the defaults
    model.save_pretrained(tmp_path)
    for recorded in (True, False):
        if not recorded:
            saved = json.loads((tmp_path / "config.json").read_text())
            (tmp_path / "config.json").write_text(json.dumps({**saved, "collab_bands": None}))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)  # built on the meta device, then loaded
        assert all(torch.equal(loaded.get_buffer(name), b) for name, b in bands.items())
        with torch.no_grad():
            assert torch.equal(loaded(ids()).logits, model(ids()).logits)


@contextlib.contextmanager
def seeded_init():
    """Every module initialized from the same seed (transformers' test_can_init_all_missing_weights does this): two
    builds that initialize alike then hold the same weights."""
    initialize = transformers.PreTrainedModel._initialize_weights

    def seeded(*args, **kwargs):
        transformers.set_seed(42)
        initialize(*args, **kwargs)

    transformers.PreTrainedModel._initialize_weights = seeded
    try:
        yield
    finally:
        transformers.PreTrainedModel._initialize_weights = initialize


@pytest.mark.parametrize("family", ROTARY)
@pytest.mark.parametrize("method", list(HALVED))
def test_weights_missing_from_a_checkpoint_are_initialized_as_the_constructor_does(family, method):
    """transformers' test_can_init_all_missing_weights: a model loaded from an empty state dict (every weight built
    on the meta device, then initialized by _init_weights) equals one built from the config."""
    config = convert(original(family), method, *HALVED[method]).config
    model_class = collab_model_class(type(original(family)))
    with seeded_init():
        built = model_class(copy.deepcopy(config)).state_dict()
        loaded = model_class.from_pretrained(None, config=copy.deepcopy(config), state_dict={}).state_dict()
    assert sorted(loaded) == sorted(built)
    assert [name for name in built if not torch.equal(loaded[name], built[name])] == []


def test_the_tensor_parallel_plan_names_no_converted_weights():
    """transformers' test_tp_plan_matches_params: every entry of the plan names a parameter or module; the converted
    attention has no per-head split, so its entries go (the MLP's stay)."""
    model = convert(original("llama"), "cp", *HALVED["cp"])
    names = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_modules()}
    for plan in (model.tp_plan, model.model.tp_plan, type(model.config).base_model_tp_plan):
        assert plan and not any("self_attn" in pattern for pattern in plan)
        assert any("mlp" in pattern for pattern in plan)
    for pattern in model.tp_plan:
        assert any(re.fullmatch(pattern.replace(".", r"\.").replace("*", r"\d+"), name) for name in names), pattern


@pytest.mark.parametrize("family", list(WINDOWED))
@pytest.mark.parametrize("method", list(EXACT))
def test_sliding_windows_convert_exactly_at_full_size_beyond_the_window(family, method):
    model = original(family, **WINDOWED[family])
    exact = convert(model, method, *EXACT[method])
    windows = [layer.self_attn.sliding_window for layer in exact.model.layers]
    assert windows == ([WINDOW, WINDOW] if family == "mistral" else [None, WINDOW])
    assert all(isinstance(layer.self_attn, ConvertedSelfAttention) for layer in exact.model.layers)
    tokens = ids(length=3 * WINDOW)
    unwindowed = original(family)  # the same weights (the same seed), every position seen
    with torch.no_grad():
        expected = model(tokens).logits
        assert relative(unwindowed(tokens).logits, expected) > 0.01  # the window changes what the model computes
        assert relative(exact(tokens).logits, expected) < 1e-5


@pytest.mark.parametrize("family", list(WINDOWED))
@pytest.mark.parametrize("method", ["cp", "key-svd", "kv-svd", "merge-kv"])
def test_greedy_decoding_past_the_window_equals_the_original_with_dynamic_and_static_caches(family, method):
    model = original(family, **WINDOWED[family])
    exact = convert(model, method, *EXACT[method])
    settings = {"max_new_tokens": 2 * WINDOW, "do_sample": False, "pad_token_id": 0}
    for prompt in (2, 2 * WINDOW + 1):  # a prompt within the window, and one past it
        tokens = ids(length=prompt)
        expected = model.generate(tokens, **settings)
        assert torch.equal(exact.generate(tokens, **settings), expected)
        assert torch.equal(exact.generate(tokens, cache_implementation="static", **settings), expected)


@pytest.mark.parametrize("family", list(WINDOWED))
@pytest.mark.parametrize("method", list(HALVED))
def test_below_full_size_cached_decoding_past_the_window_equals_recomputation(family, method):
    small = convert(original(family, **WINDOWED[family]), method, *HALVED[method])
    settings = {"max_new_tokens": 2 * WINDOW, "do_sample": False, "pad_token_id": 0}
    tokens = ids(length=WINDOW + 1)
    recomputed = small.generate(tokens, use_cache=False, **settings)
    assert torch.equal(small.generate(tokens, **settings), recomputed)
    assert torch.equal(small.generate(tokens, cache_implementation="static", **settings), recomputed)


@pytest.mark.parametrize("method", list(HALVED))
def test_the_caches_keep_only_the_window_on_sliding_layers(method):
    small = convert(original("qwen2", **WINDOWED["qwen2"]), method, *HALVED[method])
    tokens = ids(length=3 * WINDOW)
    with torch.no_grad():
        dynamic = small(tokens, use_cache=True).past_key_values
        static = transformers.StaticCache(config=small.config, max_cache_len=4 * WINDOW)
        small(tokens, use_cache=True, **{cache_keyword(small): static})
    full, sliding = dynamic.layers
    assert type(sliding) is DynamicSlidingWindowLayer and sliding.keys.shape[2] == sliding.values.shape[2] == WINDOW - 1
    assert full.keys.shape[2] == full.values.shape[2] == 3 * WINDOW
    assert sliding.keys.shape[-1] == full.keys.shape[-1] < HEADS * HEAD_DIM  # the converted layout, narrower
    assert type(static.layers[1]) is StaticSlidingWindowLayer
    assert static.layers[1].keys.shape[2] == static.layers[1].values.shape[2] == WINDOW
    assert static.layers[0].keys.shape[2] == 4 * WINDOW


def compiled_graphs(model) -> int:
    """Greedy decoding of 9 tokens after 5 with a static cache under ``torch.compile(fullgraph=True)`` (no graph
    breaks) equals eager decoding; returns how many graphs it compiled."""
    tokens = token_ids(length=5)
    settings = {"cache_implementation": "static", "new_tokens": 9}
    compile_config = CompileConfig(fullgraph=True, backend="aot_eager")
    compile_config._compile_all_devices = True  # transformers compiles on accelerators only unless told
    torch._dynamo.reset()
    counters.clear()
    try:
        eager = generated(model, tokens, disable_compile=True, **settings)
        compiled = generated(model, tokens, compile_config=compile_config, **settings)
        graphs = counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert torch.equal(compiled.sequences, eager.sequences)
    assert max(float((a - b).abs().max()) for a, b in zip(compiled.logits, eager.logits)) < 1e-4
    return graphs


def test_compiled_static_decoding_past_the_window_compiles_as_the_original_does():
    """A static sliding-window layer decides in Python whether the window is full: the original compiles two graphs
    (before and after), and so does the converted model, never more."""
    model = original("mistral", vocab_size=120, **WINDOWED["mistral"])
    small = convert(model, "cp", *HALVED["cp"])
    assert compiled_graphs(small) == compiled_graphs(model) == 2


@pytest.mark.parametrize("family", ROTARY)
@pytest.mark.parametrize("method", ["cp", "kv-svd"])
def test_a_padded_batch_equals_each_row_alone_with_its_positions(family, method):
    """transformers' left-padding test: a left-padded row gives the logits of the same tokens alone, positioned from
    0 (``position_ids``); with Mistral's window too."""
    small = convert(original(family, **WINDOWED.get(family, {})), method, *HALVED[method])
    tokens = ids(length=3 * WINDOW)
    pad = 5
    mask = torch.ones_like(tokens)
    mask[1, :pad] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        padded = small(tokens, attention_mask=mask, position_ids=positions).logits
        alone = small(tokens[1:, pad:], position_ids=torch.arange(tokens.shape[1] - pad)[None]).logits
        first = small(tokens[:1]).logits
    assert (padded[1, pad:] - alone[0]).abs().max() < 1e-5
    assert (padded[0] - first[0]).abs().max() < 1e-5
