"""``collab_attn.fit_to_original``: each converted attention layer trained to give the original's attention output on
the inputs the converted model gives it (collab_attn/fitting/layer_fit.py). On tiny random GPT-2 and grouped-head Llama
models converted at half the cache by every method: the held-out KL from the original falls, the cache and the
parameter shapes stay, an exact conversion stays exact, the report has one record per layer; the other families run
through the same routine; bad arguments are refused."""

import copy

import pytest
import torch
import transformers
from conftest import random_batch, small_model

import collab_attn
from collab_attn.kinds import ConvertedSelfAttention
from collab_attn.models.settings import MethodSettings
from collab_attn.pretrained.race import mean_cache_numbers

pytestmark = pytest.mark.usefixtures("one_thread")
STEPS = 30


def gpt2(layers=2) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)  # initializer_range 0.2: attention far from uniform, so keys matter
    config = transformers.GPT2Config(n_embd=48, n_head=4, n_layer=layers, vocab_size=100, n_positions=64,
                                     initializer_range=0.2, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.GPT2LMHeadModel(config).eval()


def llama() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)  # 4 heads of 12 reading 2 key/value groups: 48 numbers cached per token and layer
    config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      num_hidden_layers=2, intermediate_size=64, vocab_size=100,
                                      max_position_embeddings=128, initializer_range=0.2, bos_token_id=1,
                                      eos_token_id=2, pad_token_id=0)
    return transformers.LlamaForCausalLM(config).eval()


def ids(seed: int, shape=(8, 24)) -> torch.Tensor:
    return torch.randint(3, 100, shape, generator=torch.Generator().manual_seed(seed))


FIT = [{"input_ids": ids(seed)} for seed in range(4)]
HELD_OUT = ids(99)  # tokens no fit reads


def kl(original, converted, tokens=HELD_OUT) -> float:
    with torch.no_grad():
        p, q = (m(tokens).logits.log_softmax(-1) for m in (original, converted))
    return float((p.exp() * (p - q)).sum(-1).mean())


def converted(make, method, rank, **options):
    original = make()
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, rank, method=method, progress=False, **options)
    return original, model


# half of each model's cache (GPT-2: 96 numbers per token and layer; the Llama: 48); key-svd keeps GPT-2's values,
# so it never gets below half there (60)
HALF = [
    (gpt2, "cp", 20, {"value_rank": 20}), (gpt2, "tucker", 20, {"value_rank": 20}), (gpt2, "key-svd", 12, {}),
    (gpt2, "kv-svd", 24, {}), (gpt2, "merge-kv", 24, {}), (gpt2, "drop-kv", 24, {}),
    (llama, "cp", 12, {"value_rank": 12}), (llama, "tucker", 12, {"value_rank": 12}),
    (llama, "key-svd", 12, {"value_rank": 12}), (llama, "kv-svd", 20, {"rope_pairs": 1}),
    (llama, "merge-kv", 12, {}), (llama, "drop-kv", 12, {}),
]


@pytest.mark.parametrize("make, method, rank, options", HALF,
                         ids=[f"{make.__name__}-{method}" for make, method, _, _ in HALF])
def test_the_fit_lowers_the_held_out_kl_and_keeps_the_cache_and_the_shapes(make, method, rank, options):
    original, model = converted(make, method, rank, **options)
    cache = mean_cache_numbers(model)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    attention = {"attn", "self_attn"}
    others = {name: p.clone() for name, p in model.named_parameters() if not attention & set(name.split("."))}
    before = kl(original, model)
    report = collab_attn.fit_to_original(model, original, FIT, steps=STEPS, progress=False)
    after = kl(original, model)
    assert after < 0.99 * before, (before, after)
    assert mean_cache_numbers(model) == cache and cache <= (60 if method == "key-svd" else 48) * (
        2 if make is gpt2 else 1)
    assert {name: p.shape for name, p in model.named_parameters()} == shapes
    for name, buffer in model.named_buffers():
        torch.testing.assert_close(buffer, buffers[name], rtol=0, atol=0)
    for name, p in model.named_parameters():  # only the attention layers move
        if name in others:
            torch.testing.assert_close(p, others[name], rtol=0, atol=0)
    assert [layer.name for layer in report.layers] == [n for n, m in model.named_modules()
                                                       if isinstance(m, ConvertedSelfAttention)]
    assert all(layer.error_after <= layer.error_before for layer in report.layers)
    assert all(layer.kept_fit and layer.error_after < 0.9 * layer.error_before for layer in report.layers)
    assert report.tokens == 4 * 8 * 24 and "| mean (" in report.table()


