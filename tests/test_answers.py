"""How far a converted model follows the original's greedy answers (collab_attn.pretrained.answers), on tiny random
Llama models: the teacher-forced agreement recomputed against the two models' own greedy generations."""

import json

import pytest
import torch
import transformers
from test_llm_race import a_finished_fitted_run, rows, tiny_llama

import collab_attn
from collab_attn.pretrained import heldout, race
from collab_attn.pretrained.answers import answer_agreement

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = ("abc", "hello there", "what is 12 plus 7?")


class ChatTokenizer:
    """A chat template of characters: the beginning of text, the prompt's characters, then an end-of-turn token."""

    def apply_chat_template(self, chat, add_generation_prompt, return_tensors, return_dict):
        assert add_generation_prompt and return_tensors == "pt" and return_dict
        ids = [1, *(3 + ord(c) % 90 for c in chat[0]["content"]), 4]
        return transformers.BatchEncoding({"input_ids": torch.tensor([ids]),
                                           "attention_mask": torch.ones(1, len(ids), dtype=torch.long)})

    def decode(self, ids, skip_special_tokens):
        return " ".join(str(i) for i in ids.tolist() if not (skip_special_tokens and i in (1, 2)))


def greedy(model, prompt, new_tokens):
    chat = ChatTokenizer().apply_chat_template([{"role": "user", "content": prompt}], True, "pt", True)
    with torch.no_grad():
        out = model.generate(**chat, max_new_tokens=new_tokens, do_sample=False)
    return out[0, chat["input_ids"].shape[1]:].tolist()


def test_the_original_follows_itself_word_for_word_with_its_own_margins():
    original = tiny_llama()
    report = answer_agreement(original, original, ChatTokenizer(), PROMPTS, new_tokens=6)
    tokens = sum(len(greedy(original, prompt, 6)) for prompt in PROMPTS)
    for prompt, measured in zip(PROMPTS, report.prompts):
        answer = greedy(original, prompt, 6)
        assert measured.tokens == len(answer) and measured.word_for_word and measured.missed == []
        assert measured.matched == measured.agreed == measured.tokens
        assert measured.answer == ChatTokenizer().decode(torch.tensor(answer), skip_special_tokens=True)
        prompt_ids = ChatTokenizer().apply_chat_template([{"role": "user", "content": prompt}], True, "pt", True)
        full = torch.cat([prompt_ids["input_ids"], torch.tensor([answer])], 1)
        with torch.no_grad():
            top = original(full).logits[0, -len(answer) - 1:-1].log_softmax(-1).topk(2).values
        assert measured.margins == pytest.approx((top[:, 0] - top[:, 1]).tolist(), abs=1e-5)
        assert min(measured.margins) >= 0
    assert f"| all | 3 of 3 | | {tokens} of {tokens} |" in report.table()


def test_a_converted_model_matches_exactly_the_prefix_its_own_greedy_answer_shares():
    original = tiny_llama()
    converted = tiny_llama()
    collab_attn.reparametrize(converted, 4, value_rank=4, progress=False)
    converted.train()
    report = answer_agreement(converted, original, ChatTokenizer(), PROMPTS, new_tokens=8)
    assert converted.training and not original.training  # modes put back
    converted.eval()
    shared = []
    for prompt, measured in zip(PROMPTS, report.prompts):
        mine, theirs = greedy(converted, prompt, 8), greedy(original, prompt, 8)
        prefix = next((i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        assert measured.matched == prefix and measured.word_for_word == (mine == theirs)
        assert measured.missed[:1] == ([] if measured.word_for_word else [prefix])
        assert measured.agreed == measured.tokens - len(measured.missed) >= measured.matched
        shared.append(prefix)
    assert sum(p.agreed for p in report.prompts) < sum(p.tokens for p in report.prompts)  # the test can fail
    data = json.loads(report.to_json())
    assert [p["matched"] for p in data["prompts"]] == shared


def test_bad_arguments_say_what_to_pass():
    """Refused before any generation: a count that is not a positive integer, one prompt as a string (each of its
    characters would be a prompt), no prompts, and an original the model was not made from."""
    original = tiny_llama()
    for new_tokens in (0, "10", 2.0, True):
        with pytest.raises(ValueError, match=f"new_tokens must be an integer of at least 1, got {new_tokens!r}"):
            answer_agreement(original, original, ChatTokenizer(), PROMPTS, new_tokens=new_tokens)
    with pytest.raises(ValueError, match="prompts must be a list of prompt strings, got str 'abc': pass \\[prompt\\]"):
        answer_agreement(original, original, ChatTokenizer(), "abc", new_tokens=3)
    with pytest.raises(ValueError, match="prompts must be non-empty strings, got \\[3, ' '\\]"):
        answer_agreement(original, original, ChatTokenizer(), ["abc", 3, " "], new_tokens=3)
    with pytest.raises(ValueError, match="no prompts"):
        answer_agreement(original, original, ChatTokenizer(), (), new_tokens=3)
    converted = tiny_llama()
    collab_attn.reparametrize(converted, 4, value_rank=4, progress=False)
    with pytest.raises(ValueError, match="original's weights outside the attention layers differ from converted's"):
        answer_agreement(converted, tiny_llama(seed=1), ChatTokenizer(), PROMPTS, new_tokens=3)


def test_the_race_follows_the_answers_of_a_finished_run_from_its_kept_fit(tmp_path, monkeypatch):
    """``answer_detail``: a finished fitted run converted again (its layer fit read back, not fitted again, its
    result file left as it was), its answers followed token by token, written beside the runs; once; not for the
    original."""
    windows = {domain: rows(count=2, length=16, seed=i) for i, domain in enumerate(heldout.DOMAINS)}
    original, entry, options, result = a_finished_fitted_run(tmp_path, monkeypatch, windows)
    written = (tmp_path / "runs" / f"{entry.name}.json").read_text()
    monkeypatch.setattr(race, "answer_agreement",
                        lambda model, orig, tokenizer: answer_agreement(model, orig, tokenizer, PROMPTS, 5))
    again = race.run_entry(entry, original, ChatTokenizer(), windows, tmp_path, original_cache=48,
                           answer_detail=True, **options)
    assert again == result and (tmp_path / "runs" / f"{entry.name}.json").read_text() == written
    detail = json.loads((tmp_path / "answers" / f"{entry.name}.json").read_text())
    assert [p["prompt"] for p in detail["prompts"]] == list(PROMPTS)
    assert all(p["tokens"] == 5 and len(p["margins"]) == 5 for p in detail["prompts"])
    assert "| all |" in (tmp_path / "answers" / f"{entry.name}.md").read_text()
    monkeypatch.setattr(race, "answer_agreement", lambda *a: pytest.fail("measured twice"))
    race.run_entry(entry, original, ChatTokenizer(), windows, tmp_path, original_cache=48, answer_detail=True,
                   **options)
    race.run_entry(race.Entry("none"), original, ChatTokenizer(), windows, tmp_path, original_cache=48,
                   answer_detail=True)
    assert not (tmp_path / "answers" / "original.json").exists()
