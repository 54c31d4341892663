"""Training runs on Tiny Shakespeare through the library's one training path (``collab_attn.training.train``).

A run is one (attention kind, rank, mixing init, seed) trained with one recipe (``configs/recipe/``): the
Trainer's AdamW, linear warm-up then cosine decay to ``min_lr``, gradient clipping, bf16 autocast where the GPU has
it. The validation blocks are evaluated at step 0, every ``eval_steps`` and at the end; the best validation loss is
the minimum over those evaluations (nanoGPT's ``best_val_loss``). Each run writes ``<output_dir>/runs/<name>.json``
atomically when it has finished and is skipped when that file exists; with ``checkpoint_every`` an interrupted run
continues from its last checkpoint. Models named in ``save_models`` are saved under ``<output_dir>/models/<name>``.
"""

from __future__ import annotations

import fnmatch
import json
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import default_data_collator

from collab_attn import cli, run_store
from collab_attn.char_lm import data as lm_data
from collab_attn.char_lm.kinds import ATTENTION, KINDS, MIXING_INITS
from collab_attn.char_lm.models import (
    MODEL_KEYS,
    POSITIONS,
    ROPE_THETA,
    build_model,
    cache_bytes,
    gpt_config,
    parameter_counts,
)
from collab_attn.char_lm.sampling import sample_text
from collab_attn.deprecation import renamed_keyword
from collab_attn.files import write_text_atomic
from collab_attn.run_store import RunStore, ranks_for
from collab_attn.tracking import check_logger, make_tracker
from collab_attn.training import train, training_args

RESULT_VERSION = 1
MODES = ("train", "sweep")


def use_bf16(setting) -> bool:
    """``bf16: auto`` means bf16 autocast on a CUDA GPU that supports it, float32 elsewhere."""
    if setting == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return bool(setting)


