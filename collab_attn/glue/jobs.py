"""A GLUE job, read once from the resolved settings into a frozen typed object, and what identifies it.

``GlueJob.of(settings)`` reads the settings of one job (``scripts/train_glue.py`` composes them with Hydra) into its
typed parts: the task, the model and its weights, the method (``MethodSettings``), the seed, the fine-tuning and
re-fine-tuning recipes, the distillation settings, the data limits and where results go. It refuses a bad value
with a message that names the setting; the files the settings name are checked by ``glue.pipeline.validate``.
Every stage of ``glue.pipeline`` takes the job.

A job's identity is its ``JobKey``: the method through ``MethodSettings`` (so a default moved between a YAML file
and a dataclass does not change it), the recipes without the ``TrainingArguments`` fields that only change what is
logged. The job's folder is ``<output_root>/runs/<task>/<model>/<method label>-r<rank>/seed<seed>-<digest of the
key>``. Folders made before job keys existed were named by a hash of the composed config groups. ``runs/index.json``
(written once, committed beside them) maps each of those folders to its key, so ``GlueJob.stored_name`` finds a
finished job whatever the config files look like now; a job the index does not know gets the folder its key names.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import transformers

from collab_attn import cli
from collab_attn.distillation import DistillSettings
from collab_attn.glue import tasks as glue
from collab_attn.models.settings import MethodSettings, rank_tag
from collab_attn.run_store import RunStore
from collab_attn.texts import CALIBRATION_SAMPLES, DEFAULT_MAX_LENGTH
from collab_attn.tracking import check_logger

KEY_VERSION = 1
INDEX_FILE = "index.json"
# TrainingArguments fields that change what is logged, not what is learned: not part of a job's identity.
LOGGING_ONLY = frozenset({"logging_steps", "logging_strategy", "disable_tqdm", "per_device_eval_batch_size",
                          "report_to"})
RANDOM_SUFFIX = "-random-init"  # how paths and records name a model with weights=random
WEIGHTS = ("pretrained", "random")


def digest(payload) -> str:
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]


def without_logging(group: Mapping) -> dict:
    """A trainer group without the logging-only fields."""
    return {k: v for k, v in group.items() if k not in LOGGING_ONLY}


def model_slug(name: str) -> str:
    """A short, path-safe name for a model: ``minilm``, ``bert-base-uncased``, ``org--name``, a directory's name."""
    path = Path(name)
    return path.name if path.is_dir() else name.replace("/", "--")


