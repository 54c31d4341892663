"""A converted model's answers to a fixed set of chat prompts, and how far they follow the original's.

``answers(model, tokenizer)``: greedy answers through the chat template (what the race prints beside each run).

``answer_agreement(model, original, tokenizer)``: the original's greedy answer to each prompt read by both models
in one teacher-forced pass. Up to its first miss the converted model's greedy answer *is* the original's (the
prefixes are the same tokens), so ``matched == tokens`` exactly when the two greedy answers agree word for word.
Beside it, at every position of the answer: whether the converted model's most likely token is the original's, and
the original's own margin there (the log-probability of its first choice minus that of its second), so a miss at a
near-tie of the original is told apart from a miss where the original was sure.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from collab_attn.identity import check_same_source

PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "What is 12 plus 7?",
    "Name three colours.",
    "Who wrote Romeo and Juliet?",
)


def _chat(tokenizer, prompt: str, device) -> dict:
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         return_tensors="pt", return_dict=True).to(device)


def answers(model, tokenizer, prompts: Sequence[str] = PROMPTS, new_tokens: int = 24) -> list[str]:
    """Greedy answers through the chat template."""
    replies = []
    for prompt in prompts:
        chat = _chat(tokenizer, prompt, model.device)
        with torch.no_grad():
            out = model.generate(**chat, max_new_tokens=new_tokens, do_sample=False)
        replies.append(tokenizer.decode(out[0, chat["input_ids"].shape[1]:], skip_special_tokens=True).strip())
    return replies


@dataclass(frozen=True)
class AnswerAgreement:
    prompt: str
    answer: str  # the original's greedy answer
    tokens: int  # its length in tokens
    matched: int  # its leading tokens the converted model's greedy answer shares
    agreed: int  # its positions where the converted model's most likely token is the original's (teacher-forced)
    margins: list[float]  # the original's margin at each position: log p(first choice) - log p(second choice)
    missed: list[int]  # the positions where the converted model's most likely token is another

    @property
    def word_for_word(self) -> bool:
        return self.matched == self.tokens


@dataclass
class AnswerReport:
    prompts: list[AnswerAgreement]

    def to_dict(self) -> dict:
        return {"prompts": [asdict(p) for p in self.prompts]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """One Markdown row per prompt, then the totals: the positions agreed, and the original's median margin
        where the converted model agreed against where it missed."""
        rows = ["| prompt | word for word | leading tokens matched | positions agreed | original's median margin "
                "(all / at the misses) |", "|---|---|---:|---:|---:|"]
        for p in self.prompts:
            at_misses = statistics.median(p.margins[i] for i in p.missed) if p.missed else None
            rows.append(f"| {p.prompt} | {'yes' if p.word_for_word else 'no'} | {p.matched} of {p.tokens} | "
                        f"{p.agreed} of {p.tokens} | {statistics.median(p.margins):.2f} / "
                        f"{'-' if at_misses is None else f'{at_misses:.2f}'} |")
        tokens = sum(p.tokens for p in self.prompts)
        agreed = [m for p in self.prompts for i, m in enumerate(p.margins) if i not in p.missed]
        missed = [p.margins[i] for p in self.prompts for i in p.missed]
        rows.append(f"| all | {sum(p.word_for_word for p in self.prompts)} of {len(self.prompts)} | | "
                    f"{sum(p.agreed for p in self.prompts)} of {tokens} | "
                    f"{statistics.median(agreed) if agreed else float('nan'):.2f} agreed / "
                    f"{statistics.median(missed) if missed else float('nan'):.2f} missed |")
        return "\n".join(rows)


def answer_agreement(model, original, tokenizer, prompts: Sequence[str] = PROMPTS,
                     new_tokens: int = 24) -> AnswerReport:
    """How far ``model`` follows ``original``'s greedy answer to each prompt (the module doc). Both models run in
    eval mode; their training flags are put back. ``model`` is ``original`` converted (and perhaps trained further):
    its weights outside the attention layers are checked to be near ``original``'s
    (``collab_attn.identity.check_same_source``)."""
    if type(new_tokens) is not int or new_tokens < 1:
        raise ValueError(f"new_tokens must be an integer of at least 1, got {new_tokens!r}")
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise ValueError(f"prompts must be a list of prompt strings, got {type(prompts).__name__} {prompts!r:.60}: "
                         "pass [prompt] for one")
    if not prompts:
        raise ValueError("no prompts: pass at least one")
    empty = [prompt for prompt in prompts if not isinstance(prompt, str) or not prompt.strip()]
    if empty:
        raise ValueError(f"prompts must be non-empty strings, got {empty[:3]}")
    for name, value in (("model", model), ("original", original)):
        if not hasattr(value, "config") or not hasattr(value, "generate"):
            raise ValueError(f"{name} must be a transformers language model, got {type(value).__name__}")
    if not hasattr(tokenizer, "apply_chat_template"):
        raise ValueError("tokenizer must be the original's tokenizer, with a chat template; got "
                         f"{type(tokenizer).__name__}")
    if model is not original:
        check_same_source(model, original, trained=True)
    modes = model.training, original.training
    model.eval(), original.eval()
    measured = []
    try:
        for prompt in prompts:
            chat = _chat(tokenizer, prompt, original.device)
            start = chat["input_ids"].shape[1]
            with torch.no_grad():  # the original's logits as it chose each token, not a second pass
                out = original.generate(**chat, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                        return_dict_in_generate=True)
                reference = torch.stack(out.logits, 1)[0].float()
                converted = model(out.sequences.to(model.device)).logits[0, start - 1:-1].float().to(reference.device)
            answer = out.sequences[0, start:]
            top = reference.log_softmax(-1).topk(2).values
            hits = (converted.argmax(-1) == answer).tolist()
            missed = [i for i, hit in enumerate(hits) if not hit]
            measured.append(AnswerAgreement(
                prompt=prompt, answer=tokenizer.decode(answer, skip_special_tokens=True).strip(),
                tokens=len(hits), matched=missed[0] if missed else len(hits), agreed=sum(hits),
                margins=(top[:, 0] - top[:, 1]).tolist(), missed=missed))
    finally:
        model.train(modes[0]), original.train(modes[1])
    return AnswerReport(measured)
