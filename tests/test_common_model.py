"""The checks transformers runs on its own models (``tests/test_modeling_common.py`` and
``tests/generation/test_utils.py`` in its repository), written for converted models: every family (encoders, and
decoders: GPT-2, OPT, BERT and RoBERTa as decoders) x every method (cp, tucker, svd, prune), at full rank (where
the conversion is exact, so the converted model must give the original's outputs) and at half rank.

Attention and hidden-state outputs (as a call argument and from the config, eager and sdpa), retain_grad on them,
``inputs_embeds``, save/load of every head class of every family (its own collaborative class and the Auto classes),
dtype round trips, safetensors, tied and untied embeddings, resized embeddings, and for decoders greedy, sampled and
beam ``generate`` with dict outputs and scores, assisted and prompt-lookup decoding, generation from
``inputs_embeds``, and the cache layout the README documents (one shared key of width D~ plus one content logit per
head for collaborative layers, instead of heads x head_dim)."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from conftest import small_config
from transformers import AutoModel, AutoModelForCausalLM

import collab_attn  # noqa: F401  (registers the collaborative classes)
from collab_attn import reparametrize
from collab_attn.kinds import CollaborativeSelfAttention, ConvertedSelfAttention
from collab_attn.models.families import FAMILIES as FAMILY_SPECS
from collab_attn.models.families import attention_modules
from collab_attn.models.hf import _COLLAB_MODELS, AUTO_CLASSES, collab_model_class, head_classes

VOCAB, D, HEADS, HEAD_DIM = 120, 48, 4, 12
FULL, HALF = HEADS * HEAD_DIM, HEADS * HEAD_DIM // 2
METHODS = ["cp", "tucker", "svd", "prune", "key-svd", "kv-svd"]
ENCODERS = ["bert", "roberta", "distilbert", "albert"]
DECODERS = ["gpt2", "opt", "bert-decoder", "roberta-decoder"]
CASES = [(family, method, rank) for family in ENCODERS + DECODERS for method in METHODS for rank in (FULL, HALF)]
SPECIAL_TOKENS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def config_of(family: str) -> transformers.PretrainedConfig:
    """A small random configuration: 4 heads of 12, 2 layers (ALBERT: 3 sharing one)."""
    if family == "gpt2":
        return transformers.GPT2Config(n_embd=D, n_layer=2, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
                                       **SPECIAL_TOKENS)
    if family == "opt":
        return transformers.OPTConfig(hidden_size=D, num_attention_heads=HEADS, num_hidden_layers=2, ffn_dim=96,
                                      vocab_size=VOCAB, max_position_embeddings=64, word_embed_proj_dim=D,
                                      **SPECIAL_TOKENS)
    if family.endswith("-decoder"):
        return small_config(family.removesuffix("-decoder"), is_decoder=True, **SPECIAL_TOKENS)
    return small_config(family)


def model_type(family: str) -> str:
    return family.removesuffix("-decoder")


def build(model_class: type, family: str, **overrides) -> transformers.PreTrainedModel:
    config = config_of(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = model_class(config).eval()
    model.set_attn_implementation("eager")
    return model


def convert(model: transformers.PreTrainedModel, method: str, rank: int) -> transformers.PreTrainedModel:
    model = copy.deepcopy(model)
    layers = len(attention_modules(model, FAMILY_SPECS[model_type(model.config.model_type)]))
    options = {
        "cp": {"n_iter_max": 5}, "tucker": {"n_iter_max": 5}, "svd": {},
        "prune": {"importance": [torch.tensor([0.4, 0.9, 0.1, 0.6])] * layers}, "key-svd": {}, "kv-svd": {},
    }[method]
    reparametrize(model, rank, method=method, progress=False, **options)
    return model.eval()


def auto_class(family: str) -> type:
    return transformers.AutoModelForCausalLM if family in DECODERS else transformers.AutoModel


def base_class(family: str) -> type:
    """The class the family's auto class builds: its causal LM for decoders, its bare model for encoders."""
    return auto_class(family)._model_mapping[type(config_of(family))]


_MODELS: dict = {}


