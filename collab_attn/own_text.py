"""The original model's own text, to fit a conversion on: samples of the model itself (``own``: temperature 1, no top-k
or top-p; ``OWN_TEXTS`` names other ways), half through its chat template from varied requests, half as plain text
from short openings.

It is the one corpus whose distribution is the model's own, so a conversion fitted on it learns the original rather
than a domain, and it needs no text from the user. ``own_windows`` packs the samples one after another, each as the
model saw it (its prompt, from the beginning-of-text token, then its continuation through its end-of-text token), and
cuts the stream into windows that start with the beginning-of-text token, as
``collab_attn.texts.windows`` cuts a text.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

REQUESTS = (  # chat requests: varied topics and forms, none about the evaluation domains' texts
    "Explain how a rainbow forms.", "Write a short story about a lighthouse keeper.",
    "What are the main causes of inflation?", "Give me three tips for learning a new language.",
    "Write a Python function that reverses a linked list.", "Summarize the history of the Roman Empire.",
    "How do vaccines train the immune system?", "Write a poem about autumn leaves.",
    "What is the difference between weather and climate?", "Describe a good morning routine.",
    "How does a bicycle stay upright?", "Write an email asking a colleague to review a report.",
    "Explain recursion to a ten-year-old.", "What should I pack for a week of hiking?",
    "Compare cats and dogs as pets.", "Write a dialogue between a detective and a suspect.",
    "How do I make bread at home?", "What is photosynthesis?", "Explain what a database index does.",
    "Give arguments for and against remote work.", "Write a limerick about a forgetful robot.",
    "Why is the sky blue?", "How does compound interest work?", "Describe the water cycle.",
    "Write a product description for a reusable water bottle.", "What were the causes of the First World War?",
    "Explain the rules of chess briefly.", "Write a JavaScript snippet that debounces a function.",
    "How can I sleep better?", "Tell me about the planets of the solar system.",
    "Write a thank-you note to a teacher.", "What is machine learning?",
)
OPENINGS = (  # plain-text openings: "" samples from the beginning-of-text token alone
    "", "The", "In 1912,", "Once upon a time", "def ", "Chapter 1\n\n", "Abstract:", "Q:", "# Introduction\n\n",
    "Dear Sir,", "import ", "It was", "The following", "Breaking news:", "Recipe:", "1.",
)
CODE_REQUESTS = (  # programming requests, general ones, none about the evaluation domains' texts
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a Python script that counts the words in a text file.",
    "How do I read a CSV file with pandas and compute the mean of a column?",
    "Write pytest unit tests for a function that checks whether a string is a palindrome.",
    "My loop `for i in range(len(items)): items.remove(items[i])` fails. Why, and how do I fix it?",
    "Write a SQL query that finds the ten customers with the most orders.", "Implement binary search in C.",
    "Write a bash script that backs up a folder every night.", "Write a Rust function that parses a date string.",
    "Write a Python function that merges two sorted lists, with type hints and a docstring.",
    "Write a small Flask app with one route that returns JSON.",
)
CODE_OPENINGS = ("class ", "#!/usr/bin/env python3\n", "```python\n", "#include <", "function ")


@dataclass(frozen=True)
class OwnText:
    """How one own text is sampled: its prompts (chat requests and plain openings, in turn), its nucleus (``top_p``:
    the smallest set of next tokens holding that much probability) and its ``temperature``; 1.0 and 1.0 sample the
    model's own distribution."""

    requests: tuple[str, ...]
    openings: tuple[str, ...]
    top_p: float = 1.0
    temperature: float = 1.0


OWN_TEXTS = {  # by the fitting text's name (collab_attn.pretrained.race.FIT_TEXTS)
    "own": OwnText(REQUESTS, OPENINGS),  # about one sample in eight is code
    "owncode": OwnText(REQUESTS + CODE_REQUESTS, OPENINGS + CODE_OPENINGS),  # about one in three
    "ownnucleus": OwnText(REQUESTS, OPENINGS, top_p=0.9),
    "ownlowtemp": OwnText(REQUESTS, OPENINGS, temperature=0.7),
    "ownhightemp": OwnText(REQUESTS, OPENINGS, temperature=1.2),
    "ownhighertemp": OwnText(REQUESTS, OPENINGS, temperature=1.5),
}


