"""The claims of experiments/minilm_sst2/README.md (MiniLM fine-tuned on SST-2 for one epoch), from its job's
``results.jsonl`` and ``runs/index.json`` (scripts/train_glue.py)."""

from __future__ import annotations

import json
import math

from result_pages.engine import ROOT, Value, claim, cli, formula, strict
from result_pages.minilm_glue import by_seed

SST2 = (67_349, 872, 444)  # SST-2 (GLUE): training sentences, dev sentences, of them the majority class (positive)
GLUE = "experiments/minilm_glue/"


def result(path: str, key: str) -> float:
    """``key`` of the one line of a job's results.jsonl."""
    file = ROOT / path
    if not file.is_file():
        raise cli.Missing(f"{path}: no such result file (a claim cites it)")
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    if len(rows) != 1:
        raise ValueError(f"{path}: {len(rows)} results, the page cites one")
    return float(rows[0][key])


def job_steps(index: dict, job: str, examples: int) -> list[float]:
    """A job's batch, length and optimizer steps (epochs x batches of ``examples``), from its runs/index.json."""
    trainer = index["jobs"][job]["trainer"]
    batch = trainer["per_device_train_batch_size"]
    return [batch, index["jobs"][job]["data"]["max_seq_length"],
            trainer["num_train_epochs"] * math.ceil(examples / batch)]


def claims_minilm_sst2() -> None:
    """experiments/minilm_sst2/README.md."""
    P = "experiments/minilm_sst2/README.md"
    S = "experiments/minilm_sst2/runs/"
    job = "sst2/minilm/none/seed0-29c63132"
    results = f"{S}{job}/results.jsonl"
    src = results.removeprefix("experiments/")

    def steps(index):
        batch, length, n = job_steps(index, job, SST2[0])
        return [SST2[0], batch, length, n]
    claim(P, "SST-2's {:,.0f} training sentences with the MiniLM recipe (batch {:.0f}, length {:.0f},\nlr 1e-4) for "
             "**one epoch** instead of the paper's three ({:,.0f} steps,", formula(steps, S + "index.json"))
    claim(P, "{:.0f} minutes on the 2 cores", Value(src, lambda: [result(results, "seconds") / 60]))

    def same_model():
        mine = 100 * result(results, "accuracy")
        sweep = by_seed(GLUE, "-", "-", "finetuned", "sst2")[0]
        if round(sweep, 6) != round(mine, 6):
            raise ValueError(f"the GLUE sweep's fine-tuned SST-2 model scores {sweep}, this one {mine}")
        return [mine]
    claim(P, "dev accuracy **{:.1f}%**", Value(src + ", minilm_glue/runs/sst2", same_model))
    claim(P, "the majority\nclass is {:.1f}%", Value(f"SST-2's dev set (GLUE): {SST2[2]} of {SST2[1]} sentences "
                                                     "positive", lambda: [100 * SST2[2] / SST2[1]]))
    strict(P)
