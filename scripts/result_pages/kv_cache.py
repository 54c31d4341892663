"""The claims of experiments/kv_cache/README.md, the cache race: the Tiny Shakespeare race from its seeds' run files
(``shakespeare_cpu/convert*/seed<s>/runs/*.json`` of scripts/convert_lm.py), the MiniLM budget race from
``minilm_glue/summary.csv`` and its runs' ``results.jsonl`` (scripts/train_glue.py, scripts/summarize.py glue)."""

from __future__ import annotations

import csv
import functools
import json
import statistics

from result_pages.engine import ROOT, Value, cited, claim, cli, field, formula, run, strict

SEEDS = (0, 1, 2)
RESOLUTION = 1e-5  # collab_attn.char_lm.race_summary.LOSS_RESOLUTION: the race's paired rule
WORDS = {"better": "ahead", "worse": "behind", "tie": "tie"}


@functools.cache
def summary_rows(path: str) -> tuple[dict, ...]:
    """The rows of a summary.csv of scripts/summarize.py glue."""
    file = ROOT / path
    if not file.is_file():
        raise cli.Missing(f"{path}: no such summary file (a claim cites it)")
    return tuple(csv.DictReader(file.open()))


def summary(path: str, method: str, stage: str, *tasks: str) -> Value:
    """The scores of one row (``method``, ``stage``) of a summary.csv, per task."""
    def compute():
        rows = [r for r in summary_rows(path) if r["method"] == method and r["stage"] == stage]
        if len(rows) != 1:
            raise ValueError(f"{len(rows)} rows of {method} ({stage}) in {path}")
        return [float(rows[0][t]) for t in tasks]
    return Value(path.removeprefix("experiments/"), compute)


@functools.cache
def jsonl(path: str) -> tuple[dict, ...]:
    files = sorted(ROOT.glob(path))
    if not files:
        raise cli.Missing(f"{path}: no run files match (a claim cites them)")
    return tuple(json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip())


