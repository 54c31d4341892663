"""What ``reparametrize`` returns: per layer the rank, the relative error of the fit (the head products; the key or
key/value projection for the shared-subspace methods), the errors of the head products measured from the converted
layer, seconds and parameter counts, and their totals; JSON and a Markdown table."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from collab_attn.decomposition.rank_selection import RankSelection
from collab_attn.models.plan import Pruning


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
    # values cut to a value rank (shared or narrow): relative error of the value-output products; else None
    value_error: float | None = None
    # measured from the converted layer's own weights against the original (collab_attn.kinds.forms): the
    # relative error of the query/key head products (equal to relative_error where the fit is of those products,
    # checked) and of the value-output products (0 where every head keeps its values)
    products_error: float | None = None
    value_products_error: float | None = None


@dataclass
class ReparamReport:
    method: str
    layers: list[LayerReport] = field(default_factory=list)
    model_params_before: int = 0
    model_params_after: int = 0
    solver: str = "implicit"
    calibration: dict | None = None  # Calibration.summary() when activation-aware
    rank_selection: RankSelection | None = None  # when the ranks came from a budget
    pruning: Pruning | None = None  # head pruning: the kept heads, their scores and the budget

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
        ) | ({} if self.pruning is None else asdict(self.pruning))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A per-layer Markdown table with a total row (and a whitened-error column for activation-aware fits, a
        value-error column where the values were cut)."""
        weighted = self.calibration is not None
        values = any(layer.value_error is not None for layer in self.layers)
        columns = (" whitened error |" if weighted else "") + (" value error |" if values else "")
        rows = [
            f"| layer | rank | rel. error |{columns} seconds | attn params before | after | q/k params before "
            "| after |",
            "|---|---:|---:|" + "---:|" * columns.count("|") + "---:|---:|---:|---:|---:|",
        ]
        for layer in self.layers:
            extra = f" {layer.weighted_error:.4f} |" if weighted and layer.weighted_error is not None else (
                " 0.0000 |" if weighted else ""
            )
            extra += f" {layer.value_error:.4f} |" if values else ""
            rows.append(
                f"| {layer.name} | {layer.rank} | {layer.relative_error:.4f} |{extra} {layer.seconds:.2f} | "
                f"{layer.params_before:,} | {layer.params_after:,} | {layer.query_key_params_before:,} | "
                f"{layer.query_key_params_after:,} |"
            )
        means = ""  # the mean of each extra column
        if weighted:
            whitened = [layer.weighted_error or 0.0 for layer in self.layers]
            means = f" {sum(whitened) / len(whitened):.4f} (mean) |"
        if values:
            errors = [layer.value_error for layer in self.layers]
            means += f" {sum(errors) / len(errors):.4f} (mean) |"
        rows.append(
            f"| total | | {self.mean_relative_error:.4f} (mean) |{means} {self.seconds:.2f} | "
            f"{self.attention_params_before:,} | {self.attention_params_after:,} | "
            f"{sum(x.query_key_params_before for x in self.layers):,} | "
            f"{sum(x.query_key_params_after for x in self.layers):,} |"
        )
        return "\n".join(rows)
