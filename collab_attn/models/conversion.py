"""Model surgery: one conversion path for every method. ``reparametrize`` reads the model once, validates, plans,
then applies.

1. Read and validate (once, for every method): the method is registered, the model is a supported family that is not
   converted yet and has attention modules (``_attention``: the sites, the modules the surgery replaces); the ranks
   (or budget) are in range and the options are the method's own (checked on plain ``Sizes``); every layer's
   weights are read once, as plain tensors, and the query/key weights are finite.
2. Plan: the method (``collab_attn.models.methods``) turns every layer's query/key weights into a ``LayerPlan``;
   nothing is changed yet, so an error leaves the model as it was.
3. Apply: ``build_layers`` makes an empty converted layer of the kind the method builds for each attention module,
   which is filled: the planned query/key side, the values and output projection of the kept heads, ALBERT's
   LayerNorm. Each filled layer is then measured (``collab_attn.kinds.forms``: its head products read back from
   its own weights against the original's) and must give the error its fit reported; only then does ``put_layers``
   put the layers into the model and record the layout in the config.

The converted model saves with ``save_pretrained`` and loads back with the Auto classes after ``import
collab_attn`` (``collab_attn.models.hf``), whatever the method.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from collab_attn.decomposition.cp_als import HeadProducts
from collab_attn.decomposition.decompose import check_finite
from collab_attn.decomposition.rank_selection import RankBudget, is_budget
from collab_attn.decomposition.rotary_budget import check_rotary_budget
from collab_attn.kinds.forms import (
    band_forms_of,
    original_forms,
    original_value_forms,
    query_key_forms,
    relative_error,
    value_forms,
)
from collab_attn.models.hf import (
    HEAD_CLASSES,
    LAYER_KINDS,
    AttentionSite,
    InstalledLayer,
    Layout,
    attention_sites,
    build_layers,
    family_of,
    is_collaborative,
    put_layers,
)
from collab_attn.models.methods import METHODS, PAPER_METHOD, ConversionMethod, get_method
from collab_attn.models.methods.rotary_collab import rotary_forms
from collab_attn.models.plan import Calibration, LayerPlan, LayerWeights, Plan, Request, ValueWeights
from collab_attn.models.report import LayerReport, ReparamReport

__all__ = ["METHODS", "ReparamReport", "check_request", "reparametrize"]


def _count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _check_weights(weights: LayerWeights) -> None:
    check_finite(weights.name, query=weights.w_query, key=weights.w_key, query_bias=weights.b_query)
    groups = weights.w_query.shape[0] // weights.w_key.shape[0]  # grouped keys: each read by this many heads
    if not HeadProducts(weights.w_query, weights.w_key.repeat_interleave(groups, dim=0)).norm_sq() > 0:
        raise ValueError(f"{weights.name}: every head's query/key product Wq_h^T Wk_h is zero (all-zero query or key "
                         "weights), so there is nothing to decompose and no relative error; fix or retrain the "
                         "checkpoint first")


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


def _check_ranks(method: ConversionMethod, rank, num_layers: int, full_rank: int, rotary: bool = False):
    if is_budget(rank):
        if not (method.rotary_budgets if rotary else method.budgets):
            where = " on rotary models" if rotary and method.budgets else ""
            raise ValueError(f"method={method.name!r} takes one rank or one per layer{where}, not a budget ({rank!r})")
        return None, RankBudget.parse(rank)
    return per_layer_ranks(rank, num_layers, full_rank), None


@dataclass(frozen=True)
class Sizes:
    """What the checks and the measures of a conversion read of a model's attention besides its weights: per layer
    its name and logit scale, and the sizes every layer shares; plain values, no module."""

    names: list[str]
    scales: list[float]
    heads: int
    width: int  # heads x head_dim: the query/key (and value) width, exact for every method
    d_in: int
    rotary: bool

    @property
    def layers(self) -> int:
        return len(self.names)


# The attention implementations of transformers whose masks converted layers read (None: a config that never set one).
TAKEN_ATTENTION = (None, "eager", "sdpa")


def _attention(model: nn.Module) -> list[AttentionSite]:
    """The attention sites of a model a conversion takes: one not converted yet, of a supported family and of a head
    class that a collaborative class loads back once converted (``HEAD_CLASSES``), with attention modules."""
    if is_collaborative(model.config):
        raise ValueError("this model is already collaborative; reparametrize the original checkpoint instead")
    attention = getattr(model.config, "_attn_implementation", None)
    if attention not in TAKEN_ATTENTION:
        raise ValueError(
            f"the model computes attention with {attention!r}; converted layers take the masks of transformers' "
            "eager and sdpa attention: call model.set_attn_implementation('sdpa') (or load it with "
            "attn_implementation='sdpa') before converting"
        )
    family, sites = attention_sites(model)
    supported = HEAD_CLASSES[family.model_type]
    if type(model) not in supported:
        raise ValueError(
            f"{type(model).__name__} is not a {family.model_type} model class that transformers exports, so no "
            "collaborative class could load it back once converted; convert one of: "
            + ", ".join(cls.__name__ for cls in supported)
        )
    return sites


def _check_sizes(method: ConversionMethod, sizes: Sizes, rank, bands, value_rank):
    """Every check of the sizes a conversion asks for, for every method: ranks (or a budget) in range and the
    method's own rank rule, the bands, the value ranks. Returns the ranks or budget, and the value ranks."""
    method.layer_for(sizes.rotary)  # a method that does not convert rotary models says so here
    ranks, budget = _check_ranks(method, rank, sizes.layers, sizes.width, sizes.rotary)
    if sizes.rotary:  # collaborative rotary layers count each shared pair twice; other kinds' widths are their own
        _check_rotary_ranks(ranks, budget, counts_pairs=LAYER_KINDS[method.layer_for(True)].collaborative)
    if ranks is not None and method.check_ranks is not None:
        method.check_ranks(ranks, sizes.heads)
    _check_bands(bands, method, sizes.rotary, ranks, budget)
    return ranks, budget, _check_value_ranks(method, value_rank, sizes)


