"""llama.cpp runs what ``collab_attn.export(..., format="gguf")`` writes: SmolLM2-135M converted by ``key-svd`` at half
its key/value cache (shared bands and values), exported, loaded by llama-cpp-python with a float32 cache, gives the
exported transformers model's logits on a prompt and its greedy tokens. The original written the same way
(``source_as_standard``) gives the original's logits, and llama.cpp's default float16 cache moves each model's logits as
much as rounding its queries, keys and values to float16 in transformers does.

llama-cpp-python has no wheel for this machine (it builds llama.cpp from source, about 20 minutes), so it is not a CI
dependency: these tests skip without it. ``scripts/check_llama_cpp.sh`` installs it and runs them; its report is
``experiments/serving/llama_cpp_tests.txt``.
"""

import os

import pytest
import torch

llama_cpp = pytest.importorskip("llama_cpp")

import transformers  # noqa: E402

import collab_attn  # noqa: E402
from collab_attn.models.checkpoints import resolve_model, smollm2_gguf  # noqa: E402
from collab_attn.serving import standard_model  # noqa: E402
from collab_attn.serving.checkpoint import source_as_standard  # noqa: E402
from collab_attn.serving.gguf_file import write_gguf  # noqa: E402
from collab_attn.serving.precision import rounded_cache  # noqa: E402

PROMPT = "The capital of France is"
NEW_TOKENS = 20
F32 = 0  # GGML_TYPE_F32: the cache in float32, as the transformers model computes
TEXT = ("The Amazon river flows for about 6,400 kilometres from the Andes to the Atlantic Ocean, draining a basin "
        "larger than any other on Earth. Its tributaries rise in Peru, Bolivia, Ecuador and Colombia, and during the "
        "wet season the main channel can widen to more than forty kilometres. Explorers of the sixteenth century "
        "named it after the warriors of Greek legend, having fought, they said, a tribe led by women. Today the "
        "river carries more water to the sea than the next seven largest rivers combined.")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """SmolLM2 converted (key-svd, 96/96, shared bands, no calibration), its standard model and its GGUF file."""
    folder = resolve_model("smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    collab_attn.reparametrize(model, 96, method="key-svd", value_rank=96, bands="shared", progress=False)
    path = collab_attn.export(model, tmp_path_factory.mktemp("gguf") / "smollm2-kv96.gguf", format="gguf",
                              vocabulary=smollm2_gguf())
    return standard_model(model).model, tokenizer, path


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """SmolLM2 itself, written the way its conversions are (float32, every frequency factor 1)."""
    folder = resolve_model("smollm2")
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    path = tmp_path_factory.mktemp("gguf") / "smollm2.gguf"
    write_gguf(source_as_standard(model), path, smollm2_gguf())
    return model, path


def logits(path, ids, **options):
    engine = llama(path, **options)
    engine.eval(ids)
    return torch.tensor(engine.scores[:len(ids)])


def llama(path, **options):
    return llama_cpp.Llama(model_path=str(path), n_ctx=256, logits_all=True, verbose=False, seed=0,
                           n_threads=os.cpu_count(), **options)


def test_llama_cpp_gives_the_exported_models_logits_with_a_float32_cache(exported):
    model, tokenizer, path = exported
    ids = tokenizer(PROMPT).input_ids
    engine = llama(path, type_k=F32, type_v=F32)
    assert engine.tokenize(PROMPT.encode(), add_bos=False, special=True) == ids
    engine.eval(ids)
    got = torch.tensor(engine.scores[:len(ids)])
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    error = float((got - expected).abs().max())
    print(f"llama.cpp (float32 cache) against transformers: logits |diff| max {error:.2e} "
          f"(scale {float(expected.abs().max()):.1f})")
    assert error <= 1e-2


def test_llama_cpp_gives_the_same_greedy_tokens(exported):
    model, tokenizer, path = exported
    ids = tokenizer(PROMPT).input_ids
    with torch.no_grad():
        expected = model.generate(torch.tensor([ids]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                  pad_token_id=tokenizer.eos_token_id)[0, len(ids):].tolist()
    engine = llama(path, type_k=F32, type_v=F32)
    got = []
    for token in engine.generate(ids, top_k=1, temp=0.0, repeat_penalty=1.0):
        got.append(token)
        if len(got) == len(expected) or token == tokenizer.eos_token_id:
            break
    print(f"greedy: {tokenizer.decode(got)!r}")
    assert got == expected


def test_the_original_written_the_same_way_gives_its_logits(source, exported):
    model, path = source
    ids = exported[1](TEXT).input_ids
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0]
    error = float((logits(path, ids, type_k=F32, type_v=F32) - expected).abs().max())
    print(f"llama.cpp original (float32 cache) against transformers: logits |diff| max {error:.2e} "
          f"(scale {float(expected.abs().max()):.1f})")
    assert error <= 1e-2


def test_a_float16_cache_moves_the_logits_as_rounding_queries_keys_and_values_predicts(source, exported):
    """llama.cpp's default cache type (float16) against float32, each model against itself on a text of about 100
    tokens. llama.cpp stores keys and values in float16 and rounds the queries to float16 to multiply them with the
    keys; the largest logit change is within 2x of what that rounding does in transformers, for the original and the
    exported model alike: what the engine loses is the model's own sensitivity to rounding, not the export's. (This
    uncalibrated conversion is far more sensitive than the original; scripts/llama_cpp_half_cache.py measures the
    fitted ones.)"""
    ids = exported[1](TEXT).input_ids
    for name, path, model in (("original", source[1], source[0]), ("exported", exported[2], exported[0])):
        full, half = logits(path, ids, type_k=F32, type_v=F32), logits(path, ids)
        kl = torch.nn.functional.kl_div(half.log_softmax(-1), full.log_softmax(-1), log_target=True,
                                        reduction="none").sum(-1).mean()
        moved = float((half - full).abs().max())
        with torch.no_grad():
            full_logits = model(torch.tensor([ids])).logits[0]
            with rounded_cache(model, torch.float16, queries=True):
                expected = float((model(torch.tensor([ids])).logits[0] - full_logits).abs().max())
        print(f"{name}: float16 cache against float32, {len(ids)} tokens: logits |diff| max {moved:.3f} (transformers, "
              f"queries, keys and values rounded: {expected:.3f}), mean KL {float(kl):.2e}")
        assert expected / 2 <= moved <= 2 * expected


def test_the_decoding_benchmark_times_every_model_at_every_batch(tmp_path):
    """benchmarks/llama_cpp_decode.py at a short context: a row per model and batch, each cache the size its head
    size and key/value heads give (the timings of so short a run measure nothing)."""
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "llama_cpp_decode.py"
    spec = importlib.util.spec_from_file_location("llama_cpp_decode", script)
    benchmark = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(benchmark)
    rows = benchmark.main(["--contexts", "16", "--batches", "1", "2", "--repeats", "1", "--warmup", "0",
                           "--flash-attn", "off", "--out", str(tmp_path / "decode")])
    assert [(r["batch"], r["head_dim"], r["kv_heads"]) for r in rows] == [
        (batch, head, kv) for batch in (1, 2) for head, kv in ((64, 3), (96, 1), (48, 1))]
    original = {r["batch"]: r["cache_mib"] for r in rows if r["model"] == "original"}
    for row in rows:
        assert row["cache_mib"] / original[row["batch"]] == row["head_dim"] * row["kv_heads"] / (64 * 3)
        assert row["ms_per_step"] > 0 and row["prefill_s"] > 0
    assert (tmp_path / "decode.md").is_file() and (tmp_path / "decode.json").is_file()
