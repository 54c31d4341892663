"""The GLUE pipeline as plain functions: fine-tune -> evaluate -> reparametrize -> evaluate -> re-fine-tune ->
evaluate. Hydra lives in ``scripts/train_glue.py``; everything here takes the resolved config as a plain dict.

A job is one (task, model, collab method, rank, seed, recipe). Its results are one JSON line per stage in
``<output_root>/runs/<task>/<model>/<method>-r<rank>/seed<seed>-<recipe hash>/results.jsonl``, written only
when every stage has finished, so a job with results is done and an interrupted job leaves no results. The
fine-tuned model is cached in ``<output_root>/finetuned/...`` and shared by every rank of a sweep. Training saves a
resumable checkpoint every ``checkpoint_every`` steps (beside the cached model while fine-tuning, in the job's
``.checkpoints`` while re-fine-tuning), so running an interrupted job again continues its training where it stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

import torch
import transformers
from transformers import AutoConfig, AutoModel, AutoModelForSequenceClassification, AutoTokenizer

from collab_attn.decomposition.decompose import METHODS
from collab_attn.decomposition.rank_selection import RankBudget
from collab_attn.files import exclusive_lock, write_text_atomic
from collab_attn.glue import tasks as glue
from collab_attn.glue.tracking import make_tracker
from collab_attn.models.baselines import BASELINES, check_rank, head_importance, prune_heads, truncate_heads
from collab_attn.models.calibration import calibration_from_texts
from collab_attn.models.checkpoints import resolve_model
from collab_attn.models.conversion import ReparamReport, per_layer_ranks, reparametrize
from collab_attn.models.hf import CollaborativeSelfAttention, attention_modules, family_of
from collab_attn.training import train, training_args

log = logging.getLogger(__name__)

STAGES = ("finetuned", "reparam", "refit")
RESULTS_FILE = "results.jsonl"
_QUERY_KEY_PARTS = ("query", "key", "mixing", "mixing_core", "content_bias")


# TrainingArguments fields that change what is logged, not what is learned: left out of the recipe hashes.
_LOGGING_ONLY = {"logging_steps", "logging_strategy", "disable_tqdm", "per_device_eval_batch_size", "report_to"}


def _recipe(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _LOGGING_ONLY}


def _digest(payload) -> str:
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]


def model_slug(name: str) -> str:
    """A short, path-safe name for a model: ``minilm``, ``bert-base-uncased``, ``org--name``, a directory's name."""
    path = Path(name)
    return path.name if path.is_dir() else name.replace("/", "--")


def random_weights(settings: dict) -> bool:
    """``weights=random``: the checkpoint's architecture with fresh weights, a control for what pretraining brings."""
    return settings.get("weights", "pretrained") == "random"


def _weights_suffix(settings: dict) -> str:
    return "-random-init" if random_weights(settings) else ""


def model_label(settings: dict) -> str:
    """The model as paths name it: its slug, with ``-random-init`` for ``weights=random``."""
    return model_slug(settings["model"]) + _weights_suffix(settings)


def _with_weights(recipe: dict, settings: dict) -> dict:
    """``recipe`` plus the weights setting where it is not the default, so pretrained jobs keep their hashes."""
    return {**recipe, "weights": "random"} if random_weights(settings) else recipe


def rank_tag(rank) -> str:
    return "-".join(map(str, rank)) if isinstance(rank, list) else str(rank)


def method_label(collab: dict) -> str:
    """The method as results and tables name it: ``cp``, ``tucker`` or ``none``, then ``-tensorly`` for the
    paper's dense solver and ``-aware`` for activation-aware fitting."""
    label = collab["method"]
    if label != "none":
        label += "-tensorly" if collab.get("solver", "implicit") == "tensorly" else ""
        label += "-aware" if collab.get("calibration") else ""
    return label


