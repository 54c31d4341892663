import copy

import pytest
import torch
import transformers
from conftest import dense_products_error, random_batch, small_config, small_model
from transformers import AutoModel

import collab_attn
from collab_attn import reparametrize
from collab_attn.kinds import CollaborativeSelfAttention


def hidden(model, batch, **kwargs):
    with torch.no_grad():
        return model(**batch, output_hidden_states=True, **kwargs).hidden_states[-1]


def max_diff_on_tokens(a, b, attention_mask):
    keep = attention_mask.bool()
    return (a[keep] - b[keep]).abs().max().item()


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return AutoModel.from_pretrained(minilm_path).eval()


def test_full_rank_minilm_is_exact_on_a_real_padded_batch(minilm, real_batch):
    model = copy.deepcopy(minilm)
    expected = hidden(minilm, real_batch)
    report = reparametrize(model, rank=384, progress=False)
    got = hidden(model, real_batch)
    assert max_diff_on_tokens(got, expected, real_batch["attention_mask"]) <= 1e-4
    assert (got - expected).abs().max() <= 1e-4  # padded positions too
    assert type(model).__name__ == "CollabBertModel" and model.config.model_type == "collab_attn_bert"
    assert all(layer.relative_error == 0.0 for layer in report.layers)
    assert len(report.layers) == 6 and report.layers[0].name == "encoder.layer.0.attention.self"


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert"])
@pytest.mark.parametrize("method", ["cp", "tucker"])
def test_full_rank_is_exact_for_every_family(family, method):
    torch.manual_seed(0)
    original = small_model(family)
    model = copy.deepcopy(original)
    batch = random_batch()
    expected = hidden(original, batch)
    reparametrize(model, rank=48, method=method, progress=False)
    assert isinstance(model, type(original)) and type(model) is not type(original)
    assert (hidden(model, batch) - expected).abs().max() <= 1e-4


def test_albert_shared_layers_are_converted_once():
    model = small_model("albert")
    report = reparametrize(model, rank=24, n_iter_max=3, progress=False)
    assert len(report.layers) == 1  # three layers, one shared set of weights


@pytest.mark.parametrize("head", ["AutoModelForSequenceClassification", "AutoModelForMaskedLM"])
def test_task_heads_are_converted_exactly(head):
    torch.manual_seed(0)
    original = getattr(transformers, head).from_config(small_config("bert")).eval()
    model = copy.deepcopy(original)
    batch = random_batch()
    with torch.no_grad():
        expected = original(**batch).logits
    reparametrize(model, rank=48, progress=False)
    assert type(model).__name__ == "Collab" + type(original).__name__
    with torch.no_grad():
        assert (model(**batch).logits - expected).abs().max() <= 1e-4


def test_low_rank_report_and_compression(minilm, real_batch):
    model = copy.deepcopy(minilm)
    report = reparametrize(
        model, rank=[192, 128, 96, 96, 128, 192], init="random", n_iter_max=3, progress=False
    )
    ranks = [layer.rank for layer in report.layers]
    assert ranks == [192, 128, 96, 96, 128, 192]
    # each reported error is that of the products the converted layers hold, recomputed densely against MiniLM's
    for layer, converted, original in zip(report.layers, model.encoder.layer, minilm.encoder.layer):
        expected = dense_products_error(original.attention.self, converted.attention.self)
        assert 0.05 < layer.relative_error == pytest.approx(expected, abs=1e-5)
    first = report.layers[1]
    # q/k: 2 * (384 * 384 + 384) before; 2 * 384 * 128 shared + 12 * 128 mixing + 12 * 384 content bias after
    assert first.query_key_params_before == 2 * (384 * 384 + 384)
    assert first.query_key_params_after == 2 * 384 * 128 + 12 * 128 + 12 * 384
    assert report.model_params_after < report.model_params_before
    assert model.config.collab_ranks == ranks
    out = hidden(model, real_batch)
    assert torch.isfinite(out).all()
    payload = report.to_dict()
    assert payload["layers"][2]["rank"] == 96 and "| total |" in report.table()


def test_error_falls_as_rank_grows(minilm):
    errors = []
    for rank in (64, 192):
        model = copy.deepcopy(minilm)
        report = reparametrize(model, rank=rank, init="random", n_iter_max=3, progress=False)
        # measured from the converted layers, not taken from the solver
        errors.append(sum(layer.products_error for layer in report.layers) / len(report.layers))
        assert errors[-1] == pytest.approx(report.mean_relative_error, abs=1e-5)
    assert errors[0] > errors[1] > 0.05


def test_output_attentions_returns_collaborative_maps(minilm, real_batch):
    eager = copy.deepcopy(minilm)
    eager.set_attn_implementation("eager")  # sdpa returns no attention maps
    with torch.no_grad():
        expected = eager(**real_batch, output_attentions=True).attentions
    assert len(expected) == 6
    model = copy.deepcopy(minilm)
    reparametrize(model, rank=384, progress=False)
    with torch.no_grad():
        attentions = model(**real_batch, output_attentions=True).attentions
    assert len(attentions) == 6 and attentions[0].shape == expected[0].shape
    for got, want in zip(attentions, expected):
        assert (got - want).abs().max() < 1e-4
    padded = real_batch["attention_mask"] == 0
    assert torch.all(attentions[3].permute(0, 3, 1, 2)[padded] == 0)
    model_low = copy.deepcopy(minilm)
    reparametrize(model_low, rank=96, init="random", n_iter_max=2, progress=False)
    with torch.no_grad():
        low = model_low(**real_batch, output_attentions=True).attentions
    torch.testing.assert_close(low[0].sum(-1), torch.ones_like(low[0].sum(-1)))
    assert (low[0] - expected[0]).abs().max() > 1e-3  # it really is the collaborative model's map


