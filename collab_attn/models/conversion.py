"""Model surgery: turn the self-attention layers of a pretrained BERT-family model into collaborative ones.

For each layer the query/key weights of every head are decomposed (``decompose_heads``) into shared projections
and mixings; the query bias becomes the content bias ``c_h = Wk_h^T bq_h`` (exact), the key bias is dropped (it
only shifts each softmax row by a constant), values and the output projection are copied, and the logits keep
the original scale ``1/sqrt(head_dim)``. At rank = heads x head_dim the weights are copied with block mixing, so
the conversion is exact and no decomposition runs.

Options beyond the paper: the implicit solver (``solver="implicit"``, default; ``"tensorly"`` is the paper's dense
one), activation-aware fitting (``calibration=``, see ``collab_attn.models.calibration``) and per-layer ranks chosen under
a global budget (``rank="params:0.35"``, ``"mean:128"``, ``"energy:0.8"``; see ``collab_attn.decomposition.rank_selection``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from collab_attn.decomposition.cp_als import HeadProducts
from collab_attn.decomposition.decompose import METHODS, SOLVERS, decompose_heads
from collab_attn.decomposition.rank_selection import RankBudget, RankSelection, is_budget, select_ranks
from collab_attn.decomposition.whitening import whitening_pair
from collab_attn.models.calibration import Calibration
from collab_attn.models.hf import (
    CollaborativeSelfAttention,
    Family,
    attention_modules,
    family_of,
    install_collaborative_layers,
    is_collaborative,
)
from collab_attn.nn.attention import CollaborativeAttention


@dataclass
class LayerReport:
    name: str
    rank: int
    relative_error: float
    seconds: float
    params_before: int
    params_after: int
    query_key_params_before: int
    query_key_params_after: int
    # activation-aware fits: relative error of the whitened products (RMS relative logit error); else None
    weighted_error: float | None = None


@dataclass
class ReparamReport:
    method: str
    layers: list[LayerReport] = field(default_factory=list)
    model_params_before: int = 0
    model_params_after: int = 0
    solver: str = "implicit"
    calibration: dict | None = None  # Calibration.summary() when activation-aware
    rank_selection: RankSelection | None = None  # when the ranks came from a budget

    @property
    def mean_relative_error(self) -> float:
        return sum(layer.relative_error for layer in self.layers) / len(self.layers)

    @property
    def seconds(self) -> float:
        return sum(layer.seconds for layer in self.layers)

    @property
    def attention_params_before(self) -> int:
        return sum(layer.params_before for layer in self.layers)

    @property
    def attention_params_after(self) -> int:
        return sum(layer.params_after for layer in self.layers)

    def to_dict(self) -> dict:
        return {
            "method": self.method,
            "solver": self.solver,
            "mean_relative_error": self.mean_relative_error,
            "seconds": self.seconds,
            "attention_params_before": self.attention_params_before,
            "attention_params_after": self.attention_params_after,
            "model_params_before": self.model_params_before,
            "model_params_after": self.model_params_after,
            "layers": [asdict(layer) for layer in self.layers],
        } | ({} if self.calibration is None else {"calibration": self.calibration}) | (
            {} if self.rank_selection is None else {"rank_selection": self.rank_selection.to_dict()}
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A per-layer Markdown table with a total row (and a whitened-error column for activation-aware fits)."""
        weighted = self.calibration is not None
        rows = [
            "| layer | rank | rel. error |" + (" whitened error |" if weighted else "")
            + " seconds | attn params before | after | q/k params before | after |",
            "|---|---:|---:|" + ("---:|" if weighted else "") + "---:|---:|---:|---:|---:|",
        ]
        for layer in self.layers:
            extra = f" {layer.weighted_error:.4f} |" if weighted and layer.weighted_error is not None else (
                " 0.0000 |" if weighted else ""
            )
            rows.append(
                f"| {layer.name} | {layer.rank} | {layer.relative_error:.4f} |{extra} {layer.seconds:.2f} | "
                f"{layer.params_before:,} | {layer.params_after:,} | {layer.query_key_params_before:,} | "
                f"{layer.query_key_params_after:,} |"
            )
        mean_weighted = ""
        if weighted:
            values = [layer.weighted_error or 0.0 for layer in self.layers]
            mean_weighted = f" {sum(values) / len(values):.4f} (mean) |"
        rows.append(
            f"| total | | {self.mean_relative_error:.4f} (mean) |{mean_weighted} {self.seconds:.2f} | "
            f"{self.attention_params_before:,} | {self.attention_params_after:,} | "
            f"{sum(x.query_key_params_before for x in self.layers):,} | "
            f"{sum(x.query_key_params_after for x in self.layers):,} |"
        )
        return "\n".join(rows)


