"""The claims of experiments/scratch_sst2/README.md: every accuracy from the sweeps' run files
(``runs/*.json``, the first run through the old loop; ``trainer/runs/*.json``, the Trainer; ``batching_check/*/runs``;
each written by scripts/train_scratch.py)."""

from __future__ import annotations

import statistics

from result_pages.engine import Value, cited, claim, field, formula, seed_runs, strict

SIZES = (128, 64, 32, 16)


def claims_scratch_sst2() -> None:
    """experiments/scratch_sst2/README.md."""
    P = "experiments/scratch_sst2/README.md"
    X = "experiments/scratch_sst2/"
    loop, trainer = X + "runs/", X + "trainer/runs/"
    acc = "dev_accuracy"

    def pattern(folder, attention, k):
        return f"{folder}{attention}-k{k}-seed*.json"

    def by_seed(folder, attention, k) -> dict[int, float]:
        return {s: 100 * r[acc] for s, r in seed_runs(pattern(folder, attention, k)).items()}

    def mean(folder, attention, k) -> float:
        return statistics.fmean(by_seed(folder, attention, k).values())

    def spread(folder, attention, k) -> Value:
        from collab_attn.run_store import mean_std

        return Value(pattern(folder, attention, k).removeprefix("experiments/"),
                     lambda: list(mean_std(list(by_seed(folder, attention, k).values()))))

    def paired(folder, k, word="tie") -> Value:
        """Collaborative minus concatenated heads at key size ``k``, paired by seed: mean, 95% t-interval, in
        points of accuracy; the verdict must be ``word``."""
        def compute():
            from collab_attn.stats import compare_on_shared_seeds

            c = compare_on_shared_seeds(by_seed(folder, "collab", k), by_seed(folder, "concat", k),
                                        higher_is_better=True)
            if c.verdict != word:
                raise ValueError(f"D_k {k}: the seeds' verdict is {c.verdict}, where the page says {word}")
            return [c.mean_difference, *c.interval]
        return Value(f"{folder.removeprefix('experiments/')}collab-k{k} against concat-k{k}", compute)

    src = "scratch_sst2/runs, scratch_sst2/trainer/runs"
    one = trainer + "collab-k64-seed0.json"
    claim(P, "AdamW (lr 1e-3, weight decay {:.2f}), linear warmup over 50 steps then linear decay to 0, gradient "
             "clipping\nat {:.1f}", field(one, "signature.train.weight_decay", "signature.train.max_grad_norm"))

    def minutes():
        runs = [r for k in SIZES for a in ("concat", "collab") for r in seed_runs(pattern(trainer, a, k)).values()]
        return [min(r["train_seconds"] for r in runs) / 60, max(r["train_seconds"] for r in runs) / 60]
    claim(P, "about {:.1f} to {:.1f} minutes a run", Value("scratch_sst2/trainer/runs", minutes))
    claim(P, "Final dev accuracy (majority class {:.1f}%)", field(one, "majority_baseline", scale=100))
    for k in SIZES:
        claim(P, f"| {k} | " + " | ".join(["{:.2f} ± {:.2f}"] * 4) + " |",
              *(spread(f, a, k) for a in ("concat", "collab") for f in (loop, trainer)))

    def trainer_range():
        means = [mean(trainer, a, k) for a in ("concat", "collab") for k in SIZES]
        return [min(means), max(means)]
    claim(P, "Through the Trainer every variant ends between {:.1f} and {:.1f}%", Value(src, trainer_range))
    cited(P, "95% t-interval over seeds 0-2", "collab_attn.stats.CONFIDENCE, a setting")
    claim(P, "points of accuracy): {:+.2f} [{:+.2f},\n{:+.2f}] at 128, {:+.2f} [{:+.2f}, {:+.2f}] at 64, {:+.2f} "
             "[{:+.2f}, {:+.2f}] at 32, {:+.2f} [{:+.2f}, {:+.2f}] at 16: a tie at every\nkey size",
          *(paired(trainer, k) for k in SIZES))
    claim(P, "The first run (the loop) was tied at every size too: {:+.2f} [{:+.2f}, {:+.2f}], {:+.2f} [{:+.2f}, "
             "{:+.2f}], {:+.2f}\n[{:+.2f}, {:+.2f}], {:+.2f} [{:+.2f}, {:+.2f}]", *(paired(loop, k) for k in SIZES))
    claim(P, "the task saturates near {:.0f}% for every variant", Value(src, lambda: [statistics.fmean(
        mean(f, a, k) for f in (loop, trainer) for a in ("concat", "collab") for k in SIZES)]))
    claim(P, "The first run's higher means of collaborative heads at 64 and 32 ({:.1f} and {:.1f}%)",
          Value(src, lambda: [mean(loop, "collab", 64), mean(loop, "collab", 32)]))

    def moved(attention):
        moves = [mean(trainer, attention, k) - mean(loop, attention, k) for k in SIZES]
        return [*moves, statistics.fmean(moves)]
    claim(P, "Concatenated heads moved by {:+.1f}, {:+.1f}, {:+.1f} and {:+.1f} points (D_k 128 to 16, mean {:+.1f})",
          Value(src, lambda: moved("concat")))
    claim(P, "Collaborative heads moved by {:+.1f}, {:+.1f}, {:+.1f} and {:+.1f} (mean {:+.1f})",
          Value(src, lambda: moved("collab")))

    def single_runs():
        return [max(abs(by_seed(trainer, a, k)[s] - by_seed(loop, a, k)[s]) for a in ("concat", "collab")
                    for k in SIZES for s in by_seed(loop, a, k))]
    claim(P, "Single runs moved by up to {:.1f} points", Value(src, single_runs))
    check = X + "batching_check/"
    claim(P, "collaborative heads {:.2f} ± {:.2f} at 64 and {:.2f} ± {:.2f} at 32, the Trainer's numbers ({:.2f}, "
             "{:.2f}), not its own\n  first run's ({:.2f}, {:.2f})",
          spread(check + "random/runs/", "collab", 64), spread(check + "random/runs/", "collab", 32),
          Value(src, lambda: [mean(trainer, "collab", 64), mean(trainer, "collab", 32),
                              mean(loop, "collab", 64), mean(loop, "collab", 32)]))
    claim(P, "it gives {:.2f} again ({:.2f} in\n  the first run",
          field(check + "pooled/runs/collab-k64-seed0.json", acc, scale=100), field(loop + "collab-k64-seed0.json",
                                                                                     acc, scale=100))
    cited(P, "(`get_decay_parameter_names` in transformers 5.24)", "the installed transformers' version")

    def decay(r):
        """The schedule's sum of learning rates (linear warm-up over the warm-up share of the steps, linear decay to
        0, as transformers' get_linear_schedule_with_warmup), and the most weight decay shrinks a weight by."""
        t = r["signature"]["train"]
        steps, peak = t["max_steps"], t["learning_rate"]
        warm = round(t["warmup_steps"] * steps) if t["warmup_steps"] < 1 else t["warmup_steps"]
        total = sum(peak * (s / warm if s < warm else (steps - s) / (steps - warm)) for s in range(steps))
        return [t["weight_decay"], 100 * t["weight_decay"] * total, total]
    claim(P, "Decay {:.2f} over this schedule shrinks a weight by {:.2f}% at most\n  (the sum of the learning rates is "
             "{:.2f})", formula(decay, one))
    cited(P, "fused AdamW with betas (0.9, 0.999) and eps 1e-8", "torch.optim.AdamW's defaults, a setting")
    strict(P)