def trainer_fields(settings: dict, progress: bool = True) -> dict:
    """TrainingArguments fields of every run: the recipe's ``trainer`` plus evaluation at step 0 and every
    ``eval_steps``, batches read in order (they were drawn with the seed), loss-only evaluation, and every key of
    a block kept (the Trainer would drop ``shift_labels``, not being a ``forward`` argument, and the model would
    then shift the targets once more and learn to predict the character after next). Raises
    ``ValueError`` on anything TrainingArguments refuses."""
    fields = dict(settings["trainer"])
    for key in ("max_steps", "eval_steps", "per_device_train_batch_size"):
        cli.positive_int(f"trainer.{key}", fields.get(key))
    cli.trainer_fields("trainer", fields)
    if fields.get("gradient_accumulation_steps", 1) != 1:
        raise ValueError("gradient_accumulation_steps is not supported: the blocks are drawn per optimizer step")
    fields = {
        "logging_steps": fields["eval_steps"], "per_device_eval_batch_size": fields["per_device_train_batch_size"],
        **fields, "eval_strategy": "steps", "eval_on_start": True, "train_sampling_strategy": "sequential",
        "prediction_loss_only": True, "remove_unused_columns": False, "disable_tqdm": not progress,
        "bf16": use_bf16(settings.get("bf16", "auto")),
    }
    try:
        training_args(Path(settings["output_dir"]) / ".checkpoints", 0, fields, settings.get("checkpoint_every"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad trainer settings: {err}") from err
    return fields


def shape_of(settings: dict) -> dict:
    """What shapes a variant besides its kind and rank: ``gpt_config``'s keywords from the settings."""
    shape = {"mixing_init": settings.get("mixing_init", "random"), "value_rank": settings.get("value_rank"),
             "positions": settings.get("positions", "learned")}
    for key in ("rope_dim", "query_rank"):
        if settings.get(key) is not None:
            shape[key] = settings[key]
    if settings.get("rope_theta", ROPE_THETA) != ROPE_THETA:
        shape["rope_theta"] = settings["rope_theta"]
    return shape


def run_name(kind: str, rank: int, seed: int, mixing_init: str = "random", value_rank: int | None = None,
             positions: str = "learned", rope_dim: int | None = None, query_rank: int | None = None,
             head_dim: int | None = None, rope_theta: float | None = None, *, value_size: int | None = None) -> str:
    """``<kind>[-ones]-k<rank>[-v<values>]-seed<seed>``; with rotary positions ``rope-`` first, latent attention's
    rotary key (``-r<rope_dim>``, its default resolved from ``head_dim``) and tensor product attention's value and
    query ranks (``-v``, ``-q``) always named. ``rope_theta`` is not in the name: the run's signature records it, so
    a stored run made with another theta is refused rather than reused. ``value_size``: the deprecated name of
    ``value_rank`` (``collab_attn.deprecation``)."""
    value_rank = renamed_keyword("value_size", "value_rank", value_size, value_rank, "run_name")
    attention = ATTENTION[kind]
    mixing = "-ones" if "mixing_init" in attention.takes and mixing_init == "ones" else ""
    named = attention.named_sizes(rank, value_rank, rope_dim, query_rank, head_dim, positions == "rope")
    sizes = "".join(f"-{letter}{size}" for letter, size in named.items() if size is not None)
    prefix = "rope-" if positions == "rope" else ""
    return f"{prefix}{kind}{mixing}-k{rank}{sizes}-seed{seed}"


def name_of(settings: dict, kind: str, rank: int, seed: int) -> str:
    """The run name of one variant of ``settings``."""
    head_dim = settings["model"]["n_embd"] // settings["model"]["n_head"]
    return run_name(kind, rank, seed, head_dim=head_dim, **shape_of(settings))


def signature(settings: dict) -> dict:
    """What must agree for a stored run to be reused: everything that changes a run except its kind, rank,
    mixing and seed (not the output folder, checkpointing, threads, progress bars or bf16 'auto')."""
    trainer = {k: v for k, v in settings["trainer"].items() if k not in ("disable_tqdm", "dataloader_num_workers")}
    rope = settings.get("positions", "learned") == "rope"
    return {
        "version": RESULT_VERSION,
        "data": Path(settings["data"]["path"]).name,
        "model": {k: settings["model"][k] for k in MODEL_KEYS},
        "block_size": settings["block_size"],
        "eval_iters": settings["eval_iters"],
        "trainer": trainer,
        # rotary models: Llama's architecture (learned-position runs stored before keep their signature)
        **({"positions": {"rope_theta": float(settings.get("rope_theta", ROPE_THETA))}} if rope else {}),
    }


def check_model_settings(settings: dict) -> None:
    unknown = sorted(set(settings["model"]) - set(MODEL_KEYS))
    if unknown:
        raise ValueError(f"unknown model settings {unknown}; choose from {MODEL_KEYS}")
    for key in ("n_layer", "n_head", "n_embd"):
        cli.positive_int(f"model.{key}", settings["model"].get(key))
    cli.number("model.dropout", settings["model"].get("dropout", 0.0), 0, 1, below=True)


def learning_curve(history: Sequence[dict]) -> list[dict]:
    """One point per evaluation: step, validation loss, and the train loss and learning rate logged at that step
    (``collab_attn.run_store.learning_curve``)."""
    return run_store.learning_curve(history, {"eval_loss": "val_loss"}, ("loss", "learning_rate"))


def train_model(settings: dict, corpus, model, seed: int, checkpoints: Path, progress: bool = True,
                overrides: dict | None = None, **trainer):
    """Train ``model`` with the recipe in ``settings`` (``overrides``: TrainingArguments fields that replace the
    recipe's, e.g. a shorter ``max_steps`` with the schedule over that many steps; ``trainer``: a ``trainer_class``
    and its arguments, as ``collab_attn.training.train`` takes them); returns the ``TrainingRun`` and the training
    tokens it processed."""
    fields = {**trainer_fields(settings, progress), **(overrides or {})}
    batch, block = fields["per_device_train_batch_size"], settings["block_size"]
    blocks = lm_data.train_blocks(corpus, block, batch, fields["max_steps"], seed)
    val = lm_data.val_blocks(corpus, block, fields["per_device_eval_batch_size"], settings["eval_iters"])
    run = train(model, blocks, default_data_collator, fields, seed, checkpoints, settings.get("checkpoint_every"),
                eval_dataset=val, **trainer)
    return run, fields["max_steps"] * batch * block


def train_run(settings: dict, corpus, kind: str, rank: int, seed: int, progress: bool = True) -> dict:
    """Train one variant (or read its stored result) and return its record."""
    out = Path(settings["output_dir"])
    shape = shape_of(settings)
    mixing = shape["mixing_init"] if "mixing_init" in ATTENTION[kind].takes else None
    values = shape["value_rank"]
    name = name_of(settings, kind, rank, seed)
    store = RunStore(out, signature(settings))
    record = store.finished(name)
    if record is not None:
        print(f"{name}: done already (best val loss {record['best_val_loss']:.4f}), skipping", flush=True)
        return record
    config = gpt_config(corpus.vocab_size, settings["block_size"], **settings["model"], kind=kind,
                        rank=rank, **shape)
    model = build_model(config, seed)
    if torch.cuda.is_available():
        model.cuda()
    run, tokens = train_model(settings, corpus, model, seed, store.checkpoints(name), progress)
    curve = learning_curve(run.history)
    eval_seconds = sum(entry.get("eval_runtime", 0.0) for entry in run.history)
    train_seconds = run.seconds - eval_seconds
    best = min(curve, key=lambda p: p["val_loss"])
    record = {
        "name": name, "attention": kind, "rank": rank, "mixing_init": mixing,
        **({} if values is None else {"value_rank": values}),
        **({} if shape["positions"] == "learned" else {"positions": "rope", **rotary_sizes(model)}),
        "seed": seed, "recipe": settings.get("recipe_name"), "signature": store.signature,
        "parameters": parameter_counts(model), "cache_bytes_per_token_bf16": cache_bytes(model, 2),
        "best_val_loss": best["val_loss"], "best_step": best["step"], "final_val_loss": curve[-1]["val_loss"],
        "curve": curve, "train_seconds": train_seconds, "resumed_seconds": run.resumed_seconds,
        "tokens_per_second": tokens / train_seconds if train_seconds > 0 else None,
        "bf16": use_bf16(settings.get("bf16", "auto")),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "threads": torch.get_num_threads(),
        "sample": sample_text(model, corpus, settings.get("sample_chars", 300), seed),
    }
    if any(fnmatch.fnmatch(name, pattern) for pattern in settings.get("save_models") or []):
        model.save_pretrained(out / "models" / name)
        write_text_atomic(out / "models" / name / "vocab.json", json.dumps(corpus.chars) + "\n")
    store.save(name, record)
    log_to_tracker(settings, record)
    print(f"{name}: best val loss {record['best_val_loss']:.4f} at step {best['step']}, "
          f"{record['tokens_per_second'] or 0:,.0f} tokens/s", flush=True)
    return record


def rotary_sizes(model) -> dict:
    """The rotary sizes a record of a rotary model keeps: its rope theta, and where they apply latent attention's
    decoupled rotary key and tensor product attention's ranks, read from the model's config."""
    config = model.config
    sizes = {"rope_theta": config.rope_parameters["rope_theta"]}
    if getattr(config, "collab_rope_pairs", None):
        sizes["rope_dim"] = 2 * config.collab_rope_pairs[0]
    if getattr(config, "collab_query_ranks", None):
        sizes.update(value_rank=config.collab_value_ranks[0], query_rank=config.collab_query_ranks[0])
    return sizes


def log_to_tracker(settings: dict, record: dict) -> None:
    """``logger=wandb``: one W&B run per training run with the learning curve and the summary numbers, through the
    tracker of the GLUE jobs (``collab_attn.tracking``), so the mode is chosen as for them (``logger.mode``, else
    ``WANDB_MODE``, else online only when a key is set); ``logger=none``: nothing."""
    tracker = make_tracker(
        settings.get("logger") or {"name": "none"}, f"{record['recipe']}-{record['name']}",
        f"shakespeare_char-{record['recipe']}", record["signature"], Path(settings["output_dir"]),
    )
    for point in record["curve"]:
        tracker.log_step({k: v for k, v in point.items() if v is not None}, point["step"])
    tracker.finish({k: record[k] for k in ("best_val_loss", "tokens_per_second", "cache_bytes_per_token_bf16")})


def plan(settings: dict) -> list[tuple[str, int, int]]:
    """(kind, rank, seed) of every sweep run, seed by seed, largest rank first, concatenated first."""
    kinds = [cli.choice("kinds", kind, KINDS) for kind in cli.nonempty_list("kinds", settings["kinds"])]
    seeds = [cli.integer("seeds", seed, 0) for seed in cli.nonempty_list("seeds", settings["seeds"])]
    keys = ranks_for(settings["model"]["n_embd"], settings.get("ranks"))
    return [(kind, key, seed) for seed in seeds for key in keys for kind in kinds]


def runs_of(settings: dict) -> list[tuple[str, int, int]]:
    """The runs ``settings`` asks for: ``mode=train`` the one of ``attention``, ``rank`` (null: ``n_embd``) and
    ``seed``; ``mode=sweep`` the grid of ``plan``."""
    if cli.choice("mode", settings["mode"], MODES) == "sweep":
        return plan(settings)
    key = cli.positive_int("rank", settings["rank"], nullable=True)
    kind, model = cli.choice("attention", settings["attention"], KINDS), settings["model"]
    key = size_alias(settings, kind, model, key)
    key = ATTENTION[kind].default_rank(model["n_embd"], model["n_head"]) if key is None else key
    return [(kind, key, cli.integer("seed", settings["seed"], 0))]


# The sizes that name a variant's cache width in its own terms: grouped-query attention's number of key/value heads
# and latent attention's latent width (each kind's ``size_alias``).
SIZE_ALIASES = {kind.size_alias: name for name, kind in ATTENTION.items() if kind.size_alias}


def size_alias(settings: dict, kind: str, model: dict, rank: int | None) -> int | None:
    """``rank`` from ``kv_heads`` (``attention=gqa``) or ``latent_size`` (``attention=mla``) when one is set: an
    alias given for another attention, or beside a ``rank`` it disagrees with, is refused."""
    for name, owner in SIZE_ALIASES.items():
        value = cli.positive_int(name, settings.get(name), nullable=True)
        if value is None:
            continue
        if ATTENTION[kind].size_alias != name:
            raise cli.BadInput(f"{name}={value} is a size of attention={owner}, not of attention={kind}; remove it "
                               "or set rank")
        size = ATTENTION[owner].rank_from(value, model["n_embd"] // model["n_head"])
        if rank is not None and rank != size:
            raise cli.BadInput(f"{name}={value} means rank={size}, but rank={rank} is set; give one")
        rank = size
    return rank


def validate(settings: dict, runs: Sequence[tuple[str, int, int]]) -> lm_data.CharCorpus:
    """Every setting, the data, every run's model config and the results stored for them, before anything is
    written; returns the corpus."""
    check_model_settings(settings)
    block = cli.positive_int("block_size", settings["block_size"])
    cli.positive_int("eval_iters", settings["eval_iters"])
    for key in ("threads", "checkpoint_every"):
        cli.positive_int(key, settings.get(key), nullable=True)
    cli.integer("sample_chars", settings.get("sample_chars", 300), 0)
    if settings.get("bf16", "auto") != "auto":
        cli.boolean("bf16", settings["bf16"])
    cli.choice("mixing_init", settings.get("mixing_init", "random"), MIXING_INITS)
    cli.positive_int("value_rank", settings.get("value_rank"), nullable=True)
    cli.choice("positions", settings.get("positions", "learned"), POSITIONS)
    cli.number("rope_theta", settings.get("rope_theta", ROPE_THETA), 0, None, above=True)
    cli.integer("rope_dim", settings.get("rope_dim"), 0, nullable=True)
    cli.positive_int("query_rank", settings.get("query_rank"), nullable=True)
    patterns = settings.get("save_models") or []
    if not isinstance(patterns, (list, tuple)):  # a string would be read character by character
        raise cli.BadInput(f"save_models must be a list of run names or glob patterns (e.g. '[concat-k128-seed0]'), "
                           f"got {patterns!r}")
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise cli.BadInput(f"save_models must be a list of run names or glob patterns, got {pattern!r}")
    cli.boolean("progress", settings.get("progress", True))
    trainer_fields(settings)
    check_logger(settings.get("logger"))
    out = cli.output_dir("output_dir", settings["output_dir"])
    corpus = checked_corpus(settings)
    store = RunStore(out, signature(settings))
    for kind, key, seed in runs:
        try:
            gpt_config(2, block, **settings["model"], kind=kind, rank=key, **shape_of(settings))
        except ValueError as err:
            raise cli.BadInput(str(err)) from err
        store.finished(name_of(settings, kind, key, seed))  # a stored run made with other settings is refused
    return corpus


def checked_corpus(settings: dict) -> lm_data.CharCorpus:
    """The corpus of ``data.path``, each split longer than ``block_size`` characters."""
    path, block = settings["data"]["path"], cli.positive_int("block_size", settings["block_size"])
    corpus = lm_data.load_corpus(path)
    for split in ("train", "val"):
        if len(getattr(corpus, split)) <= block:
            raise cli.BadInput(f"data.path={path}: its {split} split has {len(getattr(corpus, split))} characters, "
                               f"too few for block_size={block}; lower block_size or pass a longer text")
    return corpus


def check(settings: dict) -> list[tuple[str, int, int]]:
    """``scripts/train_lm.py``'s check: the runs ``settings`` asks for (``runs_of``), validated. The deprecated
    ``key_size`` / ``key_sizes`` / ``value_size`` are taken as ``rank`` / ``ranks`` / ``value_rank``
    (``cli.renamed``), in place."""
    cli.renamed(settings, "key_size", "rank")
    cli.renamed(settings, "key_sizes", "ranks")
    cli.renamed(settings, "value_size", "value_rank")
    check_model_settings(settings)
    runs = runs_of(settings)
    validate(settings, runs)
    return runs


def run_many(settings: dict, runs: Sequence[tuple[str, int, int]], progress: bool = True) -> list[dict]:
    """Train (or skip) each of ``runs`` in turn; returns their records."""
    corpus = validate(settings, runs)
    if settings.get("threads"):
        torch.set_num_threads(int(settings["threads"]))
    records = []
    for number, (kind, key, seed) in enumerate(runs, 1):
        print(f"[{number}/{len(runs)}] {name_of(settings, kind, key, seed)}", flush=True)
        records.append(train_run(settings, corpus, kind, key, seed, progress))
    return records
