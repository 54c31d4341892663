"""One rule for saying that one method beats another, used by every summary.

``paired_comparison``: values of two methods paired by seed (the same seed: the same data order, the same original
model), a 95% t-interval over the paired differences, and a verdict that is ``tie`` whenever that interval holds
zero. ``timing_verdict``: the same idea for benchmark timings, which have no pairing: repeated runs, the median,
and faster or slower only when the two sets of runs do not overlap.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

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
