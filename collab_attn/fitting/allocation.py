"""Where the key/value cache goes, chosen by measurement (docs/design.md, "Fitting converted layers to what the
original computes"): ``allocate_cache(original, method, budget, batches)``.

A conversion whose keys and values have widths of their own (``reparametrize(..., value_rank=...)``: ``cp``,
``tucker``, and ``key-svd`` on rotary models) caches ``rank + value_rank``
numbers per token and layer (plus one content logit per head where the queries have a bias, whatever the
widths). Which split of a layer's budget between keys and values is best, and which layers
deserve more of the model's budget than others, is measured: every candidate size ``(rank, value_rank)`` is a
per-layer total ``T`` (``scales`` times the mean budget) split at ``key_shares`` of it. The original is converted at
each candidate for every layer at once, then each converted layer is fitted to the original's attention output on
the *original's* inputs (``fit_to_original(..., inputs="original")``: the same inputs for every candidate, whatever
the other layers got), a short fit of ``steps`` steps, and its relative output error after that fit is the
candidate's cost at that layer (a size the method refuses for the model, such as a rotary shared key wider than its
exact width, is never chosen; the reason is kept). One choice per layer then minimises the sum of the layers' errors
with the mean of
``rank + value_rank`` over layers at most ``budget``: a multiple-choice knapsack, solved exactly by dynamic
programming over the totals. The result says what each layer got and the error table it was chosen from; convert
with ``reparametrize(model, allocation.ranks, method, value_rank=allocation.value_ranks, ...)``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field

from tqdm.auto import tqdm

KEY_SHARES = (1 / 3, 1 / 2, 2 / 3)
SCALES = (2 / 3, 1.0, 4 / 3)


@dataclass
class Allocation:
    """Per layer the chosen ``ranks`` (keys) and ``value_ranks``; ``candidates`` the sizes measured, ``errors[i][c]``
    layer i's relative output error at candidate c after the short fit; ``uniform`` the candidate of the plain
    budget split in half (when measured) and its summed error beside the chosen one's."""

    method: str
    budget: float  # mean numbers per token and layer, keys and values together
    ranks: list[int]
    value_ranks: list[int]
    candidates: list[tuple[int, int]]
    errors: list[list[float]]
    steps: int
    seconds: float
    uniform: tuple[int, int] | None = None
    layers: list[str] = field(default_factory=list)
    refused: dict[str, str] = field(default_factory=dict)  # "k<rank> v<value_rank>": why the method refused it

    @property
    def error(self) -> float:
        """The summed error of the chosen sizes."""
        chosen = [self.candidates.index(size) for size in zip(self.ranks, self.value_ranks)]
        return sum(row[c] for row, c in zip(self.errors, chosen))

    @property
    def uniform_error(self) -> float | None:
        if self.uniform is None:
            return None
        index = self.candidates.index(self.uniform)
        return sum(row[index] for row in self.errors)

    def to_dict(self) -> dict:
        return asdict(self) | {"error": self.error, "uniform_error": self.uniform_error}

    @classmethod
    def from_dict(cls, data: dict) -> Allocation:
        fields = {k: v for k, v in data.items() if k not in ("error", "uniform_error")}
        fields["candidates"] = [tuple(c) for c in fields["candidates"]]
        fields["uniform"] = None if fields.get("uniform") is None else tuple(fields["uniform"])
        return cls(**fields)

    def table(self) -> str:
        """Markdown: per layer its errors at every candidate (the chosen one in bold) and what it got."""
        head = " | ".join(f"k{k} v{v}" for k, v in self.candidates)
        refused = "".join(f"\n\n{size}: refused ({why})" for size, why in self.refused.items())
        rows = [f"| layer | {head} | keys | values |", "|---|" + "---:|" * (len(self.candidates) + 2)]
        for i, row in enumerate(self.errors):
            chosen = self.candidates.index((self.ranks[i], self.value_ranks[i]))
            cells = " | ".join("-" if e == math.inf else f"**{e:.4f}**" if c == chosen else f"{e:.4f}"
                               for c, e in enumerate(row))
            rows.append(f"| {self.layers[i] if self.layers else i} | {cells} | {self.ranks[i]} | "
                        f"{self.value_ranks[i]} |")
        uniform = "" if self.uniform is None else (
            f"; the even split k{self.uniform[0]} v{self.uniform[1]} everywhere: {self.uniform_error:.4f}")
        rows.append(f"\nSummed error of the chosen sizes {self.error:.4f}{uniform} (mean cache "
                    f"{sum(self.ranks + self.value_ranks) / len(self.ranks):g} of {self.budget:g}; {self.steps} steps "
                    f"per candidate and layer, {self.seconds:.0f} s).{refused}")
        return "\n".join(rows)