@pytest.mark.parametrize("make, method, rank, options", [(gpt2, "kv-svd", 48, {}), (gpt2, "cp", 48, {}),
                                                         (llama, "key-svd", 24, {}), (llama, "cp", 48, {})],
                         ids=["gpt2-kv-svd", "gpt2-cp", "llama-key-svd", "llama-cp"])
def test_an_exact_conversion_stays_exact(make, method, rank, options):
    """kv-svd at d_in on GPT-2 and key-svd at kv_heads x head_dim on the Llama are exact at half the cache; cp at
    full rank is exact. Adam would move every weight by about its learning rate: the better of before and after is
    kept. (Where the converted layer computes the original's numbers bit for bit, as the rotary cp layer's causal
    prompt does, the loss and its gradient are zero and nothing moves.)"""
    original, model = converted(make, method, rank, **options)
    with torch.no_grad():
        expected = model(HELD_OUT).logits
    report = collab_attn.fit_to_original(model, original, FIT, steps=5, learning_rate=1e-2, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, expected, rtol=0, atol=1e-6)
    assert all(not layer.kept_fit and layer.error_after == layer.error_before < 1e-9 for layer in report.layers)
    assert all(layer.fitted_error > layer.error_before or layer.fitted_error == layer.error_before == 0
               for layer in report.layers)


def fitted_counting_passes(make, target):
    """A cp conversion at 12/12 fitted 5 steps; its report, its weights and how often its second block ran."""
    original, model = converted(make, "cp", 12, value_rank=12)
    blocks = next(n for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList))
    passes = []
    handle = model.get_submodule(f"{blocks}.1").register_forward_pre_hook(lambda *args: passes.append(1))
    report = collab_attn.fit_to_original(model, original, FIT, steps=5, target=target, progress=False)
    handle.remove()
    return report, {name: p.detach().clone() for name, p in model.named_parameters()}, len(passes)


@pytest.mark.parametrize("make, target", [(llama, "layer"), (gpt2, "layer"), (llama, "residual")])
def test_later_passes_end_at_the_first_layer_where_every_layer_takes_the_same_arguments(make, target, monkeypatch):
    """The model hands every layer the same masks and positions: a fitting pass after the first is captured at its
    first layer, and the fit is the one that captures every layer of every pass, to the bit."""
    from collab_attn.fitting import layer_fit

    shared = layer_fit._one_call
    answers = []
    monkeypatch.setattr(layer_fit, "_one_call", lambda calls: answers.append(shared(calls)) or answers[-1])
    short, weights, passes = fitted_counting_passes(make, target)
    assert answers and all(answers)  # every capture took the shortcut
    monkeypatch.setattr(layer_fit, "_one_call", lambda calls: False)
    full, full_weights, full_passes = fitted_counting_passes(make, target)
    assert [(f.error_before, f.error_after) for f in short.layers] == [(f.error_before, f.error_after)
                                                                       for f in full.layers]
    assert all(torch.equal(weights[name], full_weights[name]) for name in weights)
    assert passes < full_passes  # the second block ran in fewer passes


@pytest.mark.parametrize("family", ["bert", "albert", "distilbert"])
def test_encoders_with_padding_and_a_shared_layer_go_through_the_same_routine(family):
    """BERT keeps its output projection beside the attention module (fitted with it), ALBERT calls one layer three
    times per pass (fitted once, on every call's inputs), padding tokens are left out of the error."""
    original = small_model(family, initializer_range=0.2)
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, 12, method="cp", value_rank=12, progress=False)
    lengths = [(11, 7, 3), (9, 9, 5), (4, 10, 8)]
    batches = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]}
               for b in (random_batch(lengths=ls, seed=s) for s, ls in enumerate(lengths))]
    report = collab_attn.fit_to_original(model, original, batches, steps=STEPS, learning_rate=1e-2, progress=False)
    layers = 1 if family == "albert" else 2
    assert len(report.layers) == layers and report.tokens == sum(sum(ls) for ls in lengths)
    assert report.layers[0].calls == 3 * (3 if family == "albert" else 1)
    assert all(layer.kept_fit and layer.error_after < 0.9 * layer.error_before for layer in report.layers)


