"""The claims of docs/glue.md (the GLUE pipeline's guide): its one measurement, the same job on 1 process and on 2,
from experiments/distributed_sst2's result files; strict so that no number is added without its run files."""

from __future__ import annotations

from result_pages.engine import claim, stage, strict

JOBS = "experiments/distributed_sst2/{}/runs/sst2/minilm/cp-r128/{}/results.jsonl"
ONE, TWO, SEED1 = (JOBS.format("one_process", "seed0-8f6d260f"), JOBS.format("two_processes", "seed0-8f6d260f"),
                   JOBS.format("one_process", "seed1-e114d938"))
STAGES = ("finetuned", "reparam", "refit")


def claims_docs_glue() -> None:
    """docs/glue.md: strict on the whole page."""
    P = "docs/glue.md"
    claim(P, "dev accuracy\n  {:.4f} / {:.4f} / {:.4f} (fine-tuned / converted / re-fine-tuned) on 1 process and "
             "{:.4f} / {:.4f} / {:.4f} on 2", *(stage(ONE, s, "accuracy") for s in STAGES),
          *(stage(TWO, s, "accuracy") for s in STAGES))
    strict(P)