def per_layer_ranks(rank: int | Sequence[int], num_layers: int, full_rank: int) -> list[int]:
    if isinstance(rank, int):
        ranks = [rank] * num_layers
    elif isinstance(rank, Sequence) and not isinstance(rank, str):
        ranks = list(rank)
    else:
        raise ValueError(f"rank must be an integer or a list of integers (one per attention layer), got {rank!r}")
    if len(ranks) != num_layers:
        raise ValueError(f"got {len(ranks)} ranks but the model has {num_layers} attention layers")
    for layer, value in enumerate(ranks):
        if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= full_rank:
            raise ValueError(
                f"rank {value!r} for layer {layer} is invalid: it must be an integer in [1, {full_rank}] "
                f"(heads x head_dim; {full_rank} is exact)"
            )
    return ranks


def _head_weights(module: nn.Module, family: Family):
    """(heads, head_dim, d_in) query and key weights and the (heads, head_dim) query bias of one layer."""
    heads, head_dim = family.num_heads(module), module.attention_head_size
    query, key = getattr(module, family.query), getattr(module, family.key)
    w_query = query.weight.detach().float().cpu().view(heads, head_dim, -1)
    w_key = key.weight.detach().float().cpu().view(heads, head_dim, -1)
    b_query = None if query.bias is None else query.bias.detach().float().cpu().view(heads, head_dim)
    return w_query, w_key, b_query


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _query_key_count(module: nn.Module, family: Family) -> int:
    if isinstance(module, CollaborativeAttention):
        counts = module.parameter_counts()
        return sum(counts.get(part, 0) for part in ("query", "key", "mixing", "mixing_core", "content_bias"))
    return _count(getattr(module, family.query)) + _count(getattr(module, family.key))


@torch.no_grad()
def _fill(layer: CollaborativeSelfAttention, old: nn.Module, family: Family, factors: dict) -> None:
    """Copy the decomposed query/key factors and the unchanged value/output weights into ``layer``."""

    def put(param: torch.Tensor, value: torch.Tensor) -> None:
        if param.shape != value.shape:
            raise RuntimeError(f"shape mismatch while copying weights: {tuple(param.shape)} vs {tuple(value.shape)}")
        param.copy_(value.to(param.dtype))

    put(layer.query.weight, factors["shared_query"].T)
    put(layer.key.weight, factors["shared_key"].T)
    put(layer.mixing, factors["mixing"])
    if layer.mixing_core is not None:
        put(layer.mixing_core, factors["core"])
    if layer.content_bias is not None:
        put(layer.content_bias.weight, factors["content_bias"])
    layer.value.load_state_dict(getattr(old, family.value).state_dict())
    if family.output is not None:
        layer.output.load_state_dict(getattr(old, family.output).state_dict())
    if layer.LayerNorm is not None:
        layer.LayerNorm.load_state_dict(old.LayerNorm.state_dict())


def _exact_factors(w_query, w_key, tucker_core_size):
    """Full rank: keep every head's projections and give head h the indicator of its own block."""
    heads, head_dim, _ = w_query.shape
    blocks = torch.eye(heads).repeat_interleave(head_dim, dim=1)  # (heads, heads * head_dim)
    factors = {"shared_query": w_query.flatten(0, 1).T, "shared_key": w_key.flatten(0, 1).T}
    if tucker_core_size is None:
        factors["mixing"] = blocks
    else:
        if tucker_core_size != heads:
            raise ValueError(f"an exact Tucker conversion needs tucker_core_size = heads ({heads})")
        factors["mixing"], factors["core"] = torch.eye(heads), torch.diag_embed(blocks)
    return factors, 0.0


def _select(weights, covariances, eps, budget, found, family, full_rank, method, core_size, seed) -> RankSelection:
    """Per-layer ranks under ``budget`` from the (whitened, with a calibration) head products of every layer."""
    tensors = []
    for (w_query, w_key, _), covariance in zip(weights, covariances):
        tensor = HeadProducts(w_query, w_key)
        if covariance is not None:
            (s_query, _), (s_key, _) = whitening_pair(covariance, tensor.d_in, eps)
            tensor = HeadProducts(tensor.a @ s_query, tensor.b @ s_key)
        tensors.append(tensor)
    bias = getattr(found[0][1], family.query).bias is not None
    original = [_query_key_count(module, family) for _, module in found]
    return select_ranks(
        tensors, budget, full_rank=full_rank, method=method, core_size=core_size, bias=bias,
        original_params=original, seed=seed,
    )


