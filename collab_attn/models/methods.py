"""The conversion methods, each a planner registered by name (see ``collab_attn.models.plan``).

- ``cp`` (the paper's method) and ``tucker``: collaborative heads from a decomposition of the stacked head
  products ``Wq_h^T Wk_h`` (``decompose_heads``); at rank = heads x head_dim the heads are copied with block
  mixing and nothing is decomposed (exact). Options: the solver settings, per-layer ranks from a global budget,
  activation-aware fitting (``calibration``).
- ``svd``: concatenated heads whose query/key head size is cut to ``k = rank / heads``: each head product's best
  rank-``k`` approximation, ``sqrt(S)`` to each side. Query/key parameters per layer: ``2 d_in D~ + heads d_in``,
  collaborative attention's minus its ``heads x D~`` mixing.
- ``prune``: head pruning by importance (Michel, Levy & Neubig, 2019). The least important heads over all layers
  are removed (never a layer's last) until the kept query/key parameters fit in collaborative attention's at
  ``rank``; the scores come from ``collab_attn.models.importance.head_importance`` on task data.

``cp``, ``tucker`` and ``svd`` turn the query bias into the content bias ``c_h = Wk_h^T bq_h`` (exact) and drop the
key bias (it shifts each softmax row by a constant); ``prune`` keeps the kept heads' biases. Values, the output
projection (the kept heads' columns) and the logit scale ``1/sqrt(head_dim)`` stay as they were.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from tqdm.auto import tqdm

from collab_attn.decomposition.cp_als import DEFAULT_TOL, HeadProducts
from collab_attn.decomposition.decompose import SOLVERS, decompose_heads
from collab_attn.decomposition.rank_selection import RankSelection, query_key_params, select_ranks
from collab_attn.decomposition.truncation import truncate_head_products
from collab_attn.decomposition.whitening import whitening_pair
from collab_attn.models.hf import Layout
from collab_attn.models.importance import HeadImportance
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Request, register_method

# device: where the decompositions run; None: where the model's weights are
DECOMPOSITION_OPTIONS = {"solver": "implicit", "init": "svd", "n_iter_max": 100, "tol": DEFAULT_TOL, "device": None}


# ---------------------------------------------------------------------------------------------------------------
# cp, tucker


def _exact(layer: LayerWeights, core_size: int | None) -> LayerPlan:
    """Full rank: keep every head's projections and give head h the indicator of its own block."""
    heads = layer.heads
    blocks = torch.eye(heads).repeat_interleave(layer.head_dim, dim=1)  # (heads, heads * head_dim)
    plan = LayerPlan(layer.w_query.flatten(0, 1), layer.w_key.flatten(0, 1), mixing=blocks)
    if core_size is not None:
        if core_size != heads:
            raise ValueError(f"an exact Tucker conversion needs tucker_core_size = heads ({heads})")
        plan.mixing, plan.core = torch.eye(heads), torch.diag_embed(blocks)
    return plan


def _covariances(request: Request) -> list:
    if request.calibration is None:
        return [None] * len(request.weights)
    return [request.calibration.covariance(i) for i in range(len(request.weights))]


def _select(request: Request, method: str, core_size: int | None) -> RankSelection:
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
        tensors, request.budget, full_rank=first.heads * first.head_dim, method=method, core_size=core_size,
        bias=first.b_query is not None, original_params=request.original_query_key_params, seed=request.seed,
    )


def _decomposition_planner(method: str):
    def plan(request: Request) -> Plan:
        options = request.options
        if options["solver"] not in SOLVERS:
            raise ValueError(f"unknown solver {options['solver']!r}; choose one of {SOLVERS}")
        first = request.weights[0]
        full_rank = first.heads * first.head_dim
        core_size = options.get("tucker_core_size") or (first.heads if method == "tucker" else None)
        details = {}
        if request.calibration is not None:
            details["calibration"] = request.calibration.summary()
        ranks = request.ranks
        if ranks is None:
            details["rank_selection"] = _select(request, method, core_size)
            ranks = details["rank_selection"].ranks
        eps = None if request.calibration is None else request.calibration.eps
        layers = []
        description = f"reparametrize ({method}, rank {request.budget or ranks[0]})"
        progress = tqdm(request.weights, desc=description, disable=not request.progress)
        for layer, rank, covariance in zip(progress, ranks, _covariances(request)):
            start = time.perf_counter()
            if rank == full_rank:
                planned = _exact(layer, core_size if method == "tucker" else None)
                planned.weighted_error = None if covariance is None else 0.0
            else:
                fit = decompose_heads(
                    layer.w_query, layer.w_key, rank, method, request.seed, solver=options["solver"],
                    init=options["init"], n_iter_max=options["n_iter_max"], tol=options["tol"],
                    tucker_core_size=core_size, covariance=covariance, whitening_eps=eps, device=options["device"],
                )
                planned = LayerPlan(fit.shared_query.T, fit.shared_key.T, fit.mixing, fit.core,
                                    relative_error=fit.relative_error, weighted_error=fit.weighted_error)
            planned.content_bias = layer.content_bias()
            planned.seconds = time.perf_counter() - start
            layers.append(planned)
        return Plan(Layout(method, ranks, None, core_size), layers, options["solver"], details)

    return plan


