"""A converted pretrained language model measured against its original on held-out text: perplexity of both, the
KL divergence from the original's next-token distribution to the converted model's, and how often their most likely
next tokens agree.

Text per domain and split (``texts``), three splits that share no text:

- ``fit``: what conversions, calibrations, fits and distillations read.
- ``validation``: the evaluation windows every result up to issue 88 was measured on, and where every choice of
  recipe (methods, sizes, steps, targets, learning rates, token counts, window lengths) is made. Its windows are
  exactly the windows the former ``eval`` split gave at every length and count the scripts used (16 of 256 tokens,
  8 of 2,048), so old run files stay comparable: the split is the first part of that text. ``"eval"`` is still
  accepted, with a ``DeprecationWarning``, as ``"validation"``; a run file without a ``split`` was measured on it.
- ``test``: the rest of the evaluation text, after the validation part, which nothing read before issue 88. It is
  read once, to report rows chosen on validation (``scripts/race_smollm2.py --split test``).

Domains (``DOMAINS``: the race's first two, its default fitting mixture and validation domains; ``FIT_DOMAINS``
adds ``code``, which has all three splits too; ``TEST_DOMAINS`` adds the test-only ``docs``):

- ``wikipedia``: fit on RTE and MRPC train sentences (news and Wikipedia); the QNLI dev sentences (Wikipedia; GLUE
  ships QNLI's dev split only, and no conversion reads it) are the evaluation text: validation the first
  ``WIKIPEDIA_VALIDATION_SENTENCES`` (450) of them, test the other 5,013.
- ``shakespeare``: Tiny Shakespeare split 90% / 10% in order, as nanoGPT splits it: fit on the first part; the last
  part is the evaluation text: validation up to the first blank line at or after its character
  ``SHAKESPEARE_VALIDATION_CHARACTERS`` (52,000; 52,043 characters), test the rest (59,497 characters).
- ``code``: the Python source of the pinned torch (from the installed package), each split its own files,
  concatenated in order and checked against a SHA-256 so that every machine reads the same text (``code_text``):
  fit ``CODE_FIT_FILES`` (``torch.nn`` modules), validation ``CODE_VALIDATION_FILES`` (``torch.optim``), test
  ``CODE_FILES`` (the test-only domain of issue 88: no fit and no choice read them).
- ``docs``: test only (``fit`` and ``validation`` are refused): the Python language reference as ``pydoc`` ships it
  (``pydoc_data.topics`` of Python 3.11.7, its topics in name order, checked against ``DOCS_SHA256``; ``docs_text``).
  English technical prose with code examples, which no fit and no choice reads: the domain "no fit read".

The cut between validation and test is a cut of the text, before any tokenizer: a window of one split holds tokens of
that split's text only, whatever its length and count (``evaluation_windows`` windows one split's text; asking for
more windows than it holds is refused, never filled from the other split). The validation part holds the largest
validation read the scripts made (8 windows of 2,048 tokens: 16,376 tokens) with a margin (SmolLM2's tokenizer:
17,161 and 16,911 tokens). Windows available to SmolLM2's tokenizer (``window_count``), 256 / 2,048 tokens a window
(tokens):

| domain | validation | test |
|---|---:|---:|
| wikipedia | 67 / 8 (17,161) | 739 / 92 (188,466) |
| shakespeare | 66 / 8 (16,911) | 74 / 9 (19,071) |
| code | 150 / 18 (38,352) | 252 / 31 (64,455) |
| docs | refused | 443 / 55 (113,108) |

Evaluation windows are consecutive, non-overlapping token windows of a split's text (sentences joined by a space),
so every model sees the same tokens; each window starts from the tokenizer's beginning-of-text token. ``agreement``
keeps each window's sums beside the totals, so two runs on the same windows can be compared by a paired bootstrap
over windows (``collab_attn.stats.window_bootstrap``).
"""

from __future__ import annotations

import csv
import hashlib
import math
import sys
import warnings
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from collab_attn import own_text
from collab_attn.texts import windows

