"""One run store for every sweep (GLUE jobs, training from scratch on a GLUE task, the Tiny Shakespeare models and
their conversions), and what their summaries share.

``RunStore``: a run's results are written atomically under ``<output_dir>/runs`` once it has finished, so a file
means done and a rerun of the same sweep skips it; a stored run made with other settings (its ``signature``, or the
fields a caller expects) is refused rather than mixed in. A run is one JSON record in ``runs/<name>.json``, or, for
a run of several stages (a GLUE job: fine-tuned, reparametrized, re-fine-tuned), one record per stage in
``runs/<name>/results.jsonl``, whose folder also holds the job's W&B run. Resumable training checkpoints live in
``<output_dir>/.checkpoints/<name>`` (a staged run: ``runs/<name>/.checkpoints``) meanwhile.

``read_results`` reads every result file of a sweep for its summary, each checked to be one; ``learning_curve``
reads a Trainer log history into one point per evaluation; ``ranks_for`` is every sweep's default grid of ranks
(query/key widths); ``current_names`` reads a record stored under an old field name (``key_size``, ``value_size``)
as one written now (``rank``, ``value_rank``); ``mean_std`` and ``mean_curve`` the spread over seeds that every table
and plot reports.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

from collab_attn import cli
from collab_attn.files import write_text_atomic

# What a Trainer logs at a training step, as curves name it.
TRAIN_LOGS = {"loss": "train_loss", "learning_rate": "lr", "grad_norm": "grad_norm"}
STAGES_FILE = "results.jsonl"  # a staged run's results, one JSON line per stage


class RunStore:
    def __init__(self, output_dir: str | Path, signature: dict | None = None, staged: bool = False):
        """The runs under ``output_dir``; ``signature``: what a stored run must have been made with to be reused
        (None: not checked); ``staged``: a run is a folder of stage records rather than one record."""
        self.root = Path(output_dir)
        self.folder = self.root / "runs"
        self.signature = signature
        self.staged = staged

    def path(self, name: str) -> Path:
        return self.folder / name / STAGES_FILE if self.staged else self.folder / f"{name}.json"

    def checkpoints(self, name: str) -> Path:
        return self.folder / name / ".checkpoints" if self.staged else self.root / ".checkpoints" / name

    def finished(self, name: str, expected: Mapping | None = None) -> dict | list[dict] | None:
        """The stored record of run ``name`` (a staged run: its list of stage records), or None when it has not
        finished. One made with other settings (a ``signature`` or an ``expected`` field that differs) is refused."""
        path = self.path(name)
        if not path.exists():
            return None
        stored = cli.json_file("output_dir", path, lines=self.staged)
        stored = [current_names(r) for r in stored] if self.staged else current_names(stored)
        wanted = {**({"signature": self.signature} if self.signature is not None else {}), **(expected or {})}
        for record in stored if self.staged else [stored]:
            differs = [key for key in wanted if not isinstance(record, dict) or record.get(key) != wanted[key]]
            if differs:
                raise cli.BadInput(f"{path} was made with different settings ({', '.join(differs)}); use another "
                                   "output_dir or delete it")
        return stored

    def save(self, name: str, record: dict | Sequence[dict]) -> Path:
        """Write run ``name``'s ``record`` (a staged run: its stage records) atomically."""
        path = self.path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(r) + "\n" for r in record) if self.staged else json.dumps(record, indent=1) + "\n"
        write_text_atomic(path, text)
        return path


def current_names(record):
    """``record`` with its fields under their current names: a record written before a field was renamed
    (``key_size``, now ``rank``; ``value_size``, now ``value_rank``: ``collab_attn.deprecation.RENAMED``) reads as
    one written now, each field in its place. Committed records are read this way, never rewritten; anything but an
    object is returned as it is."""
    from collab_attn.deprecation import RENAMED

    if not isinstance(record, dict) or not any(old in record for old in RENAMED):
        return record
    return {RENAMED.get(key, key) if RENAMED.get(key, key) not in record else key: value
            for key, value in record.items()}


def read_results(
    argument: str, root: str | Path, pattern: str, keys: Collection[str], script: str,
    accept: Callable[[dict], bool] = lambda record: True,
) -> list[tuple[Path, dict]]:
    """Every record of the result files matching ``pattern`` below ``root`` (``*.jsonl``: one per line), in path
    order, with its file. A record that is not an object, lacks one of ``keys`` or that ``accept`` refuses stops
    with the file and the script that writes such results (``argument``: the setting that named ``root``)."""
    found = []
    for path in sorted(Path(root).glob(pattern)):
        lines = path.suffix == ".jsonl"
        stored = cli.json_file(argument, path, lines=lines)
        for number, record in enumerate(stored if lines else [stored], 1):
            record = current_names(record)
            why = _not_a_result(record, keys, accept)
            if why:
                where = f", result {number}," if lines else ""
                raise cli.BadInput(f"{path}{where} is not a result of scripts/{script}.py ({why}); move it out of "
                                   f"{argument}={root}")
            found.append((path, record))
    return found


def _not_a_result(record, keys: Collection[str], accept: Callable[[dict], bool]) -> str | None:
    """Why ``record`` is not a result (None when it is one)."""
    if not isinstance(record, dict):
        return "not a JSON object"
    missing = sorted(set(keys) - set(record))
    if missing:
        return f"lacks {', '.join(missing)}"
    return None if accept(record) else "holds a value it never writes"


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


def ranks_for(width: int, ranks: Sequence[int] | None) -> list[int]:
    """The ranks (query/key widths) of a sweep: as given (positive integers), or ``width``, ``/2``, ``/4``, ``/8``."""
    if ranks is None:
        return [width // div for div in (1, 2, 4, 8)]
    return [cli.positive_int("ranks", k) for k in cli.nonempty_list("ranks", ranks)]


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
