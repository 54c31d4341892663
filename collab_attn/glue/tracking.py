"""Experiment tracking for the GLUE pipeline: Weights & Biases (offline unless the user's settings say otherwise)
or nothing. One tracker per job; ``finish`` is always called, so each job of a multirun closes its own run."""

from __future__ import annotations

import netrc
import os
from pathlib import Path
from typing import Protocol


class Tracker(Protocol):
    def log_stage(self, record: dict, train_history: list[dict]) -> None: ...

    def finish(self, summary: dict) -> None: ...


class NoTracker:
    """``logger=none``: the results stay in results.jsonl only."""

    def log_stage(self, record: dict, train_history: list[dict]) -> None:
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

    def log_stage(self, record: dict, train_history: list[dict]) -> None:
        stage = record["stage"]
        self.run.define_metric(f"{stage}/train_step")
        self.run.define_metric(f"{stage}/*", step_metric=f"{stage}/train_step")
        for entry in train_history:
            if "loss" in entry:
                self.run.log({f"{stage}/train_step": entry["step"], f"{stage}/train_loss": entry["loss"]})
        numbers = {
            k: v for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("rank", "seed")
        }
        self.run.log({f"{stage}/{k}": v for k, v in numbers.items()})

    def finish(self, summary: dict) -> None:
        self.run.summary.update(summary)
        self.run.finish()


def make_tracker(logger_cfg: dict, name: str, group: str, config: dict, run_dir: Path) -> Tracker:
    if logger_cfg["name"] == "none":
        return NoTracker()
    if logger_cfg["name"] != "wandb":
        raise ValueError(f"unknown logger {logger_cfg['name']!r}; choose logger=wandb or logger=none")
    return WandbTracker(
        logger_cfg["project"], name, group, config, run_dir, logger_cfg.get("mode"), logger_cfg.get("entity"),
        logger_cfg.get("tags"),
    )