def _check_rotary_ranks(ranks, budget, counts_pairs: bool = True) -> None:
    if budget is not None:
        check_rotary_budget(budget)
        return
    odd = [rank for rank in ranks if rank % 2] if counts_pairs else []
    if odd:
        raise ValueError(f"rank {odd[0]} is odd: a rotary model's query/key width counts each shared pair twice (its "
                         "real and imaginary parts), so ranks must be even")


BANDS = ("per-layer", "shared")


def _check_bands(bands, method: ConversionMethod, rotary: bool, ranks, budget) -> None:
    """A clear error for a ``bands`` choice the conversion cannot honour."""
    if bands not in BANDS:
        raise ValueError(f"bands={bands!r}: choose 'per-layer' (each layer splits its pairs among the rotary bands) "
                         "or 'shared' (one split for every layer)")
    if bands == "per-layer":
        return
    if not rotary:
        raise ValueError("bands='shared' applies to rotary models only (Llama, Qwen2, Mistral): this model has no "
                         "rotary frequency bands; leave bands out")
    if not method.rotary_budgets:
        takes = ", ".join(name for name, m in METHODS.items() if m.rotary_budgets)
        raise ValueError(f"bands='shared' does not apply to method={method.name!r}: it splits no shared pairs among "
                         f"bands (the methods that do: {takes})")
    if ranks is not None and len(set(ranks)) > 1:
        raise ValueError(f"bands='shared' gives every layer the same pairs per band, so one rank for all layers; got "
                         f"ranks {sorted(set(ranks))}: give one rank or a 'mean:R' budget")
    if budget is not None and budget.rule != "mean":
        raise ValueError(f"bands='shared' gives every layer the same key width; the budget {budget} sizes layers "
                         "apart: give one rank or a 'mean:R' budget")