@pytest.mark.parametrize("family", ["qwen2", "mistral"])
def test_the_other_rotary_families_are_fitted_too(family):
    """Qwen2 (biased query/key/value) and Mistral: the same routine as Llama."""
    config_class, model_class = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                                 "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}[family]
    torch.manual_seed(0)
    config = config_class(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                          num_hidden_layers=2, intermediate_size=64, vocab_size=100, max_position_embeddings=128,
                          initializer_range=0.2, sliding_window=None)
    original = model_class(config).eval()
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, 12, method="key-svd", value_rank=12, progress=False)
    before = kl(original, model)
    report = collab_attn.fit_to_original(model, original, FIT, steps=STEPS, progress=False)
    assert kl(original, model) < before and all(layer.error_after < 0.9 * layer.error_before for layer in report.layers)


def test_opt_is_fitted_too():
    torch.manual_seed(0)
    config = transformers.OPTConfig(hidden_size=48, num_attention_heads=4, num_hidden_layers=2, ffn_dim=64,
                                    vocab_size=100, max_position_embeddings=64, word_embed_proj_dim=48,
                                    init_std=0.2)
    original = transformers.OPTForCausalLM(config).eval()
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, 24, method="kv-svd", progress=False)
    before = kl(original, model)
    with torch.no_grad():  # the fit trains all the same
        report = collab_attn.fit_to_original(model, original, FIT, steps=STEPS, progress=False)
    assert kl(original, model) < before and all(layer.kept_fit for layer in report.layers)


def test_bad_arguments_say_what_to_pass():
    original, model = converted(gpt2, "kv-svd", 24)
    kept = {key: value.clone() for key, value in model.state_dict().items()}
    fit = collab_attn.fit_to_original
    for steps in (0, -3, 2.5, None):
        with pytest.raises(ValueError, match="steps must be a positive number"):
            fit(model, original, FIT, steps=steps)
    with pytest.raises(ValueError, match="learning_rate must be a positive number"):
        fit(model, original, FIT, steps=3, learning_rate=0.0)
    for batches in ([], [{"input_ids": torch.zeros(0, 5, dtype=torch.long)}]):
        with pytest.raises(ValueError, match="no fitting tokens: pass at least one non-empty batch"):
            fit(model, original, batches, steps=3)
    with pytest.raises(ValueError, match="batches must be a list of tokenized batches .* got None"):
        fit(model, original, None, steps=3)
    with pytest.raises(ValueError, match="got one dict: pass \\[batch\\]"):
        fit(model, original, FIT[0], steps=3)
    with pytest.raises(ValueError, match="each batch must be a dict with input_ids"):
        fit(model, original, [HELD_OUT], steps=3)
    with pytest.raises(ValueError, match="input_ids hold token ids from .* to 100, outside the model's vocabulary "
                                         "of 100"):
        fit(model, original, [{"input_ids": HELD_OUT.clamp(max=99) + 1}], steps=3)
    with pytest.raises(ValueError, match="input_ids must be a 2-D tensor of token ids"):
        fit(model, original, [{"input_ids": HELD_OUT.float()}], steps=3)
    with pytest.raises(ValueError, match="seed must be an integer, got '0'"):
        fit(model, original, FIT, steps=3, seed="0")
    with pytest.raises(ValueError, match="progress must be True or False, got 'no'"):
        fit(model, original, FIT, steps=3, progress="no")
    torch.manual_seed(1)  # the same config, other weights: not the model converted was made from
    other = transformers.GPT2LMHeadModel(original.config).eval()
    for call in (lambda: fit(model, other, FIT, steps=3),
                 lambda: collab_attn.fit_end_to_end(model, other, FIT, steps=3),
                 lambda: collab_attn.layer_sensitivity(model, other, FIT, progress=False)):
        with pytest.raises(ValueError, match="original's weights outside the attention layers differ from "
                                             "converted's \\(transformer.*relative distance up to 1.4.*original "
                                             "must be the model"):
            call()
    with pytest.raises(ValueError, match="converted has no converted attention layers"):
        fit(gpt2(), original, FIT, steps=3)
    with pytest.raises(ValueError, match="original must be the model before the conversion"):
        fit(model, model, FIT, steps=3)
    with pytest.raises(ValueError, match="but original has 3 attention layers"):
        fit(model, gpt2(layers=3), FIT, steps=3)
    with pytest.raises(ValueError, match="original is a llama model but converted was made from a gpt2 model"):
        fit(model, llama(), FIT, steps=3)
    config = copy.deepcopy(original.config)
    config.n_inner = 64
    wider = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(ValueError, match=r"config differs from original's in \['n_inner'\]"):
        fit(model, wider, FIT, steps=3)
    for key, value in model.state_dict().items():  # nothing moved
        torch.testing.assert_close(value, kept[key], rtol=0, atol=0)


