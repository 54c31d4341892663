"""The GLUE pipeline as plain functions: fine-tune -> evaluate -> reparametrize -> evaluate -> re-fine-tune ->
evaluate. Hydra lives in ``scripts/train_glue.py``: ``validate`` reads each job's resolved settings into a
``GlueJob`` (``collab_attn.glue.jobs``: frozen, typed) and checks the files they name; ``run_job`` takes the job
and hands it to each stage.

A job is one (task, model, collab method, rank, seed, recipe), identified by its ``JobKey``. Its results are one
record per stage in the sweep's run store (``collab_attn.run_store``, staged):
``<output_root>/runs/<task>/<model>/<method>-r<rank>/seed<seed>-<key digest>/results.jsonl`` (or the folder
``runs/index.json`` gives a job finished before job keys), written only when every stage has finished, so a job
with results is done and an interrupted job leaves no results. The fine-tuned model is cached in
``<output_root>/finetuned/...`` and shared by every rank of a sweep. The stages are functions
(``finetuned_checkpoint``, ``reparametrize_stage``, ``refit_stage``) that ``run_job`` calls in turn, each given the
job. Training saves a resumable checkpoint every ``checkpoint_every`` steps (beside the cached model while
fine-tuning, in the job's ``.checkpoints`` while re-fine-tuning), so running an interrupted job again continues its
training where it stopped.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import transformers
from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

from collab_attn import cli, distributed
from collab_attn.distillation import DistillationTrainer, load_teacher
from collab_attn.files import write_text_atomic
from collab_attn.glue import tasks as glue
from collab_attn.glue.calibrate import calibrate, check_calibration
from collab_attn.glue.jobs import DataSettings, GlueJob, digest
from collab_attn.models.checkpoints import checked_model
from collab_attn.models.conversion import ReparamReport, reparametrize
from collab_attn.models.hf import attention_parameters
from collab_attn.models.importance import head_importance
from collab_attn.tracking import NoTracker, make_tracker
from collab_attn.training import train, training_args

log = logging.getLogger(__name__)


def refit_trainer(job: GlueJob, teacher_path: Path, report: ReparamReport | None) -> dict:
    """``train``'s extra arguments for the re-fine-tuning: none for plain re-fine-tuning (cross-entropy, or MSE for
    STS-B); with ``refit.distill`` the distillation trainer, its teacher (the job's fine-tuned model) and, for a
    pruned student, the teacher heads each layer kept."""
    distill = job.distill
    if distill is None:
        return {}
    return {
        "trainer_class": DistillationTrainer,
        "teacher": load_teacher(teacher_path, attention_maps=bool(distill.attention_weight)),
        "distill": distill,
        "regression": job.task.is_regression,
        "teacher_heads": report.pruning.kept_heads if report and report.pruning else None,
    }


def checkpoints_dir(job: GlueJob, stage: str) -> Path:
    """Where training saves its resumable checkpoints: beside the cached model while fine-tuning (``finetuned``),
    in the job's folder while re-fine-tuning (``refit``)."""
    if stage == "finetuned":
        target = job.finetuned_dir
        return target.with_name(f"{target.name}.checkpoints")
    return job.store.checkpoints(job.stored_name)


def validate(settings: dict) -> GlueJob:
    """Check everything that can be checked before anything is written or trained (``scripts/train_glue.py``'s
    check, run on every job of a sweep before the first starts): the settings' values, read into the job, then
    the files they name (``check_inputs``). Returns the job."""
    job = GlueJob.of(settings)
    check_inputs(job)
    return job


def check_inputs(job: GlueJob) -> str:
    """The files and folders a job names, checked before any work: the model (a supported family the method can
    convert at the rank asked for), the calibration texts, the GLUE files, the output folder. Returns the folder
    (or Hub id) to load the model from."""
    path, config = checked_model(job.model)
    job.method.check_model(config)
    check_calibration(job.method, task_allowed=True)
    if job.data.glue_dir is not None:
        check_glue_files("data.glue_dir", job.task, job.data.glue_dir)
    cli.output_dir("output_root", job.output_root)
    return path


def check_glue_files(argument: str, task: glue.GlueTask, glue_dir, splits=None, hub: bool = True) -> None:
    """The folder ``glue_dir`` (the setting ``argument``; ``hub``: null would load the Hub copy) holds the TSV files
    of the task's ``splits`` (default: all), text whose every row parses, checked before any work."""
    folder = Path(str(glue_dir))
    if not folder.is_dir():
        what = "is a file" if folder.exists() else f"does not exist (relative to {os.getcwd()})"
        raise cli.Missing(
            f"{argument}={glue_dir} {what}; point it at the folder that holds CoLA/, SST-2/, ..."
            + (f" or set {argument}=null to load nyu-mll/glue from the Hub" if hub else "")
        )
    for split in splits or task.splits:
        path = folder / task.dir_name / glue.split_file(task, split)
        if not path.exists():
            raise cli.Missing(
                f"{argument}={glue_dir} has no {task.dir_name}/{path.name} (the {split} split of GLUE task "
                f"{task.name!r}); add it from a glue_data download"
                + (f", or set {argument}=null to load the Hub copy" if hub else "")
            )
        cli.text_file(argument, path, limit=1 << 20)
        glue.check_tsv(task, path)


def load_data(task: glue.GlueTask, data: DataSettings, tokenizer):
    """The task's splits, optionally truncated (``max_train_samples``, ``max_eval_samples``), tokenized."""
    raw = glue.load_glue(task, data.glue_dir)
    for split in raw:
        limit = data.limit(split)
        if limit is not None and len(raw[split]) > limit:
            raw[split] = raw[split].select(range(limit))
    return glue.tokenize_glue(raw, tokenizer, task, data.max_seq_length)


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
        prediction = trainer.predict(data[split], metric_key_prefix=split)  # gathered from every process
        _check_once(prediction.label_ids, data[split]["labels"], split)
        values = glue.glue_metrics(task, prediction.predictions, prediction.label_ids)
        prefix = "" if i == 0 else split.removeprefix("validation_") + "_"
        metrics.update({prefix + k: v for k, v in values.items()})
    shutil.rmtree(scratch, ignore_errors=True)
    return metrics


def _check_once(predicted_labels, labels, split: str) -> None:
    """Predictions cover the split once, in order (several processes each predict a shard, then gather)."""
    predicted, expected = np.asarray(predicted_labels, np.float32).ravel(), np.asarray(labels, np.float32).ravel()
    if predicted.shape != expected.shape or not np.array_equal(predicted, expected):
        raise RuntimeError(f"{split}: {predicted.size} predictions do not match its {expected.size} examples in order")


def finetuned_checkpoint(job: GlueJob, path: str, data, tokenizer, callbacks=()) -> tuple[Path, float]:
    """Fine-tune ``path`` on the task once per (model, task, seed, recipe) and cache it; reuse it afterwards. Jobs
    that need the same fine-tuned model at once (a parallel sweep) take turns: the first trains, the others wait
    for it and reuse its model. Returns the model's folder and the training seconds of interrupted earlier runs
    that this call resumed (0 when none). Launched in several processes, all train and rank 0 alone holds the lock
    and saves the model."""
    if not job.finetune:
        return Path(path), 0.0
    target = job.finetuned_dir
    with distributed.main_lock(target.with_name(f"{target.name}.lock")):
        if distributed.from_main((target / "config.json").is_file()):
            log.info("reusing the fine-tuned model in %s", target)
            return target, 0.0
        transformers.set_seed(job.seed)
        task = job.task
        labels = {"id2label": dict(enumerate(task.label_names))} if task.label_names else {}
        if job.weights == "random":
            config = AutoConfig.from_pretrained(path, num_labels=task.num_labels, **labels)
            model = AutoModelForSequenceClassification.from_config(config)
        else:
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=task.num_labels, **labels)
        run = train(
            model, data["train"], transformers.DataCollatorWithPadding(tokenizer), job.trainer, job.seed,
            checkpoints_dir(job, "finetuned"), job.checkpoint_every, callbacks=list(callbacks),
        )
        if distributed.is_main():
            tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            record = {"seconds": run.seconds, "settings": dict(job.settings)}
            (tmp / "finetune.json").write_text(json.dumps(record, indent=2))
            tmp.rename(target)
    return target, run.resumed_seconds