def claims_kv_cache() -> None:
    """experiments/kv_cache/README.md: every section's numbers from its run files."""
    P = "experiments/kv_cache/README.md"
    X = "experiments/kv_cache/shakespeare_cpu/"
    G = "experiments/kv_cache/minilm_glue/"
    stages = {"plain": "convert", "distilled": "convert_distill"}

    def seed_run(stage: str, name: str, seed: int) -> dict:
        return run(f"{X}{stages[stage]}/seed{seed}/runs/{name}.json")

    def by_seed(stage: str, name: str, key: str) -> dict[int, float]:
        if key == "original":
            return {s: run(f"{X}runs/concat-k128-seed{s}.json")["best_val_loss"] for s in SEEDS}
        return {s: seed_run(stage, name, s)[key] for s in SEEDS}

    def src(stage: str, name: str) -> str:
        return f"kv_cache/shakespeare_cpu/{stages[stage]}/seed*/runs/{name}.json"

    def spread(stage: str, name: str, key: str) -> Value:
        """Mean and sample standard deviation over the seeds."""
        from collab_attn.run_store import mean_std

        return Value(src(stage, name), lambda: list(mean_std(list(by_seed(stage, name, key).values()))))

    def mean(stage: str, name: str, key: str) -> Value:
        return Value(src(stage, name), lambda: [statistics.fmean(by_seed(stage, name, key).values())])

    def paired(a: tuple, b: tuple, word: str | None = None, sign: float = 1.0) -> Value:
        """``a`` minus ``b`` paired by seed (each a (stage, name, key)), times ``sign``: the mean difference and its
        95% t-interval, as the race's rule (``compare_on_shared_seeds``); ``word``: the verdict for ``a`` the page
        gives (ahead, behind, tie), else the claim cannot be computed."""
        def compute():
            from collab_attn.stats import compare_on_shared_seeds

            c = compare_on_shared_seeds(by_seed(*a), by_seed(*b), resolution=RESOLUTION)
            if word is not None and WORDS[c.verdict] != word:
                raise ValueError(f"the seeds' verdict is {WORDS[c.verdict]}, where the page says {word}")
            values = [c.mean_difference, *c.interval]
            return [sign * values[0], *sorted(sign * x for x in values[1:])]
        return Value(f"{src(a[0], a[1])} against {src(b[0], b[1])}", compute)

    def names(fraction: float) -> dict[str, str]:
        """Method -> run name at one cache budget."""
        found = {}
        for f in sorted((ROOT / f"{X}convert/seed0/runs").glob("*.json")):
            r = json.loads(f.read_text())
            if r["cache_fraction"] == fraction:
                found[r["method"]] = r["name"]
        return found

    def ranking(stage: str, fraction: float, key: str, best: str, tied: set[str]) -> None:
        """Raise unless ``best`` has the lowest mean at the budget and the rule ties exactly ``tied`` with it."""
        from collab_attn.stats import rank

        at = names(fraction)
        r = rank({m: by_seed(stage, n, key) for m, n in at.items()}, resolution=RESOLUTION)
        if r.order[0] != best or set(r.tied) != tied:
            raise ValueError(f"at {fraction} ({stage}, {key}) the best is {r.order[0]}, tied with {r.tied}: the page "
                             f"says {best}, tied with {sorted(tied)}")

    def checked(value: Value, *checks) -> Value:
        def compute():
            for check in checks:
                check()
            return value.numbers()
        return Value(value.source, compute)

    BUDGETS = {"1/2": 0.5, "1/4": 0.25, "1/8": 0.125}
    conv, ret = "converted_val_loss", "retrained_val_loss"

    # The setup
    concat = X + "runs/concat-k128-seed0.json"

    def tokens(r):
        t = r["signature"]["trainer"]
        steps, batch, block = t["max_steps"], t["per_device_train_batch_size"], r["signature"]["block_size"]
        return [steps, batch, block, steps * batch * block]
    claim(P, "**all weights from scratch, {:,.0f} x {:.0f} x {:.0f} = {:,.0f} tokens**", formula(tokens, concat))
    claim(P, "best validation loss {:.4f} ± {:.4f}). The original caches {:,.0f} bytes per\n  token",
          spread("plain", "none-k128", "original"), field(concat, "cache_bytes_per_token_bf16"))
    cited(P, "256 training blocks (16,384 tokens)", "scripts/convert_lm.py's calibration setting (256 blocks of 64)")

    def retrain_tokens(r, c):
        steps, batch, block = r["retrain_steps"], c["signature"]["trainer"]["per_device_train_batch_size"], \
            c["signature"]["block_size"]
        return [steps, batch, block, steps * batch * block, 100 * steps / c["signature"]["trainer"]["max_steps"]]
    claim(P, "**all weights, {:.0f} x {:.0f} x {:.0f} = {:,.0f} tokens** per seed ({:.0f}% of the recipe",
          formula(retrain_tokens, X + "convert/seed0/runs/cp-k62-v62.json", concat))
    claim(P, "(`convert_distill/`: alpha {:.1f}, T {:.0f})",
          field(X + "convert_distill/seed0/runs/cp-k62-v62.json", "distill.alpha", "distill.temperature"))
    cited(P, "per-seed differences, 95% t-interval", "collab_attn.stats.CONFIDENCE, a setting")
    claim(P, "| none fits 1/2: run at {:.2f}x |",
          formula(lambda r: [r["cache_bytes_per_token_bf16"] / r["original_cache_bytes_per_token_bf16"]],
                  X + "convert/seed0/runs/key-svd-k16.json"))

    # 1. Without retraining
    order = ["kv-svd-aware", "kv-svd", "tucker-aware", "tucker", "cp-aware", "cp", "svd", "prune"]
    bold = {("kv-svd-aware", 0.25), ("kv-svd-aware", 0.125)}
    for method in order:
        cells, values = [], []
        for fraction in BUDGETS.values():
            name = names(fraction).get(method)
            if name is None:
                cells.append("-")
                continue
            cells.append("**{:.4f} ± {:.4f}**" if (method, fraction) in bold else "{:.4f} ± {:.4f}")
            values.append(spread("plain", name, conv))
        label = f"`{method}` (MLA)" if method == "kv-svd-aware" else f"`{method}`"
        claim(P, f"| {label} | " + " | ".join(cells) + " |", *values)
    claim(P, "| `key-svd-aware` / `key-svd` at 0.56x | {:.4f} ± {:.4f} / {:.4f} ± {:.4f} |",
          spread("plain", "key-svd-aware-k16", conv), spread("plain", "key-svd-k16", conv))
    half, quarter, eighth = names(0.5), names(0.25), names(0.125)
    claim(P, "(against `kv-svd`: {:+.4f} [{:+.4f}, {:+.4f}])",
          checked(paired(("plain", half["tucker-aware"], conv), ("plain", half["kv-svd"], conv), "tie"),
                  lambda: ranking("plain", 0.5, conv, "tucker-aware",
                                  {"kv-svd", "kv-svd-aware", "tucker", "cp-aware", "svd"})))
    claim(P, "(of the runner-up, `tucker-aware`, by {:.4f} [{:.4f},\n  {:.4f}])",
          checked(paired(("plain", quarter["tucker-aware"], conv), ("plain", quarter["kv-svd-aware"], conv),
                         "behind"), lambda: ranking("plain", 0.25, conv, "kv-svd-aware", set())))
    claim(P, "tied with the original ({:+.4f} [{:+.4f}, {:+.4f}])",
          paired(("plain", quarter["kv-svd-aware"], conv), ("plain", "none-k128", "original_val_loss"), "tie"))
    claim(P, "(of `kv-svd` by {:.4f} [{:.4f}, {:.4f}])",
          checked(paired(("plain", eighth["kv-svd"], conv), ("plain", eighth["kv-svd-aware"], conv), "behind"),
                  lambda: ranking("plain", 0.125, conv, "kv-svd-aware", set())))
    claim(P, "original ({:+.4f} [{:+.4f}, {:+.4f}]); every collaborative form is behind it (`tucker-aware` by {:.4f} "
             "[{:.4f},\n  {:.4f}], `cp-aware` by {:.4f} [{:.4f}, {:.4f}])",
          paired(("plain", eighth["kv-svd-aware"], conv), ("plain", "none-k128", "original_val_loss"), "tie"),
          paired(("plain", eighth["tucker-aware"], conv), ("plain", eighth["kv-svd-aware"], conv), "behind"),
          paired(("plain", eighth["cp-aware"], conv), ("plain", eighth["kv-svd-aware"], conv), "behind"))

    # 2. After the short re-training
    claim(P, "## 2. After the short re-training (all weights, {:,.0f} tokens per seed)",
          formula(lambda r, c: [retrain_tokens(r, c)[3]], X + "convert/seed0/runs/cp-k62-v62.json", concat))
    claim(P, "| `none` (the original, re-trained the same way) | {:.4f} / {:.4f} (every budget) |",
          mean("plain", "none-k128", ret), mean("distilled", "none-k128", ret))
    lowest = {}
    for fraction in BUDGETS.values():
        for stage in stages:
            at = names(fraction)
            means = {m: statistics.fmean(by_seed(stage, n, ret).values()) for m, n in at.items()}
            lowest[stage, fraction] = min(means, key=means.get)
    for method in order:
        cells, values = [], []
        for fraction in BUDGETS.values():
            name = names(fraction).get(method)
            if name is None:
                cells.append("-")
                continue
            cells.append(" / ".join("**{:.4f}**" if lowest[s, fraction] == method else "{:.4f}" for s in stages))
            values += [mean(s, name, ret) for s in stages]
        claim(P, f"| `{method}` | " + " | ".join(cells) + " |", *values)

    def stds():
        out = [std for stage in stages for fraction in BUDGETS.values() for name in names(fraction).values()
               for std in [statistics.stdev(by_seed(stage, name, ret).values())]]
        return [min(out), max(out)]
    claim(P, "the std over seeds is {:.3f} to {:.3f}", Value("kv_cache/shakespeare_cpu/convert*/seed*/runs", stds))

    def ties() -> None:
        ranking("plain", 0.5, ret, "tucker-aware", {"svd", "tucker"})
        ranking("distilled", 0.5, ret, "tucker-aware", {"tucker"})
        for stage, count, member in (("plain", 4, "cp"), ("distilled", 3, "cp-aware")):
            from collab_attn.stats import rank

            r = rank({m: by_seed(stage, n, ret) for m, n in quarter.items()}, resolution=RESOLUTION)
            if len(r.tied) != count or member not in r.tied:
                raise ValueError(f"at 1/4 ({stage}) the best ties {r.tied}")
        from collab_attn.stats import compare_on_shared_seeds

        for stage in stages:
            for mla in ("kv-svd", "kv-svd-aware"):
                for other, name in eighth.items():
                    if other in ("kv-svd", "kv-svd-aware"):
                        continue
                    c = compare_on_shared_seeds(by_seed(stage, eighth[mla], ret), by_seed(stage, name, ret),
                                                resolution=RESOLUTION)
                    if c.verdict != "better":
                        raise ValueError(f"at 1/8 ({stage}) {mla} is {c.verdict} against {other}")
            c = compare_on_shared_seeds(by_seed(stage, eighth["kv-svd"], ret),
                                        by_seed(stage, eighth["kv-svd-aware"], ret), resolution=RESOLUTION)
            if c.verdict != "tie":
                raise ValueError(f"at 1/8 ({stage}) kv-svd is {c.verdict} against kv-svd-aware")
    claim(P, "at 1/8 MLA (`kv-svd`, `kv-svd-aware`, tied with each other) is ahead of the rest",
          Value("kv_cache/shakespeare_cpu/convert*/seed*/runs: the paired rule", lambda: ties() or []))

    for label, fraction in BUDGETS.items():
        at = names(fraction)
        cells, values = [], []
        for method in ("cp-aware", "tucker-aware"):
            parts = []
            for stage, key in (("plain", conv), ("plain", ret), ("distilled", ret)):
                from collab_attn.stats import compare_on_shared_seeds

                c = compare_on_shared_seeds(by_seed(stage, at[method], key), by_seed(stage, at["kv-svd-aware"], key),
                                            resolution=RESOLUTION)
                word = {"better": "**ahead**", "worse": "behind", "tie": "tie"}[c.verdict]
                parts.append("{:+.4f} [{:+.4f}, {:+.4f}] " + word)
                values.append(paired((stage, at[method], key), (stage, at["kv-svd-aware"], key)))
            cells.append(" / ".join(parts))
        claim(P, f"| {label} | converted / plain / distilled | " + " | ".join(cells) + " |", *values)

    def aim(stage: str, method: str, fraction: float) -> Value:
        return paired((stage, names(fraction)[method], ret), (stage, names(fraction)[method], "original_val_loss"))

    def reaches(value: Value, limit: float, past: bool) -> Value:
        """``value`` (a difference and its interval), whose interval's top reaches past ``limit`` (``past``), or
        not."""
        def compute():
            numbers = value.numbers()
            if (numbers[2] > limit) != past:
                raise ValueError(f"the interval's top {numbers[2]:.4f} {'does not reach' if past else 'reaches'} "
                                 f"past {limit}")
            return numbers
        return Value(value.source, compute)
    cited(P, "within 0.02 at 1/4", "the issue's aim (issue 43)")
    cited(P, "(the intervals reach past 0.02)", "the issue's aim (issue 43)")
    cited(P, "within 0.05 at 1/8", "the issue's aim (issue 43)")
    claim(P, "plain `cp` {:+.4f} [{:+.4f}, {:+.4f}] and `cp-aware` {:+.4f} [{:+.4f}, {:+.4f}]",
          reaches(aim("plain", "cp", 0.25), 0.02, True), reaches(aim("plain", "cp-aware", 0.25), 0.02, True))
    claim(P, "distilled `cp` {:+.4f} [{:+.4f}, {:+.4f}] and `tucker` (plain {:+.4f}\n    [{:+.4f}, {:+.4f}], "
             "distilled {:+.4f} [{:+.4f}, {:+.4f}]): met",
          reaches(aim("distilled", "cp", 0.25), 0.02, False), reaches(aim("plain", "tucker", 0.25), 0.02, False),
          reaches(aim("distilled", "tucker", 0.25), 0.02, False))
    claim(P, "`cp` {:+.4f} [{:+.4f}, {:+.4f}], distilled {:+.4f} [{:+.4f}, {:+.4f}]; `tucker` {:+.4f}\n    [{:+.4f}, "
             "{:+.4f}], distilled {:+.4f} [{:+.4f}, {:+.4f}]: met",
          *(reaches(aim(s, m, 0.125), 0.05, False) for m in ("cp", "tucker") for s in stages))
    cited(P, "within 0.5x of the original's time", "the issue's aim (issue 43)")
    cited(P, "decoding at the 0.5x aim", "the issue's aim (issue 43)")
    bench = "experiments/benchmarks/"
    claim(P, "decodes at {:.2f}x (batch 8, static compiled cache, **faster** by `timing_verdict`)",
          _gpt2_decode(bench))

    def share(*methods_names: str) -> Value:
        return formula(lambda *rs: [100 * r["parameters"]["attention_params"] / r["original_parameters"][
            "attention_params"] for r in rs], *(f"{X}convert/seed0/runs/{n}.json" for n in methods_names))
    claim(P, "collaborative keys and values keep {:.0f}%, {:.0f}%, {:.0f}% of the attention\n  parameters, Tucker "
             "{:.0f}%, {:.0f}%, {:.0f}%, MLA {:.0f}%, {:.0f}%, {:.0f}%",
          share(*(names(f)["cp"] for f in BUDGETS.values())), share(*(names(f)["tucker"] for f in BUDGETS.values())),
          share(*(names(f)["kv-svd"] for f in BUDGETS.values())))

    # 3. MiniLM on GLUE
    S = G + "summary.csv"
    tasks = ("sst2", "mrpc", "stsb", "rte")

    def attention(method: str, rank: int) -> Value:
        """The converted model's attention parameters and cache over the original's (``minilm_sizes``), for the
        model of an MRPC run's results.jsonl."""
        path = f"{G}runs/mrpc/minilm/{method}-r{rank}/seed0-*/results.jsonl"
        return Value(path.removeprefix("experiments/"), lambda: minilm_sizes(path, method, rank))

    claim(P, "| 1 | original (fine-tuned) | | 1 / 1 | {:.1f} | {:.1f} | {:.1f} | {:.1f} |",
          summary(S, "-", "finetuned", *tasks))
    rows = [("1/2", "collaborative keys and values (CP), aware", "186/186", "cp-v186-aware", 186, "0.500"),
            ("1/2", "the same, Tucker", "82/82", "tucker-v82-aware", 82, "0.229"),
            ("1/2", "pruning", "183 (6 of 12 heads)", "prune", 183, "0.486"),
            ("1/2", "SVD-truncated keys and values", "180/180", "svd-v180", 180, "0.484"),
            ("1/4", "CP, aware", "91/91", "cp-v91-aware", 91, "0.253"),
            ("1/4", "Tucker", "51/51", "tucker-v51-aware", 51, "0.148"),
            ("1/4", "pruning", "88", "prune", 88, "0.236"),
            ("1/4", "SVD", "84/84", "svd-v84", 84, "0.234"),
            ("1/8", "CP, aware", "44/44", "cp-v44-aware", 44, "0.130"),
            ("1/8", "Tucker", "30/30", "tucker-v30-aware", 30, "0.094"),
            ("1/8", "pruning", "41", "prune", 41, "0.111"),
            ("1/8", "SVD", "36/36", "svd-v36", 36, "0.109"),
            ("(cache 1/4)", "MLA, aware", "192", "kv-svd-aware", 192, "0.25"),
            ("(cache 1/8)", "MLA, aware", "96", "kv-svd-aware", 96, "0.125")]
    for budget, label, size, method, rank, cache in rows:
        def one_row(method=method, rank=rank):
            return [r for r in summary_rows(S) if r["method"] == method and r["rank"] == str(rank)
                    and r["stage"] == "reparam"][0]
        cache_spec = "{:.2f}" if cache == "0.25" else "{:.3f}"
        claim(P, f"| {budget} | {label} | {size} | {{:.3f}} / {cache_spec} | " + " | ".join(["{:.1f}"] * 4) + " |",
              attention(method, rank),
              Value(S.removeprefix("experiments/"), lambda one_row=one_row: [float(one_row()[t]) for t in tasks]))
    cited(P, "(alpha 0.5, T 4)", "the re-fine-tuning's setting (refit=distill)")
    refit = [("CP, aware, 91/91", "cp-v91-aware + KD a0.5 T4"), ("Tucker, 51/51", "tucker-v51-aware + KD a0.5 T4"),
             ("pruning, 88", "prune + KD a0.5 T4"), ("SVD, 84/84", "svd-v84 + KD a0.5 T4")]
    for label, method in refit:
        claim(P, f"| {label} | {{:.1f}} → {{:.1f}} | {{:.1f}} → {{:.1f}} |",
              *(v for t in ("mrpc", "stsb")
                for v in (summary(S, method, "reparam", t), summary(S, method, "refit", t))))
    claim(P, "| MLA, aware, 192 ({:.0f}% of the parameters) | {:.1f} → {:.1f} | {:.1f} → {:.1f} |",
          Value("kv_cache/minilm_glue/runs/mrpc", lambda: [100 * attention("kv-svd-aware", 192).numbers()[0]]),
          *(v for t in ("mrpc", "stsb") for v in (summary(S, "kv-svd-aware + KD a0.5 T4", "reparam", t),
                                                  summary(S, "kv-svd-aware + KD a0.5 T4", "refit", t))))
    three = "experiments/minilm_glue/summary.csv"
    claim(P, "the fine-tuned models spread by {:.1f} MRPC F1, {:.1f} STS-B and {:.1f} RTE points",
          Value(three.removeprefix("experiments/"), lambda: [float([r for r in summary_rows(three)
                                                                    if r["stage"] == "finetuned"][0][t + "_std"])
                                                              for t in ("mrpc", "stsb", "rte")]))
    cited(P, "one SST-2 sentence is 0.11 points", "SST-2's validation set: 872 sentences (GLUE), 100/872")
    from result_pages.minilm_glue import fit_check

    claim(P, "MRPC's\n  majority answer scores F1 {:.1f}",
          fit_check("experiments/minilm_glue/", "mrpc", "dev, majority class"))
    claim(P, "RTE (chance {:.1f})", fit_check("experiments/minilm_glue/", "rte", "dev, majority class"))

    # What is left open
    claim(P, "(the control ends at {:.4f}, above the original's {:.4f})", mean("plain", "none-k128", ret),
          mean("plain", "none-k128", "original"))
    strict(P)