def test_fit_steps_in_the_method_settings():
    """``collab.fit_steps`` (scripts/reparametrize.py): fits on the calibration texts, the model's own without them;
    0 and null are off (and leave a GLUE job's key as it was); a method without calibration texts does not take it,
    and an entry point that does not fit refuses it rather than ignoring it."""
    group = {"method": "key-svd", "rank": 8, "calibration": "texts.txt", "fit_steps": 50}
    settings = MethodSettings.from_config(group)
    assert settings.fit_steps == 50 and settings.to_group()["fit_steps"] == 50
    for off in (0, None):
        assert MethodSettings.from_config({**group, "fit_steps": off}).to_group()["fit_steps"] is None
    own = MethodSettings.from_config({"method": "cp", "rank": 8, "fit_steps": 5})  # no texts: the model's own
    assert own.calibration.from_own and (own.calibration.samples, own.calibration.max_length) == (64, 256)
    assert own.to_group()["calibration"] == "own"
    with pytest.raises(ValueError, match="collab.fit_steps must be a number of steps per layer"):
        MethodSettings.from_config({**group, "fit_steps": "many"})
    with pytest.raises(ValueError, match="collab.fit_steps does not apply to collab.method=drop-kv"):
        MethodSettings.from_config({"method": "drop-kv", "rank": 8, "fit_steps": 5})
    with pytest.raises(ValueError, match="collab.fit_steps=50: scripts/visualize.py does not fit"):
        settings.refuse_fit("scripts/visualize.py")
    MethodSettings.from_config({**group, "fit_steps": None}).refuse_fit("scripts/visualize.py")
    both = MethodSettings.from_config({**group, "e2e_steps": 32})  # collab.e2e_steps: the same rules
    assert both.e2e_steps == 32 and both.to_group()["e2e_steps"] == 32 and settings.to_group()["e2e_steps"] is None
    assert MethodSettings.from_config({**group, "e2e_steps": 0}).e2e_steps is None
    assert MethodSettings.from_config({"method": "cp", "rank": 8, "e2e_steps": 5}).calibration.from_own
    with pytest.raises(ValueError, match="collab.e2e_steps must be a number of optimizer steps"):
        MethodSettings.from_config({**group, "e2e_steps": 2.5})
    with pytest.raises(ValueError, match="collab.e2e_steps=32: scripts/visualize.py does not fit"):
        MethodSettings.from_config({**group, "fit_steps": None, "e2e_steps": 32}).refuse_fit("scripts/visualize.py")
    shared = MethodSettings.from_config({**group, "value_rank": 8})  # key-svd shares values on rotary models
    assert shared.value_rank == 8 and MethodSettings.from_config(shared.to_group()) == shared
    fresh = MethodSettings.from_config({**group, "e2e_steps": 32, "e2e_texts": "fresh.txt"})  # collab.e2e_texts
    assert fresh.e2e_texts == "fresh.txt" and MethodSettings.from_config(fresh.to_group()) == fresh
    assert both.to_group()["e2e_texts"] is None
    with pytest.raises(ValueError, match="collab.e2e_texts=fresh.txt is what the end-to-end fit and the distillation "
                                         "train on"):
        MethodSettings.from_config({**group, "e2e_texts": "fresh.txt"})
    distilled = MethodSettings.from_config({**group, "distill_steps": 16, "e2e_texts": "fresh.txt"})  # the same rules
    assert distilled.distill_steps == 16 and MethodSettings.from_config(distilled.to_group()) == distilled
    assert MethodSettings.from_config({"method": "cp", "rank": 8, "distill_steps": 5}).calibration.from_own
    assert MethodSettings.from_config({**group, "distill_steps": 0}).distill_steps is None
    with pytest.raises(ValueError, match="collab.distill_steps must be a number of optimizer steps"):
        MethodSettings.from_config({**group, "distill_steps": True})
    with pytest.raises(ValueError, match="collab.distill_steps=16: scripts/visualize.py does not fit"):
        MethodSettings.from_config({**group, "fit_steps": None, "distill_steps": 16}).refuse_fit("scripts/visualize.py")
    with pytest.raises(ValueError, match="collab.e2e_texts must be a file path or null"):
        MethodSettings.from_config({**group, "e2e_steps": 32, "e2e_texts": 7})


