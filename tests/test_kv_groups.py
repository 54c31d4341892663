"""``merge-kv`` and ``drop-kv``: whole key/value groups merged by mean pooling or dropped with their query heads, on
rotary decoders (Llama, Qwen2, Mistral; grouped or multi-head sources) and on GPT-2 and BERT. Exact when every group
is kept, also at later positions; merging equals a grouped transformers model built by hand from mean-pooled weights;
dropping equals the original with the dropped heads' output columns zeroed, keeps the groups of largest energy and
reports the error recomputed here; caches, generation, saving, attention maps, sizes; refusals."""

import copy

import pytest
import torch
import transformers
from conftest import small_model, with_cache

import collab_attn
from collab_attn.kinds import GroupedSelfAttention, KeptHeadsSelfAttention, RotaryGroupedSelfAttention
from collab_attn.kinds.gqa.gqa_attention import GroupedQueryAttention
from collab_attn.kinds.rotary_gqa.rotary_gqa_attention import RotaryGroupedQueryAttention
from collab_attn.models.hf import Layout, attention_sites, build_layers
from collab_attn.models.methods import METHODS
from collab_attn.models.sizing import conversion_at, conversion_sizes, original_size

pytestmark = pytest.mark.usefixtures("one_thread")

ROTARY = ["llama", "qwen2", "mistral"]
METHOD_NAMES = ["merge-kv", "drop-kv"]
HEADS, KV_HEADS, HEAD_DIM, D, VOCAB = 4, 2, 12, 48, 100


def rotary_model(family: str, kv_heads: int = KV_HEADS, **overrides):
    """A small random rotary decoder with random biases (Qwen2: query, key and value), eager attention."""
    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig}[family]
    extra = {"sliding_window": None} if family == "mistral" else {}
    config = config_class(**(dict(
        hidden_size=D, num_attention_heads=HEADS, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
        num_hidden_layers=2, intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=512, pad_token_id=0,
        bos_token_id=1, eos_token_id=2) | extra | overrides))
    torch.manual_seed(0)
    return with_random_biases(transformers.AutoModelForCausalLM.from_config(config))


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=D, n_head=HEADS, n_layer=2, vocab_size=VOCAB, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    return with_random_biases(transformers.GPT2LMHeadModel(config))


def bert():
    return with_random_biases(small_model("bert"))


def with_random_biases(model):
    model.eval().set_attn_implementation("eager")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.normal_(0, 0.5)
    return model


def source(family: str, kv_heads: int = KV_HEADS):
    return {"gpt2": gpt2, "bert": bert}[family]() if family in ("gpt2", "bert") else rotary_model(family, kv_heads)


def converted(model, rank, method):
    model = copy.deepcopy(model)
    report = collab_attn.reparametrize(model, rank, method=method, progress=False)
    return model, report


def ids(batch=2, length=7, seed=0):
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def outputs(model, tokens, **kwargs):
    with torch.no_grad():
        out = model(tokens, **kwargs)
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def attention_layers(model):
    return [module for module in model.modules() if isinstance(module, (GroupedSelfAttention, KeptHeadsSelfAttention,
                                                                        RotaryGroupedSelfAttention))]


def max_difference(a, b) -> float:
    return float((a - b).abs().max())


CASES = [(family, kv, method) for family in ROTARY for kv in (KV_HEADS,) for method in METHOD_NAMES] + [
    ("llama", HEADS, method) for method in METHOD_NAMES] + [
    (family, HEADS, method) for family in ("gpt2", "bert") for method in METHOD_NAMES]