def collab_rank(collab: dict):
    """What the job asks ``reparametrize`` for: the budget string when one is set, else the rank(s)."""
    return collab["budget"] if collab.get("budget") else collab.get("rank")


def job_name(settings: dict) -> str:
    collab = settings["collab"]
    method = method_label(collab)
    if method != "none":
        method += f"-r{rank_tag(collab_rank(collab)).replace(':', '')}"
    task = glue.get_task(settings["task"]["name"]).name
    return f"{task}/{model_label(settings)}/{method}/seed{settings['seed']}"


def job_dir(settings: dict) -> Path:
    """Where a job's results go; the recipe hash keeps runs with different settings apart."""
    recipe = {k: settings[k] for k in ("model", "task", "collab", "finetune")}
    recipe.update(trainer=_recipe(settings["trainer"]), refit=_recipe(settings["refit"]))
    recipe["data"] = {k: v for k, v in settings["data"].items() if k != "glue_dir"}
    return Path(settings["output_root"]) / "runs" / f"{job_name(settings)}-{_digest(_with_weights(recipe, settings))}"


def finetuned_dir(settings: dict) -> Path:
    recipe = {
        "model": settings["model"],
        "trainer": _recipe(settings["trainer"]),
        "max_seq_length": settings["data"]["max_seq_length"],
        "max_train_samples": settings["data"]["max_train_samples"],
    }
    task = glue.get_task(settings["task"]["name"]).name
    return (
        Path(settings["output_root"]) / "finetuned" / task / model_label(settings)
        / f"seed{settings['seed']}-{_digest(_with_weights(recipe, settings))}"
    )


