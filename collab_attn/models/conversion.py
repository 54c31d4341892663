"""Model surgery: one conversion path for every method. ``reparametrize`` validates, plans, then applies.

1. Validate (once, for every method): the method is registered, the model is a supported family that is not
   converted yet and has attention modules, the ranks (or budget) are in range, the options are the method's own,
   and the query/key weights are finite.
2. Plan: the method's planner (``collab_attn.models.methods``) turns every layer's query/key weights into a
   ``LayerPlan``; nothing is changed yet, so an error leaves the model as it was.
3. Apply: ``install_layers`` replaces each attention module by an empty converted one (collaborative for ``cp`` and
   ``tucker``, concatenated heads for ``svd`` and ``prune``) and records the layout in the config, then the layers
   are filled: the planned query/key side, the values and output projection of the kept heads, ALBERT's LayerNorm.

The converted model saves with ``save_pretrained`` and loads back with the Auto classes after ``import
collab_attn`` (``collab_attn.models.hf``), whatever the method.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from collab_attn.decomposition.decompose import check_finite
from collab_attn.decomposition.rank_selection import RankBudget, is_budget
from collab_attn.models import methods  # noqa: F401  (registers the methods)
from collab_attn.models.calibration import Calibration
from collab_attn.models.hf import (
    Family,
    InstalledLayer,
    check_head_class,
    family_of,
    find_attention,
    install_layers,
    is_collaborative,
    query_key_count,
)
from collab_attn.models.plan import METHODS, OPTIONS, LayerPlan, LayerWeights, Plan, Request, per_layer_ranks
from collab_attn.models.report import LayerReport, ReparamReport

__all__ = ["METHODS", "ReparamReport", "check_request", "reparametrize"]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _layer_weights(name: str, module: nn.Module, family: Family) -> LayerWeights:
    weights = LayerWeights(name, *family.head_weights(module))
    check_finite(name, query=weights.w_query, key=weights.w_key, query_bias=weights.b_query)
    return weights


def _check_ranks(method: str, rank, num_layers: int, full_rank: int) -> tuple[list[int] | None, RankBudget | None]:
    if is_budget(rank):
        if not METHODS[method].takes_budgets:
            raise ValueError(f"method={method!r} takes one rank or one per layer, not a budget ({rank!r})")
        return None, RankBudget.parse(rank)
    return per_layer_ranks(rank, num_layers, full_rank), None


def _check_options(method: str, options: dict) -> dict:
    """The method's options (``OPTIONS[method]``: name -> default) with the values given; an option given (not None)
    that the method does not take is refused."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; choose one of {tuple(METHODS)}")
    accepted = OPTIONS[method]
    for name, value in options.items():
        if value is not None and name not in accepted:
            takes = ", ".join(accepted) or "none besides rank and seed"
            raise ValueError(f"{name}={value!r} does not apply to method={method!r} (its options: {takes})")
    return {name: default if options.get(name) is None else options[name] for name, default in accepted.items()}


def _validate(model: nn.Module, method: str, rank, options: dict):
    """Every check a conversion passes before planning, for every method: the method and its options, a model that
    is not converted yet and has attention modules of a supported family, ranks (or a budget) in range and the
    method's own rank rule. Returns the family, the attention modules, the ranks or budget and the options."""
    options = _check_options(method, options)
    if is_collaborative(model.config):
        raise ValueError("this model is already collaborative; reparametrize the original checkpoint instead")
    family, found = find_attention(model)
    check_head_class(model, family)
    heads, head_dim = family.num_heads(found[0][1]), family.head_dim(found[0][1])
    ranks, budget = _check_ranks(method, rank, len(found), heads * head_dim)
    if ranks is not None and METHODS[method].check_ranks is not None:
        METHODS[method].check_ranks(ranks, heads)
    return family, found, ranks, budget, options


def check_request(config, method: str, rank, tucker_core_size: int | None = None) -> None:
    """Check, before any training, that a model with this transformers ``config`` converts with ``method`` at
    ``rank`` (``_validate`` on the model's skeleton, built on the meta device: no weights are read); raises a
    ValueError that says what to change."""
    from transformers import AutoModel

    family_of(config)  # unsupported and rotary families are refused with the reason before anything is built
    with torch.device("meta"):
        skeleton = AutoModel.from_config(config)
    _validate(skeleton, method, rank, {"tucker_core_size": tucker_core_size})