def finetuned_metrics(job: GlueJob, checkpoint: Path, evaluate_fn) -> dict[str, float]:
    """The fine-tuned model's metrics, evaluated once per evaluation setting and cached beside the cached model,
    since every rank and method of a sweep starts from it. A model given ready fine-tuned (``finetune=false``) is
    not ours to write into: it is evaluated every time."""
    if not job.finetune:
        return evaluate_fn()
    cache = checkpoint / f"eval-{digest(job.data.limits)}.json"
    cached = distributed.from_main(json.loads(cache.read_text()) if cache.is_file() else None)
    if cached is not None:
        return cached
    metrics = evaluate_fn()
    if distributed.is_main():
        write_text_atomic(cache, json.dumps(metrics))
    return metrics


def stage_record(
    job: GlueJob, stage: str, metrics: dict, model, report: ReparamReport | None, seconds: float
) -> dict:
    """One line of ``results.jsonl``: what was run, its metrics, its parameter counts; a job re-fine-tuned with
    distillation records its settings (``distill``) on every line."""
    task, method, distill = job.task, job.method, job.distill
    return {
        "stage": stage,
        "task": task.name,
        "model": job.model_record,
        "method": method.label,
        "rank": method.record_rank(report),
        "budget": method.budget,
        "seed": job.seed,
        **metrics,
        "main_metric": task.main_metric,
        "model_params": sum(p.numel() for p in model.parameters()),
        **attention_parameters(model),
        "decomposition_seconds": report.seconds if report else None,
        "mean_relative_error": report.mean_relative_error if report else None,
        "seconds": seconds,
        **({"distill": dataclasses.asdict(distill)} if distill else {}),
    }