def checkpoints_dir(settings: dict, stage: str) -> Path:
    """Where training saves its resumable checkpoints: beside the cached model while fine-tuning (``finetuned``),
    in the job's folder while re-fine-tuning (``refit``)."""
    if stage == "finetuned":
        target = finetuned_dir(settings)
        return target.with_name(f"{target.name}.checkpoints")
    return job_dir(settings) / ".checkpoints"


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def attention_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Parameters of the self-attention modules (all of them, and the query/key part), plain or collaborative."""
    collaborative = [m for m in model.modules() if isinstance(m, CollaborativeSelfAttention)]
    if collaborative:
        counts = [layer.parameter_counts() for layer in collaborative]
        return {
            "attention_params": sum(c["total"] for c in counts),
            "query_key_params": sum(c.get(part, 0) for c in counts for part in _QUERY_KEY_PARTS),
        }
    family = family_of(model.config)
    layers = [module for _, module in attention_modules(model, family)]
    return {
        "attention_params": sum(p.numel() for layer in layers for p in layer.parameters()),
        "query_key_params": sum(
            p.numel() for layer in layers for name in (family.query, family.key)
            for p in getattr(layer, name).parameters()
        ),
    }


def validate(settings: dict) -> tuple[glue.GlueTask, str]:
    """Check everything that can be checked before any training; returns the task and the model path."""
    task = glue.get_task(settings["task"]["name"])
    path = resolve_model(settings["model"])
    config = AutoConfig.from_pretrained(path)
    family = family_of(config)
    weights = settings.get("weights", "pretrained")
    if weights not in ("pretrained", "random"):
        raise ValueError(f"weights={weights!r}: choose 'pretrained' (the checkpoint) or 'random' (its architecture, "
                         "freshly initialized)")
    every = settings["checkpoint_every"]
    if every is not None and not (type(every) is int and every > 0):
        raise ValueError(f"checkpoint_every must be a positive number of training steps or null, got {every!r}")
    if random_weights(settings) and not settings["finetune"]:
        raise ValueError("weights=random needs finetune=true: a freshly initialized model has to be trained first")
    collab = settings["collab"]
    if collab["method"] not in ("none", *METHODS, *BASELINES):
        raise ValueError(f"unknown collab.method {collab['method']!r}; choose one of {('none', *METHODS, *BASELINES)}")
    if collab["method"] != "none":
        with torch.device("meta"):
            skeleton = AutoModel.from_config(config)
        found = attention_modules(skeleton, family)
        heads, head_dim = family.num_heads(found[0][1]), found[0][1].attention_head_size
        full_rank = heads * head_dim
        if collab["method"] in BASELINES:
            if collab.get("budget"):
                raise ValueError(f"collab.budget does not apply to collab.method={collab['method']}; set collab.rank")
            check_rank(collab["method"], collab["rank"], len(found), heads, head_dim)
            samples = collab.get("importance_samples", 256)
            if collab["method"] == "prune" and not (type(samples) is int and samples > 0):
                raise ValueError(f"collab.importance_samples must be a positive integer, got {samples!r}")
        elif collab.get("budget"):
            RankBudget.parse(collab["budget"])
        else:
            per_layer_ranks(collab["rank"], len(found), full_rank)
        source = collab.get("calibration")
        if source and source != "task" and not Path(source).is_file():
            raise FileNotFoundError(
                f"collab.calibration={source}: no such file; use 'task' (the task's training texts), a text file "
                "(one text per line) or a GLUE train.tsv/dev.tsv"
            )
    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    for group in ("trainer", "refit"):
        unknown = sorted(set(settings[group]) - fields - {"enabled"})
        if unknown:
            raise ValueError(f"{group}.{unknown[0]} is not a transformers.TrainingArguments field; remove or rename it")
    glue_dir = settings["data"]["glue_dir"]
    if glue_dir is not None and not Path(glue_dir).is_dir():
        raise FileNotFoundError(
            f"data.glue_dir={glue_dir} does not exist (relative to {os.getcwd()}); point it at the folder that "
            "holds CoLA/, SST-2/, ... or set data.glue_dir=null to load nyu-mll/glue from the Hub"
        )
    return task, path


def load_data(task: glue.GlueTask, data_cfg: dict, tokenizer):
    """The task's splits, optionally truncated (``max_train_samples``, ``max_eval_samples``), tokenized."""
    raw = glue.load_glue(task, data_cfg["glue_dir"])
    for split in raw:
        limit = data_cfg["max_train_samples"] if split == "train" else data_cfg["max_eval_samples"]
        if limit is not None and len(raw[split]) > limit:
            raw[split] = raw[split].select(range(limit))
    return glue.tokenize_glue(raw, tokenizer, task, data_cfg["max_seq_length"])


@torch.no_grad()
def evaluate(
    model, data, tokenizer, task: glue.GlueTask, batch_size: int, scratch: Path, splits=None
) -> dict[str, float]:
    """GLUE metrics on ``splits`` (default: every evaluation split); splits after the first are prefixed (MNLI
    mismatched)."""
    args = training_args(scratch, 0, {"per_device_eval_batch_size": batch_size})
    collator = transformers.DataCollatorWithPadding(tokenizer)
    trainer = transformers.Trainer(model=model, args=args, data_collator=collator)
    metrics = {}
    for i, split in enumerate(splits or task.eval_splits):
        prediction = trainer.predict(data[split], metric_key_prefix=split)
        values = glue.glue_metrics(task, prediction.predictions, prediction.label_ids)
        prefix = "" if i == 0 else split.removeprefix("validation_") + "_"
        metrics.update({prefix + k: v for k, v in values.items()})
    shutil.rmtree(scratch, ignore_errors=True)
    return metrics


