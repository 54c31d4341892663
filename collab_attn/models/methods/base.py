"""A conversion method is one object: ``ConversionMethod``, registered by name in ``METHODS``.

It says everything the rest of the library asks of a method: its options (a frozen dataclass whose fields and
defaults are the method's keys of the ``collab`` config group), the kind of layer it builds
(``collab_attn.kinds.LAYER_KINDS``), what it needs besides the weights (calibration texts, head-importance
scores from labelled data), whether it takes a global rank budget, its own rule for the ranks, and ``plan``, which
turns a validated ``Request`` into a ``Plan``. ``collab_attn.models.conversion`` validates, plans and applies;
``collab_attn.models.settings`` reads the config group; the GLUE pipeline, the language-model conversions, the
scripts and the tests ask the method, never its name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from collab_attn.kinds import LAYER_KINDS
from collab_attn.models.families import AttentionSite
from collab_attn.models.hf import Layout
from collab_attn.models.plan import Plan, Request

MIXINGS = ("vectors", "matrices")


@dataclass(frozen=True)
class CacheSizes:
    """The sizes a method takes to cache a given number of numbers per token and layer: ``reparametrize(model, rank,
    method, value_rank=value_rank, **options)``."""

    rank: int
    value_rank: int | None = None
    options: dict = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class LayerSizes:
    """The sizes a model is laid out at (``ConversionMethod.layout_at``), each under its one name: a field of the
    kinds' specs, a key of ``collab_attn.kinds.converted.SIZES``. ``rank``; ``value_rank`` (None: the heads keep
    their values); ``rope_pairs``, the rotary pairs a partial-RoPE method keeps per key/value group (None: its
    default). A method reads those it takes."""

    rank: int
    value_rank: int | None = None
    rope_pairs: int | None = None


def uniform_layout(method: ConversionMethod, site: AttentionSite, layers: int, sizes: LayerSizes) -> Layout | None:
    """Every layer of a model like ``site`` at ``sizes.rank`` (and ``sizes.value_rank``), as the collaborative and
    SVD methods convert it; Tucker mixing with a core of as many slices as heads."""
    tucker_core_size = site.heads if method.mixing == "matrices" else None
    return Layout.uniform(method.name, method.layer, layers, rank=sizes.rank, tucker_core_size=tucker_core_size,
                          value_rank=sizes.value_rank)


def even_split(budget: int, kv_heads: int, head_dim: int, rope_pairs: int) -> CacheSizes | None:
    """Rotary keys and shared values of the same width, half the budget each (the keys' width even: it counts the
    shared rotary pairs twice); None below 2 numbers each."""
    half = budget // 2 - (budget // 2) % 2
    return CacheSizes(half, half) if half > 0 else None


@dataclass(frozen=True)
class NoOptions:
    """A method without options besides rank and seed."""


@dataclass(frozen=True)
class ConversionMethod:
    name: str
    description: str  # one line: what the method does
    planner: Callable[[Request], Plan]
    layer: str  # the kind of layer it builds: a key of collab_attn.kinds.LAYER_KINDS
    options: type = NoOptions  # frozen dataclass: the method's options and their defaults
    budgets: bool = False  # takes a global rank budget ("mean:128", ...) in place of ranks
    calibrated: bool = False  # can be fitted to activations (calibration texts)
    needs_importance: bool = False  # needs head-importance scores, measured on labelled task data
    decomposes: bool = False  # fits a decomposition (reparametrize's device= says where it runs)
    mixing: str | None = None  # collaborative layers: "vectors" (one per head) or "matrices" (from a Tucker core)
    cuts_values: bool = False  # takes a value rank: the values cached per token cut to that width (shared or narrow)
    reads_values: bool = False  # plans the value side from the values and output projection (as shared values do)
    check_ranks: Callable[[Sequence[int], int], None] | None = None  # (ranks, heads) -> raises ValueError
    # whether a plan's relative_error is that of the query/key head products (checked against the installed layer);
    # False where the fit is of a projection (the shared-subspace methods report the error of the keys they cut)
    reports_products_error: bool = True
    # the kind of layer it builds on rotary models (Llama, Qwen2, Mistral), from the same planner (the request says
    # ``rotary``); None: it does not convert them
    rotary_layer: str | None = None
    # takes a budget on rotary models too ("mean:96", "energy:0.9": collab_attn.decomposition.rotary_budget)
    rotary_budgets: bool = False
    # (budget, kv_heads, head_dim, rope_pairs) -> the largest ``CacheSizes`` whose cache on a rotary model with
    # kv_heads key/value heads of head_dim holds at most budget numbers per token and layer (None: it cannot get that
    # small); rope_pairs: the rotary pairs a partial-RoPE method keeps per group. None: the races do not size it.
    sizes_within: Callable[[int, int, int, int], CacheSizes | None] | None = None
    # (method, site, layers, sizes) -> the layout of a model of ``layers`` layers like ``site`` (an ``AttentionSite``)
    # converted at ``sizes`` (``LayerSizes``), None where the method cannot take them: what the sizing of the races
    # builds to cost a conversion (``layout_at``)
    sized_layout: Callable[[ConversionMethod, AttentionSite, int, LayerSizes], Layout | None] = uniform_layout

    def __post_init__(self):
        for layer in (self.layer, self.rotary_layer or self.layer):
            if layer not in LAYER_KINDS:
                raise ValueError(f"method {self.name!r}: unknown layer kind {layer!r}; one of {tuple(LAYER_KINDS)}")
        if self.mixing not in ((None,) if not LAYER_KINDS[self.layer].collaborative else MIXINGS):
            raise ValueError(f"method {self.name!r}: collaborative methods mix with one of {MIXINGS}, others with None")
        if not (dataclasses.is_dataclass(self.options) and self.options.__dataclass_params__.frozen):
            raise TypeError(f"method {self.name!r}: options must be a frozen dataclass, got {self.options!r}")

    @property
    def option_names(self) -> tuple[str, ...]:
        return tuple(field.name for field in dataclasses.fields(self.options))

    @property
    def collaborative(self) -> bool:
        return LAYER_KINDS[self.layer].collaborative

    def make_options(self, **given):
        """The method's options from keyword values; None means unset (the default). An option the method does not
        take is refused, naming the ones it takes."""
        for name, value in given.items():
            if value is not None and name not in self.option_names:
                takes = ", ".join(self.option_names) or "none besides rank and seed"
                raise ValueError(f"{name}={value!r} does not apply to method={self.name!r} (its options: {takes})")
        return self.options(**{k: v for k, v in given.items() if v is not None})

    def plan(self, request: Request) -> Plan:
        """The planner's plan (a planner may serve several methods)."""
        if not isinstance(request.options, self.options):
            raise TypeError(f"method {self.name!r} plans with {self.options.__name__}, got {type(request.options)}")
        return self.planner(request)

    def layer_for(self, rotary: bool) -> str:
        """The kind of layer it builds on a model with or without rotary positions (refused where it has none)."""
        if not rotary:
            return self.layer
        if self.rotary_layer is None:
            takes = [m.name for m in METHODS.values() if m.rotary_layer is not None]
            raise ValueError(f"method={self.name!r} does not convert rotary-position models (Llama, Qwen2, Mistral) "
                             f"yet; the methods that do: {takes}")
        return self.rotary_layer

    def layout_at(self, site: AttentionSite, layers: int, sizes: LayerSizes) -> Layout | None:
        """The layout of a model of ``layers`` layers like ``site`` converted by this method at ``sizes`` (None where
        it cannot take them)."""
        return self.sized_layout(self, site, layers, sizes)

    def layout(self, plan: Plan, rotary: bool = False) -> Layout:
        """What the converted model's config records: this method, the layer kind it builds, the plan's sizes."""
        return plan.layout(self.name, self.layer_for(rotary))


METHODS: dict[str, ConversionMethod] = {}


def register(method: ConversionMethod) -> ConversionMethod:
    if method.name in METHODS:
        raise ValueError(f"a conversion method named {method.name!r} is registered already")
    METHODS[method.name] = method
    return method


def get_method(name: str) -> ConversionMethod:
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose one of {tuple(METHODS)}")
    return METHODS[name]