def original_and_converted(family: str, method: str, rank: int):
    """The original model (its base class, or the causal LM for decoders) and its conversion, built once."""
    key = (family, method, rank)
    if key not in _MODELS:
        original = build(base_class(family), family)
        _MODELS[key] = original, convert(original, method, rank)
    return _MODELS[key]


def token_ids(batch: int = 2, length: int = 7, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def heads_per_layer(model) -> list[int]:
    return [m.num_heads for m in model.modules() if isinstance(m, ConvertedSelfAttention)]


def num_layers(model) -> int:
    config = model.config
    return getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) or config.n_layers


def tensors_of(output) -> dict[str, torch.Tensor]:
    return {name: value for name, value in output.items() if torch.is_tensor(value)}


def assert_same_outputs(got, expected, atol: float = 0.0):
    got, expected = tensors_of(got), tensors_of(expected)
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].shape == value.shape, name
        assert (got[name] - value).abs().max() <= atol, name


# Attention maps and hidden states ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family, method, rank", CASES)
def test_attention_maps_from_the_call_and_from_the_config(family, method, rank):
    original, model = original_and_converted(family, method, rank)
    ids = token_ids()
    with torch.no_grad():
        from_call = model(ids, output_attentions=True).attentions
        model.config.output_attentions = True
        try:
            from_config = model(ids).attentions
        finally:
            model.config.output_attentions = False
        expected = original(ids, output_attentions=True).attentions
    layers = num_layers(model)
    assert len(from_call) == len(from_config) == len(expected) == layers
    heads = heads_per_layer(model)
    for i, (a, b) in enumerate(zip(from_call, from_config)):
        assert a.shape == (2, heads[i % len(heads)], 7, 7)
        assert torch.equal(a, b)
        assert torch.allclose(a.sum(-1), torch.ones(()), atol=1e-5)  # each row a distribution
        if family in DECODERS:
            assert a.triu(1).abs().max() == 0  # nothing attends to the future
    if rank == FULL:
        for a, b in zip(from_call, expected):
            assert (a - b).abs().max() < 1e-5


@pytest.mark.parametrize("family, method", [(f, m) for f in ENCODERS + DECODERS for m in METHODS])
def test_attention_maps_in_sdpa_mode_equal_the_eager_ones(family, method):
    """In sdpa mode the original returns no maps (transformers' sdpa cannot); a converted layer computes its own
    weights, so ``output_attentions=True`` still returns them."""
    _, model = original_and_converted(family, method, HALF)
    ids = token_ids()
    with torch.no_grad():
        eager = model(ids, output_attentions=True).attentions
        model.set_attn_implementation("sdpa")
        try:
            sdpa = model(ids, output_attentions=True).attentions
        finally:
            model.set_attn_implementation("eager")
    assert len(sdpa) == num_layers(model)
    for a, b in zip(sdpa, eager):
        assert torch.allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("family, method, rank", CASES)
def test_hidden_states_and_inputs_embeds(family, method, rank):
    original, model = original_and_converted(family, method, rank)
    ids = token_ids()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
        embeds = model.get_input_embeddings()(ids)
        from_embeds = model(inputs_embeds=embeds)
        expected = original(ids, output_hidden_states=True)
    assert len(out.hidden_states) == num_layers(model) + 1
    assert all(h.shape[:2] == (2, 7) for h in out.hidden_states)
    main = "logits" if family in DECODERS else "last_hidden_state"
    assert torch.allclose(from_embeds[main], out[main], atol=1e-6)
    if family not in DECODERS:
        assert torch.equal(out.hidden_states[-1], out.last_hidden_state)
    if rank == FULL:
        for a, b in zip(out.hidden_states, expected.hidden_states):
            assert (a - b).abs().max() < 1e-4


