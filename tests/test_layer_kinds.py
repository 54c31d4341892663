"""A layer kind is one class (collab_attn.kinds.LAYER_KINDS): registered by subclassing, built from an
attention site and a spec, filled strictly from the state a method hands over, recorded in the config beside the
method, and rebuilt from it on load. A kind added from outside the library (here, in this file) works end to end."""

import dataclasses
import types

import pytest
import torch
import transformers
from conftest import random_batch, small_model

import collab_attn
from collab_attn.kinds import (
    LAYER_KINDS,
    SIZES,
    ConvertedSelfAttention,
    KeptHeadsSelfAttention,
    LayerSpec,
)
from collab_attn.models.hf import Layout, attention_sites, build_layers
from collab_attn.models.methods import METHODS, ConversionMethod
from collab_attn.models.methods.prune import plan_prune
from collab_attn.models.plan import LayerPlan, Plan


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=48, n_head=4, n_layer=2, vocab_size=120, n_positions=64)
    return transformers.GPT2Model(config).eval()


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_every_kind_builds_itself_for_a_site(family):
    model = small_model("bert") if family == "bert" else gpt2()
    model.to(torch.float64)
    _, sites = attention_sites(model)
    site = sites[1]
    assert (site.heads, site.head_dim, site.d_in, site.output_inside) == (4, 12, 48, family == "gpt2")
    for kind, cls in LAYER_KINDS.items():
        layer = cls.build(site, cls.Spec(kind, site.heads, 24))
        assert type(layer) is cls and layer.kind == kind and layer.layer_idx == site.layer_idx
        assert (layer.output is not None) == site.output_inside and layer.is_causal == site.is_causal
        assert {p.dtype for p in layer.parameters()} == {torch.float64}
        assert layer.scale == site.logit_scale


def test_a_kind_name_is_registered_once():
    with pytest.raises(ValueError, match="a layer kind named 'gqa' is registered already"):
        type("Again", (LAYER_KINDS["gqa"],), {}, kind="gqa")


def test_a_layout_names_a_registered_kind_and_only_the_sizes_its_spec_takes():
    with pytest.raises(ValueError, match="unknown layer kind 'wide'"):
        Layout("cp", "wide", {"rank": [8]})
    cutting = r"\['collaborative', 'concatenated', 'rotary-collaborative', 'rotary-shared-key', 'rotary-tpa'\]"
    with pytest.raises(ValueError, match=rf"layer kind 'mla' takes no value_rank \(its sizes: heads, rank\); the "
                                         rf"kinds that do: {cutting}"):
        Layout("kv-svd", "mla", {"rank": [8], "value_rank": [8]})
    with pytest.raises(ValueError, match="the layout has 2 ranks but 1 values of rope_pairs"):
        Layout("kv-svd", "rotary-mla", {"rank": [8, 8], "rope_pairs": [2]})
    with pytest.raises(ValueError, match=r"a layout needs the rank of every layer"):
        Layout("kv-svd", "rotary-mla", {"rope_pairs": [2]})
    with pytest.raises(ValueError, match=r"tucker_core_size is recorded once per model, but the layout gives its "
                                         r"layers \[2, 3\]"):
        Layout("tucker", "collaborative", {"rank": [8, 8], "tucker_core_size": [2, 3]}).config_fields()


def test_every_size_of_every_kind_has_one_config_field_and_round_trips_through_a_config():
    for cls in LAYER_KINDS.values():
        assert set(cls.Spec.size_names()) <= set(SIZES) and cls.Spec.size_names()[:2] == ("heads", "rank")
        assert cls.cuts_values == ("value_rank" in cls.Spec.size_names())
    layout = Layout("kv-svd", "rotary-mla", {"rank": [8, 12], "rope_pairs": [2, 3], "bands": [[[0, 1]], [[2, 3]]]})
    config = types.SimpleNamespace(**layout.config_fields())
    assert Layout.of(config) == layout
    assert [spec.rope_pairs for spec in layout.specs(4)] == [2, 3] and layout.specs(4)[1].heads == 4
    with pytest.raises(ValueError, match=r"layer kind 'bad' \(its spec\): the sizes \['width'\] have no config "
                                         "field"):
        @dataclasses.dataclass(frozen=True)
        class WideSpec(LayerSpec):
            width: int = 0

        type("Bad", (LAYER_KINDS["gqa"],), {"Spec": WideSpec}, kind="bad")