def _plan(model: nn.Module, rank, method: str, seed: int, options: dict, calibration, progress: bool):
    family, found, ranks, budget, options = _validate(model, method, rank, options)
    if calibration is not None:
        if not isinstance(calibration, Calibration):
            raise ValueError(f"calibration must be a models.calibration.Calibration, not {type(calibration)}")
        calibration.check_matches([name for name, _ in found], family.d_in(found[0][1]))
    request = Request(
        [_layer_weights(name, module, family) for name, module in found], ranks, budget, seed, options,
        calibration, [query_key_count(module, family) for _, module in found], progress,
    )
    return family, found, METHODS[method](request)


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
    if layer.LayerNorm is not None:
        layer.LayerNorm.load_state_dict(old.LayerNorm.state_dict())


def _apply(model: nn.Module, family: Family, found, plan: Plan, method: str) -> ReparamReport:
    before = {name: (_count(module), query_key_count(module, family)) for name, module in found}
    report = ReparamReport(method=method, model_params_before=_count(model), solver=plan.solver)
    report.calibration = plan.details.pop("calibration", None)
    report.rank_selection = plan.details.pop("rank_selection", None)
    report.details = plan.details
    for entry, planned, rank in zip(install_layers(model, plan.layout), plan.layers, plan.layout.ranks):
        _fill(entry, planned, family)
        report.layers.append(LayerReport(
            entry.name, rank, planned.relative_error, planned.seconds, *before[entry.name][:1], _count(entry.new),
            before[entry.name][1], query_key_count(entry.new, family), planned.weighted_error,
        ))
    report.model_params_after = _count(model)
    return report


def reparametrize(
    model: nn.Module,
    rank: int | Sequence[int] | str | RankBudget,
    method: str = "cp",
    seed: int = 0,
    *,
    solver: str | None = None,
    init: str | None = None,
    n_iter_max: int | None = None,
    tol: float | None = None,
    tucker_core_size: int | None = None,
    calibration: Calibration | None = None,
    importance=None,
    progress: bool = True,
    device: torch.device | str | None = None,
) -> ReparamReport:
    """Convert every self-attention layer of a BERT, RoBERTa, DistilBERT or ALBERT model (any head class) in place.

    ``rank`` is the shared key/query size D~: one number, one per attention layer (ALBERT's shared layers count
    once), or for ``cp`` and ``tucker`` a global budget from which per-layer ranks are chosen
    (``collab_attn.decomposition.rank_selection``): ``"params:F"``, ``"mean:R"``, ``"energy:E"`` or a ``RankBudget``.

    ``method``:

    - ``"cp"`` (mixing vectors, the paper's method) or ``"tucker"`` (mixing matrices from a core of
      ``tucker_core_size`` slices, default: heads). ``solver``: ``"implicit"`` (ALS on the projections, the
      default) or ``"tensorly"`` (dense, the paper's); ``init`` (default ``"svd"``), ``n_iter_max`` (100), ``tol``
      (5e-4: stop once the error improves by less than 0.05% in 3 iterations in a row) and ``seed`` go to
      ``decompose_heads``. ``device``: where the decompositions run (None: the model's device; ``"cuda"`` for a
      model on the CPU works too); the converted model stays where it was. ``calibration``: input statistics of
      this model's attention layers (``collab_attn.models.calibration``) for activation-aware fitting; the report
      then also gives each layer's whitened error.
    - ``"svd"``: SVD-truncated concatenated heads of query/key size ``rank / heads`` (a multiple of the heads).
    - ``"prune"``: head pruning within collaborative attention's query/key parameters at ``rank``;
      ``importance``: a ``HeadImportance`` (``collab_attn.models.importance.head_importance`` on task data) or one
      score tensor per layer.

    An option the method does not take raises. The model is changed only once every layer has been planned, so an
    error leaves it as it was. Returns a per-layer report.
    """
    options = {"solver": solver, "init": init, "n_iter_max": n_iter_max, "tol": tol,
               "tucker_core_size": tucker_core_size, "importance": importance, "device": device}
    if calibration is not None and method not in ("cp", "tucker"):
        raise ValueError(f"calibration does not apply to method={method!r}: only cp and tucker fit the logits")
    family, found, plan = _plan(model, rank, method, seed, options, calibration, progress)
    return _apply(model, family, found, plan, method)
