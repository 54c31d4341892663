"""Rotary-position decoders (Llama, Qwen2, Mistral; grouped key/value heads) converted by ``cp``: each frequency
band's head forms decomposed into shared query/key pairs that rotate with the band (rotary-exact collaborative keys).
Exact at full size, also at later positions; the measured error is the fit's; every head class converts, saves and
loads through the Auto classes; generation with and without a cache, with a static cache, assisted; attention maps;
what is not supported yet is refused with the reason."""

import copy
import re

import pytest
import torch
import transformers

import collab_attn
from collab_attn.kinds import RotaryCollaborativeSelfAttention
from collab_attn.models.conversion import check_request
from collab_attn.models.families import FAMILIES
from collab_attn.models.hf import AUTO_CLASSES, collab_model_class, head_classes
from collab_attn.models.methods import METHODS

pytestmark = pytest.mark.usefixtures("one_thread")

ROTARY = ["llama", "qwen2", "mistral"]
HEADS, KV_HEADS, HEAD_DIM, D, VOCAB = 4, 2, 12, 48, 100
FULL, HALF = HEADS * HEAD_DIM, HEADS * HEAD_DIM // 2


def config_of(family: str, **overrides):
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    settings = dict(hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                    num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=512,
                    pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return config_class(**(settings | extra | overrides))


def original(family: str, model_class=transformers.AutoModelForCausalLM, **overrides):
    """A small random model with random biases (Qwen2: query, key and value), eager attention."""
    torch.manual_seed(0)
    config = config_of(family, **overrides)
    model = (model_class.from_config(config) if hasattr(model_class, "from_config") else model_class(config)).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model


def converted(model, rank, **options):
    model = copy.deepcopy(model)
    report = collab_attn.reparametrize(model, rank, progress=False, **options)
    return model, report


def ids(batch=2, length=7, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("family, kv_heads", [(family, KV_HEADS) for family in ROTARY] + [("llama", HEADS)])
def test_full_size_is_exact_also_at_later_positions(family, kv_heads):
    model = original(family, num_key_value_heads=kv_heads)
    exact, report = converted(model, FULL)
    assert [layer.relative_error for layer in report.layers] == [0.0, 0.0]
    assert all(type(m) is RotaryCollaborativeSelfAttention for m in exact.modules() if hasattr(m, "pair_bands"))
    tokens = ids()
    for shift in (0, 300):
        positions = torch.arange(7)[None].expand(2, -1) + shift
        with torch.no_grad():
            expected = model(tokens, position_ids=positions).logits
            got = exact(tokens, position_ids=positions).logits
        assert float((got - expected).norm() / expected.norm()) < 1e-5


@pytest.mark.parametrize("family", ROTARY)
def test_below_full_size_the_measured_error_is_the_fit_and_grows_as_pairs_shrink(family):
    model = original(family)
    errors = []
    for rank in (FULL - 12, HALF, 12):
        _, report = converted(model, rank)
        for layer in report.layers:
            assert layer.products_error == pytest.approx(layer.relative_error, abs=1e-6)
        errors.append(sum(layer.relative_error for layer in report.layers))
    assert 0 < errors[0] < errors[1] < errors[2] < 2


@pytest.mark.parametrize("family", ROTARY)
def test_shared_values_on_a_grouped_source(family):
    model = original(family)
    exact, report = converted(model, FULL, value_rank=FULL)
    assert [layer.value_products_error for layer in report.layers] == pytest.approx([0.0, 0.0], abs=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(exact(ids()).logits, model(ids()).logits, atol=1e-4, rtol=1e-4)
    small, report = converted(model, HALF, value_rank=HALF)
    assert all(0 < layer.value_products_error < 1 for layer in report.layers)
    layer = small.model.layers[0].self_attn
    assert layer.value.weight.shape == (HALF, D) and layer.value_mixing.shape == (HEADS, HALF)


def assert_generates_alike(small, model, tokens) -> None:
    """Greedy tokens of ``small`` the same with a dynamic cache, without one, with a static one, and assisted by the
    original ``model`` (batch of one)."""
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    greedy = small.generate(tokens, **settings)
    assert torch.equal(small.generate(tokens, use_cache=False, **settings), greedy)
    assert torch.equal(small.generate(tokens, cache_implementation="static", **settings), greedy)
    one = tokens[:1]
    assert torch.equal(small.generate(one, assistant_model=model, **settings), small.generate(one, **settings))


@pytest.mark.parametrize("family", ROTARY)
def test_generation_with_and_without_a_cache_static_and_assisted(family):
    model = original(family)
    small, _ = converted(model, HALF)
    tokens = ids(length=5)
    assert_generates_alike(small, model, tokens)
    with torch.no_grad():
        cache = small(tokens, use_cache=True).past_key_values
    layer = small.model.layers[0].self_attn
    assert cache.layers[0].keys.shape == (2, 1, 5, HALF)  # the rotated shared pairs, once for all heads
    assert cache.layers[0].values.shape == (2, KV_HEADS, 5, HEAD_DIM)  # the source's grouped values
    assert layer.cache_width() == HALF + KV_HEADS * HEAD_DIM


@pytest.mark.parametrize("family", ROTARY)
def test_attention_maps_equal_the_original_at_full_size(family):
    model = original(family)
    exact, _ = converted(model, FULL)
    with torch.no_grad():
        expected = model(ids(), output_attentions=True).attentions
        got = exact(ids(), output_attentions=True).attentions
    assert len(got) == 2
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ROTARY)
def test_every_head_class_converts_saves_and_loads_back(family, tmp_path):
    classes = head_classes(FAMILIES[family])
    assert {"ForCausalLM", "Model", "ForSequenceClassification"} <= {
        cls.__name__.removeprefix(family.capitalize() if family != "qwen2" else "Qwen2") for cls in classes}
    inputs = {"input_ids": ids(), "attention_mask": torch.ones(2, 7, dtype=torch.long)}
    for model_class in classes:
        model, _ = converted(original(family, model_class), HALF)
        assert type(model) is collab_model_class(model_class)
        for loaded in assert_loads_back(model, family, model_class, tmp_path / model_class.__name__, inputs):
            assert loaded.config.collab_layer == "rotary-collaborative"


def assert_loads_back(model, family: str, model_class, folder, inputs) -> list:
    """Save ``model`` and load it back through its collaborative class and every Auto class that maps ``family`` to
    ``model_class`` (at least two loaders): every tensor output identical. Returns the loaded models."""
    model.save_pretrained(folder)
    loaders = [collab_model_class(model_class)] + [
        auto for auto in AUTO_CLASSES if auto._model_mapping._model_mapping.get(family) == model_class.__name__]
    assert len(loaders) >= 2, model_class
    loaded_models = []
    with torch.no_grad():
        expected = model(**inputs)
        for loader in loaders:
            loaded = loader.from_pretrained(folder).eval()
            got = loaded(**inputs)
            for name, value in expected.items():
                if torch.is_tensor(value):
                    torch.testing.assert_close(got[name], value, rtol=0, atol=0)
            loaded_models.append(loaded)
    return loaded_models


def test_what_rotary_models_do_not_take_yet_is_refused_with_the_reason():
    model = original("llama")
    takes = [method.name for method in METHODS.values() if method.rotary_layer is not None]
    assert {"cp", "kv-svd", "merge-kv", "drop-kv"} <= set(takes) and "svd" not in takes
    with pytest.raises(ValueError, match=r"method='svd' does not convert rotary-position models .* do: "
                                         + re.escape(str(takes))):
        collab_attn.reparametrize(copy.deepcopy(model), HALF, method="svd", progress=False)
    with pytest.raises(ValueError, match="rank 23 is odd"):
        collab_attn.reparametrize(copy.deepcopy(model), 23, progress=False)
    with pytest.raises(ValueError, match="a params:0.5 budget does not apply to rotary models"):
        collab_attn.reparametrize(copy.deepcopy(model), "params:0.5", progress=False)
    with pytest.raises(ValueError, match="solver='tensorly', init='svd' do not apply to rotary models"):
        collab_attn.reparametrize(copy.deepcopy(model), HALF, solver="tensorly", progress=False)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        check_request(config_of("llama", partial_rotary_factor=0.5), "cp", HALF)
    check_request(config_of("mistral", sliding_window=64), "cp", HALF)  # passes: tests/test_rotary_model_contract.py
    check_request(config_of("qwen2"), "cp", HALF, value_rank=HALF)  # passes
    assert type(model.model.layers[0].self_attn).__name__ == "LlamaAttention"


def test_other_rotary_architectures_are_refused_naming_the_supported_ones():
    config = transformers.GPTNeoXConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=50,
                                        intermediate_size=64)
    with pytest.raises(ValueError, match="unsupported rotary architecture 'gpt_neox'.*llama, qwen2, mistral"):
        collab_attn.reparametrize(transformers.GPTNeoXForCausalLM(config), rank=8)


def test_attention_other_than_eager_and_sdpa_is_refused_before_and_after_converting(tmp_path):
    model = original("llama")
    model.set_attn_implementation("flex_attention")
    with pytest.raises(ValueError, match=r"attention with 'flex_attention'.*set_attn_implementation\('sdpa'\)"):
        collab_attn.reparametrize(copy.deepcopy(model), HALF, progress=False)
    model.set_attn_implementation("sdpa")
    model, _ = converted(model, HALF)
    with pytest.raises(ValueError, match="does not support .*flex_attention"):
        model.set_attn_implementation("flex_attention")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not support .*flex_attention"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="flex_attention")
    model.config._attn_implementation = "flex_attention"  # set past transformers' check: the layers refuse its mask
    with pytest.raises(TypeError, match="got a BlockMask: call model.set_attn_implementation"):
        model(ids())