DOMAINS = ("wikipedia", "shakespeare")  # the race's default fitting mixture and validation domains
FIT_DOMAINS = (*DOMAINS, "code")  # fitted on, chosen on (validation) and tested on
TEST_DOMAINS = (*FIT_DOMAINS, "docs")  # docs: the test split only
OWN = "own"  # a fitting text that is no domain: the original's own samples (collab_attn.own_text)
OWN_TEXTS = tuple(own_text.OWN_TEXTS)  # fitting texts of the original's own samples, each sampled its own way
SPLITS = ("fit", "validation", "test")
EVALUATION_SPLITS = ("validation", "test")
WIKIPEDIA_VALIDATION_SENTENCES = 450  # the first QNLI dev sentences: validation; the rest: test
SHAKESPEARE_VALIDATION_CHARACTERS = 52_000  # validation: the evaluation text up to the first blank line from here
# The code domain: these files of torch==2.13.0 (pinned in pyproject.toml), in this order, concatenated as they are;
# each split's own files and the SHA-256 of their text.
CODE_FILES = ("torch/functional.py", "torch/serialization.py", "torch/hub.py", "torch/random.py",
              "torch/quasirandom.py", "torch/_lowrank.py")  # test
CODE_SHA256 = "ff69f86a2444e0a260cc8d321d5da1f658dbc80ea414cb660533a0cc60ddc09e"
CODE_FIT_FILES = tuple(f"torch/nn/modules/{name}.py" for name in ("module", "conv", "rnn", "activation", "loss",
                                                                   "transformer"))
CODE_VALIDATION_FILES = ("torch/optim/optimizer.py", "torch/optim/lr_scheduler.py")
CODE_SPLITS = {"fit": (CODE_FIT_FILES, "4ed2a2bc7269473d948df504b7edd931d9faf895160586f722e886c0a2a2a207"),
               "validation": (CODE_VALIDATION_FILES,
                              "f6171a66f171169317cf2cb4bd3418a84f68741b96248f383d0152f8aa7ae9c9"),
               "test": (CODE_FILES, CODE_SHA256)}
DOCS_SHA256 = "71f2ff5d99bdc1f9c48c5c2353ad138201c5ca1c377e0226857ef8fa89b8bcee"  # pydoc_data.topics, Python 3.11.7


def _tsv_column(path: Path, columns: Sequence[str]) -> list[str]:
    with open(path, newline="", encoding="utf-8") as handle:
        rows = csv.DictReader(handle, delimiter="\t", quoting=csv.QUOTE_NONE)
        missing = [c for c in columns if c not in (rows.fieldnames or [])]
        if missing:
            raise ValueError(f"{path}: no column {missing[0]!r} (columns: {rows.fieldnames})")
        return [row[c].strip() for row in rows for c in columns if row[c] and row[c].strip()]


def code_text(root: str | Path | None = None, split: str = "test") -> str:
    """The ``code`` domain's ``split`` text: its files (``CODE_SPLITS``) read from ``root`` (default: the folder
    holding the installed ``torch`` package), concatenated in order; refused unless its SHA-256 is the recorded one
    (another torch than the pinned 2.13.0, or edited files, would give other text)."""
    files, sha256 = CODE_SPLITS[split]
    root = Path(torch.__file__).resolve().parents[1] if root is None else Path(root)
    missing = [name for name in files if not (root / name).is_file()]
    if missing:
        raise ValueError(f"the code domain's {split} split reads {', '.join(files)} under {root}: {missing[0]} is "
                         "missing (it needs torch==2.13.0, pinned in pyproject.toml)")
    text = "".join((root / name).read_text(encoding="utf-8") for name in files)
    return _pinned(text, sha256, f"the code domain's {split} text ({', '.join(files)} under {root}, torch "
                   f"{torch.__version__})", "torch==2.13.0 that every code measurement read; install the pinned "
                   "torch (pyproject.toml)")


def _pinned(text: str, sha256: str, what: str, expected: str) -> str:
    """``text`` when its SHA-256 is ``sha256``; else refused, naming ``what`` it is and the ``expected`` text."""
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if digest != sha256:
        raise ValueError(f"{what} has SHA-256 {digest}, not {sha256}: it is not the text of {expected}")
    return text


def docs_text(topics: dict[str, str] | None = None) -> str:
    """The ``docs`` domain's text: the topics of ``pydoc_data.topics`` (default: the running Python's), in name order,
    joined by blank lines; refused unless its SHA-256 is ``DOCS_SHA256`` (Python 3.11.7's)."""
    if topics is None:
        from pydoc_data.topics import topics
    text = "\n\n".join(topics[name] for name in sorted(topics))
    return _pinned(text, DOCS_SHA256, f"the docs domain's text (pydoc_data.topics of Python {sys.version.split()[0]})",
                   "the Python 3.11.7 language reference that every docs measurement read; run under Python 3.11.7")


