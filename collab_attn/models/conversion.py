"""Model surgery: one conversion path for every method. ``reparametrize`` validates, plans, then applies.

1. Validate (once, for every method): the method is registered, the model is a supported family that is not
   converted yet and has attention modules, the ranks (or budget) are in range, the options are the method's own,
   and the query/key weights are finite.
2. Plan: the method (``collab_attn.models.methods``) turns every layer's query/key weights into a ``LayerPlan``;
   nothing is changed yet, so an error leaves the model as it was.
3. Apply: ``build_layers`` makes an empty converted layer of the kind the method builds for each attention module,
   which is filled: the planned query/key side, the values and output projection of the kept heads, ALBERT's
   LayerNorm. Each filled layer is then measured (``collab_attn.models.products``: its head products read back from
   its own weights against the original's) and must give the error its fit reported; only then does ``put_layers``
   put the layers into the model and record the layout in the config.

The converted model saves with ``save_pretrained`` and loads back with the Auto classes after ``import
collab_attn`` (``collab_attn.models.hf``), whatever the method.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from collab_attn.decomposition.cp_als import HeadProducts
from collab_attn.decomposition.decompose import check_finite
from collab_attn.decomposition.rank_selection import RankBudget, is_budget
from collab_attn.models.calibration import Calibration
from collab_attn.models.hf import (
    Family,
    InstalledLayer,
    build_layers,
    check_head_class,
    family_of,
    find_attention,
    is_collaborative,
    put_layers,
    query_key_count,
)
from collab_attn.models.methods import METHODS, PAPER_METHOD, ConversionMethod, get_method
from collab_attn.models.plan import LayerPlan, LayerWeights, Plan, Request, ValueWeights, per_layer_ranks
from collab_attn.models.products import (
    original_forms,
    original_value_forms,
    query_key_forms,
    relative_error,
    value_forms,
)
from collab_attn.models.report import LayerReport, ReparamReport

__all__ = ["METHODS", "ReparamReport", "check_request", "reparametrize"]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _layer_weights(name: str, module: nn.Module, family: Family) -> LayerWeights:
    weights = LayerWeights(name, *family.head_weights(module))
    check_finite(name, query=weights.w_query, key=weights.w_key, query_bias=weights.b_query)
    if not HeadProducts(weights.w_query, weights.w_key).norm_sq() > 0:
        raise ValueError(f"{name}: every head's query/key product Wq_h^T Wk_h is zero (all-zero query or key weights), "
                         "so there is nothing to decompose and no relative error; fix or retrain the checkpoint first")
    return weights


def _check_ranks(method: ConversionMethod, rank, num_layers: int, full_rank: int):
    if is_budget(rank):
        if not method.budgets:
            raise ValueError(f"method={method.name!r} takes one rank or one per layer, not a budget ({rank!r})")
        return None, RankBudget.parse(rank)
    return per_layer_ranks(rank, num_layers, full_rank), None


def _validate(model: nn.Module, method: ConversionMethod, rank):
    """Every check a conversion passes before planning, for every method: a model that is not converted yet and has
    attention modules of a supported family, ranks (or a budget) in range and the method's own rank rule. Returns
    the family, the attention modules and the ranks or budget."""
    if is_collaborative(model.config):
        raise ValueError("this model is already collaborative; reparametrize the original checkpoint instead")
    family, found = find_attention(model)
    check_head_class(model, family)
    heads, head_dim = family.num_heads(found[0][1]), family.head_dim(found[0][1])
    ranks, budget = _check_ranks(method, rank, len(found), heads * head_dim)
    if ranks is not None and method.check_ranks is not None:
        method.check_ranks(ranks, heads)
    return family, found, ranks, budget


def check_request(config, method: str, rank, value_rank=None, **options) -> None:
    """Check, before any training, that a model with this transformers ``config`` converts with ``method`` at
    ``rank`` with ``options`` (``_validate`` on the model's skeleton, built on the meta device: no weights are read);
    raises a ValueError that says what to change."""
    from transformers import AutoModel

    conversion = get_method(method)
    conversion.make_options(**options)
    family_of(config)  # unsupported and rotary families are refused with the reason before anything is built
    with torch.device("meta"):
        skeleton = AutoModel.from_config(config)
    family, found, _, _ = _validate(skeleton, conversion, rank)
    _check_value_ranks(conversion, value_rank, found, family)


@torch.no_grad()
def _fill(entry: InstalledLayer, planned: LayerPlan, family: Family) -> None:
    """Copy the planned query/key side and the kept heads' values and output projection into the new layer."""
    layer, old = entry.new, entry.old

    def put(param: torch.Tensor, value: torch.Tensor) -> None:
        if param.shape != value.shape:
            raise RuntimeError(f"shape mismatch while copying weights: {tuple(param.shape)} vs {tuple(value.shape)}")
        param.copy_(value.to(param.dtype))

    for name in ("query", "key"):
        put(getattr(layer, name).weight, getattr(planned, name))
        if getattr(planned, f"{name}_bias") is not None:
            put(getattr(layer, name).bias, getattr(planned, f"{name}_bias"))
    for name in ("mixing", "core"):
        if getattr(planned, name) is not None:
            put(layer.mixing if name == "mixing" else layer.mixing_core, getattr(planned, name))
    if planned.content_bias is not None:
        put(layer.content_bias.weight, planned.content_bias)
    if planned.latent is not None:
        put(layer.latent.weight, planned.latent)
        if layer.latent.bias is not None:
            layer.latent.bias.zero_()
    if planned.values is not None:
        _fill_shared_values(entry, planned.values, family, put)
    else:
        _fill_head_values(entry, planned, family, put)
    if layer.LayerNorm is not None:
        layer.LayerNorm.load_state_dict(old.LayerNorm.state_dict())


def _fill_shared_values(entry: InstalledLayer, values, family: Family, put) -> None:
    """The planned value projection (its bias zero: folded into the output bias), the heads' value mixing (shared
    values) and the output projection (inside the layer, or the new one beside it)."""
    layer = entry.new
    put(layer.value.weight, values.value)
    if layer.value.bias is not None:
        layer.value.bias.zero_()
    if values.value_mixing is not None:
        put(layer.value_mixing, values.value_mixing)
    if values.value_core is not None:
        put(layer.value_core, values.value_core)
    target = layer.output if family.output is not None else entry.new_outer_output
    put(target.weight, values.output)
    if values.output_bias is not None:
        put(target.bias, values.output_bias)


def _fill_head_values(entry: InstalledLayer, planned: LayerPlan, family: Family, put) -> None:
    """The kept heads' values and output columns, copied."""
    layer, old = entry.new, entry.old
    head_dim = family.head_dim(old)
    index = None if planned.kept_heads is None else torch.tensor(
        [h * head_dim + i for h in planned.kept_heads for i in range(head_dim)]
    )
    weight, bias = family.projection(old, "value")
    put(layer.value.weight, weight if index is None else weight[index])
    if bias is not None:
        put(layer.value.bias, bias if index is None else bias[index])
    if family.output is not None:
        source, target = getattr(old, family.output), layer.output
    else:  # beside the attention module; replaced only where heads were removed
        source, target = entry.old_outer_output, entry.new_outer_output
    if target is not None:
        weight, bias = family.output_weights(source)
        put(target.weight, weight if index is None else weight[:, index])
        if bias is not None:
            put(target.bias, bias)


def _originals(model: nn.Module, family: Family, found, request: Request) -> list:
    """Every layer's original logit forms and value maps (``collab_attn.models.products``), from the weights the
    request read (the value side read here where the method did not need it), before the surgery."""
    originals = []
    for index, (name, module) in enumerate(found):
        weights = request.weights[index]
        values = request.values[index] if request.values is not None else ValueWeights(
            *family.value_output_weights(model, name, module))
        originals.append((original_forms(weights.w_query, weights.w_key, family.logit_scale(module)),
                          original_value_forms(values.w_value, values.w_output)))
    return originals


def _measure(model: nn.Module, family: Family, entry: InstalledLayer, planned: LayerPlan, original) -> tuple:
    """The relative errors of the installed layer's head products (logit forms, value maps) against the original's,
    read from the layer's own weights: what the converted model computes, whatever the planner claimed."""
    query_keys, values = original
    output = None
    if entry.new.output is None:  # beside the attention module: the new one, or the model's own where it stays
        outer = entry.new_outer_output or family.output_projection(model, entry.name)
        output = family.output_weights(outer)[0]
    return (relative_error(query_key_forms(entry.new), query_keys, planned.kept_heads),
            relative_error(value_forms(entry.new, output), values, planned.kept_heads))


def _check_installed(name: str, side: str, claimed: float | None, measured: float, dtype: torch.dtype) -> None:
    """Refuse a converted layer whose weights do not give the error its fit reported: a bug in the conversion, not
    in the input (the tolerance covers rounding the fitted factors to the model's dtype)."""
    if claimed is None:
        return
    tolerance = 1e-4 + 10 * torch.finfo(dtype).eps
    if abs(measured - claimed) > tolerance:
        raise RuntimeError(
            f"{name}: the installed {side} give a relative error of {measured:.6g} against the original, but the fit "
            f"reported {claimed:.6g}: the converted layer does not hold what was fitted (a bug in collab_attn; "
            "please report it with the model and settings)"
        )


def _apply(model: nn.Module, family: Family, found, request: Request, plan: Plan,
           method: ConversionMethod) -> ReparamReport:
    before = {name: (_count(module), query_key_count(module, family)) for name, module in found}
    originals = _originals(model, family, found, request)
    report = ReparamReport(
        method=method.name, model_params_before=_count(model), solver=plan.solver, calibration=plan.calibration,
        rank_selection=plan.rank_selection, pruning=plan.pruning,
    )
    built = build_layers(model, plan.layout)
    for entry, planned, rank, original in zip(built, plan.layers, plan.layout.ranks, originals):
        _fill(entry, planned, family)
        products_error, value_products_error = _measure(model, family, entry, planned, original)
        dtype = next(entry.new.parameters()).dtype
        value_error = None if planned.values is None else planned.values.relative_error
        if method.reports_products_error:
            _check_installed(entry.name, "query/key head products", planned.relative_error, products_error, dtype)
        _check_installed(entry.name, "value-output products", value_error, value_products_error, dtype)
        report.layers.append(LayerReport(
            entry.name, rank, planned.relative_error, planned.seconds, *before[entry.name][:1], _count(entry.new),
            before[entry.name][1], query_key_count(entry.new, family), planned.weighted_error, value_error,
            products_error, value_products_error,
        ))
    put_layers(model, built, plan.layout)  # only once every layer holds what was fitted
    report.model_params_after = _count(model)
    return report


def reparametrize(
    model: nn.Module,
    rank: int | Sequence[int] | str | RankBudget,
    method: str = PAPER_METHOD,
    seed: int = 0,
    *,
    calibration: Calibration | None = None,
    importance=None,
    value_rank: int | Sequence[int] | None = None,
    progress: bool = True,
    device: torch.device | str | None = None,
    **options,
) -> ReparamReport:
    """Convert every self-attention layer of a model of a supported family (BERT, RoBERTa, DistilBERT, ALBERT,
    GPT-2, OPT; any head class) in place, with the conversion method ``method`` (``METHODS``; see
    ``collab_attn.models.methods``; the default is the paper's CP decomposition).

    ``rank`` is the shared key/query size D~: one number, one per attention layer (ALBERT's shared layers count
    once), or, for a method that takes budgets, a global budget from which per-layer ranks are chosen
    (``collab_attn.decomposition.rank_selection``): ``"params:F"``, ``"mean:R"``, ``"energy:E"`` or a ``RankBudget``.
    ``options``: the method's own options (the fields of its options dataclass, e.g. ``solver``, ``init``,
    ``n_iter_max``, ``tol`` and ``tucker_core_size`` of the decompositions); unset ones take the dataclass's
    defaults. ``calibration``: input statistics of this model's attention layers
    (``collab_attn.models.calibration``) for the methods that fit the logits (activation-aware); the report then
    also gives each layer's whitened error. ``importance``: the head scores a pruning method ranks heads by (a
    ``HeadImportance`` from ``collab_attn.models.importance.head_importance`` on task data, or one score tensor per
    layer). ``device``: where a decomposition runs (None: the model's device; ``"cuda"`` for a model on the CPU
    works too); the converted model stays where it was. ``value_rank``: for a method that shares values, one value
    of width D_v per token for all heads (one number, or one per layer; heads x head_dim is exact), from a CP
    decomposition of the per-head value-output products ``Wv_h^T Wo_h^T``; None keeps every head's values.

    An option or input the method does not take raises. The model is changed only once every layer has been planned,
    so an error leaves it as it was. Returns a per-layer report.
    """
    conversion = get_method(method)
    options = conversion.make_options(**options)
    if calibration is not None and not conversion.calibrated:
        raise ValueError(f"calibration does not apply to method={method!r}: only the methods that fit the logits "
                         f"({', '.join(m for m, c in METHODS.items() if c.calibrated)}) take one")
    if (importance is not None) != conversion.needs_importance:
        raise ValueError(f"method={method!r} needs importance= (collab_attn.models.importance.head_importance on task "
                         "data with labels, or one score tensor per layer)" if conversion.needs_importance else
                         f"importance does not apply to method={method!r}: it needs no head scores")
    if device is not None and not conversion.decomposes:
        raise ValueError(f"device={device!r} does not apply to method={method!r}: it runs no decomposition")
    family, found, ranks, budget = _validate(model, conversion, rank)
    value_ranks = _check_value_ranks(conversion, value_rank, found, family)
    if calibration is not None:
        if not isinstance(calibration, Calibration):
            raise ValueError(f"calibration must be a models.calibration.Calibration, not {type(calibration)}")
        calibration.check_matches([name for name, _ in found], family.d_in(found[0][1]))
    request = Request(
        [_layer_weights(name, module, family) for name, module in found], ranks, budget, seed, options,
        [query_key_count(module, family) for _, module in found], calibration=calibration, importance=importance,
        value_ranks=value_ranks, device=device, progress=progress,
        values=None if value_ranks is None and not conversion.reads_values else [
            ValueWeights(*family.value_output_weights(model, name, module)) for name, module in found
        ],
    )
    return _apply(model, family, found, request, conversion.plan(request), conversion)


def _check_value_ranks(conversion: ConversionMethod, value_rank, found, family) -> list[int] | None:
    """Per-layer value widths D_v cached per token (None: each head keeps its values), each in [1, heads x head_dim]
    and within the method's rank rule."""
    if value_rank is None:
        return None
    if not conversion.cuts_values:
        cutting = [name for name, m in METHODS.items() if m.cuts_values]
        raise ValueError(f"value_rank does not apply to method={conversion.name!r}: its heads keep their values "
                         f"(methods that cut the values: {cutting})")
    module = found[0][1]
    heads = family.num_heads(module)
    try:
        ranks = per_layer_ranks(value_rank, len(found), heads * family.head_dim(module))
        if conversion.check_ranks is not None:
            conversion.check_ranks(ranks, heads)
    except ValueError as err:
        raise ValueError(f"value_rank: {err}") from err
    return ranks
