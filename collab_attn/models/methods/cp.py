"""``cp``, the paper's method: collaborative heads with one mixing vector each, from a CP decomposition of the
stacked head products (``collab_attn.models.methods.decomposition``)."""

from __future__ import annotations

from collab_attn.models.methods.base import ConversionMethod, register
from collab_attn.models.methods.decomposition import DecompositionOptions, plan_decomposition
from collab_attn.models.plan import Plan, Request

NAME = "cp"


def plan_cp(request: Request) -> Plan:
    return plan_decomposition(request, NAME, core_size=None)


CP = register(ConversionMethod(
    NAME, "collaborative heads with mixing vectors from a CP decomposition of the head products (the paper's)",
    plan_cp, layer="collaborative", options=DecompositionOptions, budgets=True, calibrated=True, decomposes=True,
    mixing="vectors", cuts_values=True,
))
