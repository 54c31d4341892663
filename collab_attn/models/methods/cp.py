"""``cp``, the paper's method: collaborative heads with one mixing vector each, from a CP decomposition of the
stacked head products (``collab_attn.models.methods.decomposition``); on rotary models, of each frequency band's
(``collab_attn.models.methods.rotary_collab``)."""

from __future__ import annotations

from collab_attn.models.methods.base import ConversionMethod, even_split, register
from collab_attn.models.methods.decomposition import DecompositionOptions, plan_decomposition
from collab_attn.models.methods.rotary_collab import plan_rotary
from collab_attn.models.plan import Plan, Request

NAME = "cp"


def plan_cp(request: Request) -> Plan:
    if request.rotary:
        return plan_rotary(request, NAME)
    return plan_decomposition(request, NAME, tucker_core_size=None)


CP = register(ConversionMethod(
    NAME, "collaborative heads with mixing vectors from a CP decomposition of the head products (the paper's)",
    plan_cp, layer="collaborative", options=DecompositionOptions, budgets=True, calibrated=True, decomposes=True,
    mixing="vectors", cuts_values=True, rotary_layer="rotary-collaborative",
    rotary_budgets=True, sizes_within=even_split,
))