@dataclass(frozen=True)
class DataSettings:
    """The ``data`` group: the GLUE folder (None: the Hub copy), the sequence length and the sample limits."""

    glue_dir: str | None
    max_seq_length: int
    max_train_samples: int | None
    max_eval_samples: int | None

    @classmethod
    def of(cls, data: Mapping) -> DataSettings:
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise cli.BadInput(f"data.{unknown[0]} is not a data setting; the data group takes {', '.join(known)}")
        cli.positive_int("data.max_seq_length", data["max_seq_length"])
        for key in ("max_train_samples", "max_eval_samples"):
            cli.positive_int(f"data.{key}", data[key], nullable=True)
        return cls(**{key: data[key] for key in known})

    @property
    def limits(self) -> dict:
        """The sequence length and sample limits: what the data is, wherever its copy lives."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "glue_dir"}

    def limit(self, split: str) -> int | None:
        return self.max_train_samples if split == "train" else self.max_eval_samples


def _recipe(group: str, fields: Mapping, own: frozenset = frozenset()) -> MappingProxyType:
    """A recipe group (``trainer``, ``refit``) read-only, without ``own`` (its keys that are no TrainingArguments
    field), each TrainingArguments field checked."""
    unknown = sorted(set(fields) - _training_fields() - own)
    if unknown:
        raise ValueError(f"{group}.{unknown[0]} is not a transformers.TrainingArguments field; remove or rename it")
    cli.trainer_fields(group, {k: v for k, v in fields.items() if k not in own})
    return MappingProxyType({k: v for k, v in fields.items() if k != "distill"})


@functools.cache
def _training_fields() -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(transformers.TrainingArguments))


@dataclass(frozen=True)
class GlueJob:
    """One GLUE job, typed: built once from the resolved settings (``GlueJob.of``), then handed to every stage."""

    task: glue.GlueTask
    model: str  # "minilm", a checkpoint folder or a Hub id, as the settings give it
    weights: str  # "pretrained" (the checkpoint) or "random" (its architecture, freshly initialized)
    method: MethodSettings
    seed: int
    finetune: bool  # false: the model is fine-tuned on the task already
    trainer: Mapping[str, Any]  # the fine-tuning's TrainingArguments fields
    refit: Mapping[str, Any]  # ``enabled`` and the TrainingArguments fields that replace the trainer's
    distill: DistillSettings | None  # ``refit.distill``: the re-fine-tuning distills from the fine-tuned model
    data: DataSettings
    checkpoint_every: int | None
    output_root: str
    logger: Mapping[str, Any]
    sweep_name: str
    settings: Mapping[str, Any] = dataclasses.field(repr=False, compare=False)  # as composed: recorded, not read

    @classmethod
    def of(cls, settings: Mapping) -> GlueJob:
        """The job of one resolved ``train_glue`` config (a plain dict); a bad value raises, naming the setting."""
        record, settings = copy.deepcopy(dict(settings)), copy.deepcopy(dict(settings))  # the job's own copies
        with cli.naming("task.name", settings["task"]["name"]):
            task = glue.get_task(settings["task"]["name"])
        method = MethodSettings.from_config(settings["collab"])
        method.refuse_fit("the GLUE pipeline")
        weights = settings.get("weights", "pretrained")
        if weights not in WEIGHTS:
            raise ValueError(f"weights={weights!r}: choose 'pretrained' (the checkpoint) or 'random' (its "
                             "architecture, freshly initialized)")
        finetune = cli.boolean("finetune", settings["finetune"])
        every = settings["checkpoint_every"]
        if every is not None and not (type(every) is int and every > 0):
            raise ValueError(f"checkpoint_every must be a positive number of training steps or null, got {every!r}")
        if weights == "random" and not finetune:
            raise ValueError("weights=random needs finetune=true: a freshly initialized model has to be trained first")
        seed = cli.integer("seed", settings["seed"], 0)
        distill = DistillSettings.from_refit(settings["refit"])
        trainer = _recipe("trainer", settings["trainer"])
        refit = _recipe("refit", settings["refit"], frozenset({"enabled", "distill"}))
        cli.boolean("refit.enabled", refit.get("enabled", True))
        data = DataSettings.of(settings["data"])
        check_logger(settings.get("logger"))
        return cls(
            task=task, model=settings["model"], weights=weights, method=method, seed=seed, finetune=finetune,
            trainer=trainer, refit=refit, distill=distill, data=data, checkpoint_every=every,
            output_root=settings["output_root"], logger=MappingProxyType(settings.get("logger") or {"name": "none"}),
            sweep_name=settings["sweep_name"], settings=MappingProxyType(record),
        )

    @property
    def refits(self) -> bool:
        """Whether the converted model is re-fine-tuned (``refit.enabled``)."""
        return self.refit.get("enabled", True)

    @property
    def refit_recipe(self) -> dict:
        """The re-fine-tuning's TrainingArguments: ``trainer`` with the fields the ``refit`` group sets replaced; a
        field it leaves out or sets to null (``max_steps`` in ``refit=paper``) is the trainer's. ``enabled`` is kept
        (``training_args`` ignores it); the distillation settings are ``distill``."""
        return {**self.trainer, **{k: v for k, v in self.refit.items() if v is not None}}

    @property
    def model_label(self) -> str:
        """The model as paths name it: its slug, with ``-random-init`` for ``weights=random``."""
        return model_slug(self.model) + RANDOM_SUFFIX * (self.weights == "random")

    @property
    def model_record(self) -> str:
        """The model as result records name it: as given, with ``-random-init`` for ``weights=random``."""
        return self.model + RANDOM_SUFFIX * (self.weights == "random")

    @property
    def key(self) -> JobKey:
        return JobKey.of(self)

    @property
    def name(self) -> str:
        """``<task>/<model>/<method label>[-r<rank>]/seed<seed>``: the job as logs and folders name it."""
        method = self.method
        label = method.label + (f"-r{rank_tag(method.rank_request)}" if method.converts else "")
        return f"{self.task.name}/{self.model_label}/{label}/seed{self.seed}"

    @property
    def store(self) -> RunStore:
        """The run store of a sweep's jobs: one folder of stage records per job under ``<output_root>/runs``."""
        return RunStore(self.output_root, staged=True)

    @property
    def stored_name(self) -> str:
        """The job's name in its store: the folder the index gives its key, else the one its key's digest names."""
        key = self.key
        indexed = read_index(self.store.folder).get(json.dumps(key.to_dict(), sort_keys=True))
        return indexed if indexed is not None else f"{self.name}-{key.digest}"

    @property
    def folder(self) -> Path:
        """The job's folder: its results, its W&B run, its re-fine-tuning's checkpoints."""
        return self.store.folder / self.stored_name

    @property
    def finetuned_dir(self) -> Path:
        """Where the fine-tuned model of a (task, model, weights, seed, trainer recipe, data limits) is cached:
        shared by every method and rank of a sweep."""
        recipe = {
            "model": self.model, "weights": self.weights, "trainer": without_logging(self.trainer),
            "max_seq_length": self.data.max_seq_length, "max_train_samples": self.data.max_train_samples,
        }
        return (Path(self.output_root) / "finetuned" / self.task.name / self.model_label
                / f"seed{self.seed}-{digest(recipe)}")


