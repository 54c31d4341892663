"""The claims of experiments/minilm_glue/README.md, GLUE on MiniLM: every score from the jobs' ``results.jsonl``
(scripts/train_glue.py, read as scripts/summarize.py glue reads them), the fit check from ``fit_check.md``
(scripts/fit_check.py), the random-initialization control from ``../minilm_random_init/runs``."""

from __future__ import annotations

import functools
import statistics

from result_pages.engine import ROOT, Value, cited, claim, cli, strict

FOUR = ("cola", "mrpc", "stsb", "rte")
WORDS = {"better": "ahead", "worse": "behind", "tie": "tie"}


@functools.cache
def scores(sweep: str) -> dict[tuple, dict[int, float]]:
    """(method, rank, stage, task) -> seed -> main metric x100, each stage that several jobs share (the fine-tuned
    model, the conversion of a job with and one without re-fine-tuning) averaged once per seed, as
    ``collab_attn.glue.summary`` counts them; the fine-tuned models under method and rank ``-``."""
    from collab_attn.glue.summary import load_results

    folder = ROOT / sweep
    if not folder.is_dir():
        raise cli.Missing(f"{sweep}: no such sweep (a claim cites it)")
    frame = load_results(folder)
    frame = frame.assign(score=frame["main"] * 100)
    original = frame[frame.stage == "finetuned"].assign(method="-", rank="-")
    frame = frame[frame.stage != "finetuned"]
    out: dict[tuple, dict[int, float]] = {}
    for part in (original, frame):
        per_seed = part.groupby(["method", "rank", "stage", "task", "seed"]).score.mean()
        for (method, rank, stage, task, seed), score in per_seed.items():
            out.setdefault((method, str(rank), stage, task), {})[int(seed)] = float(score)
    return out


def by_seed(sweep: str, method: str, rank, stage: str, task: str) -> dict[int, float]:
    key = (method, str(rank), stage, task)
    found = scores(sweep).get(key)
    if not found:
        raise KeyError(f"{sweep}: no scores for {key}")
    return found


def average(sweep: str, method: str, rank, stage: str, tasks=FOUR) -> dict[int, float]:
    """The average over ``tasks`` per seed (the seeds every task has)."""
    each = [by_seed(sweep, method, rank, stage, t) for t in tasks]
    seeds = set.intersection(*(set(e) for e in each))
    return {s: statistics.fmean(e[s] for e in each) for s in sorted(seeds)}


def short(sweep: str) -> str:
    return sweep.removeprefix("experiments/") + "runs/*/results.jsonl"


