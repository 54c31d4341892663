"""``tucker``: collaborative heads with mixing matrices built from a core of ``tucker_core_size`` slices (default: the
heads), from a Tucker decomposition of the stacked head products (``collab_attn.models.methods.decomposition``); with
a value rank, the values shared the same way (a Tucker decomposition of the value-output products). On rotary
models a complex Tucker per frequency band, one core slice per head (``collab_attn.models.methods.rotary_collab``)."""

from __future__ import annotations

from dataclasses import dataclass

from collab_attn.models.methods.base import ConversionMethod, even_split, register
from collab_attn.models.methods.decomposition import DecompositionOptions, plan_decomposition
from collab_attn.models.methods.rotary_collab import plan_rotary
from collab_attn.models.plan import Plan, Request

NAME = "tucker"


@dataclass(frozen=True)
class TuckerOptions(DecompositionOptions):
    tucker_core_size: int | None = None  # the core's head mode; None: the number of heads

    def __post_init__(self):
        super().__post_init__()
        size = self.tucker_core_size
        if size is not None and not (type(size) is int and size > 0):
            raise ValueError(f"tucker_core_size must be a positive integer or None, got {size!r}")


def plan_tucker(request: Request) -> Plan:
    if request.rotary:
        return plan_rotary(request, NAME)
    return plan_decomposition(request, NAME, request.options.tucker_core_size or request.weights[0].heads)


TUCKER = register(ConversionMethod(
    NAME, "collaborative heads with mixing matrices from a Tucker decomposition of the head products",
    plan_tucker, layer="collaborative", options=TuckerOptions, budgets=True, calibrated=True, decomposes=True,
    mixing="matrices", cuts_values=True, rotary_layer="rotary-collaborative", rotary_budgets=True,
    sizes_within=even_split,
))