def _method_key(method) -> dict:
    """``method.to_group()`` without unset (None) keys, but for the calibration sizes: off, they are the sizes of a
    text calibration, which the keys made before they could be null (own text) hold."""
    group = method.to_group()
    if "calibration_samples" in group and group["calibration_samples"] is None:
        group.update(calibration_samples=CALIBRATION_SAMPLES, calibration_max_length=DEFAULT_MAX_LENGTH)
    return {k: v for k, v in group.items() if v is not None}


@dataclass(frozen=True)
class JobKey:
    """Everything that identifies a job, as plain values (``asdict`` is what the index stores)."""

    task: str
    model: str
    weights: str
    method: dict  # MethodSettings.to_group() without unset (None) keys: an option added later, off by default,
    #               leaves the keys of the jobs made before it as they were
    seed: int
    finetune: bool
    trainer: dict
    refit: dict  # the effective TrainingArguments (and enabled) and the distillation settings
    data: dict  # sequence length and sample limits
    version: int = KEY_VERSION

    @classmethod
    def of(cls, job: GlueJob) -> JobKey:
        refit = {
            "recipe": without_logging(job.refit_recipe),  # with ``enabled``
            "distill": None if job.distill is None else dataclasses.asdict(job.distill),
        }
        return cls(
            task=job.task.name, model=job.model, weights=job.weights,
            method=_method_key(job.method), seed=job.seed,
            finetune=job.finetune, trainer=without_logging(job.trainer), refit=refit, data=job.data.limits,
        )

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str))

    @property
    def digest(self) -> str:
        return digest(self.to_dict())


def read_index(runs: Path) -> dict[str, str]:
    """``runs/index.json`` as {canonical key JSON: folder relative to ``runs``}; empty when there is none. Parsed
    once per file version: a sweep asks it for every job."""
    path = runs / INDEX_FILE
    if not path.is_file():
        return {}
    return _parsed_index(path.resolve(), path.stat().st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _parsed_index(path: Path, version: int) -> dict[str, str]:
    index = json.loads(path.read_text())
    return {json.dumps(key, sort_keys=True): folder for folder, key in index["jobs"].items()}
