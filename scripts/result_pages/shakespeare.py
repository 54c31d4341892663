"""The claims of experiments/shakespeare_char/README.md, the Tiny Shakespeare page."""

from __future__ import annotations

import statistics

from result_pages.engine import (
    Value,
    cited,
    claim,
    field,
    formula,
    run,
    seed_pairs,
    seed_runs,
    seeds_word,
    short,
    strict,
)


def claims_shakespeare() -> None:
    """experiments/shakespeare_char/README.md, the Tiny Shakespeare page: every section's numbers from its run files
    (``<folder>/runs/*.json`` of scripts/train_lm.py, ``<folder>/convert/runs/*.json`` of scripts/convert_lm.py)."""
    P = "experiments/shakespeare_char/README.md"
    X = "experiments/shakespeare_char/"
    best = "best_val_loss"
    nano = "nanoGPT's published figure (../shared/data/tinyshakespeare/README.md)"

    def spread(pattern: str) -> Value:
        """Mean and sample standard deviation of the best validation loss over the seeds' run files."""
        from collab_attn.run_store import mean_std

        return Value(short(pattern), lambda: list(mean_std([r[best] for r in seed_runs(pattern).values()])))

    def tokens(path: str) -> Value:
        """steps x batch x block = tokens, from a run's signature: four numbers."""
        def compute(r):
            t = r["signature"]["trainer"]
            steps, batch, block = t["max_steps"], t["per_device_train_batch_size"], r["signature"]["block_size"]
            return [steps, batch, block, steps * batch * block]
        return formula(compute, path)

    def judged(a: str, b: str, verdict: str) -> Value:
        """``seed_pairs(a, b)`` on the best validation loss, whose verdict for ``a`` must be ``verdict`` (ahead,
        behind or tie: the interval below zero, above it, or across it), else the claim cannot be computed."""
        pairs = seed_pairs(a, b, best)

        def compute():
            mean, low, high = pairs.numbers()
            found = seeds_word(low, high)
            if found != verdict:
                raise ValueError(f"the seeds' verdict is {found}, where the page says {verdict}")
            return [mean, low, high]
        return Value(pairs.source, compute)

    def params(a: str, b: str, key: str = "attention_params") -> Value:
        return formula(lambda x, y: [x["parameters"][key] / y["parameters"][key]], a, b)

    # How to read the numbers: settings
    cited(P, "on the last 10% of `input.txt`", "nanoGPT's split (data/shakespeare_char/prepare.py), a setting")
    cited(P, "a 95%\n  t-interval", "collab_attn.stats.CONFIDENCE, a setting")
    cited(P, "[95%] |", "the tables' headers: collab_attn.stats.CONFIDENCE, a setting")
    cited(P, "5,000 steps, dropout 0.2)", "nanoGPT's config/train_shakespeare_char.py (configs/recipe/gpu.yaml)")

    # 1. nanoGPT reproduced
    gpu, cpu0, machine = X + "gpu/runs/concat-k384-seed0.json", X + "cpu/runs/concat-k128-seed0.json", \
        X + "cpu_machine/runs/concat-k128-seed0.json"
    claim(P, "| `gpu` | concatenated, seed 0, H100 bf16 | all weights, {:,.0f} x {:.0f} x {:.0f} = {:,.0f} tokens | "
             "**{:.4f}** |", tokens(gpu), field(gpu, best))
    cited(P, "| 1.4697 |", nano + ": config/train_shakespeare_char.py")
    claim(P, "| `cpu` | concatenated, seed 0, H100 bf16 (`cpu/`) | all weights, {:,.0f} x {:.0f} x {:.0f} = {:,.0f} "
             "tokens | {:.4f} | ~1.88 |", tokens(cpu0), field(cpu0, best))
    claim(P, "this 2-core CPU, float32, one thread (`cpu_machine/`) | the same | {:.4f} | ~1.88 |",
          field(machine, best))
    cited(P, "| ~1.88 |", nano + ": the CPU variant, 'about 1.88'")
    claim(P, "(final loss {:.4f} at step {:,.0f})", formula(lambda r: [r["final_val_loss"], r["curve"][-1]["step"]],
                                                            gpu))

    # 2. From scratch: collaborative against concatenated heads
    cpu = X + "cpu/runs/"
    claim(P, "Every row: all weights trained from scratch, {:,.0f} x {:.0f} x {:.0f} = {:,.0f} tokens per run",
          tokens(cpu + "collab-k16-seed0.json"))
    sizes = {128: ("tie", "| {:,.0f} / {:,.0f} | {:,.0f} / {:,.0f} |"), 64: ("tie", "| {:,.0f} / {:,.0f} | {:,.0f} |"),
             32: ("**collaborative ahead**", "| {:,.0f} / {:,.0f} | {:,.0f} |"),
             16: ("tie", "| {:,.0f} / {:,.0f} | {:,.0f} |")}
    for k, (word, rest) in sizes.items():
        concat, collab = cpu + f"concat-k{k}-seed*.json", cpu + f"collab-k{k}-seed*.json"
        cache = [f"concat-k{k}-seed0.json", f"collab-k{k}-seed0.json"] if k == 128 else [f"collab-k{k}-seed0.json"]
        claim(P, f"| {{:.4f}} ± {{:.4f}} | {{:.4f}} ± {{:.4f}} | {{:+.4f}} [{{:+.4f}}, {{:+.4f}}] | {word} |",
              spread(concat), spread(collab), judged(collab, concat, "ahead" if "ahead" in word else word))
        claim(P, rest, field(cpu + f"concat-k{k}-seed0.json", "parameters.query_key_params"),
              field(cpu + f"collab-k{k}-seed0.json", "parameters.query_key_params"),
              *(field(cpu + c, "cache_bytes_per_token_bf16") for c in cache))
    claim(P, "costs collaborative heads {:+.4f} [{:+.4f}, {:+.4f}] nats against full concatenated\n  heads ({:.1f}%) "
             "and {:+.4f} [{:+.4f}, {:+.4f}] against their own full size",
          seed_pairs(cpu + "collab-k16-seed*.json", cpu + "concat-k128-seed*.json", best),
          Value("cpu/runs/collab-k16, concat-k128", lambda: [100 * (
              statistics.fmean(r[best] for r in seed_runs(cpu + "collab-k16-seed*.json").values())
              / statistics.fmean(r[best] for r in seed_runs(cpu + "concat-k128-seed*.json").values()) - 1)]),
          seed_pairs(cpu + "collab-k16-seed*.json", cpu + "collab-k128-seed*.json", best))
    claim(P, "Query/key parameters fall from {:.0f}k to {:.0f}k, the cache from {:,.0f} to {:,.0f} bytes",
          field(cpu + "concat-k128-seed0.json", "parameters.query_key_params", scale=1e-3),
          field(cpu + "collab-k16-seed0.json", "parameters.query_key_params", scale=1e-3),
          field(cpu + "concat-k128-seed0.json", "cache_bytes_per_token_bf16"),
          field(cpu + "collab-k16-seed0.json", "cache_bytes_per_token_bf16"))

    # 3. The trained concatenated model converted
    conv, h100 = X + "cpu_machine/convert/runs/", X + "cpu/convert/runs/"
    methods = {"cp": "`cp` (the paper's CP)", "cp-aware": "`cp-aware` (activation-aware CP)",
               "svd": "`svd` (each head's product truncated)",
               "prune": "`prune` (whole heads; 32 and 16 both keep one head per layer)"}

    def within(a, b):
        return [max(abs(a[x] - b[x]) for x in ("converted_val_loss", "retrained_val_loss"))]

    shared = [f"{m}-k{k}.json" for m in ("cp", "cp-aware", "prune") for k in (64, 32, 16)] + ["none-k128.json"]
    claim(P, "`cpu_machine/` (the CPU-trained model, {:.4f}; the H100-trained one, `cpu/`, lacks the SVD rows and "
             "agrees with\nthese rows within {:.3f})", field(machine, best),
          Value("cpu_machine/convert/runs against cpu/convert/runs", lambda: [max(
              within(run(conv + f), run(h100 + f))[0] for f in shared)]))
    claim(P, "Re-trained: **all\nweights**, {:.0f} x {:.0f} x {:.0f} = {:,.0f} tokens",
          formula(lambda r, m: [r["retrain_steps"], m["signature"]["trainer"]["per_device_train_batch_size"],
                                m["signature"]["block_size"], r["retrain_steps"] * m["signature"]["trainer"][
                                    "per_device_train_batch_size"] * m["signature"]["block_size"]],
                  conv + "cp-k16.json", machine))
    claim(P, "| none (the original; re-training only) | {:.4f} | {:.4f} |",
          field(conv + "none-k128.json", "converted_val_loss", "retrained_val_loss"))
    for m, label in methods.items():
        ks = (64, 32, 16)
        loss = "{:.4f} / {:.4f} / **{:.4f}**" if m == "cp-aware" else "{:.4f} / {:.4f} / {:.4f}"
        claim(P, f"| {label} | {loss} | {{:.4f}} / {{:.4f}} / {{:.4f}} |",
              *(field(conv + f"{m}-k{k}.json", "converted_val_loss") for k in ks),
              *(field(conv + f"{m}-k{k}.json", "retrained_val_loss") for k in ks))
    claim(P, "Without retraining, CP and SVD cost at most {:.4f} at D = 64; at 16 activation-aware CP loses {:.3f}, "
             "{:.1f} of plain\n  CP's {:.3f}.",
          formula(lambda *rs: [max(r["converted_val_loss"] - r["original_val_loss"] for r in rs)],
                  *(conv + f"{m}-k64.json" for m in ("cp", "cp-aware", "svd"))),
          formula(lambda a, p: [a["converted_val_loss"] - a["original_val_loss"],
                                (a["converted_val_loss"] - a["original_val_loss"])
                                / (p["converted_val_loss"] - p["original_val_loss"]),
                                p["converted_val_loss"] - p["original_val_loss"]],
                  conv + "cp-aware-k16.json", conv + "cp-k16.json"))
    claim(P, "makes the original itself worse ({:.4f} to {:.4f}:",
          field(conv + "none-k128.json", "converted_val_loss", "retrained_val_loss"))
    cited(P, "every conversion that lost less than about 0.01 ends worse than it started",
          "a threshold of the sentence, read off the table's rows (claimed above): every row that lost under 0.01 "
          "re-trains above its converted loss")

    # 4. At a matched cache, learned positions, context 64
    kv, kv4 = X + "kv_race/runs/", X + "kv_race_4000_iters/runs/"
    claim(P, "Every row: all weights trained from scratch on this CPU (float32, one thread), {:,.0f} x {:.0f} x {:.0f} "
             "= {:,.0f} tokens per\nrun (the last row: {:,.0f} x {:.0f} x {:.0f} = {:,.0f})",
          tokens(kv + "mqa-k32-seed0.json"), tokens(kv4 + "mqa-k32-seed0.json"))
    original = kv + "concat-k128-seed*.json"
    claim(P, "| 1 | concatenated (the original) | {:.4f} ± {:.4f} |", spread(original))
    rows = [  # cache, variant, run name, the budget's lowest mean (None: this row), verdicts vs it and the original
        ("1/2", "GQA, 2 key/value heads", "gqa-k64", None, "", "tie"),
        ("1/2", "collaborative keys and values 62/62", "collab-k62-v62", "gqa-k64", "tie", "behind"),
        ("1/2", "MLA, latent 128", "mla-k128", "gqa-k64", "tie", "behind"),
        ("1/4", "MQA", "mqa-k32", None, "", "tie"),
        ("1/4", "collaborative keys and values 30/30", "collab-k30-v30", "mqa-k32", "behind", "behind"),
        ("1/4", "collaborative, keys 44 / values 16", "collab-k44-v16", "mqa-k32", "behind", "behind"),
        ("1/4", "collaborative, keys 16 / values 44", "collab-k16-v44", "mqa-k32", "behind", "behind"),
        ("1/4", "MLA, latent 64", "mla-k64", "mqa-k32", "behind", "behind"),
        ("1/8", "collaborative keys and values 14/14", "collab-k14-v14", None, "", "behind"),
        ("1/8", "MLA, latent 32", "mla-k32", "collab-k14-v14", "tie", "behind")]
    for cache, name, run_name, against, vs_best, vs_original in rows:
        variant = kv + f"{run_name}-seed*.json"
        if against is None:
            quote = f"| {cache} | {name} | **{{:.4f}} ± {{:.4f}}** | lowest mean"
            values = [spread(variant)]
        else:
            quote = f"| {cache} | {name} | {{:.4f}} ± {{:.4f}} | {{:+.4f}} [{{:+.4f}}, {{:+.4f}}], {vs_best} |"
            values = [spread(variant), judged(variant, kv + f"{against}-seed*.json", vs_best)]
        claim(P, quote, *values)
        claim(P, f"| {{:+.4f}} [{{:+.4f}}, {{:+.4f}}], {vs_original} |", judged(variant, original, vs_original))
    claim(P, "| 1/4, 4,000 steps | MQA against collaborative 30/30 | {:.4f} ± {:.4f} against {:.4f} ± {:.4f} | MQA "
             "ahead by {:.4f} [{:.4f}, {:.4f}] |", spread(kv4 + "mqa-k32-seed*.json"),
          spread(kv4 + "collab-k30-v30-seed*.json"),
          judged(kv4 + "collab-k30-v30-seed*.json", kv4 + "mqa-k32-seed*.json", "behind"))

    # 5. At a matched cache, rotary positions, context 256
    r12, r8, r4 = X + "rope_race_12000/runs/", X + "rope_race_8000/runs/", X + "rope_race_long/runs/"
    cited(P, "the last 10% of the steps moved the loss by less than the\nspread over seeds",
          "the issue's criterion (issue 69), a setting of collab_attn.char_lm.runs_summary")
    claim(P, "from scratch**, {:,.0f} x {:.0f} x {:.0f} = {:,.0f} tokens per run ({:,.0f} x {:.0f} x {:.0f} = {:,.0f} "
             "for the 1/4 rows)", tokens(r12 + "rope-concat-k128-seed0.json"), tokens(r8 + "rope-mqa-k32-seed0.json"))

    def frac(path: str, folder: str) -> Value:
        return formula(lambda t, o: [t["cache_bytes_per_token_bf16"] / o["cache_bytes_per_token_bf16"]],
                       folder + path, folder + "rope-concat-k128-seed0.json")

    for folder, steps, rows in (
            # cache, variant, run name, the lowest mean?, the budget's lowest (None: this row or the original),
            # the verdict against it as the page words it, and against the original
            (r12, "12,000", [("1", "concatenated, rotary (the original)", "rope-concat-k128", "", None, "", ""),
                             ("1/2", "**collaborative keys and values 64/64**", "rope-collab-k64-v64", "best", None,
                              "", "tie"),
                             ("1/2", "GQA, 2 key/value heads", "rope-gqa-k64", "", "rope-collab-k64-v64", ", tie",
                              "tie"),
                             ("1/2", "MLA, latent 112 + rotary key 16", "rope-mla-k112-r16", "",
                              "rope-collab-k64-v64", ", tie", "tie"),
                             ("{:.4f}", "TPA, ranks 2/2 (query rank 6)", "rope-tpa-k2-v2-q6", "",
                              "rope-collab-k64-v64", ", behind collaborative 64/64", "tie"),
                             ("1/8", "**MLA, latent 16 + rotary key 16**", "rope-mla-k16-r16", "best", None, "",
                              "behind"),
                             ("1/8", "collaborative keys and values 16/16", "rope-collab-k16-v16", "",
                              "rope-mla-k16-r16", ", tie", "tie")]),
            (r8, "8,000", [("1", "concatenated, rotary (the original)", "rope-concat-k128", "", None, "", ""),
                           ("1/4", "**MQA**", "rope-mqa-k32", "best", None, "", "tie"),
                           ("1/4", "collaborative keys and values 32/32", "rope-collab-k32-v32", "", "rope-mqa-k32",
                            ", tie", "tie"),
                           ("1/4", "MLA, latent 48 + rotary key 16", "rope-mla-k48-r16", "", "rope-mqa-k32", ", tie",
                            "tie"),
                           ("{:.3f}", "TPA, ranks 1/1", "rope-tpa-k1-v1-q6", "", "rope-mqa-k32",
                            " against MQA, tie", "tie")])):
        for cache, name, run_name, mark, against, vs_best, vs_original in rows:
            variant = folder + f"{run_name}-seed*.json"
            loss = "**{:.4f} ± {:.4f}**" if mark else "{:.4f} ± {:.4f}"
            values = [frac(f"{run_name}-seed0.json", folder)] if cache.startswith("{") else []
            quote = f"| {steps} | {cache} | {name} | {loss} |"
            values.append(spread(variant))
            if run_name == "rope-concat-k128":
                quote += " | |"
            elif against is None:
                quote += f" lowest mean | {{:+.4f}} [{{:+.4f}}, {{:+.4f}}], {vs_original} |"
                values.append(judged(variant, folder + "rope-concat-k128-seed*.json", vs_original))
            else:
                quote += f" {{:+.4f}} [{{:+.4f}}, {{:+.4f}}]{vs_best} |"
                values.append(judged(variant, folder + f"{against}-seed*.json",
                                     next(w for w in ("ahead", "behind", "tie") if w in vs_best)))
            claim(P, quote, *values)
            if against is not None:
                claim(P, f"| {{:+.4f}} [{{:+.4f}}, {{:+.4f}}], {vs_original} |", judged(
                    variant, folder + "rope-concat-k128-seed*.json", vs_original))
    claim(P, "(with less\n  cache than TPA's {:.4f}), at {:.2f}x its attention parameters",
          frac("rope-tpa-k2-v2-q6-seed0.json", r12),
          params(r12 + "rope-collab-k64-v64-seed0.json", r12 + "rope-tpa-k2-v2-q6-seed0.json"))
    claim(P, "at 4,000 steps MQA was ahead of collaborative heads at 1/4 ({:+.4f} [{:+.4f},\n  {:+.4f}])",
          judged(r4 + "rope-mqa-k32-seed*.json", r4 + "rope-collab-k32-v32-seed*.json", "ahead"))
    claim(P, "Collaborative heads carry {:.2f}x GQA's attention parameters\n  at 1/2, {:.2f}x MQA's at 1/4 and {:.2f}x "
             "MLA's at 1/8", params(r12 + "rope-collab-k64-v64-seed0.json", r12 + "rope-gqa-k64-seed0.json"),
          params(r8 + "rope-collab-k32-v32-seed0.json", r8 + "rope-mqa-k32-seed0.json"),
          params(r12 + "rope-collab-k16-v16-seed0.json", r12 + "rope-mla-k16-r16-seed0.json"))
    strict(P)
