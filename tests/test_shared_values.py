"""Collaborative values (issue 43): ``reparametrize(..., value_rank=D_v)`` shares one value per token among the heads,
from a CP (or Tucker) decomposition of the per-head value-output products. Exact at full value rank for encoders and
decoders; below it, the cache holds D~ + heads + D_v numbers per token and layer, decoding with it equals
recomputation, generate agrees with and without the cache (greedy, beams, left padding), and save/load is identical."""

import copy

import pytest
import torch
import transformers
from conftest import random_batch, small_model
from test_pipeline import settings as glue_settings

import collab_attn
from collab_attn.glue.jobs import GlueJob
from collab_attn.models.settings import MethodSettings

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny problems: a second thread only waits on the busy cores

DECODERS = {
    "gpt2": transformers.GPT2Config(n_embd=48, n_head=4, n_layer=2, vocab_size=100, n_positions=64,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "opt": transformers.OPTConfig(hidden_size=48, num_attention_heads=4, num_hidden_layers=2, ffn_dim=96,
                                  vocab_size=100, max_position_embeddings=64, word_embed_proj_dim=48,
                                  bos_token_id=2, eos_token_id=2, pad_token_id=1),
}


def decoder(family: str) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(copy.deepcopy(DECODERS[family])).eval()


@pytest.mark.parametrize("method", ["cp", "tucker"])
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert"])
def test_encoders_at_full_value_rank_are_exact(family, method, tmp_path):
    model, batch = small_model(family), random_batch()
    with torch.no_grad():
        expected = model(**batch).last_hidden_state
    collab_attn.reparametrize(model, 24, method=method, value_rank=48, progress=False)
    reference = small_model(family)
    collab_attn.reparametrize(reference, 24, method=method, progress=False)  # the same keys, every head's values
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).last_hidden_state, reference(**batch).last_hidden_state,
                                   atol=1e-5, rtol=1e-5)
    exact = small_model(family)
    collab_attn.reparametrize(exact, 48, method=method, value_rank=48, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(exact(**batch).last_hidden_state, expected, atol=1e-5, rtol=1e-5)
    exact.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.collab_value_ranks == exact.config.collab_value_ranks
    with torch.no_grad():
        torch.testing.assert_close(loaded(**batch).last_hidden_state, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["cp", "tucker"])
@pytest.mark.parametrize("family", list(DECODERS))
def test_decoders_at_full_value_rank_are_exact(family, method):
    model = decoder(family)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
    collab_attn.reparametrize(model, 48, method=method, value_rank=48, progress=False)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, atol=1e-5, rtol=1e-5)


HEADS, HEAD_DIM, D = 4, 12, 48
FIT = {"n_iter_max": 100, "tol": 5e-4}  # the same decomposition settings for the conversion and the reference fit


def _bert_with_distinct_heads() -> transformers.PreTrainedModel:
    """``small_model("bert")`` with its query and key weights scaled up so that its heads attend differently: at
    the initializer's scale every head's attention is nearly uniform, so a head's value mixing could be given to
    another head (or every head's values summed) without changing any output."""
    model = small_model("bert")
    model.set_attn_implementation("eager")  # the original layers return their attention maps
    with torch.no_grad():
        for layer in model.encoder.layer:
            layer.attention.self.query.weight.mul_(8)
            layer.attention.self.key.weight.mul_(8)
    return model


