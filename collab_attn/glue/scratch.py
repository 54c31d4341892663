"""Training from scratch on a GLUE classification task: is collaborative attention a drop-in replacement for
concatenated heads?

``run_sweep`` trains ``ScratchForSequenceClassification`` (``collab_attn.models.scratch_classifier``) for every
(attention, rank, seed) with one recipe through ``collab_attn.training.train`` (Hugging Face ``Trainer``: AdamW,
linear warmup then linear decay, gradient clipping; the dev split is evaluated every ``eval_steps`` and at the start and
end, and the learning curve is read from the Trainer's log history). Each run writes one JSON (atomically) when it has
finished and is skipped when that file exists; with ``checkpoint_every`` an interrupted run continues from its last
checkpoint. ``write_summary`` turns the runs into ``results.md`` and ``curves.png``. The Hydra entry point is
``scripts/train_scratch.py`` (settings: ``configs/scratch.yaml``).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import transformers
from huggingface_hub.errors import StrictDataclassError

from collab_attn import cli, run_store
from collab_attn.files import replacing, write_text_atomic
from collab_attn.models.scratch_classifier import ATTENTION_KINDS, ScratchConfig, ScratchForSequenceClassification
from collab_attn.run_store import RunStore, mean_curve, mean_std, ranks_for
from collab_attn.training import train, training_args

MODEL_SETTINGS = ("d_model", "num_layers", "num_heads", "ffn_dim", "dropout", "pooling", "mixing_init")
RESULT_VERSION = 2  # bump when a run's result JSON changes meaning (2: trained by the Trainer)


def load_task(
    task: str,
    glue_dir: str | Path | None,
    tokenizer,
    max_length: int,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
) -> tuple[list[dict], list[dict]]:
    """Train and dev examples of a GLUE classification task (first ``max_*_samples`` rows if given), tokenized
    without padding: one ``{"input_ids", "attention_mask", "labels"}`` dict each (no token type ids: the model
    has no segment embeddings)."""
    from collab_attn.glue.tasks import load_glue, tokenize_glue

    info = _classification_task(task)
    dev_split = info.eval_splits[0]
    raw = load_glue(info, glue_dir, splits=("train", dev_split))
    for split, limit in (("train", max_train_samples), (dev_split, max_eval_samples)):
        if limit is not None:
            raw[split] = raw[split].select(range(min(limit, len(raw[split]))))
    data = tokenize_glue(raw, tokenizer, info, max_length)
    return tuple(
        [{"input_ids": i, "attention_mask": m, "labels": y} for i, m, y in
         zip(data[split]["input_ids"], data[split]["attention_mask"], data[split]["labels"])]
        for split in ("train", dev_split)
    )


def _classification_task(task: str):
    from collab_attn.glue.tasks import get_task

    info = get_task(task)
    if info.is_regression:
        raise ValueError(f"GLUE task {info.name!r} is a regression task; training from scratch supports "
                         "classification tasks only")
    return info


def accuracy(eval_prediction) -> dict[str, float]:
    """``compute_metrics`` for the Trainer: the share of argmax predictions equal to the labels."""
    logits, labels = eval_prediction[0], eval_prediction[1]
    return {"accuracy": float(np.mean(np.asarray(logits).argmax(-1) == np.asarray(labels)))}


def trainer_fields(settings: dict, progress: bool = True) -> dict:
    """TrainingArguments fields of every run: ``settings["train"]`` plus evaluation every ``eval_steps`` (and at
    step 0), train loss logged as often. Raises ``ValueError`` on anything TrainingArguments refuses."""
    train_settings = dict(settings["train"])
    steps, every = train_settings.get("max_steps"), train_settings.get("eval_steps")
    if not isinstance(steps, int) or steps <= 0:
        raise ValueError(f"train.max_steps must be a positive number of optimizer steps, got {steps!r}")
    if not isinstance(every, int) or every <= 0:
        raise ValueError(f"train.eval_steps must be a positive number of steps between evaluations, got {every!r}")
    fields = {
        "logging_steps": every, **train_settings, "eval_strategy": "steps", "eval_on_start": True,
        "disable_tqdm": not progress,
    }
    try:
        training_args(Path(settings["output_dir"]) / ".checkpoints", 0, fields, settings.get("checkpoint_every"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"bad train settings: {err}") from err
    return fields


def model_config(settings: dict, vocab_size: int, num_labels: int, kind: str, rank: int,
                 pad_token_id: int = 0) -> ScratchConfig:
    """The classifier of one run; bad sizes raise ``ValueError``."""
    unknown = sorted(set(settings["model"]) - set(MODEL_SETTINGS))
    if unknown:
        raise ValueError(f"unknown model settings {unknown}; choose from {MODEL_SETTINGS}")
    try:
        return ScratchConfig(
            vocab_size=vocab_size, num_labels=num_labels, max_length=settings["max_length"], attention=kind,
            rank=rank, pad_token_id=pad_token_id, **settings["model"],
        )
    except StrictDataclassError as err:
        raise ValueError(str(err.__cause__ or err)) from err


def learning_curve(history: Sequence[dict]) -> list[dict]:
    """One point per evaluation: step, dev accuracy and loss, and the train loss, learning rate and gradient norm
    logged at that step (``collab_attn.run_store.learning_curve``)."""
    return run_store.learning_curve(history, {"eval_accuracy": "dev_accuracy", "eval_loss": "dev_loss"},
                                    ("loss", "learning_rate", "grad_norm"))


# ---------------------------------------------------------------------------------------------------
# Sweep: every (attention, rank, seed), one result JSON each, then results.md and curves.png


def run_name(kind: str, rank: int, seed: int) -> str:
    return f"{kind}-k{rank}-seed{seed}"


def run_signature(settings: dict) -> dict:
    """What must agree for a stored run to be reused: everything that changes a run except its kind, rank
    and seed (not the output folder, checkpointing, thread count or progress bar)."""
    return {
        "version": RESULT_VERSION,
        **{key: settings.get(key) for key in ("task", "tokenizer", "max_length", "max_train_samples",
                                              "max_eval_samples")},
        "model": dict(settings["model"]),
        "train": dict(settings["train"]),
    }


class Sweep(NamedTuple):
    task: Any  # collab_attn.glue.tasks.GlueTask
    fields: dict  # TrainingArguments fields of every run
    plan: list[tuple[str, int, int]]  # (attention, rank, seed), seed by seed
    records: dict[str, dict]  # the runs already done, by name


def check(settings: dict, progress: bool = True) -> Sweep:
    """Every setting, the task's data files, every configuration of the sweep and the runs already stored for it,
    before anything is written (``scripts/train_scratch.py``'s check): a bad rank fails now, not an hour in. The
    deprecated ``key_sizes`` is taken as ``ranks`` (``cli.renamed``), in place."""
    from collab_attn.glue.pipeline import check_glue_files
    from collab_attn.models.checkpoints import resolve_model

    cli.renamed(settings, "key_sizes", "ranks")
    with cli.naming("task", settings["task"]):
        task = _classification_task(settings["task"])
    if settings.get("glue_dir") is not None:
        check_glue_files("glue_dir", task, settings["glue_dir"], ("train", task.eval_splits[0]))
    with cli.naming("tokenizer", settings["tokenizer"]):
        resolve_model(settings["tokenizer"])
    cli.positive_int("max_length", settings["max_length"])
    for key in ("max_train_samples", "max_eval_samples", "threads", "checkpoint_every"):
        cli.positive_int(key, settings.get(key), nullable=True)
    model = settings["model"]
    for key in ("d_model", "num_layers", "num_heads", "ffn_dim"):
        if key in model:
            cli.positive_int(f"model.{key}", model[key])
    cli.number("model.dropout", model.get("dropout", 0.0), 0, 1, below=True)
    kinds = [cli.choice("kinds", kind, ATTENTION_KINDS) for kind in cli.nonempty_list("kinds", settings["kinds"])]
    seeds = [cli.integer("seeds", seed, 0) for seed in cli.nonempty_list("seeds", settings["seeds"])]
    keys = ranks_for(model["d_model"], settings.get("ranks"))
    cli.trainer_fields("train", settings["train"])
    fields = trainer_fields(settings, progress)
    for kind in kinds:
        for key in keys:
            model_config(settings, 1, task.num_labels, kind, key)
    cli.output_dir("output_dir", settings["output_dir"], files=("results.md", "curves.png"))
    store = RunStore(settings["output_dir"], run_signature(settings))
    plan = [(kind, key, seed) for seed in seeds for key in keys for kind in kinds]
    records = {}
    for name in (run_name(*p) for p in plan):
        record = store.finished(name)
        if record is not None:
            records[name] = record
    return Sweep(task, fields, plan, records)


def run_sweep(settings: dict, progress: bool = True) -> list[dict]:
    """Train every configuration in ``settings`` (the resolved ``configs/scratch.yaml``) that has no result yet.

    Runs go seed by seed (all configurations of seed 0 first), each into ``<output_dir>/runs/<name>.json``
    written atomically; a run whose file exists is skipped after checking it was made with the same settings.
    With ``checkpoint_every``, a run saves a checkpoint in ``<output_dir>/.checkpoints/<name>`` that often and an
    interrupted run continues from it. Writes ``results.md`` and ``curves.png`` at the end and returns every run's
    record. Everything is checked (``check``) before the first folder is made.
    """
    from transformers import AutoTokenizer, DataCollatorWithPadding

    from collab_attn.models.checkpoints import resolve_model

    task, fields, plan, records = check(settings, progress)
    if settings.get("threads"):
        torch.set_num_threads(int(settings["threads"]))
        os.environ.setdefault("RAYON_NUM_THREADS", str(settings["threads"]))  # the Rust tokenizer's thread pool

    out = Path(settings["output_dir"])
    store = RunStore(out, run_signature(settings))
    store.folder.mkdir(parents=True, exist_ok=True)
    pending = [p for p in plan if run_name(*p) not in records]
    print(f"{len(plan) - len(pending)} of {len(plan)} runs already done in {store.folder}; {len(pending)} to go")

    if pending:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(settings["tokenizer"]))
        train_data, dev_data = load_task(
            task.name, settings.get("glue_dir"), tokenizer, settings["max_length"],
            settings.get("max_train_samples"), settings.get("max_eval_samples"),
        )
        dev_labels = np.array([example["labels"] for example in dev_data])
        majority = float(np.bincount(dev_labels).max() / len(dev_labels))
        collator = DataCollatorWithPadding(tokenizer)
        for number, (kind, key, seed) in enumerate(pending, 1):
            name = run_name(kind, key, seed)
            print(f"[{number}/{len(pending)}] {name}", flush=True)
            config = model_config(settings, len(tokenizer), task.num_labels, kind, key, tokenizer.pad_token_id or 0)
            transformers.set_seed(seed)
            model = ScratchForSequenceClassification(config)
            run = train(
                model, train_data, collator, fields, seed, store.checkpoints(name),
                settings.get("checkpoint_every"), eval_dataset=dev_data, compute_metrics=accuracy,
            )
            curve = learning_curve(run.history)
            eval_seconds = sum(entry.get("eval_runtime", 0.0) for entry in run.history)
            record = {
                "name": name,
                "attention": kind,
                "rank": key,
                "seed": seed,
                "task": task.name,
                "signature": store.signature,
                "parameters": model.parameter_counts(),
                "majority_baseline": majority,
                "threads": torch.get_num_threads(),
                "curve": curve,
                "dev_accuracy": curve[-1]["dev_accuracy"],
                "dev_loss": curve[-1]["dev_loss"],
                "train_seconds": run.seconds - eval_seconds,  # training alone: evaluations left out
                "resumed_seconds": run.resumed_seconds,
            }
            store.save(name, record)
            records[name] = record
            print(f"{name}: dev accuracy {record['dev_accuracy']:.4f}, {record['train_seconds']:.0f} s", flush=True)

        with contextlib.suppress(OSError):  # every run's checkpoints are gone once it has finished
            (out / ".checkpoints").rmdir()

    ordered = [records[run_name(*p)] for p in plan]
    write_summary(ordered, out)
    return ordered


def summary_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (attention, rank): parameter counts and final dev metrics, mean and std over seeds."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["attention"], record["rank"]), []).append(record)
    rows = []
    for (kind, key), runs in sorted(groups.items(), key=lambda item: (-item[0][1], ATTENTION_KINDS.index(item[0][0]))):
        accuracy, accuracy_std = mean_std([r["dev_accuracy"] for r in runs])
        loss, loss_std = mean_std([r["dev_loss"] for r in runs])
        rows.append({
            "attention": kind,
            "rank": key,
            "query_key_params": runs[0]["parameters"]["query_key_per_layer"],
            "total_params": runs[0]["parameters"]["total"],
            "dev_accuracy": accuracy,
            "dev_accuracy_std": accuracy_std,
            "dev_loss": loss,
            "dev_loss_std": loss_std,
            "seeds": sorted(r["seed"] for r in runs),
            "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),
        })
    return rows


def results_markdown(records: Sequence[dict]) -> str:
    rows = summary_rows(records)
    first = records[0]
    sig = first["signature"]
    lines = [
        f"# Training from scratch on {first['task']}: concatenated vs collaborative heads",
        "",
        f"Model: {sig['model']}; max length {sig['max_length']}; training: {sig['train']}.",
        f"Dev majority-class baseline: {100 * first['majority_baseline']:.1f}%.",
        "",
        "| attention | key size D_k | q/k params per layer | total params | final dev accuracy (%) | final dev loss "
        "| seeds | train s (mean) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['attention']} | {row['rank']} | {row['query_key_params']:,} | {row['total_params']:,} "
            f"| {100 * row['dev_accuracy']:.2f} ± {100 * row['dev_accuracy_std']:.2f} "
            f"| {row['dev_loss']:.3f} ± {row['dev_loss_std']:.3f} | {','.join(map(str, row['seeds']))} "
            f"| {row['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _curves_by_config(records: Sequence[dict]) -> dict[tuple[str, int], tuple[list[int], list[float], list[float]]]:
    """Per (attention, rank): steps, mean and std over seeds of the dev accuracy (steps all runs share)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["attention"], record["rank"]), []).append(record)
    return {config: mean_curve(runs, "dev_accuracy") for config, runs in groups.items()}


