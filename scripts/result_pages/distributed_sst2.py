"""The claims of experiments/distributed_sst2/README.md (one GLUE job on 1 process and on 2), from its jobs'
results.jsonl (scripts/train_glue.py)."""

from __future__ import annotations

from result_pages.docs_glue import ONE, SEED1, STAGES, TWO
from result_pages.engine import Value, claim, short, stage, strict


def claims_distributed_sst2() -> None:
    """experiments/distributed_sst2/README.md: every number, from the three jobs' result files."""
    P = "experiments/distributed_sst2/README.md"
    for label, name in (("fine-tuned", "finetuned"), ("converted (`cp`, rank 128)", "reparam"),
                        ("re-fine-tuned", "refit")):
        claim(P, f"| {label} | {{:.4f}} | {{:.4f}} | {{:.4f}} |", stage(ONE, name, "accuracy"),
              stage(TWO, name, "accuracy"), stage(SEED1, name, "accuracy"))

    def apart(other):
        def compute():
            return [abs(stage(ONE, s, "accuracy").numbers()[0] - stage(other, s, "accuracy").numbers()[0])
                    for s in STAGES]
        return Value(f"{short(ONE)} against {short(other)}", compute)

    def examples():
        gap = abs(stage(ONE, "refit", "accuracy").numbers()[0] - stage(TWO, "refit", "accuracy").numbers()[0])
        return [gap * 872, 872]

    claim(P, "Two processes against one: {:.4f} / {:.4f} / {:.4f} apart", apart(TWO))
    claim(P, "(the last is {:.0f} of {:.0f} sentences)", Value("the re-fine-tuned gap, in SST-2's 872 dev sentences",
                                                               examples))
    claim(P, "A change of seed on one process: {:.4f} / {:.4f} / {:.4f}", apart(SEED1))
    strict(P)
