"""llama.cpp runs what ``collab_attn.export(..., format="gguf")`` writes: SmolLM2-135M converted by ``key-svd`` at half
its key/value cache (shared bands and values), exported, loaded by llama-cpp-python with a float32 cache, gives the
exported transformers model's logits on a prompt and its greedy tokens.

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

PROMPT = "The capital of France is"
NEW_TOKENS = 20
F32 = 0  # GGML_TYPE_F32: the cache in float32, as the transformers model computes


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
