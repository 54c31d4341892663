"""The claims of experiments/minilm_rte_recipe/README.md (RTE fine-tuned at lr 3e-5 for 4 epochs), from its job's
``results.jsonl`` and ``runs/index.json`` (scripts/train_glue.py) and the GLUE sweep's fine-tuned RTE models
(``../minilm_glue/runs``)."""

from __future__ import annotations

from result_pages.engine import Value, claim, formula, strict
from result_pages.minilm_glue import by_seed
from result_pages.minilm_sst2 import job_steps, result

RTE_TRAIN = 2_490  # RTE's training pairs (GLUE)
GLUE = "experiments/minilm_glue/"


def claims_minilm_rte_recipe() -> None:
    """experiments/minilm_rte_recipe/README.md."""
    P = "experiments/minilm_rte_recipe/README.md"
    S = "experiments/minilm_rte_recipe/runs/"
    job = "rte/minilm/none/seed0-f449d15f"
    results = f"{S}{job}/results.jsonl"
    src = results.removeprefix("experiments/")

    def recipe(index):
        batch, length, _ = job_steps(index, job, RTE_TRAIN)
        return [index["jobs"][job]["seed"], batch, length]
    claim(P, "RTE with seed {:.0f}, batch {:.0f}, length {:.0f}", formula(recipe, S + "index.json"))

    def sweep_seeds():
        seeds = by_seed(GLUE, "-", "-", "finetuned", "rte")
        return [seeds[s] for s in sorted(seeds)]
    claim(P, "dev accuracy **{:.1f}%**", Value(src, lambda: [100 * result(results, "accuracy")]))
    claim(P, "the same as with the MiniLM recipe ({:.1f}, {:.1f} and {:.1f} over\nseeds 0 to 2)",
          Value("minilm_glue/runs/rte/*/results.jsonl", sweep_seeds))
    claim(P, "{:.0f} steps, {:.0f} minutes on one CPU thread",
          formula(lambda index: [job_steps(index, job, RTE_TRAIN)[2]], S + "index.json"),
          Value(src, lambda: [result(results, "seconds") / 60]))
    strict(P)