def finetuned_checkpoint(settings, task, path, data, tokenizer) -> tuple[Path, float]:
    """Fine-tune ``path`` on the task once per (model, task, seed, recipe) and cache it; reuse it afterwards. Jobs
    that need the same fine-tuned model at once (a parallel sweep) take turns: the first trains, the others wait
    for it and reuse its model. Returns the model's folder and the training seconds of interrupted earlier runs
    that this call resumed (0 when none)."""
    if not settings["finetune"]:
        return Path(path), 0.0
    target = finetuned_dir(settings)
    with exclusive_lock(target.with_name(f"{target.name}.lock")):
        if (target / "config.json").is_file():
            log.info("reusing the fine-tuned model in %s", target)
            return target, 0.0
        transformers.set_seed(settings["seed"])
        labels = {"id2label": dict(enumerate(task.label_names))} if task.label_names else {}
        if random_weights(settings):
            config = AutoConfig.from_pretrained(path, num_labels=task.num_labels, **labels)
            model = AutoModelForSequenceClassification.from_config(config)
        else:
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=task.num_labels, **labels)
        run = train(
            model, data["train"], transformers.DataCollatorWithPadding(tokenizer), settings["trainer"],
            settings["seed"], checkpoints_dir(settings, "finetuned"), settings["checkpoint_every"],
        )
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "finetune.json").write_text(json.dumps({"seconds": run.seconds, "settings": settings}, indent=2))
        tmp.rename(target)
    return target, run.resumed_seconds


def finetuned_metrics(settings: dict, checkpoint: Path, evaluate_fn) -> dict[str, float]:
    """The fine-tuned model's metrics, evaluated once per evaluation setting and cached beside the cached model,
    since every rank and method of a sweep starts from it. A model given ready fine-tuned (``finetune=false``) is
    not ours to write into: it is evaluated every time."""
    if not settings["finetune"]:
        return evaluate_fn()
    data = {k: v for k, v in settings["data"].items() if k != "glue_dir"}
    cache = checkpoint / f"eval-{_digest(data)}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    metrics = evaluate_fn()
    write_text_atomic(cache, json.dumps(metrics))
    return metrics


def stage_record(settings, task, stage, metrics, model, report: ReparamReport | None, seconds) -> dict:
    collab = settings["collab"]
    return {
        "stage": stage,
        "task": task.name,
        "model": settings["model"] + _weights_suffix(settings),
        "method": method_label(collab),
        "rank": _record_rank(collab, report),
        "budget": collab.get("budget"),
        "seed": settings["seed"],
        **metrics,
        "main_metric": task.main_metric,
        "model_params": sum(p.numel() for p in model.parameters()),
        **attention_parameters(model),
        "decomposition_seconds": report.seconds if report else None,
        "mean_relative_error": report.mean_relative_error if report else None,
        "seconds": seconds,
    }


def _record_rank(collab: dict, report: ReparamReport | None):
    """The rank the table shows: the configured one, or the per-layer ranks a budget chose."""
    if collab["method"] == "none":
        return None
    if collab.get("budget") and report is not None:
        return [layer.rank for layer in report.layers]
    return collab_rank(collab)


def calibrate(model, tokenizer, collab: dict, task: glue.GlueTask, glue_dir, seed: int):
    """Input statistics for activation-aware fitting (``collab.calibration``), or None when it is off or when every
    layer keeps its full key/query size (an exact conversion has nothing to fit)."""
    source, limit = collab.get("calibration"), collab.get("calibration_samples", 512)
    if not source or _keeps_full_size(collab_rank(collab), model.config.hidden_size):
        return None
    if source == "task":
        texts = glue.task_texts(task, glue_dir, "train", limit=limit, seed=seed)
    else:
        texts = glue.load_texts(source, limit=limit, seed=seed)
    return calibration_from_texts(model, tokenizer, texts, max_length=collab.get("calibration_max_length", 128))


def _keeps_full_size(rank, width: int) -> bool:
    ranks = rank if isinstance(rank, (list, tuple)) else [rank]
    return all(isinstance(r, int) and r == width for r in ranks)


