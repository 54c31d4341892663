"""``collab_attn.layer_sensitivity`` (collab_attn/fitting/sensitivity.py): how much each converted attention layer adds
to a converted model's loss against the original. On two-layer models the identities that hold whatever the layers'
errors are: putting layer 0's original attention back is the original with only layer 1 converted, every layer
restored is the original (loss 0), an exact conversion costs nothing anywhere; the loss is the end-to-end fit's;
both models come back with their own modules."""

import copy

import pytest
from conftest import random_batch, small_model
from test_fitting import FIT, gpt2, kl, llama

import collab_attn

pytestmark = pytest.mark.usefixtures("one_thread")
CASES = [(llama, "key-svd", 8, {"value_rank": 12}), (llama, "cp", 12, {"value_rank": 12}),
         (llama, "kv-svd", 20, {"rope_pairs": 1}), (gpt2, "cp", 20, {"value_rank": 20})]


def converted(make, method, rank, **options):
    original = make()
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, rank, method=method, progress=False, **options)
    return original, model


def modules(model):
    return {name: id(module) for name, module in model.named_modules()}


@pytest.mark.parametrize("make, method, rank, options", CASES, ids=[f"{m.__name__}-{x}" for m, x, _, _ in CASES])
def test_restoring_one_layer_of_two_is_converting_the_other_alone(make, method, rank, options):
    original, model = converted(make, method, rank, **options)
    own = (modules(original), modules(model))
    report = collab_attn.layer_sensitivity(model, original, FIT[:2], progress=False)
    assert (modules(original), modules(model)) == own and not model.training
    assert report.kind == "kl" and report.tokens == 2 * FIT[0]["input_ids"].numel()
    whole = sum(kl(original, model, batch["input_ids"]) for batch in FIT[:2]) / 2  # the test's own KL
    assert report.loss == pytest.approx(whole, rel=1e-4) and report.loss > 1e-3
    first, second = report.layers
    assert first.restored == pytest.approx(second.alone, rel=1e-4, abs=1e-7)
    assert second.restored == pytest.approx(first.alone, rel=1e-4, abs=1e-7)
    assert all(0 < layer.alone < report.loss and layer.restored < report.loss for layer in report.layers)
    assert "| sum (" in report.table() and len(report.table().splitlines()) == 5


def test_every_layer_restored_is_the_original_and_an_exact_conversion_costs_nothing():
    original, model = converted(llama, "key-svd", 24, value_rank=24)  # 2 groups x 12: exact
    report = collab_attn.layer_sensitivity(model, original, FIT[:1], progress=False)
    assert report.loss < 1e-8 and all(x.restored < 1e-8 and x.alone < 1e-8 for x in report.layers)
    original, model = converted(lambda: gpt2(layers=1), "cp", 12, value_rank=12)
    report = collab_attn.layer_sensitivity(model, original, FIT[:1], progress=False)
    assert report.layers[0].restored < 1e-8 < report.loss == pytest.approx(report.layers[0].alone)


def test_a_model_without_logits_is_measured_on_its_hidden_states_with_the_projection_beside_it():
    original = small_model("bert", num_hidden_layers=2)  # BERT keeps the output projection beside the attention
    model = copy.deepcopy(original)
    collab_attn.reparametrize(model, 16, progress=False, value_rank=16)
    batch = random_batch()
    report = collab_attn.layer_sensitivity(model, original, [batch], progress=False)
    assert report.kind == "relative squared error" and report.tokens == int(batch["attention_mask"].sum())
    first, second = report.layers
    assert first.restored == pytest.approx(second.alone, rel=1e-4) and second.restored == pytest.approx(first.alone,
                                                                                                        rel=1e-4)


def test_bad_arguments_are_refused():
    original, model = converted(llama, "key-svd", 8, value_rank=12)
    with pytest.raises(ValueError, match="original must be the model before the conversion"):
        collab_attn.layer_sensitivity(model, model, FIT[:1], progress=False)
    with pytest.raises(ValueError, match="no fitting tokens"):
        collab_attn.layer_sensitivity(model, original, [], progress=False)
