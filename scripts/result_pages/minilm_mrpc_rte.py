"""The claims of experiments/minilm_mrpc_rte/README.md (one seed, exact and compressed collaborative heads on MRPC
and RTE), from its jobs' ``results.jsonl`` (scripts/train_glue.py) and ``../minilm_glue/fit_check.md``
(scripts/fit_check.py)."""

from __future__ import annotations

from result_pages.engine import ROOT, Value, cited, claim, strict
from result_pages.minilm_glue import average as task_average
from result_pages.minilm_glue import by_seed, fit_check, short, stage_minutes

GLUE = "experiments/minilm_glue/"
MRPC_DEV = (408, 279)  # MRPC's dev set: pairs, of them paraphrases (GLUE)


def claims_minilm_mrpc_rte() -> None:
    """experiments/minilm_mrpc_rte/README.md: seed 0 of the MRPC and RTE jobs."""
    P = "experiments/minilm_mrpc_rte/README.md"
    S = "experiments/minilm_mrpc_rte/"
    src = short(S)

    def at(method, rank, stage, task) -> float:
        return by_seed(S, method, rank, stage, task)[0]

    def v(*cells) -> Value:
        return Value(src, lambda: [at(*c) for c in cells])

    claim(P, "(a 3-epoch MRPC run takes {:.0f} to {:.0f} minutes)",
          Value(src, lambda: [min(stage_minutes(S, "mrpc")), max(stage_minutes(S, "mrpc"))]))
    original = ("-", "-", "finetuned")
    claim(P, "moves MRPC F1 from {:.1f} to {:.1f} and RTE from\n  {:.1f} to {:.1f}",
          v((*original, "mrpc"), ("cp", 384, "refit", "mrpc"), (*original, "rte"), ("cp", 384, "refit", "rte")))
    cited(P, "(the paper's BERT-base: 83.0 to 83.2 GLUE average at exact size)", "the paper's Table 2")

    def none_paraphrase():
        import json

        rows = [json.loads(line) for f in (ROOT / S).glob("runs/mrpc/minilm/cp-r128/*/results.jsonl")
                for line in f.read_text().splitlines()]
        r = next(r for r in rows if r["stage"] == "reparam")
        pairs, positive = MRPC_DEV
        if r["f1"] != 0 or round(r["accuracy"] * pairs) != pairs - positive:
            raise ValueError("plain CP at 128 does not predict 'not paraphrase' for every MRPC pair")
        return [100 * r["f1"], at("cp", 128, "reparam", "rte")]
    claim(P, "(MRPC F1 {:.1f}: every pair\n  predicted \"not paraphrase\"; RTE {:.1f}, below chance)",
          Value(src, none_paraphrase))

    def accuracy(method, rank, stage):
        import json

        rows = [json.loads(line) for f in (ROOT / S).glob(f"runs/mrpc/minilm/{method}-r{rank}/*/results.jsonl")
                for line in f.read_text().splitlines()]
        return 100 * next(r for r in rows if r["stage"] == stage)["accuracy"]
    claim(P, "recover MRPC only to F1 {:.1f}\n  (accuracy {:.1f}, under the majority class's {:.1f}) and RTE to {:.1f} "
             "(under its majority class, {:.1f}): {:+.1f} points\n  on the two-task average ({:.1f} to {:.1f})",
          v(("cp", 128, "refit", "mrpc")),
          Value(src, lambda: [accuracy("cp", 128, "refit"), 100 * MRPC_DEV[1] / MRPC_DEV[0]]),
          v(("cp", 128, "refit", "rte")), fit_check(GLUE, "rte", "dev, majority class"),
          Value(src, lambda: [(lambda a, b: [a - b, b, a])(task_average(S, "cp", 128, "refit", ("mrpc", "rte"))[0],
                                                           task_average(S, "-", "-", "finetuned", ("mrpc", "rte"))[0])
                              ][0]))
    cited(P, "far more than the paper's -1.3 average", "the paper's Table 2")
    claim(P, "F1 {:.1f} straight after conversion, and {:.1f} after\n  re-fine-tuning, above the fine-tuned model "
             "({:.1f}) and the exact conversion re-fine-tuned ({:.1f})",
          v(("cp-aware", 128, "reparam", "mrpc"), ("cp-aware", 128, "refit", "mrpc"), (*original, "mrpc"),
            ("cp", 384, "refit", "mrpc")))
    claim(P, "Plain CP re-fine-tuned from the same rank ends at {:.1f}", v(("cp", 128, "refit", "mrpc")))
    claim(P, "RTE is weak for this model ({:.1f} against a majority class of {:.1f})",
          v((*original, "rte")), fit_check(GLUE, "rte", "dev, majority class"))
    claim(P, "training set\n  ({:.1f}% accuracy)", fit_check(GLUE, "rte", "train"))
    strict(P)