def reparametrize_stage(model, tokenizer, data, task: glue.GlueTask, settings: dict) -> ReparamReport:
    """The ``reparam`` stage, in place: collaborative heads (``cp``, ``tucker``) or a baseline at the same
    key/query size (``svd``: SVD-truncated heads; ``prune``: head pruning by importance on the training split)."""
    collab, seed = settings["collab"], settings["seed"]
    if collab["method"] == "svd":
        return truncate_heads(model, collab["rank"])
    if collab["method"] == "prune":
        importance = head_importance(
            model, data["train"], transformers.DataCollatorWithPadding(tokenizer),
            samples=collab.get("importance_samples", 256), batch_size=collab.get("importance_batch_size", 32),
            seed=seed,
        )
        return prune_heads(model, collab["rank"], importance)
    calibration = calibrate(model, tokenizer, collab, task, settings["data"]["glue_dir"], seed)
    solver_keys = ("solver", "init", "n_iter_max", "tol", "tucker_core_size")
    options = {k: collab[k] for k in solver_keys if k in collab}
    return reparametrize(model, collab_rank(collab), collab["method"], seed, calibration=calibration, **options)


def _summary_line(name: str, record: dict) -> str:
    metrics = ", ".join(
        f"{k}={record[k]:.4f}" for k in ("matthews_correlation", "accuracy", "f1", "pearson", "spearmanr")
        if k in record
    )
    return (
        f"[{name}] {record['stage']:>9}: {metrics} (main {record['main_metric']} {record['main']:.4f}); "
        f"q/k params {record['query_key_params']:,}; {record['seconds']:.0f} s"
    )


def run_job(settings: dict) -> list[dict]:
    """Run (or skip, if its results exist) one job; returns its result records."""
    name, out = job_name(settings), job_dir(settings)
    if (out / RESULTS_FILE).is_file():
        print(f"[{name}] results exist in {out}; skipping")
        return read_results(out / RESULTS_FILE)
    task, path = validate(settings)
    out.mkdir(parents=True, exist_ok=True)
    scratch = out / f".scratch-{os.getpid()}"
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = load_data(task, settings["data"], tokenizer)
    tracker = make_tracker(settings["logger"], name, settings["sweep_name"], settings, out)
    eval_batch = settings["trainer"].get("per_device_eval_batch_size", 64)
    records, summary = [], {}
    try:
        start = time.perf_counter()
        checkpoint, resumed = finetuned_checkpoint(settings, task, path, data, tokenizer)
        model = AutoModelForSequenceClassification.from_pretrained(checkpoint)
        stages = ["finetuned"]
        if settings["collab"]["method"] != "none":
            stages += ["reparam", "refit"] if settings["refit"]["enabled"] else ["reparam"]
        report, history = None, []
        evaluate_model = functools.partial(evaluate, model, data, tokenizer, task, eval_batch, scratch / "eval")
        for stage in stages:
            if stage == "reparam":
                report = reparametrize_stage(model, tokenizer, data, task, settings)
            elif stage == "refit":
                refit = {**settings["trainer"], **settings["refit"]}
                run = train(
                    model, data["train"], transformers.DataCollatorWithPadding(tokenizer), refit, settings["seed"],
                    checkpoints_dir(settings, stage), settings["checkpoint_every"],
                )
                history, resumed = run.history, run.resumed_seconds
            metrics = (
                finetuned_metrics(settings, checkpoint, evaluate_model) if stage == "finetuned" else evaluate_model()
            )
            # a stage that resumed interrupted training also counts the time of the runs before it
            record = stage_record(settings, task, stage, metrics, model, report, time.perf_counter() - start + resumed)
            start, resumed = time.perf_counter(), 0.0
            records.append(record)
            tracker.log_stage(record, history)
            print(_summary_line(name, record))
            summary.update({f"{stage}/main": record["main"], "query_key_params": record["query_key_params"]})
        write_text_atomic(out / RESULTS_FILE, "".join(json.dumps(r) + "\n" for r in records))
        compression = records[-1]["query_key_params"] / records[0]["query_key_params"]
        summary.update(rank=records[-1]["rank"], query_key_compression=compression)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        tracker.finish(summary)
    return records