def _attention_outputs(model, hidden_states) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Per layer, the attention's output before the residual connection (``attention.output.dense`` of the
    self-attention's output: where every head's values end up) and the attention maps, on the given inputs."""
    outputs = []
    with torch.no_grad():
        for layer, hidden in zip(model.encoder.layer, hidden_states):
            context, maps = layer.attention.self(hidden)
            outputs.append((layer.attention.output.dense(context), maps))
    return outputs


def _fitted_outputs(original, hidden_states, method: str, value_rank: int) -> list[torch.Tensor]:
    """What a layer with shared values must compute, built here from the original layer: its attention maps P_h,
    ``decompose_heads`` of its value-output products ``Wv_h^T Wo_h^T`` at ``value_rank`` (the fit the conversion
    makes, same settings and seed) and its output bias with the value bias folded in:
    ``sum_h P_h X (A N_h B^T) + bo + sum_h Wo_h bv_h``."""
    outputs = []
    for layer, hidden, (_, maps) in zip(original.encoder.layer, hidden_states,
                                        _attention_outputs(original, hidden_states)):
        value, dense = layer.attention.self.value, layer.attention.output.dense
        w_value = value.weight.detach().view(HEADS, HEAD_DIM, D)
        w_output = dense.weight.detach().T.reshape(HEADS, HEAD_DIM, D)
        fit = collab_attn.decompose_heads(w_value, w_output, value_rank, method, seed=0, **FIT)
        bias = dense.bias.detach() + torch.einsum("hao,ha->o", w_output, value.bias.detach().view(HEADS, HEAD_DIM))
        outputs.append(torch.einsum("bhts,bsi,hio->bto", maps, hidden, fit.head_products()) + bias)
    return outputs


def _value_rank_errors(method: str, value_ranks) -> list[float]:
    """Relative error, over all layers, of the attention outputs of a small BERT with its keys exact and its values
    shared at each of ``value_ranks``, against the original layers' outputs on the same inputs (the original's
    hidden states: every layer sees what the original layer sees). Below full width each converted layer must
    also give what its value fit says it gives (``_fitted_outputs``), so that a fit installed wrongly (heads'
    mixings exchanged, scaled) fails even where the fit itself is far from the original."""
    original, batch = _bert_with_distinct_heads(), random_batch(lengths=(11, 11, 11))
    with torch.no_grad():
        hidden_states = original(**batch, output_hidden_states=True).hidden_states[:-1]
    expected = [output for output, _ in _attention_outputs(original, hidden_states)]
    norm = torch.stack([e.norm() for e in expected]).norm()
    errors = []
    for value_rank in value_ranks:
        converted = _bert_with_distinct_heads()
        collab_attn.reparametrize(converted, D, method=method, value_rank=value_rank, progress=False, **FIT)
        got = [output for output, _ in _attention_outputs(converted, hidden_states)]
        if value_rank < D:
            for layer, (mine, fitted) in enumerate(zip(got, _fitted_outputs(original, hidden_states, method,
                                                                              value_rank))):
                relative = float((mine - fitted).norm() / fitted.norm())
                assert relative < 1e-4, f"layer {layer} at value rank {value_rank}: {relative:.3g} off its fit"
        errors.append(float(torch.stack([(g - e).norm() for g, e in zip(got, expected)]).norm() / norm))
    return errors


@pytest.mark.parametrize("method", ["cp", "tucker"])
def test_approximation_improves_with_the_value_rank(method):
    errors = _value_rank_errors(method, (8, 24, 40, 48))
    assert errors[0] > errors[1] > errors[2] > errors[3] and errors[3] < 1e-5, errors


def test_tucker_values_fit_at_least_as_well_as_cp_at_the_same_width():
    """Tucker's per-head mixing matrices contain CP's diagonal ones: at the same D_v it fits no worse."""
    for value_rank in (8, 24):
        (cp,), (tucker,) = _value_rank_errors("cp", [value_rank]), _value_rank_errors("tucker", [value_rank])
        assert tucker <= cp * 1.02, (value_rank, cp, tucker)


@pytest.mark.parametrize("family,method", [("gpt2", "cp"), ("opt", "cp"), ("gpt2", "tucker")])
def test_decoders_cache_one_value_per_token_and_generate_alike(family, method, tmp_path):
    model = decoder(family)
    collab_attn.reparametrize(model, 24, method=method, value_rank=12, progress=False)
    ids = torch.randint(3, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    cache = transformers.DynamicCache()
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        pieces = [model(ids[:, s:e], use_cache=True, cache=cache).logits for s, e in [(0, 4)] + [(i, i + 1)
                                                                                               for i in range(4, 9)]]
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)
    stored = [sum(t[0, :, 0].numel() for t in (layer.keys, layer.values)) for layer in cache.layers]
    assert stored == [24 + 4 + 12] * 2  # shared key, 4 content logits, one shared value of 12
    settings = {"max_new_tokens": 5, "do_sample": False, "pad_token_id": model.config.pad_token_id}
    prompt = ids[:, :5]
    greedy = model.generate(prompt, **settings)
    assert torch.equal(model.generate(prompt, use_cache=False, **settings), greedy)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **settings), greedy)
    beams = model.generate(prompt, num_beams=3, **settings)
    assert torch.equal(model.generate(prompt, num_beams=3, use_cache=False, **settings), beams)
    # left padding: the second prompt, two tokens shorter, continues as it does alone
    padded = prompt.clone()
    padded[1, :2] = model.config.pad_token_id
    mask = torch.ones_like(padded)
    mask[1, :2] = 0
    batch_out = model.generate(padded, attention_mask=mask, **settings)
    alone = model.generate(prompt[1:, 2:], **settings)
    assert torch.equal(batch_out[1, 2:], alone[0])
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, use_cache=False).logits, full)


@pytest.mark.parametrize("method", ["cp", "tucker"])
@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert", *DECODERS])
def test_shared_values_give_attention_maps(family, method):
    """``output_attentions=True``: one (batch, heads, tgt, src) map per layer, rows summing to one, the output the
    same as without the maps."""
    model = decoder(family) if family in DECODERS else small_model(family)
    collab_attn.reparametrize(model, 24, method=method, value_rank=16, n_iter_max=20, progress=False)
    model.set_attn_implementation("eager")
    inputs = {"input_ids": torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(4))}
    with torch.no_grad():
        out = model(**inputs, output_attentions=True)
        plain = model(**inputs)
    first = out.logits if family in DECODERS else out.last_hidden_state
    torch.testing.assert_close(first, plain.logits if family in DECODERS else plain.last_hidden_state)
    assert len(out.attentions) == model.config.num_hidden_layers
    for maps in out.attentions:
        assert maps.shape == (2, 4, 7, 7)
        torch.testing.assert_close(maps.sum(-1), torch.ones(2, 4, 7))


def test_value_rank_is_refused_where_it_cannot_be_honoured():
    with pytest.raises(ValueError, match="method='key-svd' shares the values on rotary models only"):
        collab_attn.reparametrize(small_model("bert"), 24, method="key-svd", value_rank=24)
    with pytest.raises(ValueError, match=r"exact Tucker values need tucker_core_size = heads \(4\)"):
        collab_attn.reparametrize(small_model("bert"), 24, method="tucker", value_rank=48, tucker_core_size=2)
    with pytest.raises(ValueError, match=r"value_rank: rank 49 for layer 0 is invalid.*\[1, 48\]"):
        collab_attn.reparametrize(small_model("bert"), 24, value_rank=49)
    with pytest.raises(ValueError, match="collab.value_rank must be a positive integer"):
        MethodSettings.from_config({"method": "cp", "rank": 24, "value_rank": "wide"})
    with pytest.raises(ValueError, match="collab.value_rank does not apply to collab.method=prune"):
        MethodSettings.from_config({"method": "prune", "rank": 48, "value_rank": 24})


def test_the_collab_group_takes_a_value_rank():
    settings = MethodSettings.from_config({"method": "cp", "rank": 128, "value_rank": 64})
    assert settings.reparametrize_kwargs()["value_rank"] == 64 and settings.to_group()["value_rank"] == 64
    job = GlueJob.of(glue_settings("collab.rank=128", "collab.value_rank=64"))
    assert settings.label == "cp-v64" and job.name == "mrpc/minilm/cp-v64-r128/seed0"


def test_accounting_counts_what_the_shared_value_layer_holds():
    from collab_attn import CollaborativeAttention
    from collab_attn.analysis.accounting import attention_parameters, cache_bytes_per_token
    from collab_attn.nn.attention import cache_numbers_per_token

    layer = CollaborativeAttention(48, 4, 20, value_rank=16)
    assert attention_parameters(48, 4, 20, value_rank=16) == layer.parameter_counts()
    assert cache_bytes_per_token(48, 4, 20, value_rank=16, dtype_bytes=1)["total"] == cache_numbers_per_token(layer)
    tucker = CollaborativeAttention(48, 4, 20, value_rank=16, tucker_core_size=3)
    counts = attention_parameters(48, 4, 20, value_rank=16, method="tucker", tucker_core_size=3)
    assert counts == tucker.parameter_counts() and counts["value_core"] == 3 * 16 * 16
    assert cache_numbers_per_token(tucker) == cache_numbers_per_token(layer)
    with pytest.raises(ValueError, match="value_rank .* needs collaborative heads"):
        cache_bytes_per_token(48, 4, value_rank=16)