def claims_minilm_glue() -> None:
    """experiments/minilm_glue/README.md: every section's numbers from its jobs' results."""
    P = "experiments/minilm_glue/README.md"
    S = "experiments/minilm_glue/"
    src = short(S)

    def original_avg() -> dict[int, float]:
        return average(S, "-", "-", "finetuned")

    def paired(a, b, word: str | None = None, table_word: bool = False) -> Value:
        """``a`` minus ``b`` (each a function giving seed -> score) paired by seed, higher is better: the mean
        difference and its 95% t-interval (``collab_attn.stats.paired_comparison``); ``word``: the verdict the page
        gives for ``a`` (ahead, behind, tie), else the claim cannot be computed."""
        def compute():
            from collab_attn.stats import paired_comparison

            c = paired_comparison(a(), b(), higher_is_better=True)
            if word is not None and WORDS[c.verdict] != word:
                raise ValueError(f"the seeds' verdict is {WORDS[c.verdict]}, where the page says {word}")
            return [c.mean_difference, *c.interval]
        return Value(src, compute)

    def change(method, rank, stage, word=None) -> Value:
        return paired(lambda: average(S, method, rank, stage), original_avg, word)

    def spread(method, rank, stage, task) -> Value:
        from collab_attn.run_store import mean_std

        return Value(src, lambda: list(mean_std(list(by_seed(S, method, rank, stage, task).values()))))

    def one(method, rank, stage, task) -> Value:
        def compute():
            found = by_seed(S, method, rank, stage, task)
            if list(found) != [0]:
                raise ValueError(f"{method} {rank} {stage} {task}: seeds {list(found)}, where the page says seed 0")
            return [found[0]]
        return Value(src, compute)

    # The setup
    cited(P, "(95% t-interval;", "collab_attn.stats.CONFIDENCE, a setting")
    cited(P, "(`refit=distill`: alpha 0.5, T 4,", "configs/refit/distill.yaml, a setting")
    cited(P, "## 3. Re-fine-tuned with distillation (`refit=distill`: alpha 0.5, T 4)",
          "configs/refit/distill.yaml, a setting")

    # 1. Without retraining
    cell = "{:+.1f} [{:+.1f}, {:+.1f}], "
    claim(P, "Change of the four-task average against the fine-tuned originals ({:.1f}), three seeds",
          Value(src, lambda: [statistics.fmean(original_avg().values())]))
    sizes = {"cp": (384, 256, 192, 128, 96, 64), "cp-aware": (256, 192, 128, 96, 64), "prune": (256, 192, 128, 96, 64),
             "svd": (252, 192, 120, 96, 60)}
    verdicts = {
        "reparam": {384: ["tie (exact)"], 256: ["behind", "tie", "tie", "behind"],
                    192: ["behind", "tie", "tie", "behind"], 128: ["behind", "tie", "behind", "behind"],
                    96: ["behind"] * 4, 64: ["behind"] * 4},
        "refit": {384: ["tie"], 256: ["tie", "tie", "tie", "behind"], 192: ["behind", "tie", "tie", "behind"],
                  128: ["behind", "tie", "tie", "behind"], 96: ["behind", "tie", "tie", "behind"],
                  64: ["behind"] * 4}}
    for stage, rows in verdicts.items():
        for row, words in rows.items():
            i = (384, 256, 192, 128, 96, 64).index(row)
            cells, values = [], []
            for method, word in zip(sizes, words):
                rank = (252, 192, 120, 96, 60)[i - 1] if method == "svd" else row
                cells.append(cell + word)
                values.append(change(method, rank, stage, word.removesuffix(" (exact)")))
            tail = " |" if row != 384 else " | | | |"
            claim(P, f"| {row} | " + " | ".join(cells) + tail, *values)
    claim(P, "MRPC F1 (fine-tuned {:.1f} ± {:.1f}; answering \"paraphrase\" to every pair scores {:.1f})",
          spread("-", "-", "finetuned", "mrpc"), fit_check(S, "mrpc", "dev, majority class"))
    for method, ranks in sizes.items():
        ranks = [r for r in ranks if r != 384]
        claim(P, f"| `{method}` | " + " | ".join(["{:.1f} ± {:.1f}"] * len(ranks)) + " |",
              *(spread(method, r, "reparam", "mrpc") for r in ranks))

    def prune_cp(rank, stage, word, m=("prune", "cp-aware")) -> Value:
        return paired(lambda: average(S, m[0], rank, stage), lambda: average(S, m[1], rank, stage), word)
    claim(P, "tied at 256 ({:+.1f} [{:+.1f}, {:+.1f}]) and 192 ({:+.1f} [{:+.1f},\n  {:+.1f}]), behind at 128 "
             "({:+.1f} [{:+.1f}, {:+.1f}]), **ahead at 64** ({:+.1f} [{:+.1f}, {:+.1f}])",
          prune_cp(256, "reparam", "tie"), prune_cp(192, "reparam", "tie"), prune_cp(128, "reparam", "behind"),
          prune_cp(64, "reparam", "ahead"))
    claim(P, "(plain CP {:.1f} to {:.1f} from 256 to 64,\n  activation-aware {:.1f} to {:.1f}, against {:.1f})",
          one("cp", 256, "reparam", "sst2"), one("cp", 64, "reparam", "sst2"),
          one("cp-aware", 256, "reparam", "sst2"), one("cp-aware", 64, "reparam", "sst2"),
          one("-", "-", "finetuned", "sst2"))

    # 2. Re-fine-tuned
    paper = "the paper's Table 2 (BERT-base on GLUE, re-fine-tuned), a published figure"
    claim(P, "at 192 it is {:.1f} behind", Value(src, lambda: [-change("cp", 192, "refit", "behind").numbers()[0]]))
    cited(P, "BERT-base loss at half size (0.5; the paper's\n  figures: +0.2 at 768, -0.5 at 384, -1.3 at 256, with no "
             "interval)", paper)
    claim(P, "and at a third {:.1f} behind", Value(src, lambda: [-change("cp", 128, "refit", "behind").numbers()[0]]))
    cited(P, "(the paper: 1.3)", paper)
    claim(P, "pruning minus CP {:+.1f} [{:+.1f}, {:+.1f}]; at 128 {:+.1f} [{:+.1f}, {:+.1f}]",
          prune_cp(64, "refit", "tie"), prune_cp(128, "refit", "tie"))

    def sst2_refit(skip_svd60: bool):
        def compute():
            found = [v[0] for (m, r, st, t), v in scores(S).items() if st == "refit" and t == "sst2"
                     and m in ("cp", "cp-aware", "prune", "svd") and ((m, r) == ("svd", "60")) != skip_svd60]
            return [min(found), max(found)]
        return Value(src, compute)
    claim(P, "within about a point of the original's {:.1f} ({:.1f} to {:.1f}),\n  SVD at 60 aside ({:.1f})",
          one("-", "-", "finetuned", "sst2"), sst2_refit(True),
          Value(src, lambda: [by_seed(S, "svd", 60, "refit", "sst2")[0]]))
    cited(P, "One dev sentence is 0.11 points", "SST-2's dev set: 872 sentences (GLUE), 100/872")

    # 3. Re-fine-tuned with distillation
    kd = " + KD a0.5 T4"
    rows3 = [("`cp-aware` 128", "cp-aware", 128, ("tie", "tie", "tie")),
             ("`prune` 128", "prune", 128, ("tie", "tie", "tie")),
             ("`cp-aware` 64", "cp-aware", 64, ("behind", "behind", "tie")),
             ("`prune` 64", "prune", 64, ("behind", "behind", "tie")),
             ("`svd` 60", "svd", 60, ("behind", "behind", "tie"))]
    for label, method, rank, words in rows3:
        claim(P, f"| {label} | " + " | ".join(cell + w for w in words) + " |",
              change(method, rank, "refit", words[0]), change(method + kd, rank, "refit", words[1]),
              paired(lambda m=method, r=rank: average(S, m + kd, r, "refit"),
                     lambda m=method, r=rank: average(S, m, r, "refit"), words[2]))
    cited(P, "within 0.5 of the original at 128 and 1.0 at 64", "the issue's aims")

    def excludes(value: Value, limit: float) -> Value:
        def compute():
            numbers = value.numbers()
            if not numbers[2] < limit:
                raise ValueError(f"the interval's top {numbers[2]} does not exclude {limit}")
            return numbers[:1]
        return Value(value.source, compute)
    claim(P, "at 128 not\n  settled ({:+.1f}, an interval from {:+.1f} to {:+.1f}); at 64 **missed** ({:+.1f}, the "
             "interval excludes -1.0)", change("cp-aware" + kd, 128, "refit", "tie"),
          excludes(change("cp-aware" + kd, 64, "refit", "behind"), -1.0))

    def higher_on_every_seed(rank) -> Value:
        value = prune_cp(rank, "refit", "tie", ("cp-aware" + kd, "prune" + kd))

        def compute():
            a, b = average(S, "cp-aware" + kd, rank, "refit"), average(S, "prune" + kd, rank, "refit")
            if not all(a[s] > b[s] for s in a):
                raise ValueError("CP is not higher on every seed")
            return value.numbers()
        return Value(src, compute)
    claim(P, "(CP minus pruning {:+.1f} [{:+.1f}, {:+.1f}] at 128, {:+.1f} [{:+.1f},\n  {:+.1f}] at 64, where CP is "
             "higher on all three seeds)", prune_cp(128, "refit", "tie", ("cp-aware" + kd, "prune" + kd)),
          higher_on_every_seed(64))

    def seed0_change(method) -> Value:
        def compute():
            after = average(S, method, 192, "refit")
            if list(after) != [0]:
                raise ValueError(f"{method} 192: seeds {list(after)}")
            return [after[0] - original_avg()[0]]
        return Value(src, compute)
    claim(P, "(CP {:+.1f}, pruning {:+.1f} distilled; one seed, no interval)", seed0_change("cp-aware" + kd),
          seed0_change("prune" + kd))
    claim(P, "distilled CP {:.1f} at 128 and {:.1f} at 64 against {:.1f} (readings)",
          one("cp-aware" + kd, 128, "refit", "sst2"), one("cp-aware" + kd, 64, "refit", "sst2"),
          one("-", "-", "finetuned", "sst2"))

    # Are the fine-tuned baselines plausible?
    turc = "Turc et al. (2019), Well-Read Students Learn Better, GLUE test: a published figure"
    cited(P, "| 4 x 512 | 27.8 | 89.7 | 83.4 | 78.8 | 61.8 |", turc)
    cited(P, "| 8 x 512 | 38.0 | 89.6 | 86.6 | 80.4 | 62.2 |", turc)
    claim(P, "| 6 x 384 | {:.1f} ± {:.1f} | {:.1f} | {:.1f} ± {:.1f} | {:.1f} ± {:.1f} | {:.1f} ± {:.1f} |",
          spread("-", "-", "finetuned", "cola"), one("-", "-", "finetuned", "sst2"),
          *(spread("-", "-", "finetuned", t) for t in ("mrpc", "stsb", "rte")))
    claim(P, "RTE is low on every seed ({:.1f}, {:.1f}, {:.1f}; majority\nclass {:.1f})",
          Value(src, lambda: list(by_seed(S, "-", "-", "finetuned", "rte").values())),
          fit_check(S, "rte", "dev, majority class"))
    claim(P, "RTE {:.1f} train against {:.1f} dev on seed 0", fit_check(S, "rte", "train", "dev"))
    rte_recipe = "experiments/minilm_rte_recipe/"
    claim(P, "{:.1f} again at lr 3e-5", Value(short(rte_recipe), lambda: [
        by_seed(rte_recipe, "-", "-", "finetuned", "rte")[0]]))
    random = "experiments/minilm_random_init/"
    claim(P, "initialization RTE scores {:.1f} ± {:.1f}, against the pretrained {:.1f} ± {:.1f} a tie (paired by "
             "seed: {:+.1f} [{:+.1f}, {:+.1f}];",
          Value(short(random), lambda: _mean_std(by_seed(random, "-", "-", "finetuned", "rte"))),
          spread("-", "-", "finetuned", "rte"),
          paired(lambda: by_seed(random, "-", "-", "finetuned", "rte"),
                 lambda: by_seed(S, "-", "-", "finetuned", "rte"), "tie"))
    cited(P, "RTE (277 pairs,\none pair 0.36 points)", "RTE's dev set: 277 pairs (GLUE), 100/277")
    strict(P)


