"""What identifies a GLUE job, and where its results live.

A job is one (task, model and its weights, conversion method with every option, seed, training recipe, data
limits). ``JobKey.of(settings)`` builds that identity once from the resolved settings, typed: the method through
``MethodSettings`` (so a default moved between a YAML file and a dataclass does not change it), the recipes without
the ``TrainingArguments`` fields that only change what is logged. The job's folder is
``<output_root>/runs/<task>/<model>/<method label>-r<rank>/seed<seed>-<digest of the key>``.

Folders made before job keys existed were named by a hash of the composed config groups. ``runs/index.json`` (written
once, committed beside them) maps each of those folders to its key, so ``job_dir`` finds a finished job whatever
the config files look like now; a job the index does not know gets the folder its key names.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from collab_attn.distillation import DistillSettings
from collab_attn.glue import tasks as glue
from collab_attn.models.settings import MethodSettings, rank_tag
from collab_attn.run_store import RunStore

KEY_VERSION = 1
INDEX_FILE = "index.json"
# TrainingArguments fields that change what is logged, not what is learned: not part of a job's identity.
LOGGING_ONLY = frozenset({"logging_steps", "logging_strategy", "disable_tqdm", "per_device_eval_batch_size",
                          "report_to"})


def digest(payload) -> str:
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]


def without_logging(group: dict) -> dict:
    """A trainer group without the logging-only fields."""
    return {k: v for k, v in group.items() if k not in LOGGING_ONLY}


def refit_fields(settings: dict) -> dict:
    """The re-fine-tuning's TrainingArguments: ``trainer.*`` with the fields the ``refit`` group sets replaced; a
    field it leaves out or sets to null (``max_steps`` in ``refit=paper``) is the trainer's. The ``distill`` block
    (``refit=distill``) is not a TrainingArguments field: the distillation trainer reads it."""
    refit = {k: v for k, v in settings["refit"].items() if v is not None and k != "distill"}
    return {**settings["trainer"], **refit}


def model_slug(name: str) -> str:
    """A short, path-safe name for a model: ``minilm``, ``bert-base-uncased``, ``org--name``, a directory's name."""
    path = Path(name)
    return path.name if path.is_dir() else name.replace("/", "--")


def weights_of(settings: dict) -> str:
    """``pretrained`` (the checkpoint) or ``random`` (its architecture, freshly initialized: a control for what
    pretraining brings)."""
    return settings.get("weights", "pretrained")


RANDOM_SUFFIX = "-random-init"  # how paths and records name a model with weights=random


def model_label(settings: dict) -> str:
    """The model as paths name it: its slug, with ``-random-init`` for ``weights=random``."""
    return model_slug(settings["model"]) + RANDOM_SUFFIX * (weights_of(settings) == "random")


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
    def of(cls, settings: dict, method: MethodSettings | None = None) -> JobKey:
        method = method or MethodSettings.from_config(settings["collab"])
        distill = DistillSettings.from_refit(settings["refit"])
        refit = {
            "recipe": without_logging(refit_fields(settings)),  # with ``enabled``
            "distill": None if distill is None else dataclasses.asdict(distill),
        }
        return cls(
            task=glue.get_task(settings["task"]["name"]).name, model=settings["model"], weights=weights_of(settings),
            method={k: v for k, v in method.to_group().items() if v is not None}, seed=settings["seed"],
            finetune=settings["finetune"],
            trainer=without_logging(settings["trainer"]), refit=refit,
            data={k: v for k, v in settings["data"].items() if k != "glue_dir"},
        )

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self), sort_keys=True, default=str))

    @property
    def digest(self) -> str:
        return digest(self.to_dict())


def job_name(settings: dict, method: MethodSettings | None = None) -> str:
    """``<task>/<model>/<method label>[-r<rank>]/seed<seed>``: the job as logs and folders name it."""
    method = method or MethodSettings.from_config(settings["collab"])
    label = method.label + (f"-r{rank_tag(method.rank_request)}" if method.converts else "")
    task = glue.get_task(settings["task"]["name"]).name
    return f"{task}/{model_label(settings)}/{label}/seed{settings['seed']}"


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


def job_store(settings: dict) -> RunStore:
    """The run store of a sweep's jobs: one folder of stage records per job under ``<output_root>/runs``."""
    return RunStore(settings["output_root"], staged=True)


def stored_name(settings: dict, method: MethodSettings | None = None) -> str:
    """The job's name in its store: the folder the index gives its key, else the one its key's digest names."""
    key = JobKey.of(settings, method)
    indexed = read_index(job_store(settings).folder).get(json.dumps(key.to_dict(), sort_keys=True))
    return indexed if indexed is not None else f"{job_name(settings, method)}-{key.digest}"


def job_dir(settings: dict, method: MethodSettings | None = None) -> Path:
    """The job's folder: its results, its W&B run, its re-fine-tuning's checkpoints."""
    return job_store(settings).folder / stored_name(settings, method)


def finetuned_dir(settings: dict) -> Path:
    """Where the fine-tuned model of a (task, model, weights, seed, trainer recipe, data limits) is cached: shared by
    every method and rank of a sweep."""
    recipe = {
        "model": settings["model"], "weights": weights_of(settings), "trainer": without_logging(settings["trainer"]),
        "max_seq_length": settings["data"]["max_seq_length"],
        "max_train_samples": settings["data"]["max_train_samples"],
    }
    task = glue.get_task(settings["task"]["name"]).name
    return (Path(settings["output_root"]) / "finetuned" / task / model_label(settings)
            / f"seed{settings['seed']}-{digest(recipe)}")