def own_text(name: str) -> OwnText:
    if name not in OWN_TEXTS:
        raise ValueError(f"own text {name!r}: choose one of {', '.join(OWN_TEXTS)}")
    return OWN_TEXTS[name]


def prompts(tokenizer, count: int, text: str = "own") -> list[list[int]]:
    """The token ids of the first ``count`` prompts of ``OWN_TEXTS[text]``: chat requests (through the tokenizer's
    chat template, with the assistant's turn opened) and plain openings (after the beginning-of-text token) in turn;
    only plain openings when the tokenizer has no chat template. Each list is cycled."""
    recipe = own_text(text)
    requests, openings = recipe.requests, recipe.openings
    bos = tokenizer.bos_token_id
    if bos is None:
        raise ValueError("the tokenizer has no beginning-of-text token to start a plain sample with")
    chat = getattr(tokenizer, "chat_template", None) is not None
    out = []
    for i in range(count):
        if chat and i % 2 == 0:
            message = [{"role": "user", "content": requests[(i // 2) % len(requests)]}]
            out.append(list(tokenizer.apply_chat_template(message, add_generation_prompt=True, tokenize=True,
                                                          return_dict=True)["input_ids"]))
        else:
            opening = openings[(i // 2 if chat else i) % len(openings)]
            out.append([bos] + tokenizer(opening, add_special_tokens=False).input_ids)
    return out


@torch.no_grad()
def _sample(model, batch: list[list[int]], new_tokens: int, pad: int, eos: int | None,
            recipe: OwnText = OWN_TEXTS["own"]) -> list[list[int]]:
    """Each prompt of ``batch`` followed by its sampled continuation, through its first end-of-text token."""
    width = max(map(len, batch))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=model.device)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=recipe.temperature, top_k=0,
                         top_p=recipe.top_p, max_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=eos)
    samples = []
    for prompt, row in zip(batch, out[:, width:].tolist()):
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        samples.append(prompt + row)
    return samples


def own_windows(model, tokenizer, length: int, count: int, seed: int = 0, batch: int = 32,
                progress: bool = True, text: str = "own") -> torch.Tensor:
    """``count`` windows of ``length`` tokens of ``model``'s own samples (a (count, length) tensor on the CPU): the
    samples of ``prompts(tokenizer, n, text)`` in order, each continued for up to ``length`` new tokens sampled as
    ``OWN_TEXTS[text]`` says, packed and cut as the module says. Seeded by ``seed``; sampled ``batch`` prompts at
    a time."""
    if type(length) is not int or length < 2 or type(count) is not int or count < 1:
        raise ValueError(f"own_windows(length={length!r}, count={count!r}): a window holds the beginning-of-text "
                         "token and at least one more (length >= 2), and at least one window is asked for")
    if type(batch) is not int or batch < 1:
        raise ValueError(f"batch={batch!r}: sample at least one prompt at a time")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    if pad is None:
        raise ValueError("the tokenizer has neither a padding nor an end-of-text token to pad prompts with")
    body = length - 1
    needed = body * count
    recipe = own_text(text)
    cycle = prompts(tokenizer, 2 * math.lcm(len(recipe.requests), len(recipe.openings)), text)  # each, tokenized once
    stream: list[int] = []
    was_training = model.training
    model.eval()
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    done = 0
    try:
        with tqdm(total=needed, desc="sampling the model's own text", unit="tok", disable=not progress) as bar:
            while len(stream) < needed:
                batch_prompts = [cycle[(done + i) % len(cycle)] for i in range(batch)]
                for sample in _sample(model, batch_prompts, length, pad, eos, recipe):
                    stream += sample
                done += batch
                bar.update(min(len(stream), needed) - bar.n)
    finally:
        torch.random.set_rng_state(generator_state)
        model.train(was_training)
    bos = tokenizer.bos_token_id
    return torch.tensor([[bos] + stream[i * body:(i + 1) * body] for i in range(count)])
