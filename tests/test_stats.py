"""The one comparison rule of every summary (collab_attn/stats.py): paired by seed, a 95% t-interval over the
differences, a tie whenever it holds zero; its bootstrap over held-out windows for deterministic runs; and its
timing twin for benchmarks."""

import math

import numpy as np
import pytest
from scipy import stats as scipy_stats

from collab_attn.stats import paired_comparison, rank, timing_verdict, window_bootstrap


def test_a_clear_win_is_better_with_the_hand_computed_interval():
    # losses: a is below b by 0.010, 0.012, 0.008 -> differences -0.010, -0.012, -0.008
    a, b = {0: 1.900, 1: 1.905, 2: 1.910}, {0: 1.910, 1: 1.917, 2: 1.918}
    result = paired_comparison(a, b)
    mean, sd = -0.010, 0.002  # the differences' mean and sample standard deviation
    half = scipy_stats.t.ppf(0.975, 2) * sd / math.sqrt(3)  # 4.303 x 0.002 / 1.732 = 0.00497
    assert result.mean_difference == pytest.approx(mean)
    assert result.interval == pytest.approx((mean - half, mean + half))
    assert result.verdict == "better" and result.pairs == 3
    # the interval excludes zero exactly when the paired t-test's two-sided p is below 0.05
    assert scipy_stats.ttest_rel(list(a.values()), list(b.values())).pvalue < 0.05


def test_a_clear_loss_is_worse():
    result = paired_comparison([2.00, 2.01, 2.02, 2.03], [1.90, 1.92, 1.91, 1.93])
    assert result.verdict == "worse" and result.interval[0] > 0
    assert result.mean_difference == pytest.approx(0.1)


def test_a_difference_inside_the_spread_is_a_tie():
    # the cache race, plain re-training at a quarter: tucker ahead of kv-svd-aware on every seed, by 0.0002 to 0.0022
    tucker, kv_svd = [1.9085, 1.9159, 1.9100], [1.9087, 1.9175, 1.9122]
    result = paired_comparison(tucker, kv_svd)
    assert result.mean_difference < 0 and result.interval[0] < 0 < result.interval[1]
    assert result.verdict == "tie"
    assert scipy_stats.ttest_rel(tucker, kv_svd).pvalue > 0.05


def test_mixed_signs_are_a_tie_whatever_the_mean():
    result = paired_comparison({0: 1.0, 1: 2.0, 2: 3.0}, {0: 1.5, 1: 1.9, 2: 3.2})
    assert result.verdict == "tie" and result.mean_difference == pytest.approx(-0.2)


def test_one_seed_is_a_tie_without_an_interval():
    result = paired_comparison({0: 88.1}, {0: 87.8}, higher_is_better=True)
    assert result.verdict == "tie" and result.pairs == 1
    assert result.mean_difference == pytest.approx(0.3) and all(math.isnan(x) for x in result.interval)
    assert result.describe(1) == "+0.3, 1 seed: tie"


def test_higher_is_better_turns_the_verdict_round():
    high, low = [86.0, 86.5, 87.0], [84.0, 84.4, 85.1]
    assert paired_comparison(high, low, higher_is_better=True).verdict == "better"
    assert paired_comparison(low, high, higher_is_better=True).verdict == "worse"
    assert paired_comparison(high, low).verdict == "worse"  # as losses


def test_pairs_follow_the_seeds_not_the_order():
    a = {2: 1.0, 0: 3.0, 1: 2.0}
    b = {0: 3.1, 1: 2.1, 2: 1.1}
    result = paired_comparison(a, b)
    assert result.mean_difference == pytest.approx(-0.1) and result.interval == pytest.approx((-0.1, -0.1))
    assert result.verdict == "better"
    assert result.describe() == "-0.1000 [-0.1000, -0.1000], better"


@pytest.mark.parametrize("a, b, message", [
    ({0: 1.0, 1: 2.0}, {0: 1.0, 2: 2.0}, r"seeds \[1, 2\] are in only one"),
    ([1.0, 2.0], [1.0], "2 values against 1"),
    ({0: 1.0}, [1.0], "two mappings"),
    ([], [], "no values"),
])
def test_unpaired_values_are_refused(a, b, message):
    with pytest.raises(ValueError, match=message):
        paired_comparison(a, b)


def test_timings_are_faster_or_slower_only_outside_the_run_to_run_spread():
    faster = timing_verdict([0.70, 0.72, 0.71], [1.00, 0.98, 1.02])
    assert faster.verdict == "faster" and faster.ratio == pytest.approx(0.71 / 1.00)
    assert faster.candidate.median == 0.71 and (faster.reference.low, faster.reference.high) == (0.98, 1.02)
    assert timing_verdict([1.00, 0.98, 1.02], [0.70, 0.72, 0.71]).verdict == "slower"
    overlapping = timing_verdict([0.80, 0.69, 0.77], [0.75, 1.00, 0.95])
    assert overlapping.verdict == "tie" and overlapping.ratio < 1  # a lower median alone says nothing
    assert timing_verdict([0.5], [1.0]).verdict == "tie"  # one run: no spread to judge by
    with pytest.raises(ValueError, match="no runs"):
        timing_verdict([], [1.0])


