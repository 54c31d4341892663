"""Per-layer ranks under a global budget, from each layer's decomposition error as a function of rank.

Layers differ in how well a low-rank collaborative form fits them (on MiniLM the first layer loses far less
than the last at the same rank), so one rank everywhere spends parameters where they buy little. A budget says
what to spend; ``select_ranks`` says where:

- ``"params:F"``: the converted query/key parameters (shared projections, mixing, content bias) of all layers
  together are at most ``F`` times those of the original query/key projections (weights and biases);
- ``"mean:R"``: the same number of query/key parameters as rank ``R`` in every layer, spread differently;
- ``"energy:E"``: in each layer, the smallest rank whose fit keeps a fraction ``E`` of the energy of the head
  products (``1 - relative_error^2 >= E``); no global coupling, so the total follows from the threshold.

For the parameter budgets the ranks minimize the sum over layers of the squared relative errors, by a greedy
walk along the lower convex hull of each layer's (parameters, error^2) curve, then single steps with what is
left. The curves come from short implicit ALS runs (``curve_iters`` iterations) at ``curve_points`` ranks per
layer, interpolated linearly in error^2 between them; the exact rank (heads x head_dim) has error 0. With a
calibration the curves are those of the whitened products, the error activation-aware fitting minimizes.
Ranks are multiples of ``step`` (default: the number of heads).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from collab_attn.decomposition.cp_als import HeadProducts, cp_als, tucker_hooi

BUDGET_RULES = ("params", "mean", "energy")


@dataclass(frozen=True)
class RankBudget:
    """A global rank budget: ``rule`` in ``BUDGET_RULES`` and its ``value`` (see the module doc).

    ``step``: ranks are multiples of it (default: the number of heads). ``min_rank``: no layer goes below it
    (default: ``step``). As a string: ``"params:0.35"``, ``"mean:128"``, ``"energy:0.8"``.
    """

    rule: str
    value: float
    step: int | None = None
    min_rank: int | None = None

    def __post_init__(self):
        if self.rule not in BUDGET_RULES:
            raise ValueError(f"unknown rank budget {self.rule!r}; choose one of {BUDGET_RULES} (e.g. 'params:0.35')")
        bad = (
            (self.rule == "params" and not 0 < self.value <= 1)
            or (self.rule == "energy" and not 0 < self.value <= 1)
            or (self.rule == "mean" and (self.value < 1 or self.value != int(self.value)))
        )
        if bad:
            expected = {"params": "a fraction in (0, 1]", "energy": "a fraction in (0, 1]", "mean": "an integer rank"}
            raise ValueError(
                f"rank budget {self.rule}:{self.value} is invalid: {self.rule} takes {expected[self.rule]}"
            )
        for name in ("step", "min_rank"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"rank budget {name} must be a positive integer, got {value!r}")

    @classmethod
    def parse(cls, spec: str | RankBudget) -> RankBudget:
        if isinstance(spec, RankBudget):
            return spec
        if not isinstance(spec, str) or spec.count(":") != 1:
            raise ValueError(
                f"a rank budget is 'params:<fraction>', 'mean:<rank>' or 'energy:<fraction>', got {spec!r}"
            )
        rule, value = (part.strip() for part in spec.split(":"))
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"rank budget {spec!r}: {value!r} is not a number") from None
        return cls(rule, number)

    def __str__(self) -> str:
        value = int(self.value) if self.rule == "mean" else self.value
        return f"{self.rule}:{value}"


def is_budget(rank) -> bool:
    """Whether a ``rank`` argument is a budget (a string or ``RankBudget``) rather than ranks."""
    return isinstance(rank, (str, RankBudget))


def query_key_params(
    rank: int, d_in: int, heads: int, *, bias: bool = True, method: str = "cp", core_size: int | None = None
) -> int:
    """Query/key parameters of one collaborative layer: shared projections, mixing (and core), content bias."""
    core_size = core_size or heads
    mixing = heads * rank if method == "cp" else heads * core_size + core_size * rank * rank
    return 2 * d_in * rank + mixing + (heads * d_in if bias else 0)


@dataclass
class RankSelection:
    """What ``select_ranks`` chose and why: the curves it used and the predicted errors."""

    budget: str
    ranks: list[int]
    predicted_errors: list[float]
    query_key_params: int
    budget_params: int | None
    curve_ranks: list[int]
    curve_errors: list[list[float]] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def error_curves(
    tensors: list[HeadProducts],
    ranks: list[int],
    *,
    method: str = "cp",
    core_size: int | None = None,
    full_rank: int | None = None,
    curve_iters: int = 10,
    seed: int = 0,
) -> list[list[float]]:
    """Relative error of each layer at each of ``ranks`` (short implicit runs; ``full_rank`` is exact: 0),
    made non-increasing in rank."""
    curves = []
    for tensor in tensors:
        curve = []
        for rank in ranks:
            if full_rank is not None and rank >= full_rank:
                curve.append(0.0)
            elif method == "cp":
                fit = cp_als(
                    tensor, None, rank, n_iter_max=curve_iters, tol=0, seed=seed, linesearch=True,
                    matmul_dtype=torch.float32,
                )
                curve.append(fit.relative_error)
            else:
                curve.append(tucker_hooi(tensor, None, rank, core_size, n_iter_max=curve_iters, tol=0).relative_error)
        curves.append(np.minimum.accumulate(np.asarray(curve)).tolist())
    return curves


def _lower_hull(costs: np.ndarray, values: np.ndarray) -> list[int]:
    """Indices of the lower convex hull of the points (costs increasing), from the first to the last."""
    hull: list[int] = []
    for i in range(len(costs)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            # drop b if it lies on or above the segment a -> i
            if (values[b] - values[a]) * (costs[i] - costs[a]) >= (values[i] - values[a]) * (costs[b] - costs[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def _allocate(costs: list[np.ndarray], values: list[np.ndarray], budget: float) -> list[int]:
    """Indices into each layer's grid minimizing sum(values) with sum(costs) <= budget (greedy on the hulls,
    then single steps)."""
    position = [0] * len(costs)
    spent = sum(c[0] for c in costs)
    hulls = [_lower_hull(c, v) for c, v in zip(costs, values)]
    step_in_hull = [0] * len(costs)
    active = set(range(len(costs)))
    while active:
        best, best_rate = None, 0.0
        for layer in active:
            hull, at = hulls[layer], step_in_hull[layer]
            if at + 1 >= len(hull):
                continue
            i, j = hull[at], hull[at + 1]
            rate = (values[layer][i] - values[layer][j]) / (costs[layer][j] - costs[layer][i])
            if best is None or rate > best_rate:
                best, best_rate = layer, rate
        if best is None:
            break
        i, j = hulls[best][step_in_hull[best]], hulls[best][step_in_hull[best] + 1]
        if spent + costs[best][j] - costs[best][i] <= budget:
            spent += costs[best][j] - costs[best][i]
            step_in_hull[best] += 1
            position[best] = j
        else:
            active.discard(best)  # its later segments are flatter: they cannot beat what still fits elsewhere
    # spend what is left one grid step at a time, best gain per parameter first
    while True:
        best, best_rate = None, 0.0
        for layer, at in enumerate(position):
            if at + 1 < len(costs[layer]):
                extra = costs[layer][at + 1] - costs[layer][at]
                gain = values[layer][at] - values[layer][at + 1]
                if spent + extra <= budget and gain > 0 and (best is None or gain / extra > best_rate):
                    best, best_rate = layer, gain / extra
        if best is None:
            return position
        spent += costs[best][position[best] + 1] - costs[best][position[best]]
        position[best] += 1


def select_ranks(
    tensors: list[HeadProducts],
    budget: str | RankBudget,
    *,
    full_rank: int,
    method: str = "cp",
    core_size: int | None = None,
    bias: bool = True,
    original_params: list[int] | None = None,
    curve_points: int = 8,
    curve_iters: int = 10,
    seed: int = 0,
) -> RankSelection:
    """Per-layer ranks for the layers' head products ``tensors`` (plain or whitened) under ``budget``.

    ``full_rank`` (heads x head_dim) is the exact rank and the largest allowed; ``original_params`` the query/key
    parameters of each original layer (needed for ``params:``; default ``2 * (d_in * full_rank + full_rank)``).
    """
    budget = RankBudget.parse(budget)
    heads, d_in = tensors[0].heads, tensors[0].d_in
    step = budget.step or heads
    min_rank = budget.min_rank or step
    grid = [r for r in range(step, full_rank + 1, step) if r >= min_rank]
    if not grid or grid[-1] != full_rank:
        grid.append(full_rank)
    grid = sorted(set(grid))
    if budget.rule == "mean" and not min_rank <= budget.value <= full_rank:
        raise ValueError(f"rank budget {budget}: the mean rank must be in [{min_rank}, {full_rank}]")
    # the ranks the curves are computed at: evenly spread over the grid, always its two ends
    picks = np.unique(np.linspace(0, len(grid) - 1, max(2, min(curve_points, len(grid)))).round().astype(int))
    curve_ranks = [grid[i] for i in picks]
    curves = error_curves(
        tensors, curve_ranks, method=method, core_size=core_size, full_rank=full_rank, curve_iters=curve_iters,
        seed=seed,
    )
    squared = [np.interp(grid, curve_ranks, np.square(curve)) for curve in curves]
    cost = np.array([query_key_params(r, d_in, heads, bias=bias, method=method, core_size=core_size) for r in grid])
    budget_params = None
    if budget.rule == "energy":
        positions = [int(np.argmax(sq <= 1 - budget.value + 1e-12)) for sq in squared]
    else:
        if budget.rule == "params":
            original = original_params or [2 * (d_in * full_rank + (full_rank if bias else 0))] * len(tensors)
            budget_params = int(budget.value * sum(original))
        else:
            budget_params = len(tensors) * query_key_params(
                int(budget.value), d_in, heads, bias=bias, method=method, core_size=core_size
            )
        if budget_params < len(tensors) * cost[0]:
            raise ValueError(
                f"rank budget {budget} allows {budget_params:,} query/key parameters, fewer than rank {grid[0]} in "
                f"every layer needs ({len(tensors) * int(cost[0]):,}); raise the budget or lower min_rank/step"
            )
        positions = _allocate([cost] * len(tensors), squared, budget_params)
    ranks = [grid[p] for p in positions]
    return RankSelection(
        budget=str(budget),
        ranks=ranks,
        predicted_errors=[float(np.sqrt(sq[p])) for sq, p in zip(squared, positions)],
        query_key_params=int(sum(cost[p] for p in positions)),
        budget_params=budget_params,
        curve_ranks=curve_ranks,
        curve_errors=curves,
    )