def plot_curves(records: Sequence[dict], path: str | Path) -> Path:
    """Left: dev accuracy against step, mean over seeds (band: ± std), colour = rank, solid = concatenated,
    dashed = collaborative. Right: final dev accuracy against rank, mean ± std."""
    from matplotlib.figure import Figure

    curves = _curves_by_config(records)
    keys = sorted({k for _, k in curves}, reverse=True)
    colours = {k: f"C{i}" for i, k in enumerate(keys)}
    styles = {"concat": "-", "collab": "--"}
    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    for (kind, key), (steps, mean, std) in sorted(curves.items(), key=lambda item: (-item[0][1], item[0][0])):
        mean_pc = [100 * m for m in mean]
        left.plot(steps, mean_pc, styles[kind], color=colours[key], label=f"{kind} D_k={key}")
        left.fill_between(steps, [m - 100 * s for m, s in zip(mean_pc, std)],
                          [m + 100 * s for m, s in zip(mean_pc, std)], color=colours[key], alpha=0.08)
    majority = 100 * records[0]["majority_baseline"]
    for ax in (left, right):
        ax.axhline(majority, color="grey", lw=0.8, ls=":", label="majority class")
        ax.grid(alpha=0.3)
    left.set_xlabel("training step")
    left.set_ylabel("dev accuracy (%)")
    left.set_title(f"{records[0]['task']}: dev accuracy, mean over seeds")
    left.legend(fontsize=7, ncol=2)
    for kind in ATTENTION_KINDS:
        rows = [r for r in summary_rows(records) if r["attention"] == kind]
        if rows:
            right.errorbar([r["rank"] for r in rows], [100 * r["dev_accuracy"] for r in rows],
                           yerr=[100 * r["dev_accuracy_std"] for r in rows], fmt="o" + styles[kind], capsize=3,
                           label=kind)
    right.set_xscale("log", base=2)
    right.set_xticks(keys, [str(k) for k in keys])
    right.set_xlabel("key/query size D_k")
    right.set_ylabel("final dev accuracy (%)")
    right.set_title("final dev accuracy, mean ± std over seeds")
    right.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def write_summary(records: Sequence[dict], out_dir: str | Path) -> dict[str, Path]:
    """``results.md`` and ``curves.png`` for the given runs, each written atomically into ``out_dir``."""
    out = Path(out_dir)
    md = write_text_atomic(out / "results.md", results_markdown(records))
    with replacing(out / "curves.png") as tmp:
        plot_curves(records, tmp)
    return {"results": md, "curves": out / "curves.png"}


__all__ = [
    "accuracy",
    "learning_curve",
    "load_task",
    "model_config",
    "run_sweep",
    "summary_rows",
    "trainer_fields",
    "write_summary",
]