def candidate_sizes(budget: float, key_shares: Sequence[float] = KEY_SHARES,
                    scales: Sequence[float] = SCALES) -> list[tuple[int, int]]:
    """The ``(rank, value_rank)`` sizes tried: each total ``round(scale x budget)`` (even) split at each key share
    (the key width even: rotary keys count pairs), both at least 2; distinct, in order."""
    if budget < 4:
        raise ValueError(f"budget must be at least 4 numbers per token and layer (2 for keys, 2 for values), got "
                         f"{budget!r}")
    if not key_shares or not all(0 < s < 1 for s in key_shares):
        raise ValueError(f"key_shares must be fractions in (0, 1) of a layer's budget for its keys, got {key_shares}")
    if not scales or not all(s > 0 for s in scales) or min(scales) > 1:
        raise ValueError(f"scales must be positive multiples of the budget, one of them at most 1 (or no allocation "
                         f"fits), got {scales}")
    sizes = []
    for scale in scales:
        total = 2 * round(scale * budget / 2)
        for share in key_shares:
            rank = max(2, 2 * round(share * total / 2))
            size = (rank, total - rank)
            if size[1] >= 2 and size not in sizes:
                sizes.append(size)
    return sizes


def choose(errors: list[list[float]], costs: list[int], capacity: int) -> list[int]:
    """One candidate per layer (row of ``errors``) minimising the summed error with the summed cost at most
    ``capacity``: exact dynamic programming over the reachable totals."""
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}
    for row in errors:
        following: dict[int, tuple[float, list[int]]] = {}
        for total, (error, picks) in best.items():
            for c, (e, cost) in enumerate(zip(row, costs)):
                t = total + cost
                if t <= capacity and (t not in following or error + e < following[t][0]):
                    following[t] = (error + e, picks + [c])
        if not following:
            raise ValueError(f"no choice of the candidates fits {capacity} numbers over {len(errors)} layers")
        best = following
    return min(best.values(), key=lambda item: item[0])[1]


def allocate_cache(original, method: str, budget: float, batches, *, steps: int = 25, calibration=None,
                   key_shares: Sequence[float] = KEY_SHARES, scales: Sequence[float] = SCALES, seed: int = 0,
                   progress: bool = True, **options) -> Allocation:
    """Per-layer key and value widths for ``method`` at a mean of ``budget`` numbers per token and layer, chosen by
    the output error each candidate leaves after a short fit (module doc). ``original`` is left as it is;
    ``calibration`` and ``options`` go to every candidate's ``reparametrize``."""
    from collab_attn import cli
    from collab_attn.fitting.checks import check_seed_and_progress, checked_batches
    from collab_attn.fitting.layer_fit import fit_to_original
    from collab_attn.models.conversion import reparametrize, takes_value_rank
    from collab_attn.models.families import find_attention

    if not hasattr(original, "config"):
        raise ValueError(f"original must be a transformers model, got {type(original).__name__}")
    if not isinstance(method, str):
        raise ValueError(f"method must be a conversion method's name (e.g. 'cp'), got {method!r}")
    cli.number("budget", budget, 4)  # numbers per token and layer: 2 for keys, 2 for values at least
    cli.positive_int("steps", steps)
    check_seed_and_progress(seed, progress)
    if not takes_value_rank(original, method):
        raise ValueError(f"method={method!r} has no key/value split to choose on a {original.config.model_type} "
                         "model (it takes no value_rank): allocate_cache takes a method that gives the values a width "
                         "of their own (cp, tucker; key-svd on rotary models)")
    start = time.perf_counter()
    layers = [name for name, _ in find_attention(original)[1]]
    candidates = candidate_sizes(budget, key_shares, scales)
    if isinstance(batches, Iterator):  # a generator is read once, here
        batches = list(batches)
    checked_batches(original, batches, next(original.parameters()).device)  # checked before the first candidate
    batches = list(batches)
    errors = [[math.inf] * len(candidates) for _ in layers]
    refused = {}
    bar = tqdm(candidates, desc=f"allocate {method}", disable=not progress)
    for c, (rank, value_rank) in enumerate(bar):
        bar.set_postfix(keys=rank, values=value_rank, refresh=False)
        model = copy.deepcopy(original)
        sizes = {} if calibration is None else {"calibration": calibration}
        try:
            reparametrize(model, rank, method=method, value_rank=value_rank, seed=seed, progress=False, **sizes,
                          **options)
        except ValueError as err:  # a size this method cannot take here (the others still can)
            refused[f"k{rank} v{value_rank}"] = str(err)
            continue
        report = fit_to_original(model, original, batches, steps=steps, seed=seed, inputs="original",
                                 progress=False)
        for i, layer in enumerate(report.layers):
            errors[i][c] = layer.error_after
        del model
    if len(refused) == len(candidates):
        raise ValueError(f"{method} refused every candidate size at budget {budget:g}: "
                         f"{next(iter(refused.values()))}")
    kept = [c for c in range(len(candidates)) if f"k{candidates[c][0]} v{candidates[c][1]}" not in refused]
    picks = [kept[p] for p in choose([[row[c] for c in kept] for row in errors], [sum(candidates[c]) for c in kept],
                                     int(budget * len(layers)))]
    even = 2 * round(budget / 4)
    uniform = (even, int(budget) - even)
    uniform = uniform if uniform in candidates and errors[0][candidates.index(uniform)] < math.inf else None
    return Allocation(method, float(budget), [candidates[p][0] for p in picks], [candidates[p][1] for p in picks],
                      candidates, errors, steps, time.perf_counter() - start, uniform, layers, refused)