def reparametrize(
    model: nn.Module,
    rank: int | Sequence[int] | str | RankBudget,
    method: str = "cp",
    seed: int = 0,
    *,
    solver: str = "implicit",
    init: str = "svd",
    n_iter_max: int = 100,
    tol: float = 1e-8,
    tucker_core_size: int | None = None,
    calibration: Calibration | None = None,
    progress: bool = True,
) -> ReparamReport:
    """Convert every self-attention layer of a BERT, RoBERTa, DistilBERT or ALBERT model in place.

    ``rank`` is the shared key/query size D~: one number, one per attention layer (ALBERT's shared layers
    count once), or a global budget from which per-layer ranks are chosen (``collab_attn.decomposition.rank_selection``):

    - ``"params:F"``: at most ``F`` times the original query/key parameters, over all layers together;
    - ``"mean:R"``: as many query/key parameters as rank ``R`` everywhere, spread where they fit best;
    - ``"energy:E"``: per layer, the smallest rank keeping a fraction ``E`` of the head products' energy;
    - or a ``RankBudget`` (same kinds, plus the rank ``step`` and ``min_rank``).

    ``method`` is ``"cp"`` (mixing vectors, the paper's method) or ``"tucker"`` (mixing matrices from a core of
    ``tucker_core_size`` slices, default: heads). ``solver``: ``"implicit"`` (ALS on the projections, fast) or
    ``"tensorly"`` (dense, the paper's); ``init``, ``n_iter_max``, ``tol`` and ``seed`` go to ``decompose_heads``.
    ``calibration``: input statistics of this model's attention layers (``collab_attn.models.calibration``) for
    activation-aware fitting; the report then also gives each layer's whitened error.

    The model is only changed once every layer has been decomposed, so an error leaves it as it was. Returns a
    per-layer report.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {METHODS}")
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {SOLVERS}")
    if is_collaborative(model.config):
        raise ValueError("this model is already collaborative; reparametrize the original checkpoint instead")
    family = family_of(model.config)
    found = attention_modules(model, family)
    if not found:
        raise ValueError(f"found no {family.attention_class.__name__} modules in {type(model).__name__}")
    heads, head_dim = family.num_heads(found[0][1]), found[0][1].attention_head_size
    budget = RankBudget.parse(rank) if is_budget(rank) else None
    ranks = None if budget is not None else per_layer_ranks(rank, len(found), heads * head_dim)
    core_size = heads if method == "tucker" and tucker_core_size is None else tucker_core_size
    if method == "cp" and tucker_core_size is not None:
        raise ValueError("tucker_core_size only applies to method='tucker'")
    if calibration is not None:
        if not isinstance(calibration, Calibration):
            raise ValueError(f"calibration must be a collab_attn.models.calibration.Calibration, got {type(calibration)}")
        calibration.check_matches([name for name, _ in found], getattr(found[0][1], family.query).in_features)

    weights = []
    for name, module in found:
        w_query, w_key, b_query = _head_weights(module, family)
        for tensor_name, tensor in (("query", w_query), ("key", w_key), ("query bias", b_query)):
            if tensor is not None and not torch.isfinite(tensor).all():
                raise ValueError(f"{name}: the {tensor_name} weights contain NaN or Inf; fix the checkpoint first")
        weights.append((w_query, w_key, b_query))

    report = ReparamReport(
        method=method, model_params_before=_count(model), solver=solver,
        calibration=None if calibration is None else calibration.summary(),
    )
    covariances = [None] * len(found) if calibration is None else [calibration.covariance(i) for i in range(len(found))]
    eps = None if calibration is None else calibration.eps
    if budget is not None:
        report.rank_selection = _select(
            weights, covariances, eps, budget, found, family, heads * head_dim, method, core_size, seed
        )
        ranks = report.rank_selection.ranks
    factors_per_layer = []
    layers = tqdm(weights, desc=f"reparametrize ({method}, rank {rank})", disable=not progress)
    for (w_query, w_key, b_query), layer_rank, covariance in zip(layers, ranks, covariances):
        start = time.perf_counter()
        weighted = None
        if layer_rank == heads * head_dim:
            factors, error = _exact_factors(w_query, w_key, core_size)
            weighted = None if calibration is None else 0.0
        else:
            decomposition = decompose_heads(
                w_query, w_key, layer_rank, method, seed, solver=solver, init=init, n_iter_max=n_iter_max, tol=tol,
                tucker_core_size=core_size, covariance=covariance, whitening_eps=eps,
            )
            factors = {
                "shared_query": decomposition.shared_query, "shared_key": decomposition.shared_key,
                "mixing": decomposition.mixing, "core": decomposition.core,
            }
            error, weighted = decomposition.relative_error, decomposition.weighted_error
        if b_query is not None:
            factors["content_bias"] = torch.einsum("hai,ha->hi", w_key, b_query)
        factors_per_layer.append((factors, error, weighted, time.perf_counter() - start))

    old_counts = {name: (_count(module), _query_key_count(module, family)) for name, module in found}
    for (name, old, new), (factors, error, weighted, seconds), layer_rank in zip(
        install_collaborative_layers(model, ranks, core_size), factors_per_layer, ranks
    ):
        _fill(new, old, family, factors)
        report.layers.append(
            LayerReport(
                name, layer_rank, error, seconds, old_counts[name][0], _count(new), old_counts[name][1],
                _query_key_count(new, family), weighted,
            )
        )
    report.model_params_after = _count(model)
    return report

