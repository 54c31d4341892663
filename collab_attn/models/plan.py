"""What a conversion plans before it touches the model: per layer, one ``LayerPlan``; the request a method plans from,
with the input statistics an activation-aware request carries (``Calibration``, collected by
``collab_attn.fitting.calibration``).

A method (``collab_attn.models.methods``) reads every layer's query/key weights (``LayerWeights``) from a validated
``Request`` and returns a ``Plan``: the sizes the converted model's config records and, per layer, the new layer's
tensors by its own state-dict names. ``collab_attn.models.conversion`` validates the request, asks the method for
the plan and applies it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from collab_attn.decomposition.rank_selection import RankBudget, RankSelection
from collab_attn.decomposition.whitening import DEFAULT_EPS
from collab_attn.models.hf import Layout

KEY_STATISTICS = ("centered", "raw")


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

    def content_bias_state(self) -> dict:
        """The content bias by a converted layer's name (none without a query bias)."""
        bias = self.content_bias()
        return {} if bias is None else {"content_bias.weight": bias}


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

    def replaced_by(self, value: torch.Tensor, output: torch.Tensor, value_bias: bool = True) -> dict:
        """The state of a new value side: the (width, d_in) value projection ``value``, its bias zero where the
        layer has one (``value_bias`` and a biased original: folded into the output bias), and the (d_out, width)
        output projection ``output`` with the folded bias."""
        state = {"value.weight": value, "output.weight": output}
        if value_bias and self.b_value is not None:
            state["value.bias"] = value.new_zeros(value.shape[0])
        if self.output_bias() is not None:
            state["output.bias"] = self.output_bias()
        return state


@dataclass
class LayerPlan:
    """What a method hands over for one converted layer: ``state``, the new layer's tensors by the names of its own
    ``state_dict`` (``collab_attn.models.layers``; ``output.*`` names the output projection wherever the model keeps
    it). What the plan leaves out of the state is kept from the original: the values and output columns of the
    ``kept_heads`` (None: all), ALBERT's LayerNorm. The layer is then loaded strictly: a tensor missing or extra is
    an error, not a default.

    ``relative_error``: the fit's error (of the query/key head products, or of the projection a shared-subspace
    method cuts); ``weighted_error``: the whitened error of an activation-aware fit; ``value_error``: the error of
    the value-output products where the method fitted the values alone (None where it kept them or fitted them
    jointly with the keys)."""

    state: dict[str, torch.Tensor]
    relative_error: float = 0.0
    weighted_error: float | None = None
    value_error: float | None = None
    kept_heads: list[int] | None = None
    seconds: float = 0.0


@dataclass
class Pruning:
    """What head pruning decided: the heads each layer kept, the importance scores they were ranked by and the query/key
    parameter budget they fit in."""

    kept_heads: list[list[int]]
    importance: list[list[float]]
    query_key_budget: int


@dataclass
class Plan:
    """A method's plan: per layer, what to install; the ``sizes`` of the layers, per layer by the names of the spec
    of the kind the method builds (``collab_attn.kinds.SIZES``: ``rank`` always; None or left out: the
    kind's default), which the converted model's config records; how it was planned (the solver, and what the report
    says of a calibration, a budget's choice of ranks or a pruning)."""

    layers: list[LayerPlan]
    sizes: dict[str, list | None]
    solver: str
    calibration: dict | None = None  # Calibration.summary() of an activation-aware fit
    rank_selection: RankSelection | None = None  # when a budget chose the ranks
    pruning: Pruning | None = None

    def layout(self, method: str, kind: str) -> Layout:
        return Layout(method, kind, self.sizes)


@dataclass
class Calibration:
    """Per-layer input statistics of a model's self-attention layers (in ``attention_modules`` order).

    ``second_moments[i]`` is ``E[x x^T]`` over the (non-padding) tokens entering layer ``i``;
    ``centered_moments[i]`` the same for ``x`` minus the mean of its sequence. ``keys`` picks the key-side statistic
    ``covariance`` returns (see ``collab_attn.fitting.calibration``, which collects them); ``eps`` the
    regularization of the whitening.
    """

    names: list[str]
    second_moments: list[torch.Tensor]
    centered_moments: list[torch.Tensor]
    tokens: int
    sequences: int
    keys: str = "centered"
    eps: float = DEFAULT_EPS
    metadata: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.keys not in KEY_STATISTICS:
            raise ValueError(f"unknown key statistic {self.keys!r}; choose one of {KEY_STATISTICS}")

    def __len__(self) -> int:
        return len(self.names)

    def covariance(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(query side, key side) second-moment matrices of layer ``index``."""
        keys = self.centered_moments[index] if self.keys == "centered" else self.second_moments[index]
        return self.second_moments[index], keys

    def check_matches(self, names: Sequence[str], d_in: int) -> None:
        if list(names) != list(self.names):
            raise ValueError(
                f"the calibration was collected on attention layers {self.names[:2]}... ({len(self.names)}) but the "
                f"model has {list(names)[:2]}... ({len(names)}); collect it on this model"
            )
        if self.second_moments[0].shape != (d_in, d_in):
            raise ValueError(f"calibration statistics are {tuple(self.second_moments[0].shape)}, expected d_in={d_in}")

    def summary(self) -> dict:
        return {"tokens": self.tokens, "sequences": self.sequences, "keys": self.keys, "eps": self.eps,
                **self.metadata}

    def save(self, path: str | Path) -> None:
        torch.save({**vars(self)}, path)

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        return cls(**torch.load(path, weights_only=True))


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
    rotary: bool = False  # rotary positions: the keys may be grouped ((kv_heads, head_dim, d_in) weights)
    bands: str = "per-layer"  # rotary: each layer splits its pairs among the bands, or "shared": one split for all
