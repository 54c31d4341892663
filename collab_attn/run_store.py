"""One run store for the sweeps that keep one JSON record per run (training from scratch on a GLUE task, the
Tiny Shakespeare models and their conversions), and what their summaries share.

``RunStore``: ``<output_dir>/runs/<name>.json``, written atomically once a run has finished, so a file means done
and a rerun of the same sweep skips it; a record carries the ``signature`` of the settings that made it, and a
stored run made with other settings is refused rather than mixed in. Resumable training checkpoints live in
``<output_dir>/.checkpoints/<name>`` meanwhile. (The GLUE pipeline's jobs, several stages each, are named by their
``JobKey`` instead: ``collab_attn.glue.jobs``.)

``learning_curve`` reads a Trainer log history into one point per evaluation; ``key_sizes_for`` is every sweep's
default grid of key sizes; ``mean_std`` the spread over seeds that every table reports.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from collab_attn import cli
from collab_attn.files import write_text_atomic

# What a Trainer logs at a training step, as curves name it.
TRAIN_LOGS = {"loss": "train_loss", "learning_rate": "lr", "grad_norm": "grad_norm"}


class RunStore:
    def __init__(self, output_dir: str | Path, signature: dict | None = None):
        """The runs under ``output_dir``; ``signature``: what a stored run must have been made with to be reused
        (None: not checked)."""
        self.root = Path(output_dir)
        self.folder = self.root / "runs"
        self.signature = signature

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def checkpoints(self, name: str) -> Path:
        return self.root / ".checkpoints" / name

    def finished(self, name: str) -> dict | None:
        """The stored record of run ``name``, or None when it has not finished; one made with other settings is
        refused."""
        path = self.path(name)
        if not path.exists():
            return None
        record = cli.json_file("output_dir", path)
        if self.signature is not None and (not isinstance(record, dict) or record.get("signature") != self.signature):
            raise cli.BadInput(f"{path} was made with different settings; use another output_dir or delete it")
        return record

    def save(self, record: dict) -> Path:
        """Write ``record`` (its ``name`` names the file) atomically."""
        path = self.path(record["name"])
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(record, indent=1) + "\n")
        return path


def learning_curve(history: Sequence[dict], evaluated: Mapping[str, str], logged: Sequence[str]) -> list[dict]:
    """One point per evaluation of a Trainer log history: the step, the evaluated metrics (``evaluated``: history
    key -> curve key; the first one marks an evaluation) and what was logged at that step (``logged``: keys of
    ``TRAIN_LOGS``; None where nothing was, as at step 0). A step evaluated twice (a resumed run evaluates at its
    start) keeps its last evaluation."""
    trained = {entry["step"]: entry for entry in history if "loss" in entry}
    marker = next(iter(evaluated))
    points = {}
    for entry in history:
        if marker in entry:
            train_log = trained.get(entry["step"], {})
            points[entry["step"]] = {
                "step": entry["step"],
                **{name: entry[key] for key, name in evaluated.items()},
                **{TRAIN_LOGS[key]: train_log.get(key) for key in logged},
            }
    return [points[step] for step in sorted(points)]


def key_sizes_for(width: int, key_sizes: Sequence[int] | None) -> list[int]:
    """The key sizes of a sweep: as given (positive integers), or ``width``, ``/2``, ``/4``, ``/8``."""
    if key_sizes is None:
        return [width // div for div in (1, 2, 4, 8)]
    return [cli.positive_int("key_sizes", k) for k in cli.nonempty_list("key_sizes", key_sizes)]


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def mean_curve(runs: Sequence[dict], metric: str, skip_steps: frozenset = frozenset()) -> tuple[list, list, list]:
    """The learning curves (``record["curve"]``) of several seeds of one configuration as steps (those every run
    evaluated, but ``skip_steps``), mean and standard deviation of ``metric`` at each."""
    by_step = [{point["step"]: point[metric] for point in run["curve"]} for run in runs]
    steps = sorted(set.intersection(*(set(curve) for curve in by_step)) - skip_steps)
    stats = [mean_std([curve[step] for curve in by_step]) for step in steps]
    return steps, [m for m, _ in stats], [s for _, s in stats]