def _evaluation_parts(domain: str, glue_dir, shakespeare) -> tuple[str, str, str]:
    """The evaluation text of ``domain`` as (validation, separator, test): validation + separator + test is the
    whole evaluation text (the former ``eval`` split), validation its start."""
    if domain == "wikipedia":
        if glue_dir is None:
            raise ValueError("the wikipedia domain reads GLUE's QNLI, RTE and MRPC: give glue_dir")
        sentences = _tsv_column(Path(glue_dir) / "QNLI" / "dev.tsv", ["sentence"])
        cut = WIKIPEDIA_VALIDATION_SENTENCES
        if len(sentences) <= cut:
            raise ValueError(f"{glue_dir}/QNLI/dev.tsv holds {len(sentences)} sentences: the validation split is "
                             f"the first {cut}, the test split the rest (GLUE's QNLI dev: 5,463)")
        return " ".join(sentences[:cut]), " ", " ".join(sentences[cut:])
    if shakespeare is None:
        raise ValueError("the shakespeare domain reads Tiny Shakespeare: give shakespeare (its input.txt)")
    text = Path(shakespeare).read_text(encoding="utf-8")
    held = text[int(0.9 * len(text)):]
    blank = held.find("\n\n", SHAKESPEARE_VALIDATION_CHARACTERS)
    if blank < 0:
        raise ValueError(f"{shakespeare}: its last 10% ({len(held):,} characters) has no blank line after character "
                         f"{SHAKESPEARE_VALIDATION_CHARACTERS:,}, where the validation split ends and the test split "
                         "starts (Tiny Shakespeare: 111,540 characters)")
    return held[:blank + 2], "", held[blank + 2:]


def _renamed(split: str) -> str:
    """``"eval"``, the former name of ``"validation"``, with a ``DeprecationWarning``; other names as given."""
    if split == "eval":
        warnings.warn("split='eval' is now 'validation' (the same windows; the text after them is 'test')",
                      DeprecationWarning, stacklevel=3)
        return "validation"
    return split


def texts(domain: str, split: str, glue_dir: str | Path | None = None,
          shakespeare: str | Path | None = None) -> str:
    """The ``fit``, ``validation`` or ``test`` text (``SPLITS``) of ``domain`` (``TEST_DOMAINS``; ``docs`` has a
    ``test`` split only), one string. ``"eval"``: the former name of ``"validation"`` (a ``DeprecationWarning``)."""
    split = _renamed(split)
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: use 'fit' (calibration, re-training), 'validation' (held out: every "
                         "choice of recipe is made here) or 'test' (held out: read once, to report)")
    if domain not in TEST_DOMAINS:
        raise ValueError(f"domain={domain!r}: choose one of {', '.join(TEST_DOMAINS)}")
    if domain == "docs":
        if split != "test":
            raise ValueError(f"domain 'docs' is a test-only domain: no fit and no choice reads it, so it has no "
                             f"{split!r} split; use split='test'")
        return docs_text()
    if domain == "code":
        return code_text(split=split)
    if split == "fit":
        if domain == "wikipedia":
            if glue_dir is None:
                raise ValueError("the wikipedia domain reads GLUE's QNLI, RTE and MRPC: give glue_dir")
            glue = Path(glue_dir)
            return " ".join(_tsv_column(glue / "RTE" / "train.tsv", ["sentence1", "sentence2"])
                            + _tsv_column(glue / "MRPC" / "train.tsv", ["#1 String", "#2 String"]))
        if shakespeare is None:
            raise ValueError("the shakespeare domain reads Tiny Shakespeare: give shakespeare (its input.txt)")
        text = Path(shakespeare).read_text(encoding="utf-8")
        return text[:int(0.9 * len(text))]
    validation, _, test = _evaluation_parts(domain, glue_dir, shakespeare)
    return validation if split == "validation" else test


def window_count(tokenizer, text: str, length: int) -> int:
    """How many windows of ``length`` tokens ``windows`` can take from ``text`` (its tokens over ``length - 1``: each
    window's first token is the beginning-of-text token)."""
    if length < 2:
        raise ValueError(f"length={length}: a window holds the beginning-of-text token and at least one more")
    return len(tokenizer(text, add_special_tokens=False).input_ids) // (length - 1)