@pytest.mark.parametrize("family, method", [(f, m) for f in ENCODERS + DECODERS for m in METHODS])
def test_gradients_reach_retained_hidden_states_and_attentions(family, method):
    """As transformers' test: the first hidden state and attention map keep their gradients, non-zero where the
    original's are (OPT's first hidden state does not reach the output: a zero gradient in the original too)."""
    original, model = original_and_converted(family, method, HALF)
    reached = []
    for m in (original, model):
        out = m(token_ids(), output_hidden_states=True, output_attentions=True)
        hidden, attention = out.hidden_states[0], out.attentions[0]
        hidden.retain_grad()
        attention.retain_grad()
        last = out[0][:, -1]  # the last position: under a causal mask it sees every token
        # a fixed random direction: the plain sum of a LayerNorm output is constant
        (last * torch.randn(last.shape, generator=torch.Generator().manual_seed(0))).sum().backward()
        assert hidden.grad is not None and attention.grad is not None
        reached.append((bool(hidden.grad.abs().sum() > 0), bool(attention.grad.abs().sum() > 0)))
        m.zero_grad(set_to_none=True)
    assert reached[1] == reached[0]
    assert reached[1][1]  # the first layer's attention map shapes the output


# Every head class: convert, save, load back -------------------------------------------------------------------------


def head_class_cases():
    return [(family, cls, method) for family in ENCODERS + ["gpt2", "opt"]
            for cls in head_classes(FAMILY_SPECS[family]) for method in METHODS]


def inputs_for(model_class: type) -> dict[str, torch.Tensor]:
    ids = token_ids()
    if "MultipleChoice" in model_class.__name__ or "DoubleHeads" in model_class.__name__:
        ids = torch.stack([ids, token_ids(seed=1)], dim=1)  # (batch, choices, length)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def auto_classes_of(model_class: type) -> list[type]:
    return [auto for auto in AUTO_CLASSES
            if auto._model_mapping._model_mapping.get(model_class.config_class.model_type) == model_class.__name__]


@pytest.mark.parametrize("family, model_class, method", head_class_cases(),
                         ids=lambda v: v.__name__ if isinstance(v, type) else str(v))
def test_every_head_class_converts_saves_and_loads_back(tmp_path, family, model_class, method):
    model = convert(build(model_class, family), method, HALF)
    assert type(model) is collab_model_class(model_class)
    model.save_pretrained(tmp_path)
    inputs = inputs_for(model_class)
    extra = {"use_cache": False} if family in ("gpt2", "opt") else {}
    with torch.no_grad():
        expected = model(**inputs, **extra)
        for loader in [collab_model_class(model_class), *auto_classes_of(model_class)]:
            loaded = loader.from_pretrained(tmp_path).eval()
            assert type(loaded) is collab_model_class(model_class), loader.__name__
            assert_same_outputs(loaded(**inputs, **extra), expected)


def test_head_classes_come_from_transformers_and_all_have_collaborative_classes():
    for family in FAMILY_SPECS.values():
        classes = head_classes(family)
        assert classes and all(issubclass(cls, transformers.PreTrainedModel) for cls in classes)
        assert not any(cls.__name__.endswith("PreTrainedModel") for cls in classes)
        assert all(cls in _COLLAB_MODELS for cls in classes)
    assert transformers.GPT2DoubleHeadsModel in head_classes(FAMILY_SPECS["gpt2"])


def test_a_class_transformers_does_not_export_is_refused_before_anything_changes():
    class MyBert(transformers.BertModel):
        pass

    torch.manual_seed(0)
    model = MyBert(small_config("bert")).eval()
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    with pytest.raises(ValueError, match="MyBert is not a bert model class.*BertForSequenceClassification"):
        reparametrize(model, HALF, progress=False)
    assert model.config.model_type == "bert" and type(model) is MyBert
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


# Weights: dtypes, safetensors, tied and resized embeddings ---------------------------------------------------------