def reparametrize_stage(job: GlueJob, model, tokenizer, train_data) -> ReparamReport:
    """The ``reparam`` stage, in place, with what the method needs measured first: head importance on ``train_data``
    (labelled task examples) for a method that ranks heads, input statistics on ``collab.calibration`` (a file, or
    the task's training texts) for an activation-aware fit. What the conversion refuses in the model it is given
    (query/key weights that are NaN or Inf, statistics that do not match it) is bad input (``cli.BadInput``): the
    script reports it in one line."""
    method, seed = job.method, job.seed
    measured = {}
    if method.importance is not None:
        if train_data is None:
            raise ValueError(f"collab={method.method} needs labelled task examples to score the heads on")
        measured["importance"] = head_importance(
            model, train_data, transformers.DataCollatorWithPadding(tokenizer), seed=seed,
            samples=method.importance.samples, batch_size=method.importance.batch_size,
        )
    elif method.calibration is not None:
        with cli.as_bad_input():
            measured["calibration"] = calibrate(model, tokenizer, method, seed, functools.partial(
                glue.task_texts, job.task, job.data.glue_dir, "train"))
    with cli.as_bad_input():
        return reparametrize(model, seed=seed, **method.reparametrize_kwargs(), **measured)


def _summary_line(name: str, record: dict) -> str:
    metrics = ", ".join(
        f"{k}={record[k]:.4f}" for k in ("matthews_correlation", "accuracy", "f1", "pearson", "spearmanr")
        if k in record
    )
    return (
        f"[{name}] {record['stage']:>9}: {metrics} (main {record['main_metric']} {record['main']:.4f}); "
        f"q/k params {record['query_key_params']:,}; {record['seconds']:.0f} s"
    )