def evaluation_windows(tokenizer, domain: str, split: str, length: int, count: int | None = None,
                       glue_dir: str | Path | None = None, shakespeare: str | Path | None = None) -> torch.Tensor:
    """``count`` windows of ``length`` tokens of ``domain``'s ``validation`` or ``test`` text (``windows``), all
    that it holds when ``count`` is None; refused when it holds fewer (never filled from another split)."""
    split = _renamed(split)
    if split not in EVALUATION_SPLITS:
        raise ValueError(f"split={split!r}: evaluation windows come from 'validation' (every choice of recipe is "
                         "made there) or 'test' (read once, to report); the fit text is windowed by "
                         "collab_attn.pretrained.distill.fit_windows")
    text = texts(domain, split, glue_dir, shakespeare)
    try:
        return windows(tokenizer, text, length, count)
    except ValueError as error:
        raise ValueError(f"{domain}, {split} split: {error} (it holds {window_count(tokenizer, text, length)})") \
            from None


@dataclass(frozen=True)
class Window:
    """One evaluation window's sums: what a paired bootstrap over windows resamples (``collab_attn.stats``).
    ``fingerprint`` names the window's token ids (CRC-32), so two runs can be checked to hold the same windows."""

    tokens: int  # next tokens predicted
    nll: float  # the model's summed negative log-likelihood of those tokens, nats
    original_nll: float  # the original's
    kl: float  # summed KL(original || model), nats
    top1: int  # positions whose most likely next token is the original's
    fingerprint: str

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "nll": self.nll, "original_nll": self.original_nll, "kl": self.kl,
                "top1": self.top1, "fingerprint": self.fingerprint}


@dataclass(frozen=True)
class Agreement:
    """One model against the original on the same tokens (every next-token prediction of every window), with each
    window's sums in ``windows``."""

    tokens: int
    perplexity: float
    original_perplexity: float
    kl: float  # mean KL(original || model) per token, nats
    top1: float  # fraction of positions whose most likely next token is the original's
    windows: tuple[Window, ...] = ()

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "perplexity": self.perplexity, "original_perplexity": self.original_perplexity,
                "kl": self.kl, "top1": self.top1, "windows": [w.as_dict() for w in self.windows]}


def fingerprint(ids: torch.Tensor) -> str:
    """The CRC-32 of one window's token ids (as int64), eight hex digits."""
    return f"{zlib.crc32(ids.detach().to('cpu', torch.int64).contiguous().numpy().tobytes()):08x}"


def _batches(rows: torch.Tensor, batch: int) -> Iterator[torch.Tensor]:
    for start in range(0, len(rows), batch):
        yield rows[start:start + batch]


@torch.no_grad()
def agreement(model, original, rows: torch.Tensor, batch: int = 4, progress=None) -> Agreement:
    """``model`` against ``original`` on the token windows ``rows``: perplexities of both on the next tokens, the
    mean KL divergence of the model's next-token distribution from the original's, top-1 agreement, and the same
    sums per window (``progress``: a tqdm bar advanced by the windows done)."""
    per_window = []
    for ids in _batches(rows, batch):
        ids = ids.to(model.device)
        logp = F.log_softmax(model(ids).logits[:, :-1].double(), dim=-1)
        ref = F.log_softmax(original(ids).logits[:, :-1].double(), dim=-1)
        target = ids[:, 1:, None]
        nll = -logp.gather(-1, target).sum(dim=(1, 2))
        original_nll = -ref.gather(-1, target).sum(dim=(1, 2))
        kl = (ref.exp() * (ref - logp)).sum(dim=(1, 2))
        agree = (logp.argmax(-1) == ref.argmax(-1)).sum(dim=1)
        for i in range(len(ids)):
            per_window.append(Window(int(target[i].numel()), float(nll[i]), float(original_nll[i]), float(kl[i]),
                                     int(agree[i]), fingerprint(ids[i])))
        if progress is not None:
            progress.update(len(ids))
    tokens = sum(w.tokens for w in per_window)
    return Agreement(tokens, math.exp(math.fsum(w.nll for w in per_window) / tokens),
                     math.exp(math.fsum(w.original_nll for w in per_window) / tokens),
                     math.fsum(w.kl for w in per_window) / tokens, sum(w.top1 for w in per_window) / tokens,
                     tuple(per_window))
