"""Activation-aware fitting from the ``collab`` group's calibration texts: a text file (one text per line), a GLUE
train.tsv/dev.tsv (its task's text fields), or ``task`` (the task's training texts, which the GLUE pipeline passes
in). ``load_texts`` reads a file, ``check_calibration`` checks the source before any work, ``calibrate`` samples
the texts and collects the attention layers' input statistics, ``fit_batches`` tokenizes the same texts for
``collab.fit_steps`` and ``collab.e2e_steps`` (``collab_attn.fit_to_original``, ``collab_attn.fit_end_to_end``),
``end_to_end_batches`` the texts of ``collab.e2e_texts`` instead where they are set. With ``collab.calibration=own``
(a decoder's own samples, sampled once from the original before the conversion) or a text file read as windows
(``scripts/reparametrize.py`` reads a decoder's that way, ``file_windows``: windows of 256 tokens drawn from the
whole file, as the SmolLM2 race reads its fitting text), ``fitting_windows`` takes every window the fits read, and
every fit reads them, ``OWN_BATCH`` a step as the race does; the end-to-end fit is judged on the ``OWN_HELD_OUT``
batches after its own (``end_to_end_held_out``). The GLUE pipeline and the scripts that convert a model
(``scripts/reparametrize.py``, ``scripts/visualize.py``) use it."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from collab_attn import cli
from collab_attn.fitting.calibration import calibration_from_texts, collect_calibration, text_batches
from collab_attn.glue.tasks import get_task, task_texts
from collab_attn.models.settings import MethodSettings
from collab_attn.own_text import own_windows
from collab_attn.texts import CALIBRATION_SAMPLES, read_texts, windows

log = logging.getLogger(__name__)
GLUE_SPLITS = {"train.tsv": "train", "dev.tsv": "validation"}  # the GLUE files a calibration source may be
FIT_BATCH_SIZE = 16  # texts per batch of fitting tokens: one optimizer step of the layer or end-to-end fit
OWN_BATCH = 4  # windows of own text per step (4 x 256 tokens, about FIT_BATCH_SIZE GLUE texts)
OWN_HELD_OUT = 4  # batches of own text after the end-to-end fit's own, which decide whether it is kept


def load_texts(
    source: str | Path, limit: int | None = CALIBRATION_SAMPLES, seed: int = 0
) -> list[str | tuple[str, str]]:
    """Calibration texts from a file: a ``.tsv`` of the GLUE layout (``<glue_dir>/<Task>/{train,dev}.tsv``: the
    task's text fields, one text or sentence pair per row) or any other text file (one text per non-empty line).
    With more than ``limit`` texts, a sample of ``limit`` drawn with ``seed`` (in file order)."""
    path = Path(source)
    if path.suffix != ".tsv" or not path.is_file():
        return read_texts(path, limit, seed)
    split = GLUE_SPLITS.get(path.name)
    if split is None:
        raise ValueError(f"{path}: expected a GLUE train.tsv or dev.tsv")
    return task_texts(path.parent.name, path.parent.parent, split, limit=limit, seed=seed)


def check_calibration(method: MethodSettings, task_allowed: bool, own_allowed: bool = False) -> None:
    """The calibration texts of ``collab.calibration`` (and the end-to-end fit's, ``collab.e2e_texts``) are there and
    are text (a GLUE train.tsv/dev.tsv in its task folder, or a file of one text per line), before any work.
    ``own_allowed``: whether the caller can sample a decoder's own text (``collab.calibration=own``)."""
    if method.calibration is not None and method.calibration.from_own:
        if not own_allowed:
            raise cli.BadInput("collab.calibration=own (also what collab.fit_steps or collab.e2e_steps read without "
                               "collab.calibration) samples a decoder's own text, which this pipeline does not: set "
                               "collab.calibration to a text file or a GLUE train.tsv/dev.tsv")
        if method.e2e_texts is not None:
            _check_texts("collab.e2e_texts", Path(method.e2e_texts))
        return
    sources = {"collab.calibration": None if method.calibration is None else method.calibration.source,
               "collab.e2e_texts": method.e2e_texts}
    for key, source in sources.items():
        if source is not None and Path(source).is_dir():
            raise cli.BadInput(f"{key}={source} is a folder; pass a text file (one text per line) or a GLUE "
                               "train.tsv/dev.tsv")
    method.check_calibration_source(task_allowed)
    for key, source in sources.items():
        if source is not None and not (key == "collab.calibration" and method.calibration.from_task):
            _check_texts(key, Path(source))


def _check_texts(key: str, path: Path) -> None:
    if path.suffix != ".tsv":
        if not cli.text_file(key, path).strip():
            raise cli.BadInput(f"{key}={path} holds no texts; pass a file with one text per line")
        return
    if path.name not in GLUE_SPLITS:
        raise cli.BadInput(f"{key}={path}: a .tsv must be a GLUE train.tsv or dev.tsv")
    with cli.naming(key, path):
        get_task(path.parent.name)
    cli.text_file(key, path, limit=1 << 20)


def training_windows(method: MethodSettings) -> int:
    """How many windows the end-to-end fit (with its held-out batches) and the distillation of ``method`` read when
    the fits read windows (own text, or a text file read as windows) and no ``collab.e2e_texts``; 0 without them."""
    if method.e2e_texts is not None:
        return 0
    e2e = (method.e2e_steps + OWN_HELD_OUT) * OWN_BATCH if method.e2e_steps else 0
    return max(e2e, (method.distill_steps or 0) * OWN_BATCH)


def fitting_windows(model, tokenizer, method: MethodSettings, seed: int) -> torch.Tensor | None:
    """Every window the fits of ``method`` read, where they read windows (take them before the conversion): with
    ``collab.calibration=own`` (or another of ``OWN_TEXTS``) ``model``'s own samples; with a text file read as
    windows (``CalibrationSettings.windows``) ``file_windows``; None for other calibrations (texts)."""
    settings = method.calibration
    if settings is None or not settings.from_windows:
        return None
    if settings.from_own:
        count = max(settings.samples, training_windows(method))
        return own_windows(model, tokenizer, settings.max_length, count, seed=seed, text=settings.source)
    return file_windows(tokenizer, method, seed)


def file_windows(tokenizer, method: MethodSettings, seed: int) -> torch.Tensor:
    """The windows of ``collab.calibration_max_length`` tokens that the file of ``collab.calibration`` holds (its
    text as it is, cut one after another, each window from the beginning-of-text token, as
    ``collab_attn.texts.windows`` cuts a text), in an order drawn with ``seed`` so that every part of the file is
    read: as many as the fits read, or all the file holds when the calibration asks for more (the calibration then
    reads fewer; ``scripts/reparametrize.py`` refuses a ``collab.calibration_samples`` the user gives that the file
    does not hold). Refused when the end-to-end fit or the distillation needs more than the file holds."""
    settings = method.calibration
    length = settings.max_length
    try:
        rows = windows(tokenizer, _text_of(settings.source), length)  # every window, in the file's order
    except ValueError:
        if tokenizer.bos_token_id is None:
            raise  # no window can start: said as windows says it
        raise cli.BadInput(f"collab.calibration={settings.source} holds fewer tokens than one window of {length}: "
                           "give more text or a shorter collab.calibration_max_length") from None
    held = len(rows)
    training = training_windows(method)
    if training > held:
        steps = "e2e_steps" if training > (method.distill_steps or 0) * OWN_BATCH else "distill_steps"
        raise cli.BadInput(f"collab.{steps}={getattr(method, steps)} reads {training} windows of {length} tokens "
                           f"({OWN_BATCH} a step) from {settings.source}, which holds {held}: give fewer steps or "
                           "more text")
    order = torch.randperm(held, generator=torch.Generator().manual_seed(seed))
    return rows[order[:max(settings.samples, training)]]


def _text_of(source: str) -> str:
    """A file's text to cut windows from: a text file as it is (its indentation and blank lines kept: code reads
    as code), a GLUE .tsv's texts joined by newlines (a pair by a space)."""
    if Path(source).suffix != ".tsv":
        return cli.text_file("", source)
    return "\n".join(t if isinstance(t, str) else " ".join(t) for t in load_texts(source, limit=None))


def _window_batches(rows: torch.Tensor) -> list[dict]:
    return [{"input_ids": rows[i:i + OWN_BATCH]} for i in range(0, len(rows), OWN_BATCH)]


def _needs_windows(settings, rows) -> bool:
    if settings is not None and settings.from_windows:
        if rows is None:
            raise ValueError(f"collab.calibration={settings.source} is read as windows: pass "
                             "rows=fitting_windows(...), taken before the conversion")
        return True
    return False


def calibrate(model, tokenizer, method: MethodSettings, seed: int, task_texts=None, rows=None):
    """Input statistics for activation-aware fitting (``collab.calibration``: a text file, a GLUE .tsv, ``task``,
    whose texts ``task_texts(limit, seed)`` draws, or ``own``; where the fits read windows, the first
    ``collab.calibration_samples`` of ``rows``, what ``fitting_windows`` took), or None when it is off or when every
    layer keeps its full key/query size (an exact conversion has nothing to fit)."""
    settings = method.calibration
    if settings is None or method.keeps_full_size(model.config.hidden_size):
        return None
    if _needs_windows(settings, rows):
        calibration_rows = rows[:settings.samples]
        log.info("calibrating on %d windows of %s", len(calibration_rows),
                 "the model's own text" if settings.from_own else settings.source)
        return collect_calibration(model, _window_batches(calibration_rows.to(model.device)))
    if settings.from_task:
        if task_texts is None:
            method.check_calibration_source(task_allowed=False)
        texts = task_texts(limit=settings.samples, seed=seed)
    else:
        texts = load_texts(settings.source, seed=seed, limit=settings.samples)
    log.info("calibrating on %d texts from %s", len(texts), settings.source)
    return calibration_from_texts(model, tokenizer, texts, max_length=settings.max_length)


def fit_batches(tokenizer, method: MethodSettings, seed: int, rows=None) -> list[dict]:
    """The texts of ``collab.calibration`` (a file; the same sample ``calibrate`` draws), tokenized in batches of
    ``FIT_BATCH_SIZE`` for ``collab.fit_steps`` and ``collab.e2e_steps``: the fitting tokens of
    ``collab_attn.fit_to_original`` and ``collab_attn.fit_end_to_end``; where the fits read windows, the calibration
    windows of ``rows``, ``OWN_BATCH`` a batch."""
    settings = method.calibration
    if _needs_windows(settings, rows):
        return _window_batches(rows[:settings.samples])
    if settings is None or settings.from_task:
        raise ValueError("collab.fit_steps and collab.e2e_steps fit on the texts of collab.calibration: set it to a "
                         "text file or a GLUE train.tsv/dev.tsv")
    texts = load_texts(settings.source, seed=seed, limit=settings.samples)
    return list(text_batches(tokenizer, texts, batch_size=FIT_BATCH_SIZE, max_length=settings.max_length))


def end_to_end_batches(tokenizer, method: MethodSettings, seed: int, rows=None) -> list[dict]:
    """What ``collab.e2e_steps`` trains on: with ``collab.e2e_texts``, ``FIT_BATCH_SIZE`` texts of that file per
    step (one pass over fresh text, drawn with ``seed``; all of them, in passes, when the file holds fewer), cut at
    ``collab.calibration_max_length``; where the fits read windows, ``OWN_BATCH`` windows of ``rows`` a step, one
    pass from the first; else the calibration texts (``fit_batches``)."""
    if method.e2e_texts is None and _needs_windows(method.calibration, rows):
        return _window_batches(rows[:method.e2e_steps * OWN_BATCH])
    if method.e2e_texts is None:
        return fit_batches(tokenizer, method, seed)
    texts = load_texts(method.e2e_texts, seed=seed, limit=FIT_BATCH_SIZE * method.e2e_steps)
    return list(text_batches(tokenizer, texts, batch_size=FIT_BATCH_SIZE, max_length=method.calibration.max_length))


def end_to_end_held_out(method: MethodSettings, rows=None) -> list[dict] | None:
    """Where the fits read windows (and no ``collab.e2e_texts``), the ``OWN_HELD_OUT`` batches of ``rows`` after the
    end-to-end fit's own, which judge it (``fit_end_to_end(held_out=...)``); None otherwise (it is judged on its own
    batches)."""
    if method.e2e_texts is not None or not _needs_windows(method.calibration, rows):
        return None
    start = method.e2e_steps * OWN_BATCH
    return _window_batches(rows[start:start + OWN_HELD_OUT * OWN_BATCH])


def distill_windows(tokenizer, method: MethodSettings, seed: int, rows=None) -> torch.Tensor:
    """What ``collab.distill_steps`` reads, ``OWN_BATCH`` windows a step (``collab_attn.pretrained.distill``): where
    the fits read windows (and no ``collab.e2e_texts``), the first of ``rows``, those the end-to-end fit reads; else
    windows of ``collab.calibration_max_length`` tokens cut from the texts of ``collab.e2e_texts`` (else
    ``collab.calibration``) one after another, so that no position is padding. Refused when the texts hold too few
    tokens."""
    count = method.distill_steps * OWN_BATCH
    if method.e2e_texts is None and _needs_windows(method.calibration, rows):
        return rows[:count]
    source = method.e2e_texts or method.calibration.source
    length = method.calibration.max_length
    try:
        return windows(tokenizer, _text_of(source), length, count)
    except ValueError as err:
        raise cli.BadInput(f"collab.distill_steps={method.distill_steps} reads {count} windows of {length} tokens "
                           f"({OWN_BATCH} a step) from {source}: {err}; give fewer steps or more text") from None