@pytest.mark.parametrize("make, method, rank, options", [(gpt2, "cp", 20, {"value_rank": 20}),
                                                         (llama, "key-svd", 12, {"value_rank": 12}),
                                                         (llama, "kv-svd", 20, {"rope_pairs": 1})],
                         ids=["gpt2-cp", "llama-key-svd", "llama-kv-svd"])
@pytest.mark.parametrize("target", ["prefix", "residual"])
def test_targets_on_the_original_inputs_lower_the_held_out_kl_too(make, method, rank, options, target):
    """``target="prefix"`` (the original layer on the original's inputs) and ``"residual"`` (also the drift of the
    stream before it): the first layer sees no drift, so its error before the fit is the same for every target; a
    later layer's target differs from the layer target's by what the converted layers before it changed."""
    original, model = converted(make, method, rank, **options)
    layer_target = collab_attn.fit_to_original(copy.deepcopy(model), original, FIT, steps=1, progress=False)
    before = kl(original, model)
    report = collab_attn.fit_to_original(model, original, FIT, steps=STEPS, target=target, progress=False)
    assert report.target == target and report.to_dict()["target"] == target and f"target {target}" in report.table()
    assert kl(original, model) < 0.99 * before
    assert report.layers[0].error_before == pytest.approx(layer_target.layers[0].error_before, rel=1e-9)
    assert report.layers[1].error_before > 1.2 * layer_target.layers[1].error_before
    assert all(layer.kept_fit and layer.error_after < 0.9 * layer.error_before for layer in report.layers)


@pytest.mark.parametrize("target, inputs", [("prefix", "converted"), ("residual", "converted"),
                                            ("layer", "original")])
def test_an_exact_conversion_stays_exact_for_every_target(target, inputs):
    """At full rank the converted stream is the original's: every target is the original layer's output."""
    original, model = converted(llama, "cp", 48)
    with torch.no_grad():
        expected = model(HELD_OUT).logits
    report = collab_attn.fit_to_original(model, original, FIT, steps=5, learning_rate=1e-2, target=target,
                                         inputs=inputs, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, expected, rtol=0, atol=1e-6)
    assert all(not layer.kept_fit and layer.error_before < 1e-9 for layer in report.layers)


def test_inputs_original_fits_each_layer_on_the_original_inputs():
    """``inputs="original"``: a layer's error does not depend on what the layers before it are: with the first layer
    perturbed, the second's error is the same (and it is not when the layers are chained)."""
    original, model = converted(gpt2, "cp", 20, value_rank=20)
    perturbed = copy.deepcopy(model)
    with torch.no_grad():
        for p in perturbed.transformer.h[0].attn.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    one, two = (collab_attn.fit_to_original(copy.deepcopy(m), original, FIT, steps=1, inputs="original",
                                            progress=False) for m in (model, perturbed))
    assert one.layers[1].error_before == pytest.approx(two.layers[1].error_before, rel=1e-9)
    assert one.layers[0].error_before > 1.2 * two.layers[0].error_before or \
        two.layers[0].error_before > 1.2 * one.layers[0].error_before
    chained = [collab_attn.fit_to_original(copy.deepcopy(m), original, FIT, steps=1, progress=False)
               for m in (model, perturbed)]
    assert chained[0].layers[1].error_before != pytest.approx(chained[1].layers[1].error_before, rel=1e-3)


def test_bad_targets_and_inputs_say_what_to_pass():
    original, model = converted(gpt2, "kv-svd", 24)
    with pytest.raises(ValueError, match="target must be one of 'layer', 'prefix', 'residual'"):
        collab_attn.fit_to_original(model, original, FIT, steps=3, target="stream")
    with pytest.raises(ValueError, match="inputs must be 'converted' or 'original'"):
        collab_attn.fit_to_original(model, original, FIT, steps=3, inputs="both")
    with pytest.raises(ValueError, match="use target='layer' with inputs='original'"):
        collab_attn.fit_to_original(model, original, FIT, steps=3, target="residual", inputs="original")