def _mean_std(values: dict[int, float]) -> list[float]:
    from collab_attn.run_store import mean_std

    return list(mean_std(list(values.values())))


def fit_check(sweep: str, task: str, *columns: str) -> Value:
    """Columns of one task's row of ``fit_check.md`` (scripts/fit_check.py): train, dev, dev majority class."""
    path = sweep + "fit_check.md"

    def compute():
        file = ROOT / path
        if not file.is_file():
            raise cli.Missing(f"{path}: no such file (a claim cites it)")
        lines = [line for line in file.read_text().splitlines() if line.startswith("|")]
        head = [h.strip() for h in lines[0].strip("|").split("|")]
        row = next(line for line in lines[2:] if line.strip("|").split("|")[0].strip() == task)
        cells = [x.strip() for x in row.strip("|").split("|")]
        return [float(cells[head.index(c)]) for c in columns]
    return Value(path.removeprefix("experiments/"), compute)


def stage_minutes(sweep: str, task: str, stages=("finetuned", "refit")) -> list[float]:
    """Minutes of every stage ``stages`` that trained (a fine-tuned model loaded from the cache takes seconds) in the
    jobs of one task."""
    import json

    found = []
    for f in sorted((ROOT / sweep).glob(f"runs/{task}/*/*/*/results.jsonl")):
        for line in f.read_text().splitlines():
            r = json.loads(line)
            if r["stage"] in stages and r["seconds"] > 300:
                found.append(r["seconds"] / 60)
    if not found:
        raise ValueError(f"{sweep}: no {task} jobs with a training stage")
    return found
