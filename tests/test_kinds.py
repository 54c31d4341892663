"""A layer kind is one package under ``collab_attn/kinds/`` that registers itself on import (issue 90). The same
parts, written here outside the library (a converted class under a new kind name, its own reader of the layer's
logit forms, and a method that builds it), are all a kind needs: a model converts with it, trains, saves and loads
back through the Auto classes with the same logits."""

import dataclasses

import pytest
import torch
import transformers
from conftest import random_batch

import collab_attn
from collab_attn.kinds import LAYER_KINDS, CollaborativeSelfAttention, ConvertedSelfAttention, collaborative_forms
from collab_attn.models.methods import METHODS
from collab_attn.nn import cache_numbers_per_token

READ = []  # the layers the outside kind's reader was asked for


def outside_forms(layer):
    """The kind's reader of its logit forms: collaborative heads' own, recorded."""
    READ.append(layer)
    return collaborative_forms(layer)


@pytest.fixture
def outside_kind(monkeypatch):
    """A kind registered from this file, and a method building it (``cp``'s planner)."""

    class OutsideSelfAttention(CollaborativeSelfAttention, kind="outside-collaborative"):
        query_key_reader = staticmethod(outside_forms)

    method = dataclasses.replace(METHODS["cp"], name="outside-cp", layer="outside-collaborative", rotary_layer=None)
    monkeypatch.setitem(METHODS, "outside-cp", method)
    READ.clear()
    yield OutsideSelfAttention
    del LAYER_KINDS["outside-collaborative"]


def gpt2_lm() -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=48, n_head=4, n_layer=2, vocab_size=120, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config).eval()


def test_a_kind_registered_from_outside_converts_trains_saves_and_loads(outside_kind, tmp_path):
    model = gpt2_lm()
    report = collab_attn.reparametrize(model, 24, method="outside-cp", progress=False)
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    assert model.config.collab_layer == "outside-collaborative" and len(layers) == 2
    assert all(type(layer) is outside_kind and layer.kind == "outside-collaborative" for layer in layers)
    assert any(read is layer for read in READ for layer in layers)  # measured through the kind's own reader
    assert all(layer.products_error < 0.5 for layer in report.layers)
    # the shared key, a content logit per head (GPT-2 has a query bias) and every head's value
    assert all(cache_numbers_per_token(layer) == 24 + 4 + 4 * 12 for layer in layers)

    batch = random_batch()
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    model.train()
    before = {name: p.detach().clone() for name, p in layers[0].named_parameters()}
    loss = model(**batch, labels=labels).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.1).step()
    assert torch.isfinite(loss)
    changed = [name for name, p in layers[0].named_parameters() if not torch.equal(p, before[name])]
    assert {"query.weight", "key.weight", "mixing"} <= set(changed)

    model.eval()
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.collab_layer == "outside-collaborative"
    assert sum(type(m) is outside_kind for m in loaded.modules()) == 2
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).logits, model(**batch).logits)