def test_a_plan_that_misses_or_adds_a_tensor_is_refused_naming_it(monkeypatch):
    def plan_without_key(request):
        plan = plan_prune(request)
        for layer in plan.layers:
            del layer.state["key.weight"]
            layer.state["mixing"] = torch.ones(1)
        return plan

    monkeypatch.setitem(METHODS, "broken", ConversionMethod("broken", "", plan_without_key, layer="kept-heads",
                                                            needs_importance=True))
    model = gpt2()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"needs \['key.weight'\] and has no place for \['mixing'\]"):
        collab_attn.reparametrize(model, 24, method="broken", importance=[torch.ones(4)] * 2, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.fixture
def first_heads_kind(monkeypatch):
    """A layer kind and a method that builds it, added from outside the library: heads kept by position (the first
    ones of each layer), as kept-heads layers that record a kind of their own."""

    class FirstHeadsSelfAttention(KeptHeadsSelfAttention, kind="first-heads"):
        pass

    def plan_first_heads(request):
        keep = len(request.ranks) * [list(range(request.ranks[0] // request.weights[0].head_dim))]
        layers = []
        for weights, kept in zip(request.weights, keep):
            state = {"query.weight": weights.w_query[kept].flatten(0, 1),
                     "key.weight": weights.w_key[kept].flatten(0, 1),
                     "query.bias": weights.b_query[kept].flatten(), "key.bias": weights.b_key[kept].flatten()}
            layers.append(LayerPlan(state, relative_error=float("nan"), kept_heads=kept))
        return Plan(layers, {"rank": list(request.ranks), "heads": [len(k) for k in keep]}, "first")

    method = ConversionMethod("first-heads", "the first heads of each layer", plan_first_heads, layer="first-heads",
                              reports_products_error=False)
    monkeypatch.setitem(METHODS, "first-heads", method)
    yield FirstHeadsSelfAttention
    del LAYER_KINDS["first-heads"]


def test_a_kind_added_from_outside_converts_saves_and_loads(first_heads_kind, tmp_path):
    model = small_model("bert")
    for layer in model.encoder.layer:  # heads 2 and 3 score nothing (their logits are constant)
        with torch.no_grad():
            layer.attention.self.query.weight[24:] = 0
            layer.attention.self.query.bias[24:] = 0
            layer.attention.self.value.weight[24:] = 0  # and add nothing but their value bias
    batch = random_batch()
    report = collab_attn.reparametrize(model, 24, method="first-heads", progress=False)
    assert model.config.collab_layer == "first-heads" and model.config.collab_method == "first-heads"
    assert [layer.products_error for layer in report.layers] == pytest.approx([0.0, 0.0], abs=1e-6)
    assert all(type(m) is first_heads_kind for m in model.modules() if isinstance(m, ConvertedSelfAttention))
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert sum(type(m) is first_heads_kind for m in loaded.modules()) == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).last_hidden_state, model.eval()(**batch).last_hidden_state)


def test_build_layers_leaves_the_model_alone():
    model = small_model("bert")
    _, sites = attention_sites(model)
    built = build_layers(sites, Layout("svd", "concatenated", {"rank": [24, 24], "value_rank": [8, 8]}))
    assert [entry.new_outer_output.in_features for entry in built] == [8, 8]
    assert all(type(model.get_submodule(site.name)).__name__ == "BertSelfAttention" for site in sites)
    assert model.get_submodule(sites[0].output_name).in_features == 48
