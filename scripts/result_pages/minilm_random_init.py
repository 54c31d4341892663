"""The claims of experiments/minilm_random_init/README.md (the random-initialization control), from its jobs'
``results.jsonl`` (scripts/train_glue.py) against the fine-tuned models of ``../minilm_glue/`` and its
``fit_check.md`` (scripts/fit_check.py)."""

from __future__ import annotations

from result_pages.engine import Value, cited, claim, strict
from result_pages.minilm_glue import WORDS, by_seed, fit_check, short, stage_minutes

GLUE = "experiments/minilm_glue/"


def claims_minilm_random_init() -> None:
    """experiments/minilm_random_init/README.md: the control's jobs against the fine-tuned models of
    ../minilm_glue/."""
    P = "experiments/minilm_random_init/README.md"
    R = "experiments/minilm_random_init/"
    both = f"{short(R)}; {short(GLUE)}"

    def seeds(sweep, task):
        return by_seed(sweep, "-", "-", "finetuned", task)

    def mean_std(sweep, task) -> Value:
        from collab_attn.run_store import mean_std as spread

        return Value(short(sweep), lambda: list(spread(list(seeds(sweep, task).values()))))

    def paired(task, word) -> Value:
        def compute():
            from collab_attn.stats import paired_comparison

            c = paired_comparison(seeds(GLUE, task), seeds(R, task), higher_is_better=True)
            if WORDS[c.verdict] != word:
                raise ValueError(f"the seeds' verdict is {WORDS[c.verdict]}, where the page says {word}")
            return [c.mean_difference, *c.interval]
        return Value(both, compute)

    claim(P, "(Matthews {:.1f}, accuracy {:.1f} over three seeds)",
          Value(short(GLUE), lambda: [mean_std(GLUE, "cola").numbers()[0], mean_std(GLUE, "rte").numbers()[0]]))
    claim(P, "Each job takes {:.0f} to {:.0f} minutes on one CPU thread.",
          Value(short(R), lambda: [min(m for t in ("cola", "rte") for m in stage_minutes(R, t)),
                                   max(m for t in ("cola", "rte") for m in stage_minutes(R, t))]))
    claim(P, "original row) | {:.1f} ± {:.1f} | {:.1f} ± {:.1f} |", mean_std(GLUE, "cola"), mean_std(GLUE, "rte"))
    claim(P, "([`summary.md`](summary.md)) | {:.1f} ± {:.1f} | {:.1f} ± {:.1f} |", mean_std(R, "cola"),
          mean_std(R, "rte"))
    claim(P, "| majority class | {:.1f} | {:.1f} |", fit_check(GLUE, "cola", "dev, majority class"),
          fit_check(GLUE, "rte", "dev, majority class"))
    claim(P, "Per seed, RTE: pretrained {:.1f}, {:.1f}, {:.1f}", Value(short(GLUE), lambda: list(
        seeds(GLUE, "rte").values())))
    claim(P, "random initialization {:.1f}, {:.1f}, {:.1f}", Value(short(R), lambda: list(seeds(R, "rte").values())))

    def under():
        return [mean_std(R, "rte").numbers()[0], mean_std(GLUE, "rte").numbers()[0] - mean_std(R, "rte").numbers()[0]]
    claim(P, "reaches {:.1f}, {:.1f} points under the pretrained model", Value(both, under))
    claim(P, "paired by seed:\n  {:+.1f} [{:+.1f}, {:+.1f}], a tie)", paired("rte", "tie"))

    def best():
        a, b = max(seeds(R, "rte").values()), max(seeds(GLUE, "rte").values())
        if a != b:
            raise ValueError(f"the control's best RTE seed {a} is not the pretrained model's best {b}")
        return [a]
    claim(P, "one seed ({:.1f}) equals the pretrained model's best", Value(both, best))
    published = "published GLUE figures (Turc et al., 2019; Devlin et al., 2019; Wang et al., 2020 for MiniLM-L12)"
    cited(P, "Pretrained BERTs reach 57.9\n  (BERT-Mini) to 66.4 (BERT-base)", published)
    cited(P, "ends where Google's BERT-Small does (27.8), far under MiniLM-L12's published 58.5", published)
    claim(P, "**CoLA: the checkpoint brings {:.0f} Matthews points** ({:+.1f} [{:+.1f}, {:+.1f}] paired by seed)",
          Value(both, lambda: [paired("cola", "ahead").numbers()[0]]), paired("cola", "ahead"))
    strict(P)