def test_a_ranking_names_the_best_and_every_method_the_rule_cannot_tell_from_it():
    values = {"mla": {0: 2.00, 1: 2.01, 2: 2.02}, "mqa": {0: 1.90, 1: 1.91, 2: 1.92},
              "collab": {0: 1.89, 1: 1.94, 2: 1.92}, "gqa": {1: 1.95, 2: 1.96}}  # gqa lacks seed 0: paired on 1, 2
    ranking = rank(values)
    assert ranking.order == ("mqa", "collab", "gqa", "mla") and ranking.means["gqa"] == pytest.approx(1.955)
    assert ranking.runner_up == paired_comparison([1.90, 1.91, 1.92], [1.89, 1.94, 1.92])
    assert ranking.tied == ("collab",)
    scores = rank({"cp": [88.1], "prune": [87.2]}, higher_is_better=True)
    assert scores.order == ("cp", "prune") and scores.tied == ("prune",)  # one seed: a tie
    assert rank({"alone": {0: 1.0}}).runner_up is None


def test_a_difference_within_the_resolution_is_a_tie():
    # an exact conversion evaluated in float32: 1e-7 below the original on every seed
    exact = paired_comparison([1.8984621, 1.9055244, 1.9059248], [1.8984622, 1.9055245, 1.9059249])
    assert exact.verdict == "better"  # the bare rule sees a consistent difference ...
    assert paired_comparison([1.8984621, 1.9055244, 1.9059248], [1.8984622, 1.9055245, 1.9059249],
                             resolution=1e-5).verdict == "tie"  # ... that is below what the evaluation resolves


def windows(nll_per_token, tokens=255, seed=0, noise=0.3):
    """Per-window records as the SmolLM2 race writes them: 16 windows whose mean nll per token scatters by ``noise``
    around ``nll_per_token``."""
    rng = np.random.default_rng(seed)
    return [{"tokens": tokens, "nll": float(tokens * (nll_per_token + noise * rng.standard_normal())),
             "fingerprint": f"{i:08x}"} for i in range(16)]


def test_the_window_bootstrap_finds_a_clear_difference_and_its_direction():
    base = windows(4.0)
    # the same windows (the same text difficulty), the model 0.2 nats per token worse on each, +-0.05
    worse = [dict(w, nll=w["nll"] + w["tokens"] * (0.2 + 0.05 * math.sin(i))) for i, w in enumerate(base)]
    result = window_bootstrap(base, worse)
    ppl = [math.exp(sum(w["nll"] for w in run) / (16 * 255)) for run in (base, worse)]
    assert result.mean_difference == pytest.approx(ppl[0] / ppl[1] - 1) and result.pairs == 16
    low, high = result.interval
    assert result.verdict == "better" and low < result.mean_difference < high < 0
    assert window_bootstrap(worse, base).verdict == "worse"
    # the shared difficulty of a window cancels in the pairing: unpaired, a 0.3-nats spread would hide 0.2
    assert high - low < 0.05


def test_the_window_bootstrap_calls_identical_runs_and_noise_a_tie():
    base = windows(4.0)
    same = window_bootstrap(base, [dict(w) for w in base])
    assert same.verdict == "tie" and same.mean_difference == 0 and same.interval == (0, 0)
    shuffled = [dict(w, nll=w["nll"] + w["tokens"] * 0.1 * (-1) ** i) for i, w in enumerate(base)]  # +-0.1, no trend
    noisy = window_bootstrap(base, shuffled)
    assert noisy.verdict == "tie" and noisy.interval[0] < 0 < noisy.interval[1]
    slight = [dict(w, nll=w["nll"] + w["tokens"] * 1e-6) for w in base]
    assert window_bootstrap(base, slight).verdict == "better"
    assert window_bootstrap(base, slight, resolution=1e-4).verdict == "tie"


def test_the_window_bootstrap_is_deterministic_with_its_seed():
    a, b = windows(4.0, seed=1), windows(4.05, seed=2)
    first = window_bootstrap(a, b, resamples=2000, seed=3)
    assert window_bootstrap(a, b, resamples=2000, seed=3) == first
    assert window_bootstrap(a, b, resamples=2000, seed=4).interval != first.interval
    assert window_bootstrap(a, b, resamples=2000, seed=4).mean_difference == first.mean_difference


@pytest.mark.parametrize("change, message", [
    (lambda ws: ws[:15], "16 windows against 15"),
    (lambda ws: [dict(w, tokens=100) if i == 3 else w for i, w in enumerate(ws)], "different numbers of tokens"),
    (lambda ws: [dict(w, fingerprint="deadbeef") if i == 5 else w for i, w in enumerate(ws)],
     "window 5 holds other tokens"),
    (lambda ws: ws[:1], "1 window"),
])
def test_the_window_bootstrap_refuses_windows_that_do_not_pair(change, message):
    base = windows(4.0)
    other = change([dict(w) for w in base])
    with pytest.raises(ValueError, match=message):
        window_bootstrap(base if len(other) > 1 else base[:1], other)
    no_prints = [{k: v for k, v in w.items() if k != "fingerprint"} for w in base]
    assert window_bootstrap(no_prints, base).verdict == "tie"  # fingerprints checked only where both have them