def refit_stage(job: GlueJob, model, data, tokenizer, checkpoint: Path, report, callbacks) -> float:
    """The ``refit`` stage, in place: re-fine-tune the converted model (with distillation from the fine-tuned
    ``checkpoint`` under ``refit.distill``); returns the training seconds of interrupted earlier runs it resumed."""
    run = train(
        model, data["train"], transformers.DataCollatorWithPadding(tokenizer), job.refit_recipe, job.seed,
        checkpoints_dir(job, "refit"), job.checkpoint_every, callbacks=callbacks,
        **refit_trainer(job, checkpoint, report),
    )
    return run.resumed_seconds


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` (deepest first) while they are empty: what a failed job made and left nothing in; a folder
    holding anything (resumable training checkpoints, another job's results) stays, and so do those above it."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def run_job(job: GlueJob) -> list[dict]:
    """Run (or skip, if its results exist) one job; returns its result records. Launched in several processes
    (torchrun, accelerate launch, SLURM tasks), every process trains and evaluates, and rank 0 alone writes."""
    if not isinstance(job, GlueJob):
        raise TypeError(f"run_job takes a GlueJob (GlueJob.of(settings)), not a {type(job).__name__}")
    distributed.setup()
    main = distributed.is_main()
    store, name, stored = job.store, job.name, job.stored_name
    out = store.folder / stored
    records = distributed.from_main(store.finished(stored) if main else None)
    if records is not None:
        if main:
            print(f"[{name}] results exist in {out}; skipping")
        return records
    path = check_inputs(job)
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = load_data(job.task, job.data, tokenizer)  # before any folder exists: bad data leaves nothing behind
    made = [folder for folder in (out, *out.parents) if not folder.exists()]  # by this run, deepest first
    if main:
        out.mkdir(parents=True, exist_ok=True)
    scratch = out / f".scratch-{os.getpid()}"
    tracker = make_tracker(job.logger, name, job.sweep_name, dict(job.settings), out) if main else NoTracker()
    eval_batch = job.trainer.get("per_device_eval_batch_size", 64)
    records, summary = [], {}
    start = time.perf_counter()
    finished = False

    def finish(stage: str, metrics: dict, report: ReparamReport | None, resumed: float = 0.0) -> None:
        """Record a stage; a stage that resumed interrupted training also counts the time of the runs before it."""
        nonlocal start
        record = stage_record(job, stage, metrics, model, report, time.perf_counter() - start + resumed)
        start = time.perf_counter()
        records.append(record)
        tracker.log_stage(record)
        if main:
            print(_summary_line(name, record))
        summary.update({f"{stage}/main": record["main"], "query_key_params": record["query_key_params"]})

    try:
        checkpoint, resumed = finetuned_checkpoint(
            job, path, data, tokenizer, callbacks=tracker.training_callbacks("finetuned")
        )
        model = AutoModelForSequenceClassification.from_pretrained(checkpoint)
        evaluate_model = functools.partial(evaluate, model, data, tokenizer, job.task, eval_batch, scratch / "eval")
        finish("finetuned", finetuned_metrics(job, checkpoint, evaluate_model), None, resumed)
        if job.method.converts:
            report = reparametrize_stage(job, model, tokenizer, data["train"])
            distributed.sync_parameters(model)  # each process converted its copy; rank 0's is the one saved
            finish("reparam", evaluate_model(), report)
            if job.refits:
                resumed = refit_stage(job, model, data, tokenizer, checkpoint, report,
                                      tracker.training_callbacks("refit"))
                finish("refit", evaluate_model(), report, resumed)
        if main:
            store.save(stored, records)
        compression = records[-1]["query_key_params"] / records[0]["query_key_params"]
        summary.update(rank=records[-1]["rank"], query_key_compression=compression)
        finished = True
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        tracker.finish(summary)
        if main and not finished:  # a job that failed before it saved anything leaves no folder behind
            _remove_empty(made)
    distributed.barrier()  # the next job of a sweep starts when rank 0 has written this one's results
    return records
