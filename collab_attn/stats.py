"""One rule for saying that one method beats another, used by every summary.

``paired_comparison``: values of two methods paired by seed (the same seed: the same data order, the same original
model), a 95% t-interval over the paired differences, and a verdict that is ``tie`` whenever that interval holds
zero. ``window_bootstrap``: two deterministic runs evaluated on the same held-out windows, paired by window, a 95%
percentile interval of their perplexity ratio from resampling the windows, the same verdict. ``timing_verdict``: the
same idea for benchmark timings, which have no pairing: repeated runs, the median, and faster or slower only when the
two sets of runs do not overlap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats as scipy_stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Comparison:
    """``a`` against ``b``: ``mean_difference`` is the mean of ``a - b`` over the pairs, ``interval`` its 95%
    t-interval (``(nan, nan)`` with fewer than two pairs), ``verdict`` ``better``, ``worse`` or ``tie`` (read as "a is
    better than b")."""

    mean_difference: float
    interval: tuple[float, float]
    verdict: str
    pairs: int

    def describe(self, digits: int = 4) -> str:
        """``-0.0011 [-0.0061, +0.0039], tie`` (``+0.0011, 1 seed: tie`` without an interval)."""
        if self.pairs < 2:
            return f"{self.mean_difference:+.{digits}f}, {self.pairs} seed: tie"
        low, high = self.interval
        return f"{self.mean_difference:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}], {self.verdict}"


def _pairs(a, b) -> list[tuple[float, float]]:
    """The values of ``a`` and ``b`` paired: by key for two mappings (seed -> value), by position for two sequences."""
    if isinstance(a, Mapping) != isinstance(b, Mapping):
        raise ValueError("paired_comparison needs two mappings (seed -> value) or two sequences, not one of each")
    if isinstance(a, Mapping):
        if set(a) != set(b):
            unpaired = sorted(set(a) ^ set(b), key=str)
            raise ValueError(f"paired_comparison: seeds {unpaired} are in only one of the two; pair by seed first")
        return [(float(a[key]), float(b[key])) for key in sorted(a, key=str)]
    if len(a) != len(b):
        raise ValueError(f"paired_comparison: {len(a)} values against {len(b)}; the values must pair one to one")
    return [(float(x), float(y)) for x, y in zip(a, b)]


def paired_comparison(a: Mapping | Sequence[float], b: Mapping | Sequence[float],
                      higher_is_better: bool = False, resolution: float = 0.0) -> Comparison:
    """Is ``a`` better than ``b``? Lower is better unless ``higher_is_better`` (a loss by default, a score with it).

    The differences ``d_i = a_i - b_i`` of n pairs give the interval ``mean(d) ± t(0.975, n-1) sd(d) / sqrt(n)``
    (the paired t-test's, ``scipy.stats.ttest_rel``); the verdict is a win or a loss only when that interval excludes
    zero, and ``tie`` otherwise, and always with fewer than two pairs (no spread to judge by). ``resolution``: a mean
    difference no larger than this is measurement noise, a tie (float32 evaluations of an exact conversion differ
    from the original's by about 1e-7, always the same way)."""
    pairs = _pairs(a, b)
    if not pairs:
        raise ValueError("paired_comparison: no values")
    differences = [x - y for x, y in pairs]
    mean = statistics.fmean(differences)
    if len(differences) < 2:
        return Comparison(mean, (math.nan, math.nan), "tie", len(differences))
    n = len(differences)
    half = float(scipy_stats.t.ppf(0.5 + CONFIDENCE / 2, n - 1)) * statistics.stdev(differences) / math.sqrt(n)
    low, high = mean - half, mean + half
    if low <= 0 <= high or abs(mean) <= resolution:
        verdict = "tie"
    else:
        verdict = "better" if (mean > 0) == higher_is_better else "worse"
    return Comparison(mean, (low, high), verdict, n)


def compare_on_shared_seeds(a: Mapping, b: Mapping, higher_is_better: bool = False,
                            resolution: float = 0.0) -> Comparison:
    """``paired_comparison`` of two methods' values (seed -> value) on the seeds both have."""
    seeds = set(a) & set(b)
    return paired_comparison({s: a[s] for s in seeds}, {s: b[s] for s in seeds}, higher_is_better, resolution)


def _window_field(window, name: str):
    return window[name] if isinstance(window, Mapping) else getattr(window, name)


def _paired_windows(a: Sequence, b: Sequence) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Tokens and the two runs' nll sums per window; refused unless the windows pair one to one: the same count, the
    same tokens per window, and the same fingerprints where both runs recorded them."""
    if len(a) != len(b):
        raise ValueError(f"window_bootstrap: {len(a)} windows against {len(b)}; both runs must be evaluated on the "
                         "same windows")
    if len(a) < 2:
        raise ValueError(f"window_bootstrap: {len(a)} window; resampling needs at least two")
    tokens = np.array([_window_field(w, "tokens") for w in a], dtype=np.int64)
    if not np.array_equal(tokens, np.array([_window_field(w, "tokens") for w in b], dtype=np.int64)):
        raise ValueError("window_bootstrap: the windows predict different numbers of tokens; not the same windows")
    prints = [[w.get("fingerprint") if isinstance(w, Mapping) else getattr(w, "fingerprint", None) for w in run]
              for run in (a, b)]
    if all(p is not None for p in prints[0] + prints[1]) and prints[0] != prints[1]:
        first = next(i for i, (x, y) in enumerate(zip(*prints)) if x != y)
        raise ValueError(f"window_bootstrap: window {first} holds other tokens in the two runs "
                         f"(fingerprints {prints[0][first]} and {prints[1][first]}); not the same windows")
    if (tokens <= 0).any():
        raise ValueError("window_bootstrap: a window predicts no token")
    nll = [np.array([_window_field(w, "nll") for w in run], dtype=np.float64) for run in (a, b)]
    return tokens, nll[0], nll[1]


def window_bootstrap(a: Sequence, b: Sequence, resamples: int = 10_000, seed: int = 0,
                     resolution: float = 0.0) -> Comparison:
    """Is run ``a`` better (lower perplexity) than run ``b`` on the same held-out windows?

    ``a``, ``b``: one record per window (mappings or objects with ``tokens``, the tokens predicted, and ``nll``, their
    summed negative log-likelihood; ``fingerprint`` where recorded, to check that window i is the same text in both:
    ``collab_attn.pretrained.heldout.Window``), in the same window order. The statistic is the relative perplexity
    difference ``ppl(a) / ppl(b) - 1`` with ``ppl = exp(sum nll / sum tokens)``; ``mean_difference`` holds it on all
    windows. ``resamples`` draws of the windows with replacement (seeded: the same seed, the same interval), the same
    draw for both runs (paired), give its 95% percentile interval; the verdict follows ``paired_comparison``: a win or
    a loss only when the interval excludes zero and the difference exceeds ``resolution``, ``tie`` otherwise.
    ``pairs`` is the number of windows. The interval covers the choice of evaluation text only: for deterministic
    conversions, not for what a calibration sample or a training seed changes."""
    if resamples < 100:
        raise ValueError(f"window_bootstrap: resamples={resamples}; use at least 100 for a 95% interval")
    tokens, nll_a, nll_b = _paired_windows(a, b)
    n = len(tokens)
    observed = math.exp((nll_a.sum() - nll_b.sum()) / tokens.sum()) - 1
    rng = np.random.default_rng(seed)
    draws = np.empty(resamples)
    chunk = max(1, 2 ** 20 // n)  # about a million indices at a time
    for start in range(0, resamples, chunk):
        index = rng.integers(0, n, size=(min(chunk, resamples - start), n))
        draws[start:start + len(index)] = np.expm1((nll_a[index].sum(1) - nll_b[index].sum(1))
                                                   / tokens[index].sum(1))
    low, high = (float(x) for x in np.percentile(draws, [50 * (1 - CONFIDENCE), 50 * (1 + CONFIDENCE)]))
    if low <= 0 <= high or abs(observed) <= resolution:
        verdict = "tie"
    else:
        verdict = "better" if observed < 0 else "worse"
    return Comparison(observed, (low, high), verdict, n)


@dataclass(frozen=True)
class Ranking:
    """Methods by their mean over seeds, best first; the best against the runner-up (None for one method), and the
    methods the rule cannot tell from the best (``tie``)."""

    order: tuple[str, ...]
    means: dict[str, float]
    runner_up: Comparison | None
    tied: tuple[str, ...]


def rank(values: Mapping[str, Mapping[Hashable, float] | Sequence[float]], higher_is_better: bool = False,
         resolution: float = 0.0) -> Ranking:
    """``values``: method -> (seed -> value), or method -> values in seed order. Each method is compared with the best
    on the seeds both have."""
    values = {m: v if isinstance(v, Mapping) else dict(enumerate(v)) for m, v in values.items()}
    means = {method: statistics.fmean(by_seed.values()) for method, by_seed in values.items()}
    order = tuple(sorted(means, key=means.get, reverse=higher_is_better))
    best = values[order[0]]
    against = {m: compare_on_shared_seeds(best, values[m], higher_is_better, resolution) for m in order[1:]}
    return Ranking(order, means, against[order[1]] if len(order) > 1 else None,
                   tuple(m for m in order[1:] if against[m].verdict == "tie"))


@dataclass(frozen=True)
class Timing:
    """Repeated runs of one benchmark: their median and their range (the run-to-run spread)."""

    median: float
    low: float
    high: float
    runs: int


def timing(times: Sequence[float]) -> Timing:
    if not times:
        raise ValueError("timing: no runs")
    return Timing(statistics.median(times), min(times), max(times), len(times))


@dataclass(frozen=True)
class TimingComparison:
    """``candidate`` against ``reference``: the ratio of the medians, and ``faster``, ``slower`` or ``tie``."""

    ratio: float
    verdict: str
    candidate: Timing
    reference: Timing


def timing_verdict(candidate: Sequence[float], reference: Sequence[float]) -> TimingComparison:
    """Times of repeated runs (lower is faster). ``faster`` only when every run of ``candidate`` beat every run of
    ``reference`` (the ranges do not overlap), ``slower`` the other way round, ``tie`` otherwise and whenever either
    side has a single run (no spread to judge by)."""
    mine, theirs = timing(candidate), timing(reference)
    verdict = "tie"
    if mine.runs > 1 and theirs.runs > 1:
        if mine.high < theirs.low:
            verdict = "faster"
        elif mine.low > theirs.high:
            verdict = "slower"
    return TimingComparison(mine.median / theirs.median, verdict, mine, theirs)