def check_request(config, method: str, rank, value_rank=None, bands: str = "per-layer", **options) -> None:
    """Check, before any training, that a model with this transformers ``config`` converts with ``method`` at
    ``rank`` with ``options`` (the checks of ``reparametrize`` before it reads any weight, on the model's skeleton,
    built on the meta device); raises a ValueError that says what to change."""
    from transformers import AutoModel

    conversion = get_method(method)
    conversion.make_options(**options)
    family_of(config)  # unsupported and rotary families are refused with the reason before anything is built
    with torch.device("meta"):
        skeleton = AutoModel.from_config(config)
    sites = _attention(skeleton)
    sizes = Sizes([site.name for site in sites], [site.logit_scale for site in sites], sites[0].heads, sites[0].width,
                  sites[0].d_in, sites[0].rotary)
    _check_sizes(conversion, sizes, rank, bands, value_rank)


@torch.no_grad()
def _fill(entry: InstalledLayer, planned: LayerPlan) -> None:
    """Load the new layer (and its new output projection beside it) strictly: the plan's state, and what it leaves
    out kept from the original (``_kept``). ``output.*`` names the output projection wherever it lives."""
    layer = entry.new
    state = _kept(entry, planned) | planned.state
    if layer.output is None:  # the output projection lives beside the layer
        outer = {name.removeprefix("output."): value for name, value in state.items() if name.startswith("output.")}
        state = {name: value for name, value in state.items() if not name.startswith("output.")}
        if entry.new_outer_output is not None:
            _load(entry.site.output_name, entry.new_outer_output, outer)
        elif outer:
            raise RuntimeError(f"{entry.name}: the plan gives an output projection, but the layer keeps the model's")
    _load(entry.name, layer, state)


def _load(name: str, module: nn.Module, state: dict) -> None:
    expected = module.state_dict()
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        raise RuntimeError(f"{name}: the converted layer ({type(module).__name__}) needs {missing or 'nothing more'} "
                           f"and has no place for {extra or 'nothing else'} (a bug in the method's plan)")
    for key, value in state.items():
        if expected[key].shape != value.shape:
            raise RuntimeError(f"{name}: {key} is {tuple(expected[key].shape)} in the layer but "
                               f"{tuple(value.shape)} in the plan (a bug in the method's plan)")
    module.load_state_dict(state, strict=True)


def _kept(entry: InstalledLayer, planned: LayerPlan) -> dict:
    """What the converted layer keeps of the original where the plan gives nothing: the values and output columns
    of the kept heads (the output projection only where the layer holds one or a new one replaces the model's), and
    ALBERT's LayerNorm."""
    site, layer = entry.site, entry.new
    kept = {} if layer.LayerNorm is None else {
        f"LayerNorm.{name}": value for name, value in site.module.LayerNorm.state_dict().items()}
    if "value.weight" in planned.state and "output.weight" in planned.state:
        return kept
    index = None if planned.kept_heads is None else torch.tensor(
        [h * site.head_dim + i for h in planned.kept_heads for i in range(site.head_dim)]
    )
    if "value.weight" not in planned.state:  # a plan may give the values alone (merged or kept key/value groups)
        weight, bias = site.projection("value")
        kept["value.weight"] = weight if index is None else weight[index]
        if bias is not None:
            kept["value.bias"] = bias if index is None else bias[index]
    if layer.output is not None or entry.new_outer_output is not None:
        weight, bias = site.output_weights()
        kept["output.weight"] = weight if index is None else weight[:, index]
        if bias is not None:
            kept["output.bias"] = bias
    return kept


def _originals(weights: list[LayerWeights], values: list[ValueWeights], sizes: Sizes) -> list:
    """Every layer's original logit forms and value maps (``collab_attn.kinds.forms``), from the weights read before
    the surgery."""
    return [
        (band_forms_of(*rotary_forms(layer), scale) if sizes.rotary
         else original_forms(layer.w_query, layer.w_key, scale),
         original_value_forms(value.w_value, value.w_output))
        for layer, value, scale in zip(weights, values, sizes.scales)
    ]


