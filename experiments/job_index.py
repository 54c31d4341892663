"""One-off (run once, its output committed): ``runs/index.json`` of every GLUE experiment folder, which maps each
job folder committed before job keys existed to its ``JobKey`` (``collab_attn.glue.jobs``).

Those folders were named by a hash of the composed config groups. For every job of the documented sweeps
(``tests/test_configs.py`` ``SWEEPS``, the commands of the experiments' pages) this computes that legacy folder
name with the code that made it (kept here, nowhere else) and the job's key, and records the pairs whose folder
holds results. Run from the repository root: ``python experiments/job_index.py``; it refuses two folders for one key
and lists the committed folders no documented sweep reaches.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from test_configs import SWEEPS, sweep_jobs  # noqa: E402

from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.glue.jobs import INDEX_FILE, KEY_VERSION, GlueJob  # noqa: E402

_LOGGING_ONLY = {"logging_steps", "logging_strategy", "disable_tqdm", "per_device_eval_batch_size", "report_to"}


def _recipe(group: dict) -> dict:
    return {k: v for k, v in group.items() if k not in _LOGGING_ONLY}


def _digest(payload) -> str:
    return hashlib.sha1(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:8]


def as_composed_then(collab: dict) -> dict:
    """The collab group as it was composed when those runs were made: cp.yaml and cp_legacy.yaml (also under
    ``collab.method=none``) held ``tucker_core_size: null``, a Tucker key, since dropped."""
    from_cp_group = "calibration" in collab and collab.get("method") != "tucker"
    return {"tucker_core_size": None, **collab} if from_cp_group else collab


def legacy_job_dir(settings: dict) -> Path:
    """The folder the pipeline gave a job before job keys: a hash of the composed groups as they were written."""
    settings = {**settings, "collab": as_composed_then(settings["collab"])}
    trainer = settings["trainer"]
    refit = {k: trainer[k] if v is None and k in trainer else v for k, v in _recipe(settings["refit"]).items()}
    recipe = {k: settings[k] for k in ("model", "task", "collab", "finetune")}
    recipe.update(trainer=_recipe(trainer), refit=refit)
    recipe["data"] = {k: v for k, v in settings["data"].items() if k != "glue_dir"}
    if settings.get("weights", "pretrained") == "random":
        recipe = {**recipe, "weights": "random"}
    return Path(settings["output_root"]) / "runs" / f"{GlueJob.of(settings).name}-{_digest(recipe)}"


def main() -> None:
    indexes: dict[Path, dict[str, dict]] = defaultdict(dict)
    for _, multirun, command in SWEEPS:
        for job in sweep_jobs(*command.split(), multirun=multirun):
            folder = legacy_job_dir(job)
            if not (ROOT / folder / "results.jsonl").is_file():
                continue
            runs = ROOT / job["output_root"] / "runs"
            indexes[runs][str(folder.relative_to(job["output_root"], "runs"))] = GlueJob.of(job).key.to_dict()
    for runs, jobs in indexes.items():
        seen: dict[str, str] = {}
        for folder, key in jobs.items():
            canonical = json.dumps(key, sort_keys=True)
            if canonical in seen:
                raise SystemExit(f"two folders for one job key: {seen[canonical]} and {folder}")
            seen[canonical] = folder
        committed = {str(p.parent.relative_to(runs)) for p in runs.rglob("results.jsonl")}
        unreached = sorted(committed - set(jobs))
        lines = [f"  {json.dumps(folder)}: {json.dumps(key, sort_keys=True)}" for folder, key in sorted(jobs.items())]
        text = f'{{"version": {KEY_VERSION}, "jobs": {{\n' + ",\n".join(lines) + "\n}}\n"  # one job per line
        json.loads(text)
        write_text_atomic(runs / INDEX_FILE, text)
        print(f"{runs.relative_to(ROOT)}: {len(jobs)} of {len(committed)} committed job folders indexed"
              + (f"; not reached by a documented sweep: {unreached}" if unreached else ""))


if __name__ == "__main__":
    main()