def test_output_attentions_after_hooks_were_installed(minilm, real_batch):
    """Recording hooks installed before the conversion must follow the new layers."""
    model = copy.deepcopy(minilm)
    with torch.no_grad():
        model(**real_batch, output_attentions=True, output_hidden_states=True)
    reparametrize(model, rank=384, progress=False)  # full rank: exact, the same attention maps
    with torch.no_grad():
        out = model(**real_batch, output_attentions=True, output_hidden_states=True)
    reference = copy.deepcopy(minilm)
    reference.set_attn_implementation("eager")  # the original's maps (sdpa returns none)
    with torch.no_grad():
        expected = reference(**real_batch, output_attentions=True, output_hidden_states=True)
    batch, length = real_batch["input_ids"].shape
    assert len(out.attentions) == len(expected.attentions) == 6
    assert len(out.hidden_states) == len(expected.hidden_states) == 7
    for layer, (got, original) in enumerate(zip(out.attentions, expected.attentions, strict=True)):
        assert got.shape == original.shape == (batch, 12, length, length), layer
        torch.testing.assert_close(got, original, atol=1e-5, rtol=0, msg=lambda m, i=layer: f"layer {i}: {m}")
    for got, original in zip(out.hidden_states, expected.hidden_states, strict=True):
        torch.testing.assert_close(got, original, atol=1e-4, rtol=0)


def test_causal_bert_decoder_stays_causal():
    original = small_model("bert", is_decoder=True, use_cache=False)
    model = copy.deepcopy(original)
    reparametrize(model, rank=48, progress=False)
    batch = random_batch(lengths=(8,))
    with torch.no_grad():
        expected = original(**batch, use_cache=False).last_hidden_state
        got = model(**batch, use_cache=False).last_hidden_state
        weights = model(**batch, use_cache=False, output_attentions=True).attentions[0]
    assert (got - expected).abs().max() <= 1e-4
    assert torch.all(weights.triu(diagonal=1) == 0)


def test_trains_with_gradients_on_mixing():
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(small_config("bert"))
    reparametrize(model, rank=16, n_iter_max=5, progress=False)
    model.train()
    batch = random_batch()
    loss = model(**batch, labels=torch.tensor([0, 1, 1])).loss
    loss.backward()
    layers = [m for m in model.modules() if isinstance(m, CollaborativeSelfAttention)]
    assert layers and all(layer.mixing.grad is not None and layer.mixing.grad.abs().sum() > 0 for layer in layers)


@pytest.mark.parametrize("rank, message", [(0, "rank 0 for layer 0 is invalid"), (49, r"in \[1, 48\]")])
def test_bad_rank_is_explained_and_leaves_the_model_alone(rank, message):
    model = small_model("bert")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=message):
        reparametrize(model, rank=rank, progress=False)
    with pytest.raises(ValueError, match="got 3 ranks but the model has 2"):
        reparametrize(model, rank=[8, 8, 8], progress=False)
    for not_a_rank in ("16", 16.0, [16, 8.5]):
        with pytest.raises(ValueError, match="rank"):
            reparametrize(model, rank=not_a_rank, progress=False)
    assert type(model) is transformers.BertModel
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_nan_weights_are_reported_with_the_layer_name():
    model = small_model("bert")
    with torch.no_grad():
        model.encoder.layer[1].attention.self.key.weight[0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"encoder\.layer\.1\.attention\.self: the key weights contain NaN or Inf"):
        reparametrize(model, rank=8, progress=False)
    assert type(model.encoder.layer[0].attention.self).__name__ == "BertSelfAttention"


def test_a_layer_with_zero_query_weights_is_refused_before_anything_changes():
    model = small_model("bert")
    with torch.no_grad():
        model.encoder.layer[0].attention.self.query.weight.zero_()
    with pytest.raises(ValueError, match=r"encoder\.layer\.0\.attention\.self: every head's query/key product"):
        reparametrize(model, rank=8, progress=False)
    assert type(model.encoder.layer[0].attention.self).__name__ == "BertSelfAttention"


def test_unsupported_architecture_names_the_supported_ones():
    config = transformers.ElectraConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, vocab_size=50,
                                        embedding_size=32, intermediate_size=64)
    with pytest.raises(ValueError, match="unsupported architecture 'electra'.*bert, roberta, distilbert, albert, gpt2"):
        reparametrize(transformers.ElectraModel(config), rank=8)


def test_unknown_method_and_double_conversion_are_refused():
    model = small_model("bert")
    with pytest.raises(ValueError, match="unknown method 'svdd'"):
        reparametrize(model, rank=8, method="svdd")
    with pytest.raises(ValueError, match="solver='tensorly' does not apply to method='svd'"):
        reparametrize(model, rank=8, method="svd", solver="tensorly")
    with pytest.raises(ValueError, match="method='prune' needs importance="):
        reparametrize(model, rank=8, method="prune")
    reparametrize(model, rank=8, n_iter_max=2, progress=False)
    with pytest.raises(ValueError, match="already collaborative"):
        reparametrize(model, rank=8)


def test_package_exports_the_contract():
    for name in ("MultiHeadAttention", "CollaborativeAttention", "decompose_heads", "reparametrize"):
        assert hasattr(collab_attn, name)
