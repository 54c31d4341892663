"""Convert a trained character model (concatenated heads) at smaller query/key sizes, then re-train it briefly.

For each method and rank: load the trained model, convert it with ``collab_attn.reparametrize``, measure the
validation loss (the fixed validation blocks of ``collab_attn.char_lm.data``), re-train it for ``retrain_fraction`` of
the recipe's iterations (same recipe otherwise: warm-up, cosine schedule over the shorter run, batch, clipping;
training blocks drawn with ``seed + 1``, evaluation every quarter of the re-training) and sample text with the
cache before and after. Methods (``collab_attn.models.settings.labels``): every conversion method
(``collab_attn.models.methods``) at its default options; ``<method>-aware`` for a method fitted to the attention
logits on training text (``collect_calibration`` over ``calibration_blocks`` training blocks); a method that ranks
heads gets Michel et al.'s importance on ``importance_samples`` training blocks (the model's own next-character
loss); ``none``: no conversion, only the re-training (a control: what the extra iterations alone give).

The sizes are ``ranks`` (every method at each), or, with ``cache_fractions``, the cache race's: each method at
the largest size whose converted model caches at most that fraction of the original's bytes per token
(``collab_attn.models.sizing``), keys and values together where the method cuts both (a method no size of which
fits is skipped and said so). ``distill`` re-trains with distillation from the original model (``refit=distill``'s
loss on the next-character logits).

Each run writes ``<output_dir>/runs/<method>-k<rank>[-v<value rank>].json`` atomically and is skipped when it
exists.
"""

from __future__ import annotations

import math
from dataclasses import InitVar, dataclass, field
from pathlib import Path

import torch
import transformers
from transformers import default_data_collator

import collab_attn
from collab_attn import cli
from collab_attn.char_lm import data as lm_data
from collab_attn.char_lm.models import cache_bytes, parameter_counts
from collab_attn.char_lm.runs import (
    check_model_settings,
    checked_corpus,
    learning_curve,
    train_model,
    trainer_fields,
    use_bf16,
)
from collab_attn.char_lm.sampling import sample_text
from collab_attn.deprecation import renamed_keyword
from collab_attn.distillation import DistillationTrainer, DistillSettings
from collab_attn.fitting.calibration import collect_calibration
from collab_attn.models.checkpoints import resolve_model
from collab_attn.models.conversion import check_request
from collab_attn.models.importance import head_importance
from collab_attn.models.settings import NO_CONVERSION, labels, parse_label
from collab_attn.models.sizing import conversion_at, conversion_sizes, original_size
from collab_attn.run_store import RunStore

METHODS = labels()
RESULT_VERSION = 1