def _measure(entry: InstalledLayer, planned: LayerPlan, original) -> tuple:
    """The relative errors of the installed layer's head products (logit forms, value maps) against the original's,
    read from the layer's own weights: what the converted model computes, whatever the planner claimed."""
    query_keys, values = original
    output = None
    if entry.new.output is None:  # beside the attention module: the new one, or the model's own where it stays
        output = (entry.new_outer_output.weight if entry.new_outer_output is not None
                  else entry.site.output_weights()[0])
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


def _bands(layer) -> list | None:
    """The rotary bands a converted layer's pairs rotate with (its kind's ``bands_buffer``), as a list; None for a
    kind without them."""
    return None if layer.bands_buffer is None else getattr(layer, layer.bands_buffer).tolist()


def _convert(sites: list[AttentionSite], plan: Plan, originals: list, method: ConversionMethod,
             model_params: int) -> tuple[list[InstalledLayer], Layout, ReparamReport]:
    """The converted layers of the plan, filled and measured against the ``originals``, with the layout the config
    records and the report; the model (of ``model_params`` parameters) is left as it is."""
    before = [(_count(site.module), site.query_key_params) for site in sites]
    report = ReparamReport(
        method=method.name, model_params_before=model_params, solver=plan.solver, calibration=plan.calibration,
        rank_selection=plan.rank_selection, pruning=plan.pruning,
    )
    layout = method.layout(plan, sites[0].rotary)
    built = build_layers(sites, layout)
    for entry, planned, rank, original, (params, query_key_params) in zip(
            built, plan.layers, layout.ranks, originals, before):
        _fill(entry, planned)
        products_error, value_products_error = _measure(entry, planned, original)
        dtype = next(entry.new.parameters()).dtype
        if method.reports_products_error or entry.new.plans_products_error:
            _check_installed(entry.name, "query/key head products", planned.relative_error, products_error, dtype)
        _check_installed(entry.name, "value-output products", planned.value_error, value_products_error, dtype)
        report.layers.append(LayerReport(
            entry.name, rank, planned.relative_error, planned.seconds, params, _count(entry.new), query_key_params,
            entry.new.query_key_params(), planned.weighted_error, planned.value_error, products_error,
            value_products_error,
        ))
    bands = [_bands(entry.new) for entry in built]
    if any(b is not None for b in bands):  # recorded in the config: a model built from it has the layers' shape
        layout = layout.with_sizes(bands=bands)
    return built, layout, report


