"""A conversion method is one object (collab_attn.models.methods): a method registered from outside the library
converts, saves and loads, and the settings, the scripts' choices and the layer kinds all follow from it."""

import dataclasses

import pytest
import torch
import transformers
from conftest import random_batch, small_model

import collab_attn
from collab_attn.kinds import LAYER_KINDS, SIZES
from collab_attn.models import methods
from collab_attn.models.methods import METHODS, ConversionMethod, LayerSizes
from collab_attn.models.methods.base import uniform_layout
from collab_attn.models.methods.svd import plan_svd
from collab_attn.models.settings import MethodSettings, group_keys, labels
from collab_attn.models.sizing import converted_layout


@dataclasses.dataclass(frozen=True)
class HalfOptions:
    """A method option of its own: keep the query/key side at ``fraction`` of the query weights' scale, and the
    logits exact by scaling the keys up by the same factor."""

    fraction: float = 0.5


def plan_half(request):
    plan = plan_svd(request)
    for layer in plan.layers:
        layer.state["query.weight"] = layer.state["query.weight"] * request.options.fraction
        layer.state["key.weight"] = layer.state["key.weight"] / request.options.fraction
    return plan


@pytest.fixture
def half_method(monkeypatch):
    method = ConversionMethod("half", "svd with rescaled query and key", plan_half, layer="concatenated",
                              options=HalfOptions)
    monkeypatch.setitem(METHODS, "half", method)
    return method


def test_a_method_is_one_object_from_settings_to_a_saved_model(half_method, tmp_path):
    model = small_model("bert")
    batch = random_batch()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
    settings = MethodSettings.from_config({"method": "half", "rank": 48, "fraction": 0.25})
    assert settings.options == HalfOptions(0.25) and group_keys(half_method) == {"fraction": 0.5}
    assert "half" in labels() and LAYER_KINDS[half_method.layer].__name__ == "ConcatenatedSelfAttention"
    report = collab_attn.reparametrize(model, **settings.reparametrize_kwargs())
    svd = small_model("bert")
    collab_attn.reparametrize(svd, 48, method="svd")
    ours, theirs = model.encoder.layer[0].attention.self, svd.encoder.layer[0].attention.self
    torch.testing.assert_close(ours.query.weight, theirs.query.weight * 0.25)  # the option reached the planner
    torch.testing.assert_close(ours.key.weight, theirs.key.weight / 0.25)
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).last_hidden_state, expected, atol=1e-5, rtol=1e-5)
    assert report.method == "half" and model.config.collab_method == "half"
    assert model.config.collab_layer == "concatenated"
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).last_hidden_state, expected, atol=1e-5, rtol=1e-5)


def test_a_method_refuses_what_it_does_not_take(half_method):
    model = small_model("bert")
    with pytest.raises(ValueError, match=r"solver='tensorly' does not apply to method='half' \(its options: fraction"):
        collab_attn.reparametrize(model, 48, method="half", solver="tensorly")
    with pytest.raises(ValueError, match="calibration does not apply to method='half'"):
        collab_attn.reparametrize(model, 48, method="half", calibration=object())
    with pytest.raises(ValueError, match="collab.budget does not apply to collab.method=half"):
        MethodSettings.from_config({"method": "half", "rank": 48, "budget": "mean:24"})


def test_methods_are_declared_consistently():
    with pytest.raises(ValueError, match="unknown layer kind 'wide'"):
        ConversionMethod("x", "", plan_svd, layer="wide")
    with pytest.raises(ValueError, match="collaborative methods mix with one of"):
        ConversionMethod("x", "", plan_svd, layer="collaborative")
    with pytest.raises(TypeError, match="options must be a frozen dataclass"):
        ConversionMethod("x", "", plan_svd, layer="concatenated", options=dict)
    with pytest.raises(ValueError, match="registered already"):
        methods.register(METHODS["cp"])
    # the order tables and choices list them in
    assert list(METHODS) == ["cp", "tucker", "svd", "prune", "key-svd", "kv-svd", "merge-kv", "drop-kv"]


def test_a_method_lays_a_model_out_at_sizes_named_as_the_specs_name_them(half_method):
    assert {field.name for field in dataclasses.fields(LayerSizes)} <= set(SIZES)
    config = small_model("bert").config
    layers = config.num_hidden_layers
    layout = converted_layout(config, half_method, LayerSizes(48))
    assert (layout.method, layout.kind, layout.sizes) == ("half", "concatenated", {"rank": [48] * layers})

    def even_ranks(method, site, layers, sizes):  # a method's own rule, from the one sizes value
        return None if sizes.rank % 2 else uniform_layout(method, site, layers, sizes)

    even = dataclasses.replace(half_method, sized_layout=even_ranks)
    assert converted_layout(config, even, LayerSizes(47)) is None
    assert converted_layout(config, even, LayerSizes(48, rope_pairs=2)) == layout  # sizes it does not take: unread