@pytest.mark.parametrize("family", ["bert", "gpt2"])
@pytest.mark.parametrize("method", METHODS)
def test_dtype_round_trips_and_safetensors(tmp_path, family, method):
    model = convert(build(base_class(family), family), method, HALF)
    model.to(torch.bfloat16).save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").is_file() and not (tmp_path / "pytorch_model.bin").exists()
    auto = auto_class(family)
    for dtype in ["auto", torch.bfloat16]:
        loaded = auto.from_pretrained(tmp_path, dtype=dtype, use_safetensors=True)
        assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}, dtype
    assert {p.dtype for p in auto.from_pretrained(tmp_path, torch_dtype=torch.bfloat16).parameters()} == {
        torch.bfloat16}  # the keyword older code passes
    as_float = auto.from_pretrained(tmp_path, dtype=torch.float32)
    assert {p.dtype for p in as_float.parameters()} == {torch.float32}
    for name, tensor in model.state_dict().items():
        assert torch.equal(as_float.state_dict()[name], tensor.float()), name


@pytest.mark.parametrize("family, model_class", [("bert", transformers.BertForMaskedLM),
                                                 ("gpt2", transformers.GPT2LMHeadModel),
                                                 ("opt", transformers.OPTForCausalLM)])
@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings_survive_save_and_load(tmp_path, family, model_class, tied):
    model = convert(build(model_class, family, tie_word_embeddings=tied), "cp", HALF)
    model.save_pretrained(tmp_path)
    loaded = collab_model_class(model_class).from_pretrained(tmp_path).eval()
    same_storage = loaded.get_output_embeddings().weight.data_ptr() == loaded.get_input_embeddings().weight.data_ptr()
    assert same_storage == tied
    inputs = inputs_for(model_class)
    with torch.no_grad():
        assert torch.equal(loaded(**inputs).logits, model(**inputs).logits)


@pytest.mark.parametrize("family, model_class", [("bert", transformers.BertForMaskedLM),
                                                 ("gpt2", transformers.GPT2LMHeadModel)])
@pytest.mark.parametrize("method", METHODS)
def test_resized_embeddings(tmp_path, family, model_class, method):
    model = convert(build(model_class, family), method, HALF)
    model.resize_token_embeddings(VOCAB + 8)
    assert model.config.vocab_size == VOCAB + 8
    ids = token_ids()
    ids[0, -1] = VOCAB + 5  # a new token
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (2, 7, VOCAB + 8) and torch.isfinite(logits).all()
    model.save_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(collab_model_class(model_class).from_pretrained(tmp_path).eval()(ids).logits, logits)


# Generation ---------------------------------------------------------------------------------------------------------

GENERATION_CASES = [(family, method, rank) for family in DECODERS for method in METHODS for rank in (FULL, HALF)]
NEW = 4


def dict_generate(model, ids, **settings):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0,
        return_dict_in_generate=True, output_scores=True, output_logits=True, output_attentions=True,
        output_hidden_states=True, **settings,
    )


def check_dict_output(model, out, batch: int, prompt: int):
    heads = heads_per_layer(model)
    assert out.sequences.shape == (batch, prompt + NEW)
    assert len(out.scores) == len(out.logits) == NEW and all(s.shape == (batch, VOCAB) for s in out.scores)
    assert len(out.attentions) == len(out.hidden_states) == NEW
    for step, (attentions, hidden) in enumerate(zip(out.attentions, out.hidden_states)):
        queries, keys = (prompt, prompt) if step == 0 else (1, prompt + step)
        assert len(attentions) == num_layers(model) and len(hidden) == num_layers(model) + 1
        for layer, weights in enumerate(attentions):
            assert weights.shape == (batch, heads[layer % len(heads)], queries, keys)


@pytest.mark.parametrize("family, method, rank", GENERATION_CASES)
def test_greedy_dict_outputs_and_scores_with_and_without_cache(family, method, rank):
    original, model = original_and_converted(family, method, rank)
    ids = token_ids(length=5)
    cached = dict_generate(model, ids, do_sample=False, use_cache=True)
    check_dict_output(model, cached, 2, 5)
    uncached = dict_generate(model, ids, do_sample=False, use_cache=False)
    assert torch.equal(cached.sequences, uncached.sequences)
    for a, b in zip(cached.scores, uncached.scores):
        assert torch.allclose(a, b, atol=1e-4)
    if rank == FULL:
        assert torch.equal(cached.sequences, dict_generate(original, ids, do_sample=False).sequences)


