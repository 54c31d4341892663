"""Experiment tracking: Weights & Biases (offline unless the user's settings say otherwise) or nothing, for the GLUE
jobs and the language-model runs alike. One tracker per job or run; ``finish`` is always called, so each job of a
multirun closes its own run. A GLUE job logs its training curves (loss, learning rate, gradient norm, any evaluation
during training) while the Trainer runs, through ``training_callbacks``, and each stage's metrics when the stage ends;
a language-model run logs its learning curve point by point (``log_step``) once it has finished."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Protocol

import transformers

from collab_attn import cli

DEFAULT_PROJECT = "collab-attn"


class Tracker(Protocol):
    def training_callbacks(self, stage: str) -> list[transformers.TrainerCallback]: ...

    def log_stage(self, record: dict) -> None: ...

    def log_step(self, values: dict, step: int) -> None: ...

    def finish(self, summary: dict) -> None: ...


class NoTracker:
    """``logger=none`` (and every process but rank 0): the results stay in results.jsonl only."""

    def training_callbacks(self, stage: str) -> list[transformers.TrainerCallback]:
        return []

    def log_stage(self, record: dict) -> None:
        pass

    def log_step(self, values: dict, step: int) -> None:
        pass

    def finish(self, summary: dict) -> None:
        pass


def wandb_mode(requested: str | None) -> str:
    """``requested`` if given, else ``WANDB_MODE``, else online when an API key is configured, else offline."""
    if requested:
        return requested
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        if netrc.netrc().authenticators("api.wandb.ai"):
            return "online"
    except (FileNotFoundError, netrc.NetrcParseError):
        pass
    return "offline"


def check_logger(logger: dict | None) -> None:
    """The ``logger`` group: ``none``, or ``wandb`` with a mode W&B knows (null: chosen as ``wandb_mode`` says)."""
    logger = logger or {"name": "none"}
    if cli.choice("logger", logger.get("name"), ("none", "wandb")) == "wandb":
        cli.choice("logger.mode", logger.get("mode"), (None, "online", "offline", "disabled"))


class WandbTracker:
    """One W&B run per job, grouped by sweep; per-stage metrics, training curves and a compression summary."""

    def __init__(self, project: str, name: str, group: str, config: dict, run_dir: Path, mode: str | None = None,
                 entity: str | None = None, tags: list[str] | None = None):
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=project, entity=entity, name=name, group=group, tags=tags or None, config=config,
            dir=str(run_dir), mode=wandb_mode(mode), reinit="finish_previous",
        )

    def training_callbacks(self, stage: str) -> list[transformers.TrainerCallback]:
        self.run.define_metric(f"{stage}/train_step")
        self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/train_step")
        return [_LiveCurves(self.run, stage)]

    def log_stage(self, record: dict) -> None:
        stage = record["stage"]
        numbers = {
            k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("rank", "seed")
        }
        self.run.log({f"{stage}/{k}": v for k, v in numbers.items()})

    def log_step(self, values: dict, step: int) -> None:
        """One point of a curve, ``values`` at the run's step ``step``."""
        self.run.log(values, step=step)

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()


class _LiveCurves(transformers.TrainerCallback):
    """Each of the Trainer's logs, as it is made, into the run: ``<stage>/train_loss`` (the Trainer's ``loss``),
    ``<stage>/learning_rate``, ``<stage>/grad_norm``, ``<stage>/eval_*`` against ``<stage>/train_step``; the
    Trainer's closing average loss as ``<stage>/train_loss_average``."""

    _RENAMED = {"loss": "train_loss", "train_loss": "train_loss_average"}

    def __init__(self, run, stage: str):
        self.run, self.stage = run, stage

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero:
            return
        numbers = {
            f"{self.stage}/{self._RENAMED.get(k, k)}": v for k, v in (logs or {}).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if numbers:
            self.run.log({f"{self.stage}/train_step": state.global_step, **numbers})


def make_tracker(logger_cfg: dict, name: str, group: str, config: dict, run_dir: Path) -> Tracker:
    """The tracker the ``logger`` group asks for: ``NoTracker`` for ``none``, a ``WandbTracker`` (in the group's
    ``project``, ``collab-attn`` if it names none) for ``wandb``."""
    if logger_cfg["name"] == "none":
        return NoTracker()
    if logger_cfg["name"] != "wandb":
        raise ValueError(f"unknown logger {logger_cfg['name']!r}; choose logger=wandb or logger=none")
    return WandbTracker(
        logger_cfg.get("project", DEFAULT_PROJECT), name, group, config, run_dir, logger_cfg.get("mode"),
        logger_cfg.get("entity"), logger_cfg.get("tags"),
    )
