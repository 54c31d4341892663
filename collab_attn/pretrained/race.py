"""The key/value-cache race on a pretrained rotary decoder (SmolLM2-135M): each conversion at a fraction of the
original's cache, without retraining or after a short distillation from the original
(``collab_attn.pretrained.distill``), measured against the original on held-out text
(``collab_attn.pretrained.heldout``) and on a fixed set of prompts, one result file per run (resumable: a finished run
is skipped), and a summary table and plot. The summary's verdicts (``verdicts_markdown``) come from
``collab_attn.stats``: a paired bootstrap over the held-out windows, and the spread over calibration samples where there
are several.

Each run is measured on one split of the held-out text (``collab_attn.pretrained.heldout``): ``validation``, where every
choice of recipe is made (``<out>/runs/``, ``<out>/summary.md``: the runs so far, whose files have no ``split``), or
``test``, read once to report (``<out>/test/runs/``, ``<out>/test/summary.md``: ``split_dir``). A run file records its
split; runs of different splits are never resumed as one another nor compared (``run_entry``, ``summary_markdown`` and
``comparison_markdown`` refuse it). Fitted weights (``<out>/checkpoints/``) are shared: a fit reads no held-out text.

An entry is a conversion (``method``, ``rank``, ``value_rank``, method options) named for its sizes. Its cache is
read from a real cache after a forward pass (numbers per token and layer, keys and values together), not from a
formula, and checked against the budget it was sized for.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from collab_attn.files import replacing, write_text_atomic
from collab_attn.pretrained.answers import PROMPTS, answer_agreement, answers
from collab_attn.pretrained.heldout import (
    DOMAINS,
    EVALUATION_SPLITS,
    FIT_DOMAINS,
    OWN,
    OWN_TEXTS,
    TEST_DOMAINS,
    agreement,
)

# What a race's fits read: the fit split of one domain, of several, or the original's own samples (OWN), interleaved.
FIT_TEXTS = {"mixed": DOMAINS, "wikipedia": ("wikipedia",), "shakespeare": ("shakespeare",), "code": ("code",),
             "all": FIT_DOMAINS, "every": (OWN, *FIT_DOMAINS)} | {text: (text,) for text in OWN_TEXTS}

NO_DISTILLATION = {"distill_tokens": 0, "distill_learning_rate": 1e-4, "distill_passes": 1}  # an Entry's defaults


@dataclass(frozen=True)
class Entry:
    """One conversion of the race (``method="none"``: the original itself)."""

    method: str
    rank: int | str | None = None  # or a budget: "mean:96", the key width 96 spread over bands and layers;
    # "alloc:192": keys and values sized per layer by collab_attn.allocate_cache within 192 numbers per token and layer
    value_rank: int | None = None
    options: dict = field(default_factory=dict)
    budget: float = 1.0  # the fraction of the original's cache it was sized for
    distill_tokens: int = 0  # fitting tokens of the distillation after the conversion (0: none)
    distill_learning_rate: float = 1e-4  # its peak learning rate
    distill_passes: int = 1  # its passes over those tokens
    calibration_tokens: int = 0  # fitting tokens whose attention inputs fit the conversion (0: fitted to the weights)
    calibration_sample: int = 0  # which block of that many fitting tokens (0: the first)
    fit_steps: int = 0  # steps per layer of ``fit_to_original`` on the calibration tokens after the conversion
    fit_target: str = "layer"  # what ``fit_to_original`` fits each layer to (its ``target``)
    fit_solve_output: bool = False  # its output projections solved by least squares too (``solve_output``)
    e2e_steps: int = 0  # then steps of ``fit_end_to_end`` on the calibration tokens (all the attention layers at once)
    e2e_learning_rate: float = 1e-4
    e2e_tokens: int = 0  # its fitting tokens: the first this many of the fitting text (0: the calibration tokens)
    e2e_check_tokens: int = 0  # its loss before and after (keep or not) on the first this many of them (0: all)
    e2e_held_out_tokens: int = 0  # or on this many fitting tokens right after them, which it does not train on
    e2e_held_out_text: str = ""  # or on the first that many of another domain's fit split, which the fit never reads
    e2e_length: int = 0  # its windows of this many tokens (0: the calibration windows' length)
    e2e_check_every: int = 0  # its checked loss every this many steps too, the lowest's weights kept (0: not)
    e2e_anchor: float = 0.0  # its pull toward the weights it starts from (fit_end_to_end's anchor; 0: none)
    fit_text: str = "mixed"  # what every fit reads (FIT_TEXTS): "mixed", the race's two domains, unless named

    def __post_init__(self):
        for key in ("e2e_tokens", "e2e_check_tokens"):
            if getattr(self, key) and not self.e2e_steps:
                raise ValueError(f"{key}={getattr(self, key)} names the tokens of an end-to-end fit the entry does "
                                 "not make: give it e2e_steps too")
        if self.e2e_check_every and not 0 < self.e2e_check_every < self.e2e_steps:
            raise ValueError(f"e2e_check_every={self.e2e_check_every} checks an end-to-end fit every that many steps: "
                             f"give e2e_steps above it (got {self.e2e_steps})")
        if self.e2e_anchor and not self.e2e_steps:
            raise ValueError(f"e2e_anchor={self.e2e_anchor} weighs a pull in an end-to-end fit the entry does not "
                             "make: give it e2e_steps too")
        if self.e2e_length and not self.e2e_tokens:
            raise ValueError(f"e2e_length={self.e2e_length} sets the windows of the end-to-end fit's own fitting "
                             "tokens: give it e2e_tokens too")
        if self.e2e_held_out_tokens and not self.e2e_tokens:
            raise ValueError(f"e2e_held_out_tokens={self.e2e_held_out_tokens} are the fitting tokens after the "
                             "end-to-end fit's own: give it e2e_tokens too")
        if self.distill_learning_rate != 1e-4 and not self.distill_tokens:
            raise ValueError(f"distill_learning_rate={self.distill_learning_rate:g} sets the rate of a distillation "
                             "the entry does not make: give it distill_tokens too")
        if self.distill_passes != 1 and not (self.distill_tokens and self.distill_passes > 1):
            raise ValueError(f"distill_passes={self.distill_passes}: a distillation reads its tokens once or more, "
                             "and only an entry with distill_tokens distils")
        if self.fit_text not in FIT_TEXTS:
            raise ValueError(f"fit_text={self.fit_text!r}: choose one of {', '.join(FIT_TEXTS)}")
        if self.fit_text != "mixed" and not (self.calibration_tokens or self.distill_tokens):
            raise ValueError(f"fit_text={self.fit_text!r} names the text of a fit the entry does not make: give it "
                             "calibration_tokens or distill_tokens too")
        if self.e2e_held_out_text and not self.e2e_held_out_tokens:
            raise ValueError(f"e2e_held_out_text={self.e2e_held_out_text!r} names where the end-to-end fit's "
                             "held-out tokens come from: give it e2e_held_out_tokens too")
        if self.e2e_held_out_text and (self.e2e_held_out_text not in FIT_DOMAINS
                                       or self.e2e_held_out_text in FIT_TEXTS[self.fit_text]):
            others = [d for d in FIT_DOMAINS if d not in FIT_TEXTS[self.fit_text]]
            raise ValueError(f"e2e_held_out_text={self.e2e_held_out_text!r}: the end-to-end fit is judged on another "
                             f"domain's fit split, one that fit_text={self.fit_text!r} does not read: choose one of "
                             f"{', '.join(others) or '(none: this text reads every domain)'}")
        if self.e2e_held_out_tokens and self.e2e_check_tokens:
            raise ValueError("an end-to-end fit is judged on its first e2e_check_tokens or on e2e_held_out_tokens "
                             "after them, not both")

    @property
    def name(self) -> str:
        if self.method == "none":
            return "original"
        rank = str(self.rank).replace(":", "")  # a budget "mean:96" names the run "-kmean96"
        sizes = f"-k{rank}" + ("" if self.value_rank is None else f"-v{self.value_rank}")
        extra = "".join(f"-{key}{value}" for key, value in sorted(self.options.items()))
        sample = f"s{self.calibration_sample}" if self.calibration_sample else ""
        calibrated = f"-calibrated{self.calibration_tokens}{sample}" if self.calibration_tokens else ""
        target = "" if self.fit_target == "layer" else self.fit_target  # "-fitted100": the layer target
        solved = "-ls" if self.fit_solve_output else ""  # "-fitted100-ls": the output projections solved too
        fitted = f"-fitted{self.fit_steps}{target}{solved}" if self.fit_steps else ""
        rate = "" if self.e2e_learning_rate == 1e-4 else f"lr{self.e2e_learning_rate:g}"
        tokens = f"on{self.e2e_tokens}" if self.e2e_tokens else ""
        tokens += f"check{self.e2e_check_tokens}" if self.e2e_check_tokens else ""  # "-e2e256on262144check16384"
        tokens += f"held{self.e2e_held_out_tokens}" if self.e2e_held_out_tokens else ""  # "-e2e32on32768held4096"
        tokens += self.e2e_held_out_text  # "-e2e32on32768held4096code": held out from code's fit split
        tokens += f"len{self.e2e_length}" if self.e2e_length else ""  # "-e2e64on131072check16384len2048"
        tokens += f"stop{self.e2e_check_every}" if self.e2e_check_every else ""  # "-e2e128on131072held4096stop32"
        tokens += f"anchor{self.e2e_anchor:g}" if self.e2e_anchor else ""  # "-e2e32on32768held4096anchor10"
        e2e = f"-e2e{self.e2e_steps}{rate}{tokens}" if self.e2e_steps else ""  # "-e2e64lr0.0003", "-e2e64on65536"
        distill_rate = "" if self.distill_learning_rate == 1e-4 else f"lr{self.distill_learning_rate:g}"
        distill_rate += f"x{self.distill_passes}" if self.distill_passes > 1 else ""  # "-distilled32768x2": 2 passes
        distilled = f"-distilled{self.distill_tokens}{distill_rate}" if self.distill_tokens else ""  # "...lr0.0003"
        text = "" if self.fit_text == "mixed" else f"-text{self.fit_text}"  # "-textown": the original's own samples
        return f"{self.method}{sizes}{extra}{calibrated}{fitted}{e2e}{distilled}{text}"


def entries_at(method: str, fraction: float, rope_pairs: int, kv_heads: int = 3, head_dim: int = 64,
               distill_tokens: int = 0, calibration_tokens: int = 0, spread: bool = False,
               fit_steps: int = 0, allocate: bool = False) -> list[Entry]:
    """The entry of ``method`` at ``fraction`` of the cache of ``kv_heads`` key/value heads of ``head_dim``
    (default: SmolLM2's), or none when the method cannot get that small: the method says its sizes
    (``ConversionMethod.sizes_within``). ``spread``: a method that takes a key budget on rotary models (``cp``,
    ``tucker``, ``key-svd``) gets its key width as one (``"mean:R"``: the same total, spread over bands and layers).
    ``allocate``: a method whose values have a width of their own gets its key and value widths per layer from
    ``collab_attn.allocate_cache`` (``"alloc:B"``, B the budget in numbers per token and layer).
    ``fit_steps``: then fitted to the original's attention outputs on the calibration tokens."""
    from collab_attn.models.conversion import cuts_values_on_rotary_models
    from collab_attn.models.methods import get_method

    conversion = get_method(method)
    budget = int(fraction * 2 * kv_heads * head_dim)
    common = {"budget": fraction, "distill_tokens": distill_tokens, "calibration_tokens": calibration_tokens,
              "fit_steps": fit_steps}
    if allocate:  # the method sizes keys and values apart
        return [Entry(method, f"alloc:{budget}", **common)] if cuts_values_on_rotary_models(conversion) else []
    sizes = None if conversion.sizes_within is None else conversion.sizes_within(budget, kv_heads, head_dim,
                                                                                  rope_pairs)
    if sizes is None or (spread and not conversion.rotary_budgets):
        return []
    rank = f"mean:{sizes.rank}" if spread else sizes.rank
    return [Entry(method, rank, sizes.value_rank, options=dict(sizes.options), **common)]


def mean_cache_numbers(model) -> float:
    """Numbers a model's cache holds per token and layer (keys and values together, averaged over layers), read from
    the model's default cache after a forward pass of 3 tokens."""
    with torch.no_grad():
        cache = model(torch.tensor([[1, 2, 3]], device=model.device), use_cache=True).past_key_values
    numbers = sum(t.numel() for layer in cache.layers for t in (layer.keys, layer.values))
    return numbers / (3 * len(cache.layers))


def run_entry(entry: Entry, original, tokenizer, rows: dict[str, torch.Tensor], out_dir: Path,
              original_cache: float, batch: int = 4, fit_rows=None, calibration=None, calibration_rows=None,
              allocation_steps: int = 25, allocation_tokens: int | None = None, sensitivity_windows: int = 0,
              answer_detail: bool = False, split: str = "validation", export_detail: bool = False) -> dict:
    """Convert a copy of ``original`` as ``entry`` says (activation-aware with ``calibration()``, a callable giving
    the original's ``Calibration``, when the entry asks for it), fit its converted layers to the original's
    attention outputs (``collab_attn.fit_to_original``, ``entry.fit_steps`` per layer) on ``calibration_rows()`` (a
    callable giving the calibration windows, ``batch`` per step) when it asks for that, then all of them at once to
    the original's output (``collab_attn.fit_end_to_end``, ``entry.e2e_steps``) on the same windows when it asks for
    that (or on ``fit_rows(entry.e2e_tokens)`` when it names its tokens, ``fit_rows(entry.e2e_tokens,
    entry.e2e_length)`` in windows of that length, about as many tokens a step; judged on the first
    ``entry.e2e_check_tokens`` of them when it names those, or on held-out windows: the fitting tokens after them, or
    with ``entry.e2e_held_out_text`` the first of another domain's fit split, ``fit_rows(tokens, text=domain)``),
    distil it on ``fit_rows(entry.distill_tokens)`` (``fit_rows(tokens)``: the first ``tokens`` fitting tokens as
    windows) when it asks for it, measure it, write ``runs/<name>.json``; a finished run is read back instead. An
    ``"alloc:B"`` rank first chooses the layers' key and value widths (``collab_attn.allocate_cache``,
    ``allocation_steps`` per candidate and layer, on the first ``allocation_tokens`` of the calibration windows,
    default all). A layer fit's weights, and an end-to-end fit's, are kept (``fitted_state_path``) and read back by
    every later run that starts from the same fit. ``sensitivity_windows=N``: also where the model's KL from the
    original sits, layer by layer (``collab_attn.layer_sensitivity``), on the first N held-out windows of each
    domain, into ``sensitivity/<name>.json`` and ``.md`` (a finished run is converted again for it, its fits read
    back).
    ``answer_detail``: also how far it follows the original's answers to the prompts, token by token
    (``collab_attn.pretrained.answers.answer_agreement``), into ``answers/<name>.json`` and ``.md`` (the same way).
    ``split``: the held-out split ``rows`` come from (``validation`` or ``test``), recorded in the run file, which is
    kept in ``split_dir(out_dir, split) / "runs"``; a run file there of another split is refused, not resumed.
    ``export_detail``: also the model exported as the standard checkpoint of its family (``collab_attn.export``)
    measured on the same windows, and it and the original with float16 and bfloat16 caches, into
    ``split_dir(out_dir, split) / "export" / "<name>.json"`` (the same way; ``measure_export``)."""
    import collab_attn

    if split not in EVALUATION_SPLITS:
        raise ValueError(f"split={split!r}: runs are measured on 'validation' or 'test' windows")
    if split != "validation" and sensitivity_windows:
        raise ValueError("the layer sensitivity is a diagnostic that guides choices: measure it on the validation "
                         "split, not on test")
    path = split_dir(out_dir, split) / "runs" / f"{entry.name}.json"
    if path.is_file() and (recorded := split_of(json.loads(path.read_text()))) != split:
        raise ValueError(f"{path} was measured on the {recorded} split, not {split}: runs of different splits are "
                         "not resumed as one another")
    sensitivity = out_dir / "sensitivity" / f"{entry.name}.json"
    detail = out_dir / "answers" / f"{entry.name}.json"
    measure = sensitivity_windows > 0 and entry.method != "none" and not sensitivity.is_file()
    follow = answer_detail and entry.method != "none" and not detail.is_file()
    exported = split_dir(out_dir, split) / "export" / f"{entry.name}.json"
    serve = export_detail and entry.method != "none" and not exported.is_file()
    if path.is_file() and not (measure or follow or serve):
        print(f"{entry.name}: done before ({path})", flush=True)
        return json.loads(path.read_text())
    start = time.perf_counter()
    if entry.fit_solve_output and not entry.fit_steps:
        raise ValueError(f"{entry.name} solves the output projections of a fit it does not make: give it fit_steps")
    if (entry.fit_steps or entry.e2e_steps) and not (entry.calibration_tokens and calibration_rows is not None):
        raise ValueError(f"{entry.name} is fitted on its calibration tokens: give it calibration_tokens and pass "
                         "run_entry(..., calibration_rows=...)")
    if (entry.distill_tokens or entry.e2e_tokens) and fit_rows is None:
        raise ValueError(f"{entry.name} trains on fitting text beyond the calibration tokens: pass "
                         "run_entry(..., fit_rows=...)")

    def fitting_batches(windows=None, step=batch):
        windows = calibration_rows() if windows is None else windows
        return [{"input_ids": windows[i:i + step]} for i in range(0, len(windows), step)]

    model, report, fit, allocation = original, None, None, None
    if entry.method != "none":
        model = copy.deepcopy(original)
        sizes = {} if entry.value_rank is None else {"value_rank": entry.value_rank}
        if entry.calibration_tokens:
            if calibration is None:
                raise ValueError(f"{entry.name} asks for a calibration: pass run_entry(..., calibration=...)")
            sizes["calibration"] = calibration()
        rank = entry.rank
        if isinstance(rank, str) and rank.startswith("alloc:"):
            if calibration_rows is None:
                raise ValueError(f"{entry.name} measures its sizes on the calibration tokens: pass "
                                 "run_entry(..., calibration_rows=...)")
            allocation = _allocation(entry, original, out_dir, fitting_batches(), sizes.get("calibration"),
                                     allocation_steps, allocation_tokens)
            rank, sizes["value_rank"] = allocation.ranks, allocation.value_ranks
        report = collab_attn.reparametrize(model, rank, method=entry.method, **sizes, **entry.options)
    convert_seconds = time.perf_counter() - start
    if entry.fit_steps:
        fit = _kept(fitted_state_path(entry, out_dir), entry.name, model, original, lambda: collab_attn.fit_to_original(
            model, original, fitting_batches(), steps=entry.fit_steps, target=entry.fit_target,
            solve_output=entry.fit_solve_output))
    e2e = None
    if entry.e2e_steps:
        def e2e_rows(tokens, **text):
            return fit_rows(tokens, entry.e2e_length, **text) if entry.e2e_length else fit_rows(tokens, **text)

        def e2e_batches(windows):
            if not entry.e2e_length:
                return fitting_batches(windows)
            return fitting_batches(windows, max(1, batch * calibration_rows().shape[1] // entry.e2e_length))

        def end_to_end():
            batches = e2e_batches(e2e_rows(entry.e2e_tokens).to(model.device)) if entry.e2e_tokens else \
                fitting_batches()
            check = -(-entry.e2e_check_tokens // batches[0]["input_ids"].numel()) if entry.e2e_check_tokens else None
            held_out = None
            if entry.e2e_held_out_text:  # the first windows of another domain's fit split
                other = e2e_rows(entry.e2e_held_out_tokens, text=entry.e2e_held_out_text)
                held_out = e2e_batches(other.to(model.device))
            elif entry.e2e_held_out_tokens:  # the windows after the fit's own
                after = e2e_rows(entry.e2e_tokens + entry.e2e_held_out_tokens)[len(e2e_rows(entry.e2e_tokens)):]
                held_out = e2e_batches(after.to(model.device))
            return collab_attn.fit_end_to_end(model, original, batches, steps=entry.e2e_steps,
                                              learning_rate=entry.e2e_learning_rate, check_batches=check,
                                              held_out=held_out, check_every=entry.e2e_check_every or None,
                                              anchor=entry.e2e_anchor)

        e2e = _kept(fitted_state_path(entry, out_dir, "end-to-end"), entry.name, model, original, end_to_end)
    training = None
    if entry.distill_tokens:
        from collab_attn.pretrained.distill import Distillation, distill

        def distilled():
            fitting = fit_rows(entry.distill_tokens)
            run = distill(model, original, fitting, out_dir / "checkpoints" / entry.name, batch,
                          learning_rate=entry.distill_learning_rate, passes=entry.distill_passes)
            return Distillation(int(fitting.numel()), len(fitting), run.seconds, run.history)

        training = _kept(fitted_state_path(entry, out_dir, "distilled"), entry.name, model, original, distilled)
    if measure:
        _measure_sensitivity(model, original, {d: fitting_batches(rows[d][:sensitivity_windows]) for d in DOMAINS},
                             sensitivity)
    if follow:
        _measure_answers(model, original, tokenizer, detail)
    if serve:
        measure_export(model, original, rows, exported, batch)
    if path.is_file():
        return json.loads(path.read_text())
    cache = mean_cache_numbers(model)
    if cache > entry.budget * original_cache + 1e-9:
        raise ValueError(f"{entry.name} caches {cache:g} numbers per token and layer, more than its budget "
                         f"{entry.budget:g} x {original_cache:g}")
    result = {"name": entry.name, "split": split, "entry": asdict(entry), "cache_numbers": cache,
              "cache_fraction": cache / original_cache, "convert_seconds": convert_seconds,
              "mean_layer_error": None if report is None else report.mean_relative_error, "training": training,
              "fit": fit, "end_to_end": e2e,
              "allocation": None if allocation is None else allocation.to_dict(), "domains": {}}
    total = sum(len(r) for r in rows.values())
    tokens = batch * min(w.shape[1] for w in rows.values())  # longer windows go fewer at a time
    with tqdm(total=total, desc=entry.name, unit="window") as progress:
        for domain, windows in rows.items():
            result["domains"][domain] = agreement(model, original, windows, max(1, tokens // windows.shape[1]),
                                                  progress).as_dict()
    result["answers"] = answers(model, tokenizer)
    result["seconds"] = time.perf_counter() - start
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=2) + "\n")
    print(f"{entry.name}: " + ", ".join(f"{d} ppl {m['perplexity']:.2f} KL {m['kl']:.3f} top-1 {m['top1']:.3f}"
                                        for d, m in result["domains"].items()), flush=True)
    return result


def _measure_sensitivity(model, original, batches: dict[str, list[dict]], path: Path) -> None:
    """``collab_attn.layer_sensitivity`` per domain on its ``batches``, written to ``path`` (JSON) and beside it
    (.md)."""
    import collab_attn

    measured = {domain: collab_attn.layer_sensitivity(model, original, b) for domain, b in batches.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    windows = {domain: sum(len(b["input_ids"]) for b in parts) for domain, parts in batches.items()}
    write_text_atomic(path.with_suffix(".md"), "\n\n".join(
        f"## {domain} ({windows[domain]} held-out windows)\n\n{report.table()}" for domain, report in measured.items())
        + "\n")
    # the JSON last: it says the measurement is done (run_entry skips it then), so it is never there without the .md
    write_text_atomic(path, json.dumps({domain: report.to_dict() for domain, report in measured.items()},
                                       indent=2) + "\n")
    print(f"{path.stem}: layer sensitivity written to {path}", flush=True)


def measure_export(model, original, rows: dict[str, torch.Tensor], path: Path, batch: int = 4) -> dict:
    """``model`` exported as a standard checkpoint (``collab_attn.serving.standard_model``), measured against the
    original on ``rows`` as the converted model is (``agreement``): its numbers must be the converted model's. Then,
    on the domains of the race's own window length, what a float16 and a bfloat16 key/value cache does to the exported
    model and to the original (``collab_attn.serving.precision.rounded_cache``): each measured against itself in
    float32 (``half[dtype][model]``: its perplexity with the rounded cache, its float32 perplexity as
    ``original_perplexity``, and the KL from its float32 distribution). Written to ``path`` (JSON)."""
    from collab_attn.serving import standard_model
    from collab_attn.serving.precision import HALF_DTYPES, RoundedCall

    standard = standard_model(model)
    exported = standard.model.to(model.device)
    tokens = batch * min(w.shape[1] for w in rows.values())
    short = min(w.shape[1] for w in rows.values())

    def measured(candidate, reference, domains, what):
        with tqdm(total=sum(len(rows[d]) for d in domains), desc=what, unit="window") as progress:
            return {domain: agreement(candidate, reference, rows[domain], max(1, tokens // rows[domain].shape[1]),
                                      progress).as_dict() for domain in domains}

    result = {"head_dim": standard.head_dim, "logit_error": standard.logit_error,
              "frequency_error": standard.rope.frequency_error,
              "exported": measured(exported, original, list(rows), "exported"), "half": {}}
    domains = [domain for domain, w in rows.items() if w.shape[1] == short]
    for name, dtype in HALF_DTYPES.items():
        result["half"][name] = {}
        for label, full in (("exported", exported), ("original", original)):  # no copy of either model
            result["half"][name][label] = measured(RoundedCall(full, dtype), full, domains, f"{label}, {name} cache")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(result, indent=2) + "\n")
    print(f"{path.stem}: the exported model measured, written to {path}", flush=True)
    return result


def _measure_answers(model, original, tokenizer, path: Path) -> None:
    """``answer_agreement`` on the race's prompts, written to ``path`` (JSON) and beside it (.md)."""
    report = answer_agreement(model, original, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path.with_suffix(".md"), report.table() + "\n")
    write_text_atomic(path, report.to_json() + "\n")  # last: it says the measurement is done
    print(f"{path.stem}: answers followed token by token, written to {path}", flush=True)


def fitted_state_path(entry: Entry, out_dir: Path, stage: str = "layer") -> Path:
    """Where ``run_entry`` keeps the weights of ``entry``'s fit, so that every run that starts from it reads it back:
    ``stage="layer"``, the conversion after ``fit_to_original`` (before any end-to-end fit or distillation);
    ``"end-to-end"``, after ``fit_end_to_end`` too (before any distillation); ``"distilled"``, after the distillation
    (every weight)."""
    if stage == "layer":
        start = dataclasses.replace(entry, e2e_steps=0, e2e_learning_rate=1e-4, e2e_tokens=0, e2e_check_tokens=0,
                                    e2e_held_out_tokens=0, e2e_held_out_text="", e2e_length=0, e2e_check_every=0,
                                    e2e_anchor=0.0, **NO_DISTILLATION)
    elif stage == "end-to-end":
        start = dataclasses.replace(entry, **NO_DISTILLATION)
    elif stage == "distilled":
        start = entry
    else:
        raise ValueError(f"stage must be 'layer', 'end-to-end' or 'distilled', got {stage!r}")
    return out_dir / "checkpoints" / f"{start.name}.{stage}-fit.pt"


def _kept(path: Path, name: str, model, original, fit) -> dict:
    """``fit()`` (which fits ``model`` in place and returns its report: ``fit_to_original``'s or
    ``fit_end_to_end``'s), its weights kept at ``path``, its report printed and returned as a dict; or, when ``path``
    holds them from an earlier run, those weights and that dict read back instead. Only the tensors that differ from
    the original's are kept (the converted attention layers; after a distillation, every weight)."""
    if path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        current = model.state_dict()
        wrong = [key for key, value in saved["state"].items()
                 if key not in current or current[key].shape != value.shape]
        if wrong:
            raise ValueError(f"{path} holds tensors that {name}'s conversion does not have, or not in that "
                             f"shape ({', '.join(wrong[:3])}): it was written by another conversion; delete it")
        model.load_state_dict(saved["state"], strict=False)
        print(f"{name}: fit read back from {path}", flush=True)
        return saved["fit"]
    report = fit()
    print(report.table(), flush=True)
    report = report.to_dict()
    reference = original.state_dict()
    state = {key: value for key, value in model.state_dict().items()
             if key not in reference or not torch.equal(value, reference[key])}
    path.parent.mkdir(parents=True, exist_ok=True)
    with replacing(path) as tmp:
        torch.save({"state": state, "fit": report}, tmp)
    return report


def _allocation(entry: Entry, original, out_dir: Path, batches: list[dict], calibration, steps: int,
                tokens: int | None):
    """``collab_attn.allocate_cache`` for an ``"alloc:B"`` entry, measured once per conversion and settings and kept
    in ``<out>/allocations/`` (the calibrated and the fitted runs of one conversion share it)."""
    import collab_attn
    from collab_attn.fitting.allocation import Allocation

    if tokens is not None:
        batches = batches[:max(1, -(-tokens // batches[0]["input_ids"].numel()))]
    measured = sum(b["input_ids"].numel() for b in batches)
    base = dataclasses.replace(entry, fit_steps=0, fit_target="layer", fit_solve_output=False,
                               **NO_DISTILLATION)
    path = out_dir / "allocations" / f"{base.name}-steps{steps}-tokens{measured}.json"
    if path.is_file():
        return Allocation.from_dict(json.loads(path.read_text()))
    allocation = collab_attn.allocate_cache(original, entry.method, float(entry.rank.split(":")[1]), batches,
                                            steps=steps, calibration=calibration, **entry.options)
    print(allocation.table(), flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(allocation.to_dict(), indent=2) + "\n")
    return allocation


def split_dir(out_dir: Path, split: str = "validation") -> Path:
    """Where a race's runs of ``split`` live (``runs/``, ``summary.md``, ``perplexity.png``): ``out_dir`` itself for
    ``validation`` (every run file so far), ``out_dir / "test"`` for ``test``."""
    if split not in EVALUATION_SPLITS:
        raise ValueError(f"split={split!r}: choose one of {', '.join(EVALUATION_SPLITS)}")
    return Path(out_dir) if split == "validation" else Path(out_dir) / split


def split_of(result: dict) -> str:
    """The held-out split a run file was measured on (``validation`` for the files written before it was
    recorded)."""
    return result.get("split", "validation")


def one_split(results: list[dict]) -> str:
    """The one split ``results`` were measured on; runs of different splits are refused (never compared)."""
    splits = sorted({split_of(r) for r in results})
    if len(splits) > 1:
        by = {s: [r["name"] for r in results if split_of(r) == s][:2] for s in splits}
        raise ValueError("runs of different held-out splits are never compared: "
                         + "; ".join(f"{s}: {', '.join(names)}" for s, names in by.items()))
    return splits[0] if splits else "validation"


def load_runs(out_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out_dir / "runs").glob("*.json"))]


def _order(result: dict) -> tuple:
    entry = result["entry"]
    rank = entry["rank"] or 0
    return (-entry["budget"], entry.get("distill_tokens", 0), entry["method"] != "none", entry["method"],
            isinstance(rank, str), -int(str(rank).split(":")[-1]))


RESAMPLES = 10_000  # the window bootstrap's draws (collab_attn.stats.window_bootstrap)


def _sample(result: dict) -> int:
    return result["entry"].get("calibration_sample", 0) if result["entry"].get("calibration_tokens") else 0


def _conversion(result: dict) -> str:
    """The run's name without its calibration sample: the samples of one conversion share it."""
    sample = _sample(result)
    return re.sub(rf"(-calibrated\d+)s{sample}(?=-|$)", r"\1", result["name"]) if sample else result["name"]


def _ratio(x: float) -> str:
    """A relative difference ``x`` (a / b - 1) as the ratio a / b."""
    return f"{1 + x:.3g}x"


def _interval(comparison, windows: bool, sample: str = "") -> str:
    """The estimate of ``comparison`` with its own interval and what both rest on: over windows, ``a / b`` of one
    pair of runs (``sample``: which calibration sample, ``"sample 0, "``) with the window bootstrap's interval; over
    calibration samples, the geometric mean of ``a / b`` over the samples with the t-interval over them."""
    estimate, (low, high) = comparison.mean_difference, comparison.interval
    words = {"better": "ahead", "worse": "behind", "tie": "tie"}[comparison.verdict]
    if windows:
        unit = f"{sample}{comparison.pairs} windows"
    else:  # log-perplexity differences: shown as ratios
        estimate, low, high = math.expm1(estimate), math.expm1(low), math.expm1(high)
        unit = f"geometric mean of {comparison.pairs} samples"
    return f"{_ratio(estimate)} [{_ratio(low)}, {_ratio(high)}] {words} ({unit})"


def measured_domains(results: list[dict]) -> list[str]:
    """The evaluation sets the runs were measured on: ``TEST_DOMAINS`` first (``DOMAINS``, then ``code``), then the
    others (``"wikipedia 2048"``: the same text in longer windows) in the order they appear."""
    seen = list(dict.fromkeys(d for r in results for d in r["domains"]))
    return [d for d in TEST_DOMAINS if d in seen] + [d for d in seen if d not in TEST_DOMAINS]


def _log_perplexity(run: dict, domain: str) -> float:
    return math.log(run["domains"][domain]["perplexity"])


def _mean_log_perplexity(runs: dict[int, dict], domain: str) -> float:
    return sum(_log_perplexity(r, domain) for r in runs.values()) / len(runs)


def _at(runs: dict[int, dict], sample: int) -> dict | None:
    """The run of calibration sample ``sample``; a conversion without calibration is the same for every sample."""
    if sample in runs:
        return runs[sample]
    only = next(iter(runs.values()))
    return only if len(runs) == 1 and not only["entry"].get("calibration_tokens") else None


def _sample_label(a: dict, b: dict) -> str:
    """Which calibration sample a pair of runs was calibrated on (``"sample 0, "``; ``"samples 1 / 0, "`` where they
    differ), for the label of the window cell; nothing for two runs without calibration."""
    calibrated = [r for r in (a, b) if r["entry"].get("calibration_tokens")]
    if not calibrated:
        return ""
    if len({_sample(r) for r in calibrated}) == 1:
        return f"sample {_sample(calibrated[0])}, "
    return f"samples {_sample(a)} / {_sample(b)}, "


def _versus(a: dict[int, dict], b: dict[int, dict], domain: str) -> list[str]:
    """``a`` against ``b`` (calibration sample -> run) on ``domain``: the cells of one verdict row. Each estimate is
    printed beside the interval of the same runs: the first shared sample's ``a / b`` (the first with per-window
    data on both sides) beside its window bootstrap, and the geometric mean over the shared samples beside the
    t-interval over them."""
    from collab_attn.stats import compare_on_shared_seeds, window_bootstrap

    shared = [s for s in sorted(set(a) | set(b)) if _at(a, s) is not None and _at(b, s) is not None]
    if not shared:
        return ["no shared calibration sample", "no shared calibration sample",
                "no shared calibration sample: no verdict"]
    windowed = [s for s in shared if _at(a, s)["domains"][domain].get("windows")
                and _at(b, s)["domains"][domain].get("windows")]
    first = windowed[0] if windowed else shared[0]
    label = _sample_label(_at(a, first), _at(b, first))
    by_windows = None if not windowed else window_bootstrap(
        _at(a, first)["domains"][domain]["windows"], _at(b, first)["domains"][domain]["windows"],
        resamples=RESAMPLES, seed=0)
    by_samples = None if len(shared) < 2 else compare_on_shared_seeds(
        *({s: _log_perplexity(_at(runs, s), domain) for s in shared} for runs in (a, b)))
    judged = [c.verdict for c in (by_windows, by_samples) if c is not None]
    if not judged:
        verdict = "one run, no per-window data: no verdict"
    elif all(v == judged[0] for v in judged):
        verdict = {"better": "**ahead**", "worse": "**behind**", "tie": "tie"}[judged[0]]
    else:
        verdict = "tie"
    if by_windows is None:
        ratio = math.expm1(_log_perplexity(_at(a, first), domain) - _log_perplexity(_at(b, first), domain))
        windows = f"{_ratio(ratio)} ({label}no per-window data)"
    else:
        windows = _interval(by_windows, True, label)
    return [windows, "one sample" if by_samples is None else _interval(by_samples, False), verdict]


def _by_sample(runs: list[dict]) -> dict[int, dict]:
    """One conversion's runs (result files of ``run_entry``), keyed by calibration sample."""
    conversions = sorted({_conversion(r) for r in runs})
    if len(conversions) != 1:
        raise ValueError(f"runs of different conversions on one side ({', '.join(conversions)}): pass one "
                         "conversion's runs per side, one per calibration sample")
    samples = [_sample(r) for r in runs]
    twice = sorted({s for s in samples if samples.count(s) > 1})
    if twice:
        raise ValueError(f"{conversions[0]}: calibration sample {twice} given twice on one side: pass each "
                         "sample's run once")
    return {_sample(r): r for r in runs}


def comparison_markdown(a: list[dict], b: list[dict]) -> list[str]:
    """One conversion against another (each side: its runs, result files of ``run_entry``, one per calibration
    sample) on every domain all of them were measured on: a Markdown table with the same cells as the summary's
    verdicts (the perplexity ratio of the first calibration sample both have with its window bootstrap, where both
    kept per-window sums; the geometric mean of the ratio over the samples both have with the t-interval over them,
    where there are two or more). One run a side is compared window by window whatever its sample. Runs of different
    held-out splits are refused."""
    one_split([*a, *b])
    if len(a) == len(b) == 1:  # one run each, whatever their samples (two samples of one conversion too)
        a_runs, b_runs, names = {0: a[0]}, {0: b[0]}, (a[0]["name"], b[0]["name"])
    else:
        a_runs, b_runs, names = _by_sample(a), _by_sample(b), (_conversion(a[0]), _conversion(b[0]))
    runs = [*a_runs.values(), *b_runs.values()]
    domains = [d for d in measured_domains(runs) if all(d in r["domains"] for r in runs)]
    if not domains:
        raise ValueError(f"{names[0]} and {names[1]} share no evaluation domain: nothing to compare")
    lines = [f"{names[0]} against {names[1]}:", "", "| domain | perplexity a / b on one sample, over held-out "
             "windows | perplexity a / b over calibration samples | verdict |", "|---|---|---|---|"]
    for domain in domains:
        lines.append("| " + " | ".join([domain, *_versus(a_runs, b_runs, domain)]) + " |")
    return lines


def verdicts_markdown(results: list[dict], peer: str | None = "kv-svd") -> list[str]:
    """Per budget and domain, the conversion with the lowest perplexity (its mean log over calibration samples)
    against every other one there, and every conversion against the best ``peer`` (MHA2MLA's ``kv-svd``), each with
    the interval its verdict rests on: a paired bootstrap over the held-out windows where both runs kept per-window
    sums (``collab_attn.stats.window_bootstrap``), the spread over calibration samples where both have several
    (``collab_attn.stats.paired_comparison`` of log perplexity, paired by sample), "no verdict" otherwise. Runs of
    different held-out splits are refused."""
    one_split(results)
    budgets = sorted({r["entry"]["budget"] for r in results}, reverse=True)
    lines = ["## Verdicts", "",
             "`a / b`: a's perplexity over b's (below 1: a predicts the held-out text better), each printed beside "
             "the interval of the same runs. Over windows: `a / b` on one calibration sample (the first both have "
             "with per-window data, named) and a paired bootstrap over its held-out windows "
             f"({RESAMPLES:,} resamples, seed 0), 95% percentile interval: it covers the choice of evaluation "
             "text, not the calibration sample or a training seed. Over calibration samples: the geometric mean of "
             "`a / b` over the samples both have and a 95% t-interval of the log-perplexity differences paired by "
             "calibration sample (a conversion without calibration counts the same for every sample), shown as "
             "ratios. Ahead or behind only when every interval available excludes 1 the same way; a tie "
             "otherwise.", ""]
    if any(r["entry"].get("distill_tokens") for r in results):
        lines += ["Distilled runs: one run each (one distillation seed; the distilled weights were not kept), so no "
                  "interval covers the distillation itself; where a distilled run has per-window data, its window "
                  "interval covers the evaluation text only.", ""]
    for budget in budgets:
        runs = [r for r in results if r["entry"]["budget"] == budget]
        rows = []
        for domain in measured_domains(results):
            conversions: dict[str, dict[int, dict]] = {}
            for r in runs:
                if domain in r["domains"]:
                    conversions.setdefault(_conversion(r), {})[_sample(r)] = r
            if len(conversions) < 2:
                continue
            order = sorted(conversions, key=lambda name: _mean_log_perplexity(conversions[name], domain))  # noqa: B023
            pairs = [(order[0], other) for other in order[1:]]
            peers = [name for name in order if next(iter(conversions[name].values()))["entry"]["method"] == peer]
            if peers and peers[0] != order[0]:
                pairs += [(name, peers[0]) for name in order if name not in (order[0], peers[0])]
            rows += [f"| {domain} | {a} | {b} | " + " | ".join(_versus(conversions[a], conversions[b], domain))
                     + " |" for a, b in pairs]
        if rows:
            lines += [f"### budget {budget:g}", "", "| domain | a | b | a / b on one sample, over windows "
                      "| a / b over calibration samples | a against b |", "|---|---|---|---|---|---|", *rows, ""]
    return lines


def summary_markdown(results: list[dict], command: str, setup: str) -> str:
    """Per domain: cache (numbers per token and layer, fraction), perplexity and its ratio to the original's, KL,
    top-1 agreement; the verdicts with their intervals (``verdicts_markdown``); then the prompts' answers side by
    side. The runs must share one held-out split (``one_split``); a test-split summary says so in its title."""
    split = one_split(results)
    results = sorted(results, key=_order)
    title = "# The key/value-cache race on a pretrained rotary decoder" + (f" ({split} split)" if split != "validation"
                                                                           else "")
    lines = [title, "", setup, "", "```bash",
             command, "```", ""]
    for domain in measured_domains(results):
        measured = [r for r in results if domain in r["domains"]]
        if not measured:
            continue
        lines += [f"## {domain}", "", "| budget | conversion | cache / token / layer | fraction | perplexity | "
                  "vs original | KL (nats / token) | top-1 agreement | mean layer error |",
                  "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in measured:
            m = r["domains"][domain]
            error = "" if r["mean_layer_error"] is None else f"{r['mean_layer_error']:.3f}"
            lines.append(f"| {r['entry']['budget']:g} | {r['name']} | {r['cache_numbers']:g} | "
                         f"{r['cache_fraction']:.3f} | {m['perplexity']:.2f} | "
                         f"{m['perplexity'] / m['original_perplexity']:.3f}x | {m['kl']:.4f} | {m['top1']:.3f} | "
                         f"{error} |")
        lines.append("")
    lines += verdicts_markdown(results)
    lines += ["## Answers (greedy, 24 new tokens, through the chat template)", ""]
    for index, prompt in enumerate(PROMPTS):
        lines += [f"**{prompt}**", "", "| conversion | answer |", "|---|---|"]
        lines += [f"| {r['name']} | {r['answers'][index].replace('|', '/').replace(chr(10), ' ')} |"
                  for r in results]
        lines.append("")
    return "\n".join(lines)


def rewrite_summary(out_dir: Path) -> Path:
    """``<out_dir>/summary.md`` made again from ``<out_dir>/runs`` (after the runs or the summary's code changed),
    keeping the setup line and the command of the summary there."""
    path = Path(out_dir) / "summary.md"
    lines = path.read_text().split("\n")
    if lines[4:5] != ["```bash"] or "```" not in lines[6:7]:
        raise ValueError(f"{path}: not a summary written by summary_markdown (no setup line and command block)")
    write_text_atomic(path, summary_markdown(load_runs(Path(out_dir)), lines[5], lines[2]))
    return path


def plot(results: list[dict], path: Path) -> Path:
    """Perplexity relative to the original's against the cache fraction, one panel per domain, one line per
    method (and per distillation length)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = measured_domains(results)
    fig, axes = plt.subplots(1, len(domains), figsize=(5 * len(domains), 4), squeeze=False)
    for ax, domain in zip(axes[0], domains):
        def line_of(r):
            tokens = r["entry"].get("distill_tokens", 0)
            given = " (sizes as given)" if r["entry"]["budget"] == 1.0 else ""  # diagnostics: not one curve
            rank = r["entry"]["rank"]
            spread = "" if not isinstance(rank, str) else (
                " (sizes by measurement)" if rank.startswith("alloc:") else " (pairs by budget)")
            calibrated = " calibrated" if r["entry"].get("calibration_tokens") else ""
            calibrated += f" fitted {r['entry']['fit_steps']}" if r["entry"].get("fit_steps") else ""
            calibrated += f" ({r['entry']['fit_target']})" if r["entry"].get("fit_target", "layer") != "layer" else ""
            calibrated += " + output solved" if r["entry"].get("fit_solve_output") else ""
            calibrated += f" + end to end {r['entry']['e2e_steps']}" if r["entry"].get("e2e_steps") else ""
            return r["entry"]["method"] + spread + calibrated + (f" distilled {tokens}" if tokens else "") + given

        lines = sorted({line_of(r) for r in results if r["entry"]["method"] != "none"})
        colours = plt.get_cmap("tab20" if len(lines) > 10 else "tab10")
        for index, line in enumerate(lines):  # one colour per line, the same in every panel
            points = sorted((r["cache_fraction"], r["domains"][domain]["perplexity"]
                             / r["domains"][domain]["original_perplexity"])
                            for r in results if line_of(r) == line and domain in r["domains"])
            if points:
                ax.plot(*zip(*points), marker="x" if "as given" in line else "o", color=colours(index % colours.N),
                        linestyle="none" if "as given" in line else "-", label=line)
        ax.axhline(1.0, color="black", linewidth=0.8, label="original")
        ax.set(xscale="log", yscale="log", xlabel="cache per token (fraction of the original's)",
               ylabel="held-out perplexity / original's", title=domain)
        ticks = [1 / 8, 1 / 4, 1 / 3, 1 / 2, 3 / 4, 1]
        ax.set_xticks(ticks, ["1/8", "1/4", "1/3", "1/2", "3/4", "1"])
        ax.minorticks_off()
    handles, labels = axes[0][-1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside, not over, the data
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path