@pytest.mark.parametrize("family, method", [(f, m) for f in DECODERS for m in METHODS])
def test_sampling_and_beam_search_dict_outputs(family, method):
    _, model = original_and_converted(family, method, HALF)
    ids = token_ids(length=5)
    torch.manual_seed(0)
    sampled = dict_generate(model, ids, do_sample=True, top_k=10)
    check_dict_output(model, sampled, 2, 5)
    torch.manual_seed(0)
    assert torch.equal(dict_generate(model, ids, do_sample=True, top_k=10, use_cache=False).sequences,
                       sampled.sequences)
    beams = dict_generate(model, ids, do_sample=False, num_beams=2)
    assert beams.sequences.shape == (2, 5 + NEW) and beams.sequences_scores.shape == (2,)
    assert len(beams.scores) == NEW and beams.scores[0].shape == (4, VOCAB)
    assert torch.equal(beams.sequences,
                       dict_generate(model, ids, do_sample=False, num_beams=2, use_cache=False).sequences)


@pytest.mark.parametrize("family, method", [(f, m) for f in DECODERS for m in METHODS])
def test_assisted_and_prompt_lookup_decoding_equal_greedy(family, method):
    original, model = original_and_converted(family, method, HALF)
    ids = token_ids(batch=1, length=6)
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0, "num_beams": 1}
    greedy = model.generate(ids, **settings)
    for assistant in (model, original):  # itself (every draft accepted) and the original (drafts rejected)
        assert torch.equal(model.generate(ids, assistant_model=assistant, **settings), greedy)
    out = model.generate(ids, assistant_model=original, return_dict_in_generate=True, output_scores=True,
                         output_attentions=True, **settings)
    assert torch.equal(out.sequences, greedy) and len(out.scores) == 6
    assert torch.equal(model.generate(ids, prompt_lookup_num_tokens=2, **settings), greedy)


@pytest.mark.parametrize("family", DECODERS)
def test_generate_from_inputs_embeds(family):
    _, model = original_and_converted(family, "cp", HALF)
    ids = token_ids(length=5)
    settings = {"max_new_tokens": NEW, "do_sample": False, "pad_token_id": 0}
    from_ids = model.generate(ids, **settings)
    from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), **settings)
    assert torch.equal(from_embeds, from_ids[:, 5:])  # generate returns only the new tokens from inputs_embeds


@pytest.mark.parametrize("family", DECODERS)
@pytest.mark.parametrize("method", METHODS)
def test_cache_layout_is_the_documented_one(family, method):
    """transformers' own test expects (batch, heads, tokens, head_dim) keys; the README documents, per layer and
    token, one shared key of width D~ plus a content logit per head (collaborative) or each head's narrowed key plus
    its content logit (svd), beside per-head values; one shared key (key-svd) or the latent alone (kv-svd)."""
    _, model = original_and_converted(family, method, HALF)
    ids = token_ids(length=5)
    with torch.no_grad():
        cache = model(ids, use_cache=True).past_key_values
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    for layer, cached in zip(layers, cache.layers):
        if isinstance(layer, CollaborativeSelfAttention):
            assert cached.keys.shape == (2, 1, 5, HALF + HEADS)
        elif method == "svd":
            assert cached.keys.shape == (2, HEADS, 5, HALF // HEADS + 1)
        elif method in ("key-svd", "kv-svd"):  # one shared key, or the latent, per token
            assert cached.keys.shape == (2, 1, 5, HALF)
        else:  # pruned heads keep their keys and query/key biases
            assert cached.keys.shape == (2, layer.num_heads, 5, HEAD_DIM)
        if method == "kv-svd":  # no values: an empty tensor keeps the position count
            assert cached.values.shape == (2, 1, 5, 0)
        else:
            assert cached.values.shape == (2, layer.num_heads, 5, HEAD_DIM)


def test_plain_auto_loading_of_a_family_base_is_collaborative(tmp_path):
    _, model = original_and_converted("gpt2", "cp", HALF)
    model.save_pretrained(tmp_path)
    assert type(AutoModel.from_pretrained(tmp_path)).__name__ == "CollabGPT2Model"
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)).__name__ == "CollabGPT2LMHeadModel"
