"""What a conversion plans before it touches the model: per layer, one ``LayerPlan``; the request a method plans from.

A method (``collab_attn.models.methods``) reads every layer's query/key weights (``LayerWeights``) from a validated
``Request`` and returns a ``Plan``: the layout the converted model's config records and, per layer, the weights of
the new query/key side. ``collab_attn.models.conversion`` validates the request, asks the method for the plan and
applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from collab_attn.decomposition.rank_selection import RankBudget, RankSelection
from collab_attn.models.calibration import Calibration
from collab_attn.models.hf import Layout


@dataclass
class LayerWeights:
    """One original layer's query/key side: (heads, head_dim, d_in) weights and (heads, head_dim) biases."""

    name: str
    w_query: torch.Tensor
    w_key: torch.Tensor
    b_query: torch.Tensor | None
    b_key: torch.Tensor | None

    @property
    def heads(self) -> int:
        return self.w_query.shape[0]

    @property
    def head_dim(self) -> int:
        return self.w_query.shape[1]

    @property
    def d_in(self) -> int:
        return self.w_query.shape[2]

    def content_bias(self) -> torch.Tensor | None:
        """``c_h = Wk_h^T bq_h`` (heads, d_in): the query bias's term ``bq_h . Wk_h y``, exactly."""
        return None if self.b_query is None else torch.einsum("hai,ha->hi", self.w_key, self.b_query)


@dataclass
class ValueWeights:
    """One original layer's value side (read only when the values are to be shared): (heads, head_dim, d_in) value
    weights ``Wv_h``, (heads, head_dim, d_out) transposed output columns ``Wo_h^T``, the value and output biases."""

    w_value: torch.Tensor
    w_output: torch.Tensor
    b_value: torch.Tensor | None
    b_output: torch.Tensor | None

    def output_bias(self) -> torch.Tensor | None:
        """The output bias with the value bias folded in: every row of an attention map sums to one, so head h's
        value bias adds the constant ``Wo_h bv_h`` to the output (exact)."""
        if self.b_value is None:
            return self.b_output
        folded = torch.einsum("hao,ha->o", self.w_output, self.b_value.reshape(self.w_output.shape[:2]))
        return folded if self.b_output is None else self.b_output + folded


@dataclass
class ValuePlan:
    """A new value side of one layer: the ``value`` and ``output`` (d_out, width) ``nn.Linear`` weights and the output
    bias (the value bias folded in; the value projection gets none). Shared values: ``value`` (D_v, d_in) and the
    heads' ``value_mixing`` (heads, D_v; Tucker: (heads, core) with ``value_core`` (core, D_v, D_v)); latent values:
    ``value`` the up-projection (heads x head_dim, latent) and no mixing."""

    value: torch.Tensor
    output: torch.Tensor
    value_mixing: torch.Tensor | None
    output_bias: torch.Tensor | None
    relative_error: float | None = 0.0  # of the value-output products; None where keys and values were fitted jointly
    value_core: torch.Tensor | None = None


@dataclass
class LayerPlan:
    """The new query/key side of one layer. ``query`` and ``key`` are ``nn.Linear`` weights: (size, d_in) shared
    projections of width D~ (collaborative, with ``mixing`` and for Tucker ``core``), the stacked heads
    (concatenated, ``mixing`` None), per-head queries into one shared key (shared-key layers) or, for a latent
    layer, the queries and the keys' up-projection from the ``latent`` (size, d_in). ``kept_heads``: the original
    heads whose values and output columns stay (None: all)."""

    query: torch.Tensor
    key: torch.Tensor
    mixing: torch.Tensor | None = None
    core: torch.Tensor | None = None
    content_bias: torch.Tensor | None = None
    query_bias: torch.Tensor | None = None
    key_bias: torch.Tensor | None = None
    kept_heads: list[int] | None = None
    latent: torch.Tensor | None = None
    relative_error: float = 0.0
    weighted_error: float | None = None  # activation-aware fits: the error of the whitened products
    seconds: float = 0.0
    values: ValuePlan | None = None  # a new value side (shared or latent values); None: the heads keep theirs


@dataclass
class Pruning:
    """What head pruning decided: the heads each layer kept, the importance scores they were ranked by and the query/key
    parameter budget they fit in."""

    kept_heads: list[list[int]]
    importance: list[list[float]]
    query_key_budget: int


@dataclass
class Plan:
    layout: Layout
    layers: list[LayerPlan]
    solver: str
    calibration: dict | None = None  # Calibration.summary() of an activation-aware fit
    rank_selection: RankSelection | None = None  # when a budget chose the ranks
    pruning: Pruning | None = None


@dataclass
class Request:
    """A validated conversion request: the method's whole input."""

    weights: list[LayerWeights]
    ranks: list[int] | None  # per layer; None when a budget chooses them
    budget: RankBudget | None
    seed: int
    options: object  # the method's options dataclass
    original_query_key_params: list[int]
    calibration: Calibration | None = None
    importance: object = None  # a HeadImportance or one score tensor per layer (methods that need importance)
    value_ranks: list[int] | None = None  # per layer, for shared values (methods that share values)
    values: list[ValueWeights] | None = None  # the layers' value sides, read when value_ranks is set or the method
    # reads the values
    device: torch.device | str | None = None  # where decompositions run (None: where the weights are)
    progress: bool = True


def per_layer_ranks(rank: int | Sequence[int], num_layers: int, full_rank: int) -> list[int]:
    """One rank per layer from an int or a list, each in [1, full_rank]."""
    if isinstance(rank, int) and not isinstance(rank, bool):
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
