"""Collaborative heads from a decomposition of the stacked head products ``Wq_h^T Wk_h`` (``decompose_heads``): the
planner that the CP and Tucker methods share, and their options.

At rank = heads x head_dim the heads are copied with block mixing and nothing is decomposed (exact). Ranks may come
from a global budget (``collab_attn.decomposition.rank_selection``); with a calibration the fit is activation-aware
(whitened products). The query bias becomes the content bias ``c_h = Wk_h^T bq_h`` (exact); the key bias is dropped
(it shifts each softmax row by a constant).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.cp_als import DEFAULT_N_ITER_MAX, DEFAULT_TOL, HeadProducts
from collab_attn.decomposition.decompose import SOLVERS, decompose_heads
from collab_attn.decomposition.rank_selection import RankSelection, select_ranks
from collab_attn.decomposition.whitening import whitening_pair
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Request, ValueWeights

INITS = ("svd", "random")


@dataclass(frozen=True)
class DecompositionOptions:
    """``solver``: ``"implicit"`` (ALS from the projections) or ``"tensorly"`` (dense, the paper's); ``init``:
    ``"svd"`` or ``"random"``; stop after ``n_iter_max`` iterations or once the relative error improved by less than
    ``tol`` of its value in 3 iterations in a row (see ``decompose_heads``)."""

    solver: str = "implicit"
    init: str = "svd"
    n_iter_max: int = DEFAULT_N_ITER_MAX
    tol: float = DEFAULT_TOL

    def __post_init__(self):
        if self.solver not in SOLVERS:
            raise ValueError(f"solver {self.solver!r} is unknown; choose one of {SOLVERS}")
        if self.init not in INITS:
            raise ValueError(f"init {self.init!r} is unknown; choose one of {INITS}")
        if not (type(self.n_iter_max) is int and self.n_iter_max > 0):
            raise ValueError(f"n_iter_max must be a positive integer, got {self.n_iter_max!r}")
        if not (type(self.tol) in (int, float) and self.tol >= 0):
            raise ValueError(f"tol must be a number >= 0, got {self.tol!r}")


def _mixing_state(prefix: str, mixing: torch.Tensor, core: torch.Tensor | None) -> dict:
    """A side's head mixing by the layer's names: ``mixing`` (``value_mixing``) and the Tucker ``mixing_core``
    (``value_core``)."""
    names = ("mixing", "mixing_core") if prefix == "" else ("value_mixing", "value_core")
    return {names[0]: mixing} | ({} if core is None else {names[1]: core})


def _block_mixing(heads: int, head_dim: int, tucker_core_size: int | None, side: str) -> tuple:
    """Full rank: head h mixes with the indicator of its own block (CP), or through a core of one such slice per
    head (Tucker, ``tucker_core_size`` = heads)."""
    blocks = torch.eye(heads).repeat_interleave(head_dim, dim=1)  # (heads, heads * head_dim)
    if tucker_core_size is None:
        return blocks, None
    if tucker_core_size != heads:
        raise ValueError(f"exact Tucker {side} need tucker_core_size = heads ({heads})")
    return torch.eye(heads), torch.diag_embed(blocks)


def _exact(layer: LayerWeights, tucker_core_size: int | None) -> dict:
    """Full rank: keep every head's projections, each head mixing with its own block."""
    mixing, core = _block_mixing(layer.heads, layer.head_dim, tucker_core_size, "keys")
    return {"query.weight": layer.w_query.flatten(0, 1), "key.weight": layer.w_key.flatten(0, 1),
            **_mixing_state("", mixing, core)}


def shared_values(values: ValueWeights, rank: int, request: Request, covariance, decomposition: str,
                  tucker_core_size: int | None) -> tuple[dict, float]:
    """One value of width ``rank`` per token for all heads: a CP decomposition (``decomposition``, as for the keys)
    of the per-head value-output products ``Wv_h^T Wo_h^T`` (the same tensor shape as the query/key products),
    ``Wv_h^T Wo_h^T ~= A diag(n_h) B^T`` with ``A`` the shared value projection, ``n_h`` head h's value mixing and
    ``B`` the output projection; Tucker (``tucker_core_size``: the core's head mode) mixes with
    ``N_h = sum_g n_hg G_g`` instead of ``diag(n_h)``. At rank = heads x head_dim every head keeps its block
    (exact). With ``covariance`` (the layer's (query side, key side) input statistics) the fit is activation-aware
    on the input side: whitened by the inputs' raw second moments (a value's mean reaches the output), the output
    side left as it is (whitened by the identity). Returns the layer's value-side state and the fit's relative error."""
    heads, head_dim, d_in = values.w_value.shape
    if rank == heads * head_dim:
        mixing, core = _block_mixing(heads, head_dim, tucker_core_size, "values")
        state = values.replaced_by(values.w_value.flatten(0, 1), values.w_output.flatten(0, 1).T)
        return state | _mixing_state("value_", mixing, core), 0.0
    options: DecompositionOptions = request.options
    whitened = None
    if covariance is not None:
        raw = covariance[0] if isinstance(covariance, (tuple, list)) else covariance
        d_out = values.w_output.shape[2]
        if d_out != d_in:
            raise ValueError(f"activation-aware shared values need d_out = d_in, got {d_out} and {d_in}")
        whitened = (raw, torch.eye(d_out, dtype=raw.dtype))
    fit = decompose_heads(
        values.w_value, values.w_output, rank, decomposition, request.seed, solver=options.solver, init=options.init,
        n_iter_max=options.n_iter_max, tol=options.tol, device=request.device, covariance=whitened,
        whitening_eps=None if request.calibration is None else request.calibration.eps,
        tucker_core_size=tucker_core_size,
    )
    state = values.replaced_by(fit.shared_query.T, fit.shared_key) | _mixing_state("value_", fit.mixing, fit.core)
    return state, fit.relative_error


def _covariances(request: Request) -> list:
    if request.calibration is None:
        return [None] * len(request.weights)
    return [request.calibration.covariance(i) for i in range(len(request.weights))]


def _select(request: Request, decomposition: str, tucker_core_size: int | None) -> RankSelection:
    """Per-layer ranks under the request's budget from the (whitened, with a calibration) head products."""
    eps = None if request.calibration is None else request.calibration.eps
    tensors = []
    for layer, covariance in zip(request.weights, _covariances(request)):
        tensor = HeadProducts(layer.w_query, layer.w_key)
        if covariance is not None:
            (s_query, _), (s_key, _) = whitening_pair(covariance, tensor.d_in, eps)
            tensor = HeadProducts(tensor.a @ s_query, tensor.b @ s_key)
        tensors.append(tensor)
    first = request.weights[0]
    return select_ranks(
        tensors, request.budget, full_rank=first.heads * first.head_dim, method=decomposition,
        core_size=tucker_core_size,
        bias=first.b_query is not None, original_params=request.original_query_key_params, seed=request.seed,
    )


def plan_decomposition(request: Request, decomposition: str, tucker_core_size: int | None) -> Plan:
    """Collaborative layers from ``decomposition`` (``decompose_heads``'s method) of every layer's head products;
    ``tucker_core_size``: the size of a Tucker core's head mode (None for CP)."""
    options: DecompositionOptions = request.options
    first = request.weights[0]
    full_rank = first.heads * first.head_dim
    calibration = None if request.calibration is None else request.calibration.summary()
    selection = None
    ranks = request.ranks
    if ranks is None:
        selection = _select(request, decomposition, tucker_core_size)
        ranks = selection.ranks
    eps = None if request.calibration is None else request.calibration.eps
    layers = []
    description = f"reparametrize ({decomposition}, rank {request.budget or ranks[0]})"
    progress = tqdm(request.weights, desc=description, disable=not request.progress)
    for index, (layer, rank, covariance) in enumerate(zip(progress, ranks, _covariances(request))):
        start = time.perf_counter()
        if rank == full_rank:
            planned = LayerPlan(_exact(layer, tucker_core_size), weighted_error=None if covariance is None else 0.0)
        else:
            fit = decompose_heads(
                layer.w_query, layer.w_key, rank, decomposition, request.seed, solver=options.solver,
                init=options.init, n_iter_max=options.n_iter_max, tol=options.tol, tucker_core_size=tucker_core_size,
                covariance=covariance, whitening_eps=eps, device=request.device,
            )
            state = {"query.weight": fit.shared_query.T, "key.weight": fit.shared_key.T,
                     **_mixing_state("", fit.mixing, fit.core)}
            planned = LayerPlan(state, fit.relative_error, fit.weighted_error)
        planned.state |= layer.content_bias_state()
        if request.value_ranks is not None:
            value_state, planned.value_error = shared_values(
                request.values[index], request.value_ranks[index], request, covariance, decomposition,
                tucker_core_size)
            planned.state |= value_state
        planned.seconds = time.perf_counter() - start
        layers.append(planned)
    sizes = {"rank": ranks, "tucker_core_size": [tucker_core_size] * len(ranks), "value_rank": request.value_ranks}
    return Plan(layers, sizes, options.solver, calibration=calibration, rank_selection=selection)
