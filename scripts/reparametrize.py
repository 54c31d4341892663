"""Convert a pretrained checkpoint to collaborative attention (or SVD-truncated heads), check it, save it.

    python scripts/reparametrize.py                                   # MiniLM, CP, rank 192
    python scripts/reparametrize.py collab=tucker collab.rank=128 output_dir=outputs/tucker128 overwrite=true
    python scripts/reparametrize.py collab=svd collab.rank=96                # the SVD-truncated heads baseline
    python scripts/reparametrize.py model=path/to/checkpoint 'collab.rank=[384,256,256,192,192,128]'
    python scripts/reparametrize.py collab.budget=mean:128                   # per-layer ranks, same size as 128
    python scripts/reparametrize.py collab.calibration=../shared/data/glue/SST-2/train.tsv   # activation-aware
    python scripts/reparametrize.py model=path/to/gpt2-checkpoint collab.rank=192 collab.fit_steps=0  # unfitted
    python scripts/reparametrize.py model=smollm2 collab=key-svd collab.rank=96 collab.value_rank=96
                                                    # a decoder fitted by the general recipe on its own samples
    python scripts/reparametrize.py collab.calibration=texts.txt collab.fit_steps=100   # + fitted to the original
    python scripts/reparametrize.py collab.calibration=texts.txt collab.fit_steps=100 collab.e2e_steps=32  # + e2e
    python scripts/reparametrize.py collab.calibration=texts.txt collab.fit_steps=100 collab.e2e_steps=32 \
        collab.e2e_texts=more.txt                                  # the end-to-end fit on other text
    python scripts/reparametrize.py model=smollm2 collab=key-svd collab.rank=48 collab.value_rank=48 \
        collab.fit_steps=150 collab.distill_steps=32               # then every weight distilled from the original
    python scripts/reparametrize.py model=smollm2 collab=key-svd collab.rank=96 collab.value_rank=96 \
        collab.calibration=fit-all.txt collab.fit_steps=150 collab.distill_steps=64   # on a text file, as the race

The ``collab`` group becomes ``MethodSettings`` once (``collab_attn.models.settings``). ``collab=prune`` needs
labelled task examples to score the heads on, so it runs through the GLUE pipeline (``scripts/train_glue.py``);
``collab=none`` converts nothing. ``collab.fit_steps`` then trains each converted
attention layer that many steps to give the original's attention output on the calibration texts
(``collab_attn.fit_to_original``); its per-layer report is printed and saved under ``fit``. ``collab.e2e_steps``
then trains all the converted layers together that many steps to give the original model's output on the same texts
(``collab_attn.fit_end_to_end``), or with ``collab.e2e_texts`` on 16 texts of that file per step (more text: on
SmolLM2, 65,536 fitting tokens of which 49,152 were new gained more than passes over the calibration texts,
experiments/smollm2/LOG.md, "Long layer fits, then end to end on fresh text"); its report is saved under
``end_to_end``. ``collab.distill_steps`` then trains every weight of a decoder (embeddings, MLPs and norms too) that
many steps on the original's next-token distributions (``collab_attn.pretrained.distill``: the KL, 4 windows a step,
one pass), on the windows of own text (or of a text file) the end-to-end fit reads or on windows of
``collab.calibration_max_length`` tokens cut from ``collab.e2e_texts`` (else a GLUE .tsv's texts); its report is
saved under ``distillation``. The converted model is then no longer the original with new attention layers: every
weight moved.

With ``collab.fit_steps``, ``collab.e2e_steps`` or ``collab.distill_steps`` and no ``collab.calibration``, a decoder
is calibrated and fitted on the model's own samples (``collab.calibration=own``, ``collab_attn/own_text.py``; 64
windows of 256 tokens unless ``collab.calibration_samples`` and ``collab.calibration_max_length`` say otherwise, the
end-to-end fit 4 windows a step and judged on the 16 after its own): fitted on one domain's text, a model is far from
the original on others (experiments/transfer/README.md). An encoder writes no text: it needs ``collab.calibration`` to
fit. A decoder whose conversion caches less than the original, given none of ``FIT_KEYS``, is fitted by
``GENERAL_RECIPE`` (150 layer steps on 128 windows of its own samples, then every weight distilled 32 steps on them);
``collab.fit_steps=0`` converts it without fitting. A decoder reads a text file of ``collab.calibration`` as it reads
own text and as the SmolLM2 race reads its fitting text: windows of 256 tokens drawn from the whole file
(``collab_attn.glue.calibrate.file_windows``; 64 of them to calibrate and fit on, or all a shorter file holds, unless
``collab.calibration_samples`` says otherwise: a number the file does not hold is refused; ``scripts/write_fit_text.py``
writes the race's three domains' text); a GLUE .tsv stays texts.

Encoders are compared with the original on ``compare_sentences`` (last hidden states); decoders (GPT-2, OPT, BERT and
RoBERTa with ``is_decoder``) on the logits of each of ``compare_prompts`` and on their greedy continuations
(``max_new_tokens``, decoded with the key/value cache): how many tokens agree before the first difference.

Everything is validated before anything is written. The converted model (task head kept), its tokenizer and
``reparam_report.json`` (the per-layer report, the comparison with the original model, the settings) are
written to a temporary sibling of ``output_dir`` and renamed into place at the end. Bad input exits with status 2 and
one ``error: ...`` line on stderr (collab_attn/cli.py), also when only the loaded checkpoint shows it (a query or key
weight that is NaN or Inf, refused by the conversion): then nothing is written either.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import tempfile
import time
from pathlib import Path

import torch
from omegaconf import DictConfig

from collab_attn import cli, reparametrize
from collab_attn.cli import hydra_main, settings_of
from collab_attn.files import atomic_directory
from collab_attn.fitting.end_to_end import fit_end_to_end
from collab_attn.fitting.layer_fit import fit_to_original
from collab_attn.glue.calibrate import (
    OWN_BATCH,
    calibrate,
    check_calibration,
    distill_windows,
    end_to_end_batches,
    end_to_end_held_out,
    fit_batches,
    fitting_windows,
)
from collab_attn.kinds import LAYER_KINDS
from collab_attn.models import sizing
from collab_attn.models.checkpoints import (
    checked_model,
    load_model_and_tokenizer,
    smollm2_gguf,
)
from collab_attn.models.families import family_of
from collab_attn.models.hf import forward_inputs
from collab_attn.models.methods import METHODS
from collab_attn.models.settings import OWN_LENGTH, OWN_WINDOWS, CalibrationSettings, MethodSettings
from collab_attn.pretrained.distill import Distillation, distill
from collab_attn.serving import export

log = logging.getLogger("reparametrize")


def method_settings(collab: dict) -> MethodSettings:
    """The ``collab`` group as settings this script can run: a conversion method that needs no labelled task data."""
    method = MethodSettings.from_config(collab)
    runnable = [name for name, m in METHODS.items() if not m.needs_importance]
    if not method.converts:
        raise ValueError(f"collab={method.method} means 'no reparametrization' and is only for the GLUE pipeline; "
                         f"choose one of collab={', collab='.join(runnable)}")
    if method.importance is not None:
        raise ValueError(
            f"collab={method.method} scores the heads on a task's labelled training examples with a model fine-tuned "
            f"on that task, so it runs through the GLUE pipeline: python scripts/train_glue.py task=<task> "
            f"collab={method.method} collab.rank=<rank> refit=none data.glue_dir=<glue folder> (refit=none stops "
            "after the conversion)"
        )
    check_calibration(method, task_allowed=False, own_allowed=True)
    return method


EXPORTS = ("transformers", "gguf")


def check_export(settings: dict, method: MethodSettings, config) -> str | None:
    """``export`` and ``export_vocabulary`` against the conversion asked for, before any work: the form a standard
    checkpoint holds (collab_attn.export). Returns the GGUF vocabulary file for ``export=gguf``."""
    fmt, vocabulary = settings["export"], settings["export_vocabulary"]
    if fmt is None:
        if vocabulary is not None:
            raise cli.BadInput("export_vocabulary is the tokenizer of export=gguf; set export=gguf or leave it null")
        return None
    cli.choice("export", fmt, EXPORTS)
    how = ("export writes a rotary model converted by collab=key-svd, cp or tucker with collab.value_rank equal to "
           "collab.rank and collab.bands=shared (one head size and one frequency list for every layer), or by "
           "collab=merge-kv or drop-kv at one collab.rank")
    if not family_of(config).rotary:
        raise cli.BadInput(f"export={fmt}: {config.model_type} has no standard rotary form; {how}")
    kind = LAYER_KINDS.get(method.conversion.rotary_layer)
    if kind is None or kind.standard_form is None:
        raise cli.BadInput(f"export={fmt}: collab={method.method} has no standard form; {how}")
    if kind.bands_buffer is not None and method.bands != "shared":
        raise cli.BadInput(f"export={fmt} needs collab.bands=shared; {how}")
    if method.budget is not None or type(method.rank) is not int or (kind.cuts_values and
                                                                    method.value_rank != method.rank):
        values = f", value_rank {method.value_rank}" if kind.cuts_values else ""
        raise cli.BadInput(f"export={fmt} needs one collab.rank" + (" and collab.value_rank equal to it" if
                           kind.cuts_values else "") + f" (got rank {method.rank_request}{values}); {how}")
    if fmt != "gguf":
        if vocabulary is not None:
            raise cli.BadInput("export_vocabulary is the tokenizer of export=gguf; export=transformers saves the "
                               "model's own tokenizer: leave it null")
        return None
    if vocabulary is None:
        if settings["model"] != "smollm2":
            raise cli.BadInput("export=gguf takes the tokenizer from a GGUF file of the source model: set "
                               "export_vocabulary=<file.gguf>")
        vocabulary = str(smollm2_gguf())
    from collab_attn.serving.gguf_file import check_architecture, check_vocabulary

    with cli.as_bad_input():
        check_architecture(config.model_type, config)
        check_vocabulary(vocabulary)
    return vocabulary


# The general recipe (issue 91): what a decoder whose conversion caches less than the original is fitted with when the
# collab group gives no fitting setting (every key of FIT_KEYS null): calibrated and fitted on its own samples, each
# layer 150 steps on all 128 windows drawn, then every weight distilled 32 steps on the same windows
# (experiments/transfer/README.md, section 5, times it). Any of FIT_KEYS set, 0 included, turns it off:
# collab.fit_steps=0 converts without fitting. A collab.calibration_samples given is kept.
GENERAL_RECIPE = {"fit_steps": 150, "distill_steps": 32, "calibration_samples": 128}
FIT_KEYS = ("calibration", "fit_steps", "e2e_steps", "e2e_texts", "distill_steps")


def caches_less(config, method: MethodSettings) -> bool:
    """Whether the conversion at ``method``'s ranks caches fewer numbers per token than the original (a conversion
    that caches as many is exact)."""
    layers = config.num_hidden_layers
    ranks = method.rank if isinstance(method.rank, list) else [method.rank] * layers
    values = method.value_rank if isinstance(method.value_rank, list) else [method.value_rank] * layers
    return sizing.caches_less(config, method.conversion, ranks, values)


def with_general_recipe(collab: dict, method: MethodSettings, config) -> MethodSettings:
    """``method``, or with ``GENERAL_RECIPE`` where it applies: a decoder, a method that fits, no fitting setting
    given and a conversion that caches less than the original (a budget, or ranks below the original's cache)."""
    if (not family_of(config).decoder or not method.conversion.calibrated
            or any(collab.get(key) is not None for key in FIT_KEYS)):
        return method
    if method.budget is None and not caches_less(config, method):
        return method  # as large as the original: an exact conversion, nothing to fit
    recipe = {key: value for key, value in GENERAL_RECIPE.items() if collab.get(key) is None}
    log.info("no fitting setting given: the general recipe, %s on the model's own samples (collab.fit_steps=0 "
             "converts without fitting)", " ".join(f"collab.{k}={v}" for k, v in recipe.items()))
    return method_settings({**collab, **recipe})


def with_windows(collab: dict, method: MethodSettings, config) -> MethodSettings:
    """``method``, with a decoder's text file (``collab.calibration``, not a GLUE .tsv) read as windows, as own text
    is and as the SmolLM2 race reads its fitting text (``collab_attn.glue.calibrate.file_windows``: by default
    ``OWN_WINDOWS`` windows to calibrate on), and windows no longer than the positions the model reads: by default
    ``OWN_LENGTH`` tokens or all its positions where it reads fewer; a longer ``collab.calibration_max_length`` is
    refused."""
    settings = method.calibration
    if settings is None or not family_of(config).decoder or settings.from_task:
        return method
    from_file = not settings.from_own and Path(settings.source).suffix != ".tsv"
    if not (settings.from_own or from_file):
        return method
    positions = getattr(config, "max_position_embeddings", None) or OWN_LENGTH
    length = collab.get("calibration_max_length")
    if length is not None and length > positions:
        raise cli.BadInput(f"collab.calibration_max_length={length}: windows of that many tokens are longer than the "
                           f"{positions} positions {config.model_type} reads; give collab.calibration_max_length="
                           f"{positions} or fewer")
    samples = (collab.get("calibration_samples") or OWN_WINDOWS) if from_file else settings.samples
    return dataclasses.replace(method, calibration=CalibrationSettings(
        settings.source, samples, min(OWN_LENGTH, positions) if length is None else length, windows=from_file))


def check_windows(collab: dict, method: MethodSettings, rows: torch.Tensor | None) -> None:
    """A ``collab.calibration_samples`` given for a text file read as windows is there in the file: the default
    (``OWN_WINDOWS``) reads every window a shorter file holds, a number the user gives is refused."""
    given = collab.get("calibration_samples")
    if given is None or rows is None or method.calibration.from_own or len(rows) >= given:
        return
    raise cli.BadInput(f"collab.calibration_samples={given}: {method.calibration.source} holds {len(rows)} windows "
                       f"of {method.calibration.max_length} tokens; give collab.calibration_samples={len(rows)} or "
                       "fewer, or more text")


def check(settings: dict) -> tuple[MethodSettings, str]:
    """Every setting, the checkpoint's config against the method and rank, the calibration texts and the output
    folder, before anything is loaded or written; returns the method settings (with ``GENERAL_RECIPE`` where it
    applies) and the model's path."""
    method = method_settings(settings["collab"])
    path, config = checked_model(settings["model"])
    method.check_model(config)
    method = with_windows(settings["collab"], with_general_recipe(settings["collab"], method, config), config)
    if method.calibration is not None and method.calibration.from_own and not family_of(config).decoder:
        raise cli.BadInput(f"collab.calibration=own (what collab.fit_steps and collab.e2e_steps read without "
                           f"collab.calibration) samples the model's own text, which {config.model_type}, an encoder, "
                           "does not write: set collab.calibration to a text file or a GLUE train.tsv/dev.tsv")
    if method.distill_steps and not family_of(config).decoder:
        raise cli.BadInput(f"collab.distill_steps={method.distill_steps} distils the original's next-token "
                           f"distributions, which {config.model_type}, an encoder, does not give: fit its attention "
                           "with collab.fit_steps and collab.e2e_steps, or set collab.distill_steps=null")
    check_export(settings, method, config)
    cli.output_dir("output_dir", settings["output_dir"], overwrite=cli.boolean("overwrite", settings["overwrite"]))
    cli.integer("seed", settings["seed"], 0)
    cli.positive_int("max_new_tokens", settings["max_new_tokens"])
    for sentence in cli.nonempty_list("compare_sentences", settings["compare_sentences"]):
        pair = isinstance(sentence, list) and len(sentence) == 2 and all(isinstance(s, str) for s in sentence)
        if not (isinstance(sentence, str) and sentence.strip()) and not pair:
            raise cli.BadInput(f"compare_sentences: each item must be a sentence or a pair [a, b], got {sentence!r}")
    for prompt in cli.nonempty_list("compare_prompts", settings["compare_prompts"]):
        if not (isinstance(prompt, str) and prompt.strip()):
            raise cli.BadInput(f"compare_prompts: each item must be a non-empty string, got {prompt!r}")
    return method, path


@torch.no_grad()
def compare(original, converted, tokenizer, sentences) -> dict:
    """Max and mean |difference| of the last hidden states over non-padding tokens of one padded batch."""
    encoded = [tokenizer(*([s] if isinstance(s, str) else s)) for s in sentences]
    batch = tokenizer.pad(encoded, padding=True, return_tensors="pt")
    outputs = [m.eval()(**forward_inputs(m, batch), output_hidden_states=True) for m in (original, converted)]
    keep = batch["attention_mask"].bool()
    diff = (outputs[0].hidden_states[-1] - outputs[1].hidden_states[-1]).abs()[keep]
    result = {
        "sentences": len(sentences),
        "tokens": int(keep.sum()),
        "padding_tokens": int((~keep).sum()),
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
    }
    if getattr(outputs[0], "logits", None) is not None:  # a task head: compare its outputs too
        result["logits_max_abs_diff"] = (outputs[0].logits - outputs[1].logits).abs().max().item()
    return result


def is_decoder(model) -> bool:
    return family_of(model.config).decoder or bool(getattr(model.config, "is_decoder", False))


@torch.no_grad()
def compare_generation(original, converted, tokenizer, prompts, max_new_tokens: int) -> dict:
    """Per prompt (no padding): max |difference| of the logits, and the greedy continuations of both models with how
    many new tokens agree before the first difference."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    rows = []
    for prompt in prompts:
        ids = forward_inputs(original, tokenizer(prompt, return_tensors="pt"))  # only what the model takes
        logits = [m.eval()(**ids, use_cache=False).logits for m in (original, converted)]
        start = ids["input_ids"].shape[1]
        tokens = [
            m.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)[0, start:]
            for m in (original, converted)
        ]
        common = min(len(tokens[0]), len(tokens[1]))  # a model that ends its answer (end of sequence) stops early
        differ = (tokens[0][:common] != tokens[1][:common]).nonzero()
        same = int(differ[0, 0]) if len(differ) else common
        rows.append({
            "prompt": prompt,
            "logits_max_abs_diff": (logits[0] - logits[1]).abs().max().item(),
            "same_tokens_before_first_difference": same,
            "new_tokens": len(tokens[0]),
            "original": tokenizer.decode(tokens[0]),
            "converted": tokenizer.decode(tokens[1]),
        })
    return {"prompts": rows, "max_abs_diff": max(r["logits_max_abs_diff"] for r in rows)}


def distilled(model, original, rows: torch.Tensor, seed: int) -> Distillation:
    """``model`` distilled from ``original`` on ``rows`` (``OWN_BATCH`` windows a step, one pass), every weight
    trained; its checkpoints go to a temporary folder, removed at the end (a one-call conversion restarts)."""
    with tempfile.TemporaryDirectory(prefix="distill-") as folder:
        run = distill(model, original, rows, Path(folder) / "checkpoints", OWN_BATCH, seed=seed,
                      checkpoint_every=None)
    return Distillation(int(rows.numel()), len(rows), run.seconds, run.history)


def run(cfg: DictConfig) -> dict:
    """Convert ``cfg.model``, compare it with the original, save it to ``cfg.output_dir``; return the report."""
    start = time.perf_counter()
    settings = settings_of(cfg)  # resolve once: the default output_dir has a timestamp
    method, path = check(settings)
    vocabulary = check_export(settings, method, checked_model(settings["model"])[1])
    torch.manual_seed(settings["seed"])

    log.info("loading %s (%s)", settings["model"], path)
    model, tokenizer = load_model_and_tokenizer(path, model_class=None)
    original = copy.deepcopy(model)
    sampling = time.perf_counter()
    with cli.as_bad_input():  # a tokenizer without a beginning-of-text token cannot start a window: one error line
        rows = fitting_windows(model, tokenizer, method, settings["seed"])  # own samples, or a file's windows
    check_windows(settings["collab"], method, rows)
    sampling = time.perf_counter() - sampling
    with cli.as_bad_input():  # what only the loaded weights show (NaN or Inf): one error line, nothing written
        calibration = calibrate(model, tokenizer, method, settings["seed"], rows=rows)
        report = reparametrize(
            model, seed=settings["seed"], calibration=calibration, progress=True, **method.reparametrize_kwargs()
        )
    print(report.table())
    fit = None
    if method.fit_steps:  # each converted layer trained to give the original's attention output
        fit = fit_to_original(model, original, fit_batches(tokenizer, method, settings["seed"], rows),
                              steps=method.fit_steps, seed=settings["seed"])
        print(fit.table())
    end_to_end = None
    if method.e2e_steps:  # then all of them together, to give the original's output
        end_to_end = fit_end_to_end(model, original, end_to_end_batches(tokenizer, method, settings["seed"], rows),
                                    steps=method.e2e_steps, seed=settings["seed"],
                                    held_out=end_to_end_held_out(method, rows))
        print(end_to_end.table())
    distillation = None
    if method.distill_steps:  # then every weight, to give the original's next-token distributions
        distillation = distilled(model, original, distill_windows(tokenizer, method, settings["seed"], rows),
                                 settings["seed"])
        print(distillation.table())

    if is_decoder(model):
        comparison = compare_generation(
            original, model, tokenizer, settings["compare_prompts"], settings["max_new_tokens"]
        )
        for row in comparison["prompts"]:
            print(f"\n{row['prompt']!r}: logits |diff| max {row['logits_max_abs_diff']:.3e}; "
                  f"{row['same_tokens_before_first_difference']}/{row['new_tokens']} greedy tokens agree"
                  f"\n  original:  {row['original']!r}\n  converted: {row['converted']!r}")
    else:
        comparison = compare(original, model, tokenizer, settings["compare_sentences"])
    comparison.update(
        model_params_before=report.model_params_before, model_params_after=report.model_params_after,
        attention_params_before=report.attention_params_before,
        attention_params_after=report.attention_params_after,
    )
    logits = comparison.get("logits_max_abs_diff")
    if "sentences" in comparison:
        print(
            f"\nconverted vs original on {comparison['sentences']} sentences ({comparison['tokens']} tokens, "
            f"{comparison['padding_tokens']} padding): last hidden state |diff| "
            f"max {comparison['max_abs_diff']:.3e}, mean {comparison['mean_abs_diff']:.3e}"
            + ("" if logits is None else f"; logits |diff| max {logits:.3e}")
        )
    print(
        f"parameters: model {comparison['model_params_before']:,} -> {comparison['model_params_after']:,}, "
        f"attention {comparison['attention_params_before']:,} -> {comparison['attention_params_after']:,}"
    )
    result = {
        **report.to_dict(), "comparison": comparison, "model": settings["model"], "model_path": path,
        "rank": method.rank_request, "seed": settings["seed"], "config": settings,
        "collab": method.to_group(),  # as run: collab.calibration=own where fits read the model's own text
    }
    result["fit"] = None if fit is None else fit.to_dict()
    result["end_to_end"] = None if end_to_end is None else end_to_end.to_dict()
    result["distillation"] = None if distillation is None else distillation.to_dict()
    own = method.calibration is not None and method.calibration.from_own
    result["wall_seconds"] = {"own_text": sampling if own else None,  # sampling the original's text
                              "before_saving": time.perf_counter() - start}  # from the call to the model's saving

    with atomic_directory(settings["output_dir"], settings["overwrite"]) as folder:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        if settings["export"] is not None:  # the standard checkpoint beside the converted model
            target = folder / ("standard" if settings["export"] == "transformers" else "model.gguf")
            with cli.as_bad_input():
                export(model, target, format=settings["export"], tokenizer=tokenizer, vocabulary=vocabulary)
            result["export"] = target.name
            print(f"standard checkpoint ({settings['export']}): {target.name}")
        (folder / "reparam_report.json").write_text(json.dumps(result, indent=2) + "\n")
    out = Path(settings["output_dir"]).expanduser().absolute()
    log.info("saved the converted model to %s", out)
    print(f"saved to {out}")
    return result


@hydra_main("reparametrize", check)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