@pytest.mark.parametrize("family, kv_heads, method", CASES)
def test_every_group_kept_is_exact_also_at_later_positions(family, kv_heads, method):
    model = source(family, kv_heads)
    exact, report = converted(model, kv_heads * HEAD_DIM, method)
    assert [(layer.relative_error, layer.products_error) for layer in report.layers] == [(0.0, 0.0)] * 2
    assert [layer.value_products_error for layer in report.layers] == pytest.approx([0.0, 0.0], abs=1e-7)
    kinds = {type(layer) for layer in attention_layers(exact)}
    assert kinds == {RotaryGroupedSelfAttention if family in ROTARY else
                     GroupedSelfAttention if method == "merge-kv" else KeptHeadsSelfAttention}
    assert exact.config.collab_layer == METHODS[method].layer_for(family in ROTARY)
    tokens = ids()
    for shift in (0, 300) if family in ROTARY else (0,):
        positions = {"position_ids": torch.arange(7)[None].expand(2, -1) + shift} if family in ROTARY else {}
        assert max_difference(outputs(exact, tokens, **positions), outputs(model, tokens, **positions)) < 1e-5


def merged_by_hand(model, groups: int):
    """An ordinary transformers model with ``groups`` key/value heads whose key and value projections (weights and
    biases) are the means of consecutive source heads; GPT-2 (no grouped heads in transformers): every head's key and
    value replaced by its group's mean, the same function."""
    state = model.state_dict()
    if isinstance(model, transformers.GPT2LMHeadModel):
        reference = copy.deepcopy(model)
        for block in reference.transformer.h:
            fused = block.attn.c_attn  # Conv1D: weight (d, 3d) = [q | k | v] columns, bias (3d)
            for tensor in (fused.weight.data, fused.bias.data):
                for part in (1, 2):
                    columns = tensor[..., part * D:(part + 1) * D]
                    heads = columns.unflatten(-1, (groups, HEADS // groups, HEAD_DIM))
                    columns.copy_(heads.mean(-2, keepdim=True).expand_as(heads).flatten(-3))
        return reference
    config = copy.deepcopy(model.config)
    config.num_key_value_heads = groups
    reference = type(model)(config).eval()
    reference.set_attn_implementation("eager")
    for name, tensor in state.items():
        if ".k_proj." in name or ".v_proj." in name:
            state[name] = tensor.unflatten(0, (groups, -1, HEAD_DIM)).mean(1).flatten(0, 1)
    reference.load_state_dict(state)
    return reference


@pytest.mark.parametrize("family, kv_heads, groups", [
    *[(family, KV_HEADS, 1) for family in ROTARY], ("llama", HEADS, 2), ("llama", HEADS, 1), ("gpt2", HEADS, 2),
])
def test_merging_equals_a_grouped_model_built_by_hand_from_mean_pooled_weights(family, kv_heads, groups):
    model = source(family, kv_heads)
    merged, report = converted(model, groups * HEAD_DIM, "merge-kv")
    reference = merged_by_hand(model, groups)
    tokens = ids()
    expected = outputs(reference, tokens)
    assert max_difference(outputs(merged, tokens), expected) < 1e-5
    assert max_difference(expected, outputs(model, tokens)) > 1e-2  # merging changed the model
    for layer in report.layers:
        assert 0 < layer.relative_error < 1 and 0 < layer.value_error < 1
        assert layer.products_error == pytest.approx(layer.relative_error, abs=1e-6)
    layer = attention_layers(merged)[0]
    assert (layer.num_heads, layer.kv_heads) == (HEADS, groups)


def output_columns_zeroed(model, dropped_heads: list[list[int]]):
    """The original with the dropped query heads' output columns zeroed: what dropping them computes."""
    reference = copy.deepcopy(model)
    blocks = reference.transformer.h if hasattr(reference, "transformer") else reference.model.layers
    with torch.no_grad():
        for block, heads in zip(blocks, dropped_heads):
            for head in heads:
                columns = slice(head * HEAD_DIM, (head + 1) * HEAD_DIM)
                if hasattr(block, "attn"):
                    block.attn.c_proj.weight[columns] = 0  # Conv1D: weight (in, out)
                else:
                    block.self_attn.o_proj.weight[:, columns] = 0
    return reference


def plant_weak_groups(model, weak: list[int]):
    """Scale layer i's key group ``weak[i]`` (weights and bias) by 1e-3: its query/key energy becomes tiny."""
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    with torch.no_grad():
        for block, group in zip(blocks, weak):
            rows = slice(group * HEAD_DIM, (group + 1) * HEAD_DIM)
            if hasattr(block, "attn"):  # GPT-2: the key columns of the fused c_attn
                block.attn.c_attn.weight[:, D + rows.start:D + rows.stop] *= 1e-3
                block.attn.c_attn.bias[D + rows.start:D + rows.stop] *= 1e-3
            else:
                block.self_attn.k_proj.weight[rows] *= 1e-3
                if block.self_attn.k_proj.bias is not None:
                    block.self_attn.k_proj.bias[rows] *= 1e-3
    return model


def energies_by_hand(model, rotary: bool) -> list[torch.Tensor]:
    """Per layer and query head the energy of its logit form against its group's key, from dense matrices: without
    rotary positions ||Wq_h^T Wk_g||_F^2; with them, per band i, the complex form a_hi conj(b_gi)^T (a, b: rows i
    and i + head_dim/2 as real and imaginary parts, the bias appended as an input column)."""
    energies = []
    for site in attention_sites(model)[1]:
        (wq, bq), (wk, bk) = site.projection("query"), site.projection("key")
        wq, wk = wq.detach().double(), wk.detach().double()
        if rotary:
            wq = torch.cat([wq, (bq.detach().double() if bq is not None else torch.zeros(len(wq)))[:, None]], 1)
            wk = torch.cat([wk, (bk.detach().double() if bk is not None else torch.zeros(len(wk)))[:, None]], 1)
        per_head = []
        for head in range(site.heads):
            group = head // (site.heads // site.kv_heads)
            q, k = wq[head * HEAD_DIM:(head + 1) * HEAD_DIM], wk[group * HEAD_DIM:(group + 1) * HEAD_DIM]
            if rotary:
                half = HEAD_DIM // 2
                a, b = torch.complex(q[:half], q[half:]), torch.complex(k[:half], k[half:])
                forms = a[:, :, None] * b.conj()[:, None, :]  # (bands, d + 1, d + 1)
                per_head.append(float((forms.abs() ** 2).sum()))
            else:
                per_head.append(float(((q.T @ k) ** 2).sum()))
        energies.append(torch.tensor(per_head, dtype=torch.float64))
    return energies


@pytest.mark.parametrize("family, kv_heads", [(family, KV_HEADS) for family in ROTARY] + [("gpt2", HEADS)])
def test_dropping_keeps_the_groups_of_largest_energy_and_reports_the_error_removed(family, kv_heads):
    weak = [0, kv_heads - 1]  # the group planted weak in each layer
    model = plant_weak_groups(source(family, kv_heads), weak)
    kept_count = kv_heads - 1
    dropped, report = converted(model, kept_count * HEAD_DIM, "drop-kv")
    every = HEADS // kv_heads
    expected_groups = [[g for g in range(kv_heads) if g != w] for w in weak]
    assert report.pruning.kept_heads == expected_groups
    energies = energies_by_hand(model, family in ROTARY)
    for layer, energy, kept in zip(report.layers, energies, expected_groups):
        heads = [g * every + j for g in kept for j in range(every)]
        removed = energy.sum() - energy[heads].sum()
        assert layer.relative_error == pytest.approx(float((removed / energy.sum()).sqrt()), rel=1e-6)
        assert layer.products_error == pytest.approx(layer.relative_error, abs=1e-6)
        assert 0 < layer.relative_error < 0.05 and 0 < layer.value_error < 1
    for scores, energy in zip(report.pruning.importance, energies):
        assert scores == pytest.approx(energy.reshape(kv_heads, every).sum(1).tolist(), rel=1e-6)
    layer = attention_layers(dropped)[0]
    assert layer.num_heads == kept_count * every and dropped.config.collab_heads == [kept_count * every] * 2
    dropped_heads = [[w * every + j for j in range(every)] for w in weak]
    tokens = ids()
    assert max_difference(outputs(dropped, tokens), outputs(output_columns_zeroed(model, dropped_heads), tokens)) < 1e-5


@pytest.mark.parametrize("family, method", [(family, method) for family in ROTARY + ["gpt2"]
                                            for method in METHOD_NAMES])
def test_the_cache_equals_recomputation_and_generation_agrees_with_and_without_it(family, method):
    model = source(family, HEADS if family == "gpt2" else KV_HEADS)
    small, _ = converted(model, HEAD_DIM, method)  # one group
    tokens = ids(length=9)
    with torch.no_grad():
        full = small(tokens).logits
        cache = small(tokens[:, :5], use_cache=True).past_key_values
        assert cache.layers[0].keys.shape == cache.layers[0].values.shape == (2, 1, 5, HEAD_DIM)
        stepped = small(tokens[:, 5:], **with_cache(small, cache)).logits
    assert max_difference(stepped, full[:, 5:]) < 1e-5
    settings = {"max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    greedy = small.generate(tokens[:, :5], **settings)
    assert greedy.shape == (2, 11)
    assert torch.equal(small.generate(tokens[:, :5], use_cache=False, **settings), greedy)
    assert torch.equal(small.generate(tokens[:, :5], cache_implementation="static", **settings), greedy)


@pytest.mark.parametrize("family, method", [("qwen2", "merge-kv"), ("qwen2", "drop-kv"), ("llama", "drop-kv"),
                                            ("bert", "merge-kv")])
def test_saved_and_loaded_through_the_auto_classes_gives_identical_outputs(family, method, tmp_path):
    model, _ = converted(source(family), HEAD_DIM, method)
    model.save_pretrained(tmp_path)
    auto = transformers.AutoModel if family == "bert" else transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(tmp_path).eval()
    assert loaded.config.collab_method == method and type(loaded) is type(model)
    assert [type(m) for m in attention_layers(loaded)] == [type(m) for m in attention_layers(model)]
    tokens = ids()
    torch.testing.assert_close(outputs(loaded, tokens), outputs(model, tokens), rtol=0, atol=0)


@pytest.mark.parametrize("family, method", [("mistral", "merge-kv"), ("llama", "drop-kv"), ("gpt2", "merge-kv")])
def test_attention_maps_have_the_kept_heads_and_sum_to_one(family, method):
    model = source(family, HEADS if family == "gpt2" else KV_HEADS)
    small, _ = converted(model, HEAD_DIM, method)
    with torch.no_grad():
        maps = small(ids(), output_attentions=True).attentions
    heads = HEADS if method == "merge-kv" else HEADS // (HEADS if family == "gpt2" else KV_HEADS)
    assert len(maps) == 2 and all(m.shape == (2, heads, 7, 7) for m in maps)
    for m in maps:
        torch.testing.assert_close(m.sum(-1), torch.ones(2, heads, 7))
        assert float(m.triu(1).abs().max()) == 0  # causal
    exact, _ = converted(model, (HEADS if family == "gpt2" else KV_HEADS) * HEAD_DIM, method)
    with torch.no_grad():
        expected = model(ids(), output_attentions=True).attentions
        got = exact(ids(), output_attentions=True).attentions
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_sizes_at_a_cache_fraction_are_the_converted_models(family):
    model = source(family)
    kv_heads = HEADS if family == "gpt2" else KV_HEADS
    config = model.config
    original = original_size(config)
    for method, counts in (("merge-kv", [g for g in range(1, kv_heads + 1) if kv_heads % g == 0]),
                           ("drop-kv", list(range(1, kv_heads + 1)))):
        sizes = conversion_sizes(config, METHODS[method])
        assert [s.rank for s in sizes] == [g * HEAD_DIM for g in counts]
        assert [s.cache_bytes for s in sizes] == [2 * 2 * 2 * g * HEAD_DIM for g in counts]  # layers, k+v, bf16
        chosen = conversion_at(sizes, original, 0.5)
        assert chosen.cache_bytes <= original.cache_bytes / 2
        small, _ = converted(model, chosen.rank, method)
        with torch.no_grad():
            cache = small(ids(), use_cache=True).past_key_values
        measured = sum(t[0, :, 0].numel() * 2 for layer in cache.layers for t in (layer.keys, layer.values))
        assert measured == chosen.cache_bytes
        assert sum(p.numel() for m in attention_layers(small) for p in m.parameters()) == chosen.attention_params


def test_what_cannot_be_honoured_is_refused_with_the_reason():
    grouped, multi_head = rotary_model("llama"), rotary_model("llama", kv_heads=HEADS)
    refusals = [
        (grouped, "merge-kv", 3 * HEAD_DIM, r"G dividing the source's 2 key/value heads: rank one of \[12, 24\] "
                                             r"\(G = \[1, 2\]\); got rank 36"),
        (multi_head, "merge-kv", 3 * HEAD_DIM, r"G dividing the source's 4 key/value heads: rank one of "
                                                r"\[12, 24, 48\] \(G = \[1, 2, 4\]\); got rank 36"),
        (grouped, "drop-kv", 3 * HEAD_DIM, r"G at most the source's 2 key/value heads: rank one of \[12, 24\]"),
        (grouped, "drop-kv", 18, r"rank = G x head_dim \(12\).*got rank 18"),
        (grouped, "merge-kv", 0, r"rank 0 for layer 0 is invalid"),
        (gpt2(), "merge-kv", 3 * HEAD_DIM, r"G dividing the source's 4 key/value heads"),
    ]
    for model, method, rank, message in refusals:
        before = type(attention_sites(model)[1][0].module)
        with pytest.raises(ValueError, match=message):
            collab_attn.reparametrize(model, rank, method=method, progress=False)
        assert type(attention_sites(model)[1][0].module) is before  # the model is left as it was
    with pytest.raises(ValueError, match="G = 0|rank 0"):
        collab_attn.reparametrize(grouped, [HEAD_DIM, 0], method="drop-kv", progress=False)
    with pytest.raises(ValueError, match="takes one rank or one per layer, not a budget"):
        collab_attn.reparametrize(grouped, "mean:24", method="merge-kv", progress=False)


def test_the_rotary_grouped_module_needs_positions_and_an_even_head_dim():
    layer = RotaryGroupedQueryAttention(D, HEADS, KV_HEADS, head_dim=HEAD_DIM)
    x = torch.randn(1, 3, D)
    with pytest.raises(ValueError, match="needs position_embeddings=\\(cos, sin\\)"):
        layer(x)
    with pytest.raises(ValueError, match="position_embeddings must be \\(cos, sin\\) of shape \\(batch, 3 positions"):
        layer(x, position_embeddings=(torch.ones(1, 4, HEAD_DIM), torch.zeros(1, 4, HEAD_DIM)))
    with pytest.raises(ValueError, match="head_dim \\(7\\) must be even"):
        RotaryGroupedQueryAttention(D, HEADS, KV_HEADS, head_dim=7)
    # at angle zero it is plain grouped-query attention
    positions = (torch.ones(1, 3, HEAD_DIM), torch.zeros(1, 3, HEAD_DIM))
    reference = GroupedQueryAttention(D, HEADS, KV_HEADS, head_dim=HEAD_DIM)
    reference.load_state_dict(layer.state_dict())
    torch.testing.assert_close(layer(x, position_embeddings=positions)[0], reference(x)[0])


def test_build_layers_shapes_the_kinds_for_dropped_groups():
    model = rotary_model("qwen2")
    _, sites = attention_sites(model)
    layers = build_layers(sites, Layout("drop-kv", "rotary-gqa", {"rank": [HEAD_DIM] * 2, "heads": [2, 2]}))
    layer = layers[0].new
    assert (layer.num_heads, layer.kv_heads, layer.query.weight.shape, layer.key.weight.shape) == (
        2, 1, (2 * HEAD_DIM, D), (HEAD_DIM, D))
    assert layer.query.bias is not None and layer.output.bias is None  # Qwen2: q/k/v biases, no o_proj bias