register_method("cp", DECOMPOSITION_OPTIONS, budgets=True)(_decomposition_planner("cp"))
register_method("tucker", {**DECOMPOSITION_OPTIONS, "tucker_core_size": None}, budgets=True)(
    _decomposition_planner("tucker")
)


# ---------------------------------------------------------------------------------------------------------------
# svd: SVD-truncated concatenated heads


def check_svd_ranks(ranks: Sequence[int], heads: int) -> None:
    for layer, value in enumerate(ranks):
        if value % heads:
            lower, upper = max(heads, value - value % heads), value - value % heads + heads
            raise ValueError(
                f"rank {value} for layer {layer} is not a multiple of the {heads} heads: the SVD baseline gives "
                f"each head rank / heads query/key dimensions; choose e.g. {lower} or {upper}"
            )


@register_method("svd", check_ranks=check_svd_ranks)
def plan_svd(request: Request) -> Plan:
    layers = []
    for layer, rank in zip(tqdm(request.weights, desc="svd", disable=not request.progress), request.ranks):
        start = time.perf_counter()
        truncated = truncate_head_products(layer.w_query, layer.w_key, rank // layer.heads)
        layers.append(LayerPlan(
            truncated.w_query.flatten(0, 1), truncated.w_key.flatten(0, 1), content_bias=layer.content_bias(),
            relative_error=truncated.relative_error, seconds=time.perf_counter() - start,
        ))
    return Plan(Layout("svd", list(request.ranks)), layers, "svd")


# ---------------------------------------------------------------------------------------------------------------
# prune: head pruning by importance


def heads_to_keep(scores: Sequence[torch.Tensor], count: int) -> list[list[int]]:
    """The ``count`` most important heads over all layers, at least one per layer (each layer's best first)."""
    ranked = sorted(
        ((-float(score), layer, head) for layer, row in enumerate(scores) for head, score in enumerate(row))
    )
    keep: list[set[int]] = [set() for _ in scores]
    for _, layer, head in ranked:  # each layer's best head first ...
        if not keep[layer]:
            keep[layer].add(head)
    kept = len(scores)
    for _, layer, head in ranked:  # ... then the best of the rest, over all layers
        if kept >= count:
            break
        if head not in keep[layer]:
            keep[layer].add(head)
            kept += 1
    return [sorted(heads) for heads in keep]


def _head_energy(layer: LayerWeights) -> torch.Tensor:
    """||Wq_h^T Wk_h||_F^2 per head, from the head_dim x head_dim Gram matrices."""
    w_query, w_key = layer.w_query.double(), layer.w_key.double()
    return (w_query @ w_query.transpose(1, 2) * (w_key @ w_key.transpose(1, 2))).sum((1, 2))


@register_method("prune", {"importance": None})
def plan_prune(request: Request) -> Plan:
    """Keep the most important heads within collaborative attention's query/key parameters at ``rank``: per layer
    ``2 d_in D~ + heads D~ + heads d_in`` (``query_key_params``); a concatenated head costs ``2 head_dim (d_in + 1)``.
    Report: per layer the query/key size kept (kept heads x head_dim) and as ``relative_error`` the relative error of
    the stacked head products with the pruned ones zeroed, sqrt(energy fraction removed)."""
    importance = request.options["importance"]
    if importance is None:
        raise ValueError("method='prune' needs importance= (collab_attn.models.importance.head_importance on task data "
                         "with labels, or one score tensor per layer)")
    scores = list(importance.scores if isinstance(importance, HeadImportance) else importance)
    heads = [layer.heads for layer in request.weights]
    if [len(s) for s in scores] != heads:
        raise ValueError(f"importance has {[len(s) for s in scores]} scores per layer; the model has {heads} heads")
    first = request.weights[0]
    bias = first.b_query is not None
    budget = sum(query_key_params(r, first.d_in, h, bias=bias) for r, h in zip(request.ranks, heads))
    keep = heads_to_keep(scores, budget // (2 * first.head_dim * (first.d_in + int(bias))))
    shared = importance.seconds / len(heads) if isinstance(importance, HeadImportance) else 0.0
    layers = []
    for layer, kept in zip(request.weights, keep):
        start = time.perf_counter()
        energy = _head_energy(layer)
        removed = energy.sum() - energy[kept].sum()
        select = torch.tensor(kept)
        layers.append(LayerPlan(
            layer.w_query[select].flatten(0, 1), layer.w_key[select].flatten(0, 1),
            query_bias=None if layer.b_query is None else layer.b_query[select].flatten(),
            key_bias=None if layer.b_key is None else layer.b_key[select].flatten(),
            kept_heads=kept,
            relative_error=float((removed.clamp_min(0) / energy.sum().clamp_min(1e-300)).sqrt()),
            seconds=shared + time.perf_counter() - start,
        ))
    layout = Layout("prune", [len(k) * first.head_dim for k in keep], [len(k) for k in keep])
    details = {"kept_heads": keep, "importance": [s.tolist() for s in scores], "query_key_budget": budget}
    return Plan(layout, layers, "importance", details)