@torch.no_grad()
def validation_loss(model, blocks: lm_data.Blocks, batch_size: int, bf16: bool) -> float:
    """Mean next-character loss over ``blocks`` (the Trainer's evaluation: the mean of equal-size batch means)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    losses = []
    try:
        for begin in range(0, len(blocks), batch_size):
            items = [blocks[i] for i in range(begin, min(begin + batch_size, len(blocks)))]
            batch = {k: v.to(device) for k, v in default_data_collator(items).items()}
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
                losses.append(float(model(**batch).loss) * len(items))
    finally:
        model.train(was_training)
    return sum(losses) / len(blocks)


def trained_config(model_dir: str | Path, corpus: lm_data.CharCorpus):
    """The config of the trained concatenated-heads model in ``model_dir`` (its weights present, trained on the
    characters of ``corpus``), read without loading the weights."""
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise cli.Missing(f"no trained model at {model_dir}: train it first (scripts/train_lm.py) or pass "
                          "model_dir=<folder>")
    with cli.naming("model_dir", model_dir):
        resolve_model(str(model_dir))
        config = transformers.AutoConfig.from_pretrained(model_dir)
    vocab = cli.json_file("model_dir", model_dir / "vocab.json") if (model_dir / "vocab.json").is_file() else None
    if vocab is not None and vocab != corpus.chars:
        raise cli.BadInput(f"model_dir={model_dir} was trained on another vocabulary than the {len(corpus.chars)} "
                           "characters of data.path; pass the text it was trained on")
    if getattr(config, "collab_ranks", None):
        raise cli.BadInput(f"model_dir={model_dir} is already converted; start from a concatenated-heads model")
    return config


def load_trained(model_dir: str | Path, corpus: lm_data.CharCorpus):
    trained_config(model_dir, corpus)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    return model.cuda() if torch.cuda.is_available() else model


@dataclass(frozen=True)
class Conversion:
    """One run of the grid: a method label (``labels()``) at a rank (``rank``) and, for a method that cuts the
    values too, a value rank; ``fraction``: the cache budget it was sized for (``cache_fractions``), if any.
    ``value_size``: the deprecated name of ``value_rank`` (``collab_attn.deprecation``), keyword only."""

    method: str
    rank: int
    value_rank: int | None = None
    fraction: float | None = None
    value_size: InitVar[int | None] = field(default=None, kw_only=True)

    def __post_init__(self, value_size: int | None) -> None:
        if value_size is not None:
            object.__setattr__(self, "value_rank", renamed_keyword("value_size", "value_rank", value_size,
                                                                   self.value_rank, "Conversion", stacklevel=5))

    @property
    def name(self) -> str:
        return f"{self.method}-k{self.rank}" + ("" if self.value_rank is None else f"-v{self.value_rank}")


def convert(model, run: Conversion, corpus, settings: dict, seed: int):
    """Convert ``model`` in place; returns the report (None for ``none``). What the conversion refuses in the trained
    model (query/key weights that are NaN or Inf) is bad input (``cli.BadInput``): the script reports it in one
    line, and the run writes nothing."""
    conversion, aware = parse_label(run.method)
    if conversion is None:
        return None
    measured = {}
    if aware:
        blocks = lm_data.Blocks(corpus.train, settings["block_size"], settings["calibration_blocks"], seed)
        with cli.as_bad_input():
            measured["calibration"] = collect_calibration(model, lm_data.input_batches(blocks, 64, len(blocks)))
    if conversion.needs_importance:
        blocks = lm_data.Blocks(corpus.train, settings["block_size"], settings["importance_samples"], seed)
        measured["importance"] = head_importance(
            model, blocks, default_data_collator, samples=len(blocks), batch_size=64, seed=seed
        )
    with cli.as_bad_input():
        return collab_attn.reparametrize(model, run.rank, method=conversion.name, seed=seed, progress=False,
                                         value_rank=run.value_rank, **measured)


def _fractions(settings: dict) -> list[float] | None:
    if settings.get("cache_fractions") is None:
        return None
    if settings.get("ranks") is not None:
        raise cli.BadInput("ranks and cache_fractions both set: give the sizes, or the cache budgets to size "
                           "every method for, not both")
    fractions = [cli.number("cache_fractions", f, 0, 1) for f in cli.nonempty_list("cache_fractions",
                                                                                   settings["cache_fractions"])]
    if 0 in fractions:
        raise cli.BadInput("cache_fractions must be above 0 (a fraction of the original's cache), got 0")
    return fractions


def plan(settings: dict, config) -> tuple[list[Conversion], list[str]]:
    """The grid: every method at every rank (``ranks``; default n_embd/2, /4, /8), or at every cache budget
    (``cache_fractions``: each method sized by ``collab_attn.models.sizing.conversion_at``, keys and values together
    where it cuts both); ``none`` once. Also the (method, budget) pairs no size of the method reaches."""
    methods = [cli.choice("methods", m, METHODS) for m in cli.nonempty_list("methods", settings["methods"])]
    d = cli.positive_int("model.n_embd", settings["model"]["n_embd"])
    fractions = _fractions(settings)
    runs, unreachable = [], []
    if fractions is not None:
        original = original_size(config)
        for method in methods:
            conversion = parse_label(method)[0]
            if conversion is None:
                runs.append(Conversion(method, d))
                continue
            sizes = conversion_sizes(config, conversion)
            for fraction in fractions:
                size = conversion_at(sizes, original, fraction)
                if size is None:
                    unreachable.append(f"{method} at {fraction:g} of the cache")
                else:
                    runs.append(Conversion(method, size.rank, size.value_rank, fraction))
        return runs, unreachable
    keys = [d // 2, d // 4, d // 8] if settings.get("ranks") is None else [
        cli.positive_int("ranks", k) for k in cli.nonempty_list("ranks", settings["ranks"])]
    for method in methods:
        runs += [Conversion(method, d)] if method == NO_CONVERSION else [Conversion(method, k) for k in keys]
    return runs, unreachable


def check(settings: dict) -> tuple[list[Conversion], list[str]]:
    """Every setting, the text, the trained model and every run of the grid, before anything is written: a size one
    method cannot take is refused before the first conversion. Returns the grid and what it could not size
    (``plan``). The deprecated ``key_sizes`` is taken as ``ranks`` (``cli.renamed``), in place."""
    cli.renamed(settings, "key_sizes", "ranks")
    check_model_settings(settings)
    trainer_fields(settings)
    cli.number("retrain_fraction", settings["retrain_fraction"], 0, 1)
    for key in ("calibration_blocks", "importance_samples", "eval_iters"):
        cli.positive_int(key, settings[key])
    for key in ("threads", "checkpoint_every"):
        cli.positive_int(key, settings.get(key), nullable=True)
    cli.integer("seed", settings["seed"], 0)
    cli.integer("sample_chars", settings["sample_chars"], 0)
    distill = distill_settings(settings)
    store = RunStore(cli.output_dir("output_dir", settings["output_dir"]))
    config = trained_config(settings["model_dir"], checked_corpus(settings))
    runs, unreachable = plan(settings, config)
    for run in runs:
        conversion = parse_label(run.method)[0]
        if conversion is not None:
            try:
                check_request(config, conversion.name, run.rank, value_rank=run.value_rank)
            except ValueError as err:
                raise cli.BadInput(f"methods={run.method} cannot take rank {run.rank} ({err}); change "
                                   "ranks or methods") from err
        store.finished(run.name, identity(run, distill))  # a stored run of another conversion is refused
    return runs, unreachable


def distill_settings(settings: dict) -> DistillSettings | None:
    """The ``distill`` block (alpha, temperature) of a re-training distilled from the original model, or None."""
    block = settings.get("distill")
    if block is None:
        return None
    try:
        distill = DistillSettings.from_config(dict(block))
    except (TypeError, ValueError) as err:
        raise cli.BadInput(str(err).replace("refit.distill", "distill")) from err
    if distill.hidden_weight or distill.attention_weight:
        raise cli.BadInput("distill.hidden_weight and distill.attention_weight are not supported for the language "
                           "models (next-character logits only); set them to 0")
    return distill


def identity(run: Conversion, distill: DistillSettings | None) -> dict:
    """The fields of a stored conversion that must match ``run`` (and the re-training's distillation) for it to be
    reused."""
    return {"version": RESULT_VERSION, "method": run.method, "rank": run.rank, "value_rank": run.value_rank,
            "distill": _distill_record(distill)}


def _distill_record(distill: DistillSettings | None) -> dict | None:
    return None if distill is None else {"alpha": distill.alpha, "temperature": distill.temperature}


def run_conversions(settings: dict, progress: bool = True) -> list[dict]:
    """Every run of the grid in ``settings`` (the resolved ``configs/convert_lm.yaml``) without a result yet."""
    runs, unreachable = check(settings)
    distill = distill_settings(settings)
    fields = trainer_fields(settings, progress)
    retrain_steps = math.ceil(float(settings["retrain_fraction"]) * fields["max_steps"])
    if settings.get("threads"):
        torch.set_num_threads(int(settings["threads"]))
    corpus = lm_data.load_corpus(settings["data"]["path"])
    seed, bf16 = int(settings["seed"]), use_bf16(settings.get("bf16", "auto"))
    batch = fields["per_device_eval_batch_size"]
    val = lm_data.val_blocks(corpus, settings["block_size"], batch, settings["eval_iters"])
    store = RunStore(settings["output_dir"])  # each record carries what identifies it: ``identity``
    original = load_trained(settings["model_dir"], corpus)
    for missed in unreachable:
        print(f"{missed}: no size of the method fits, skipped", flush=True)
    base = {
        "version": RESULT_VERSION, "model_dir": str(settings["model_dir"]), "recipe": settings.get("recipe_name"),
        "original_val_loss": validation_loss(original, val, batch, bf16),
        "original_parameters": parameter_counts(original), "original_cache_bytes_per_token_bf16": cache_bytes(original),
        "retrain_steps": retrain_steps, "seed": seed, "distill": _distill_record(distill),
    }
    print(f"original model: val loss {base['original_val_loss']:.4f}", flush=True)
    records = []
    for number, run in enumerate(runs, 1):
        stored = store.finished(run.name, identity(run, distill))
        if stored is not None:
            print(f"[{number}/{len(runs)}] {run.name}: done already, skipping", flush=True)
            records.append(stored)
            continue
        print(f"[{number}/{len(runs)}] {run.name}", flush=True)
        model = load_trained(settings["model_dir"], corpus)
        report = convert(model, run, corpus, settings, seed)
        record = {
            **base, "name": run.name, "method": run.method, "rank": run.rank, "value_rank": run.value_rank,
            "cache_fraction": run.fraction,
            "relative_error": report.mean_relative_error if report is not None else 0.0,
            "convert_seconds": report.seconds if report is not None else 0.0,
            "parameters": parameter_counts(model), "cache_bytes_per_token_bf16": cache_bytes(model),
            "converted_val_loss": validation_loss(model, val, batch, bf16),
            "converted_sample": sample_text(model, corpus, settings["sample_chars"], seed),
        }
        if retrain_steps:
            steps = {"max_steps": retrain_steps, "eval_steps": max(1, retrain_steps // 4)}
            teacher = {} if distill is None else {
                "trainer_class": DistillationTrainer, "teacher": original, "distill": distill, "regression": False}
            trained, _ = train_model(settings, corpus, model, seed + 1, store.checkpoints(run.name), progress, steps,
                                     **teacher)
            curve = learning_curve(trained.history)
            record.update({
                "retrain_curve": curve, "retrained_val_loss": curve[-1]["val_loss"],
                "retrained_best_val_loss": min(p["val_loss"] for p in curve), "retrain_seconds": trained.seconds,
                "retrained_sample": sample_text(model, corpus, settings["sample_chars"], seed),
            })
        store.save(run.name, record)
        print(f"{run.name}: val loss {record['converted_val_loss']:.4f} converted, "
              f"{record.get('retrained_val_loss', float('nan')):.4f} re-trained", flush=True)
        records.append(record)
    return records