def _gpt2_decode(bench: str) -> Value:
    """GPT-2 small with ``cp`` 186/186 decoding at 8,192 positions, batch 8, static compiled cache: its time over the
    original's (the benchmarks page's section 5), its timing verdict faster."""
    from result_pages.benchmarks import row

    return row(bench + "decode_kernels_kv_cpu_float32_batch8_with.json", verdict="faster", batch=8, context=8192,
               cache="static", model="cp k186 v186 (0.25)")


@functools.cache
def _sizes(label: str):
    import transformers

    from collab_attn.models.settings import parse_label
    from collab_attn.models.sizing import conversion_sizes, original_size

    # all-MiniLM-L6-v2 ("minilm", collab_attn.models.checkpoints): 6 layers, d = 384, 12 heads of 32
    config = transformers.BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                     intermediate_size=1536)
    return original_size(config), {s.rank: s for s in conversion_sizes(config, parse_label(label)[0])}


def minilm_sizes(path: str, method: str, rank: int) -> list[float]:
    """The attention parameters (self-attention and output projection) and the cache of MiniLM converted by
    ``method`` at ``rank``, over the original's, as ``collab_attn.models.sizing`` counts them; the run's
    results.jsonl must agree: its original's self-attention parameters (without the output projection, 4 d^2 + 4 d
    less d^2 + d per layer) and its converted model's rank."""
    rows = jsonl(path)
    original, sizes = _sizes(method.split("-v")[0].removesuffix("-aware"))
    layers, d = 6, 384
    finetuned = next(r for r in rows if r["stage"] == "finetuned")
    if finetuned["attention_params"] != original.attention_params - layers * (d * d + d):
        raise ValueError(f"{path}: the run's model is not the 6-layer MiniLM sized here")
    if next(r for r in rows if r["stage"] == "reparam")["rank"] != rank:
        raise ValueError(f"{path}: not rank {rank}")
    size = sizes[rank]
    return [size.attention_params / original.attention_params, size.cache_bytes / original.cache_bytes]