def _projection_least_squares(model, original, batches):
    """Per converted layer of the fitted ``model``: its output projection's weight and bias as they are, and as the
    least-squares fit on ``batches`` of the original layer's output (on the inputs the converted model gives the
    layer) from what the projection reads; computed apart from the fit, with ``torch.linalg.lstsq``."""
    names = [n for n, m in model.named_modules() if isinstance(m, ConvertedSelfAttention)]
    reads, wants = {n: [] for n in names}, {n: [] for n in names}

    def hook(name):
        def forward(module, args, kwargs, output):
            wants[name].append(original.get_submodule(name)(*args, **kwargs)[0].reshape(-1, output[0].shape[-1]))
        return forward

    handles = [model.get_submodule(n).register_forward_hook(hook(n), with_kwargs=True) for n in names]
    handles += [model.get_submodule(n).output.register_forward_hook(
        lambda m, args, out, n=n: reads[n].append(args[0].reshape(-1, args[0].shape[-1]))) for n in names]
    with torch.no_grad():
        for batch in batches:
            model(**batch, use_cache=False)  # the original's layer is called with the converted one's arguments
    for handle in handles:
        handle.remove()
    result = []
    for name in names:
        projection = model.get_submodule(name).output
        inputs, weights = torch.cat(reads[name]).double(), projection.weight
        if projection.bias is not None:
            inputs = torch.cat([inputs, inputs.new_ones(len(inputs), 1)], dim=1)
            weights = torch.cat([weights, projection.bias[:, None]], dim=1)
        solution = torch.linalg.lstsq(inputs, torch.cat(wants[name]).double()).solution.T
        result.append((weights.detach().double(), solution))
    return result


@pytest.mark.parametrize("make, method, rank, options", [(gpt2, "cp", 20, {"value_rank": 20}),
                                                         (llama, "key-svd", 12, {"value_rank": 12}),
                                                         (llama, "kv-svd", 20, {"rope_pairs": 1})],
                         ids=["gpt2-cp", "llama-key-svd", "llama-kv-svd"])
def test_solve_output_leaves_each_output_projection_at_its_least_squares_optimum(make, method, rank, options):
    """``solve_output=True``: after the steps each layer's output projection is the least-squares fit of the
    original's output from what the projection reads (the layers before it fitted already, so their inputs are
    the ones it was fitted on; GPT-2's projection with its bias, the Llama's without); without it Adam's projection
    is not; the held-out KL falls."""
    original, model = converted(make, method, rank, **options)
    plain = copy.deepcopy(model)
    before = kl(original, model)
    report = collab_attn.fit_to_original(model, original, FIT, steps=STEPS, solve_output=True, progress=False)
    assert report.solve_output and report.to_dict()["solve_output"] and "output solved" in report.table()
    assert kl(original, model) < 0.99 * before and all(layer.kept_fit for layer in report.layers)
    for weights, optimum in _projection_least_squares(model, original, FIT):
        torch.testing.assert_close(weights, optimum, rtol=1e-4, atol=1e-5 * float(optimum.abs().max()))
    collab_attn.fit_to_original(plain, original, FIT, steps=STEPS, progress=False)
    (weights, optimum), _ = _projection_least_squares(plain, original, FIT)
    assert (weights - optimum).abs().max() > 1e-3 * optimum.abs().max()


def test_solve_output_keeps_an_exact_conversion_exact_and_takes_bert_s_projection_beside_the_module():
    """At full rank the solve finds the original's projection again (nothing to gain: the weights kept); BERT's
    projection is the one beside the attention module; ALBERT adds its residual LayerNorm after the projection,
    which no least-squares solve of the projection fits: refused before anything moves, as is a non-boolean."""
    original, model = converted(llama, "cp", 48)
    with torch.no_grad():
        expected = model(HELD_OUT).logits
    report = collab_attn.fit_to_original(model, original, FIT, steps=2, solve_output=True, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(HELD_OUT).logits, expected, rtol=0, atol=1e-6)
    assert all(layer.error_after < 1e-9 for layer in report.layers)

    batches = [random_batch(lengths=(9, 6, 4), seed=s) for s in range(3)]
    batches = [{"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]} for b in batches]
    for family in ("bert", "albert"):
        original = small_model(family, initializer_range=0.2)
        model = copy.deepcopy(original)
        collab_attn.reparametrize(model, 12, method="cp", value_rank=12, progress=False)
        if family == "bert":
            report = collab_attn.fit_to_original(model, original, batches, steps=STEPS, learning_rate=1e-2,
                                                 solve_output=True, progress=False)
            assert all(layer.kept_fit and layer.error_after < 0.9 * layer.error_before for layer in report.layers)
            continue
        kept = {key: value.clone() for key, value in model.state_dict().items()}
        with pytest.raises(NotImplementedError, match="something follows it.*pass False"):
            collab_attn.fit_to_original(model, original, batches, steps=3, solve_output=True, progress=False)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(value, kept[key], rtol=0, atol=0)
    with pytest.raises(ValueError, match="solve_output must be True or False, got 'yes'"):
        collab_attn.fit_to_original(model, original, batches, steps=3, solve_output="yes")