def _check_arguments(method: str, conversion: ConversionMethod, calibration, importance, device) -> None:
    """A clear error for an argument of ``reparametrize`` that the method does not take."""
    if calibration is not None and not conversion.calibrated:
        raise ValueError(f"calibration does not apply to method={method!r}: only the methods that fit the logits "
                         f"({', '.join(m for m, c in METHODS.items() if c.calibrated)}) take one")
    if (importance is not None) != conversion.needs_importance:
        raise ValueError(f"method={method!r} needs importance= (collab_attn.models.importance.head_importance on task "
                         "data with labels, or one score tensor per layer)" if conversion.needs_importance else
                         f"importance does not apply to method={method!r}: it needs no head scores")
    if device is not None and not conversion.decomposes:
        raise ValueError(f"device={device!r} does not apply to method={method!r}: it runs no decomposition")
    if calibration is not None and not isinstance(calibration, Calibration):
        raise ValueError(f"calibration must be a fitting.calibration.Calibration, not {type(calibration)}")


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
    bands: str = "per-layer",
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
    (``collab_attn.fitting.calibration``) for the methods that fit the logits (activation-aware); the report then
    also gives each layer's whitened error. ``importance``: the head scores a pruning method ranks heads by (a
    ``HeadImportance`` from ``collab_attn.models.importance.head_importance`` on task data, or one score tensor per
    layer). ``device``: where a decomposition runs (None: the model's device; ``"cuda"`` for a model on the CPU
    works too); the converted model stays where it was. ``value_rank``: for a method that shares values, one value
    of width D_v per token for all heads (one number, or one per layer; heads x head_dim is exact), from a CP
    decomposition of the per-head value-output products ``Wv_h^T Wo_h^T``; None keeps every head's values.
    ``bands`` (rotary models, ``cp``, ``tucker``, ``key-svd``): ``"per-layer"`` (each layer splits its shared pairs
    among the frequency bands by its own spectra) or ``"shared"`` (one split for every layer, by the layers' summed
    spectra, at one rank for all layers: what a standard checkpoint's single frequency list can hold,
    ``collab_attn.export``).

    An option or input the method does not take raises. The model is changed only once every layer has been planned,
    so an error leaves it as it was. Returns a per-layer report.
    """
    conversion = get_method(method)
    options = conversion.make_options(**options)
    _check_arguments(method, conversion, calibration, importance, device)
    sites = _attention(model)
    sizes = Sizes([site.name for site in sites], [site.logit_scale for site in sites], sites[0].heads, sites[0].width,
                  sites[0].d_in, sites[0].rotary)
    ranks, budget, value_ranks = _check_sizes(conversion, sizes, rank, bands, value_rank)
    if calibration is not None:
        calibration.check_matches(sizes.names, sizes.d_in)
    weights = [LayerWeights(site.name, *site.head_weights()) for site in sites]
    for layer in weights:
        _check_weights(layer)
    values = [ValueWeights(*site.value_output_weights()) for site in sites]
    request = Request(
        weights, ranks, budget, seed, options, [site.query_key_params for site in sites], calibration=calibration,
        importance=importance, value_ranks=value_ranks, device=device, progress=progress, rotary=sizes.rotary,
        bands=bands, values=None if value_ranks is None and not conversion.reads_values else values,
    )
    plan = conversion.plan(request)
    built, layout, report = _convert(sites, plan, _originals(weights, values, sizes), conversion, _count(model))
    put_layers(model, built, layout)  # only once every layer holds what was fitted
    report.model_params_after = _count(model)
    return report


def _cuts_values(conversion: ConversionMethod, rotary: bool) -> bool:
    # a method whose rotary layer cuts the values takes a value rank on rotary models (key-svd's shared values)
    return conversion.cuts_values or (rotary and conversion.rotary_layer is not None
                                      and LAYER_KINDS[conversion.rotary_layer].cuts_values)


def cuts_values_on_rotary_models(conversion: ConversionMethod) -> bool:
    """Whether the method takes a ``value_rank`` on rotary models (Llama, Qwen2, Mistral)."""
    return _cuts_values(conversion, True)


def takes_value_rank(model: nn.Module, method: str) -> bool:
    """Whether ``reparametrize(model, ..., method=method, value_rank=...)`` can give the values a width of their own
    (the methods that share or cut the values, on this model's family)."""
    return _cuts_values(get_method(method), family_of(model.config).rotary)


def _check_value_ranks(conversion: ConversionMethod, value_rank, sizes: Sizes) -> list[int] | None:
    """Per-layer value widths D_v cached per token (None: each head keeps its values), each in [1, heads x head_dim]
    and within the method's rank rule."""
    if value_rank is None:
        return None
    if not _cuts_values(conversion, sizes.rotary):
        if _cuts_values(conversion, True):
            raise ValueError(f"value_rank: method={conversion.name!r} shares the values on rotary models only (Llama, "
                             "Qwen2, Mistral); this model's heads keep their values: pass value_rank=None")
        cutting = [name for name, m in METHODS.items() if m.cuts_values]
        raise ValueError(f"value_rank does not apply to method={conversion.name!r}: its heads keep their values "
                         f"(methods that cut the values: {cutting})")
    try:
        ranks = per_layer_ranks(value_rank, sizes.layers, sizes.width)
        if conversion.check_ranks is not None:
            conversion.check_ranks(ranks, sizes.heads)
    except ValueError as err:
        raise ValueError(f"value_rank: {err}") from err
    return ranks
