"""The one training path: every model this library trains (GLUE fine-tuning and re-fine-tuning, models trained from
scratch) goes through Hugging Face ``Trainer`` here, with one optimizer setup and schedule (``TrainingArguments``),
one evaluation loop and one resume mechanism (a checkpoint every ``checkpoint_every`` steps; a call that finds one
continues from it with the batches and dropout an uninterrupted run would have seen)."""

from __future__ import annotations

import dataclasses
import logging
import shutil
import time
from pathlib import Path

import torch
import transformers

from collab_attn import distributed

log = logging.getLogger(__name__)


def training_args(
    output_dir: Path, seed: int, recipe: dict, checkpoint_every: int | None = None
) -> transformers.TrainingArguments:
    """TrainingArguments from ``recipe`` (its fields; ``enabled`` is ignored). No evaluation unless the recipe asks
    for it (``eval_strategy``, ``eval_steps``, ...); checkpoints only with ``checkpoint_every``. Launched in several
    processes, ``per_device_train_batch_size`` stays the batch of one optimizer step: each process takes its share."""
    recipe = distributed.split_batch({k: v for k, v in recipe.items() if k != "enabled"})
    # Two checkpoints are kept so that one interrupted while being written leaves the previous one whole.
    saving = (
        {"save_strategy": "steps", "save_steps": checkpoint_every, "save_total_limit": 2}
        if checkpoint_every else {"save_strategy": "no"}
    )
    defaults = {"eval_strategy": "no", "dataloader_num_workers": 0, "dataloader_pin_memory": torch.cuda.is_available()}
    if distributed.world_size() > 1:
        # Sequence-classification heads take **kwargs but ignore num_items_in_batch: averaging it across processes
        # would multiply their loss and gradients by the process count.
        defaults["average_tokens_across_devices"] = False
        if not torch.cuda.is_available():
            defaults["use_cpu"] = True  # without it the Trainer runs one independent copy per process on the CPU
    return transformers.TrainingArguments(
        output_dir=str(output_dir), seed=seed, report_to=[], **{**defaults, **recipe}, **saving
    )


def last_complete_checkpoint(folder: Path) -> Path | None:
    """The latest ``checkpoint-<step>`` in ``folder`` whose trainer state was written (the Trainer writes it
    last), or None."""
    steps = {}
    for path in folder.glob("checkpoint-*"):
        step = path.name.removeprefix("checkpoint-")
        if step.isdigit() and (path / "trainer_state.json").is_file():
            steps[int(step)] = path
    return steps[max(steps)] if steps else None


class _TrainingClock(transformers.TrainerCallback, transformers.trainer_callback.ExportableState):
    """Seconds spent training, saved in every checkpoint's trainer state so that a resumed run adds its own
    time to that of the runs before it."""

    def __init__(self, earlier: float = 0.0):
        self.earlier = earlier
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return self.earlier + time.perf_counter() - self.started

    def state(self) -> dict:
        return {"args": {"earlier": self.seconds()}, "attributes": {}}

    @classmethod
    def resuming(cls, checkpoint: Path | None) -> _TrainingClock:
        """A clock that starts from the seconds recorded in ``checkpoint`` (zero without one, or where a checkpoint
        written before the clock existed has none)."""
        if checkpoint is None:
            return cls()
        saved = transformers.TrainerState.load_from_json(str(checkpoint / "trainer_state.json")).stateful_callbacks
        return cls(**saved.get(cls.__name__, {}).get("args", {}))


@dataclasses.dataclass
class TrainingRun:
    seconds: float  # training time, interrupted runs that this one resumed included
    resumed_seconds: float  # the part of ``seconds`` spent by those earlier runs
    history: list[dict]


def train(
    model,
    train_dataset,
    data_collator,
    recipe: dict,
    seed: int,
    checkpoints: Path,
    checkpoint_every: int | None = None,
    trainer_class: type[transformers.Trainer] = transformers.Trainer,
    **trainer_kwargs,
) -> TrainingRun:
    """Train ``model`` on ``train_dataset`` with ``recipe`` (TrainingArguments fields). With ``checkpoint_every``,
    weights, optimizer, scheduler and RNG states are saved to ``checkpoints`` every that many steps, and a call
    that finds a checkpoint there continues from it (the Trainer's resumption: the same batches and dropout as an
    uninterrupted run). ``checkpoints`` is removed at the end. ``trainer_class`` (a ``Trainer`` subclass, such as
    ``distillation.DistillationTrainer``) takes ``trainer_kwargs`` beside the Trainer's own."""
    resume = distributed.from_main(last_complete_checkpoint(checkpoints)) if checkpoint_every else None
    clock = _TrainingClock.resuming(resume)
    trainer = trainer_class(
        model=model, args=training_args(checkpoints, seed, recipe, checkpoint_every), train_dataset=train_dataset,
        data_collator=data_collator, callbacks=[clock, *trainer_kwargs.pop("callbacks", [])], **trainer_kwargs,
    )
    if resume is not None:
        log.info("resuming training from %s (%.0f s of training before)", resume, clock.earlier)
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    distributed.barrier()  # every process has written its part of the last checkpoint
    if distributed.is_main():
        shutil.rmtree(checkpoints, ignore_errors=True)
    return TrainingRun(clock.seconds(), clock.earlier, trainer.state.log_history)
