"""Hugging Face integration: converted models that save, load, train and generate like any other.

For each supported family (``collab_attn.models.families``: BERT, RoBERTa, DistilBERT, ALBERT, GPT-2, OPT) this module
defines a config class with its own
``model_type`` (``collab_attn_bert``, ...) and one model class per head class of that family (``CollabBertModel``,
``CollabBertForSequenceClassification``, ...), each a subclass of the transformers class it mirrors whose
self-attention modules are converted layers (``collab_attn.models.layers``). The config records the conversion
method (``collab_method``) and the per-layer sizes (``collab_ranks``: query/key size per layer, or the shared key's
or the latent's width; ``collab_heads``: heads per layer where pruning removed some; ``collab_value_ranks``: the
values' width per layer where they were cut: one shared value, or narrow value heads in all;
``collab_tucker_core_size``; ``collab_mixing_init`` for a model built
from a config to train from scratch: ``"ones"`` or ``"random"``), from which the model class rebuilds the layers.
Importing ``collab_attn`` registers them with the Auto classes, so ``AutoModel*.from_pretrained`` loads a converted
checkpoint of any method. Without ``collab_attn`` the Auto classes refuse the unknown ``collab_attn_*``
model type instead of building a different model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, is_dataclass

import torch
import transformers
from huggingface_hub.dataclasses import strict
from torch import nn

from collab_attn.models.families import (  # noqa: F401  (re-exported: the HF layer's vocabulary)
    COLLAB_PREFIX,
    FAMILIES,
    Family,
    attention_modules,
    family_of,
    find_attention,
    is_collaborative,
)
from collab_attn.models.layers import (
    CollaborativeSelfAttention,
    ConcatenatedSelfAttention,
    ConvertedSelfAttention,
    GroupedSelfAttention,
    LatentSelfAttention,
    SharedKeySelfAttention,
)
from collab_attn.nn.attention import CollaborativeAttention


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``name`` was, in the same train/eval mode and with the forward hooks transformers uses to
    record outputs."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    new.train(old.training)
    new._forward_hooks.update(old._forward_hooks)
    setattr(parent, child, new)


@dataclass(frozen=True)
class LayerKind:
    """What the layers of a layout are: collaborative heads (shared query/key projections and mixing), concatenated
    heads whose query bias became the content bias (``content_bias``) or that keep their query/key biases, or one of
    the variants of ``collab_attn.nn.variants`` (``variant``: grouped-query, latent or shared-key attention)."""

    collaborative: bool = False
    content_bias: bool = True
    variant: str | None = None


# The layer kinds, by the name a config's ``collab_method`` may give them. A conversion method's config records the
# method's name instead (``cp``, ``svd``, ...), which ``layer_kind`` maps to the kind that method builds.
LAYER_KINDS = {
    "collaborative": LayerKind(collaborative=True),
    "concatenated": LayerKind(),  # narrow concatenated heads, the query bias folded into the content bias
    "kept-heads": LayerKind(content_bias=False),  # some of the original heads, with their query/key biases
    "gqa": LayerKind(variant="gqa"),  # grouped-query heads: ``size`` is the key width kv_heads x head_dim
    "mla": LayerKind(variant="mla"),  # latent attention: ``size`` is the latent cached per token
    "shared-key": LayerKind(variant="shared-key"),  # one key of width ``size`` shared by the heads, per-head values
}


def layer_kind(layout: str) -> LayerKind:
    """The kind of layer a layout name builds: one of ``LAYER_KINDS`` or a registered conversion method."""
    from collab_attn.models.methods import METHODS  # the methods import this module

    if layout in LAYER_KINDS:
        return LAYER_KINDS[layout]
    if layout in METHODS:
        return LAYER_KINDS[METHODS[layout].layer]
    raise ValueError(f"unknown layout {layout!r}; choose one of {(*LAYER_KINDS, *METHODS)}")


@dataclass(frozen=True)
class LayerSpec:
    """The shape of one converted layer: ``size`` is the query/key width (the rank D~ of collaborative heads, or
    heads x query/key head size of concatenated ones; the cache width of grouped-query and latent layers)."""

    kind: LayerKind
    num_heads: int
    size: int
    core_size: int | None = None
    mixing_init: str | None = None  # collaborative layers built from a config: None means block mixing where it fits
    value_size: int | None = None  # values cached per token: the shared value's width, or heads x narrow value heads


@dataclass(frozen=True)
class Layout:
    """What a converted model's config records, and from which its layers are rebuilt."""

    method: str  # a conversion method (cp, svd, ...) or a layer kind (models built from a config)
    ranks: list[int]
    heads: list[int] | None = None  # per layer, where pruning changed the head count
    tucker_core_size: int | None = None
    mixing_init: str | None = None  # models built from a config to train from scratch: "ones" or "random"
    value_ranks: list[int] | None = None  # per layer, where the values were cut (shared, or narrower heads)

    def __post_init__(self):
        kind = layer_kind(self.method)
        if self.value_ranks is not None:
            if not (kind.collaborative or kind == LAYER_KINDS["concatenated"]):
                raise ValueError(f"value ranks need collaborative or narrow concatenated layers, not layout "
                                 f"{self.method!r}")
            if len(self.value_ranks) != len(self.ranks):
                raise ValueError(f"the layout has {len(self.ranks)} ranks but {len(self.value_ranks)} value ranks")

    def specs(self, default_heads: int) -> list[LayerSpec]:
        heads = self.heads or [default_heads] * len(self.ranks)
        if len(heads) != len(self.ranks):
            raise ValueError(f"the layout has {len(self.ranks)} ranks but {len(heads)} head counts")
        kind = layer_kind(self.method)
        values = self.value_ranks or [None] * len(self.ranks)
        return [LayerSpec(kind, h, r, self.tucker_core_size, self.mixing_init, v)
                for r, h, v in zip(self.ranks, heads, values)]

    def config_fields(self) -> dict:
        """The ``collab_*`` config fields that record this layout (``Layout.of`` reads it back from them)."""
        return {
            "collab_method": self.method, "collab_ranks": list(self.ranks),
            "collab_heads": None if self.heads is None else list(self.heads),
            "collab_tucker_core_size": self.tucker_core_size, "collab_mixing_init": self.mixing_init,
            "collab_value_ranks": None if self.value_ranks is None else list(self.value_ranks),
        }

    @classmethod
    def of(cls, config) -> Layout:
        if not config.collab_ranks:
            raise ValueError(
                f"{type(config).__name__} needs config.collab_ranks; convert a model with collab_attn.reparametrize"
            )
        return cls(config.collab_method, list(config.collab_ranks), config.collab_heads,
                   config.collab_tucker_core_size, config.collab_mixing_init, config.collab_value_ranks)


@dataclass
class InstalledLayer:
    """One replaced attention module: its name, the original and the new layer, and the original output projection
    where the new one (fewer heads) replaced it outside the attention module."""

    name: str
    old: nn.Module
    new: ConvertedSelfAttention
    old_outer_output: nn.Linear | None = None
    new_outer_output: nn.Linear | None = None


def build_layer(family: Family, module: nn.Module, spec: LayerSpec) -> ConvertedSelfAttention:
    """An empty converted layer shaped by ``spec`` to replace ``module`` (same device, dtype and call contract)."""
    weight, bias = family.projection(module, "query")
    common = dict(
        head_dim=family.head_dim(module),
        dropout=family.dropout_p(module, family.dropout),
        bias=bias is not None,
        output_projection=family.output is not None,
        logit_scale=family.logit_scale(module),
        is_causal=bool(getattr(module, "is_causal", False)),
        layer_idx=getattr(module, "layer_idx", None),
        output_dropout=family.dropout_p(module, family.output_dropout) if family.output_dropout else None,
        residual_norm_eps=module.LayerNorm.eps if family.has_residual_norm else None,
    )
    kind = spec.kind
    if kind.variant == "gqa":
        head_dim = common["head_dim"]
        if spec.size % head_dim or spec.num_heads % (spec.size // head_dim):
            raise ValueError(f"grouped-query heads need a key width kv_heads x head_dim ({head_dim}) with kv_heads "
                             f"dividing {spec.num_heads} heads, got {spec.size}")
        layer = GroupedSelfAttention(weight.shape[1], spec.num_heads, spec.size // head_dim,
                                     logit_scale=common.pop("logit_scale"), **common)
    elif kind.variant in ("mla", "shared-key"):
        variant = LatentSelfAttention if kind.variant == "mla" else SharedKeySelfAttention
        layer = variant(weight.shape[1], spec.num_heads, spec.size, logit_scale=common.pop("logit_scale"), **common)
    elif kind.collaborative:
        layer = CollaborativeSelfAttention(
            weight.shape[1], spec.num_heads, spec.size, tucker_core_size=spec.core_size, mixing_init=spec.mixing_init,
            value_rank=spec.value_size, **common,
        )
    else:
        if spec.value_size is not None:  # narrow value heads
            common["head_dim"] = spec.value_size // spec.num_heads
        layer = ConcatenatedSelfAttention(
            weight.shape[1], spec.num_heads, spec.size // spec.num_heads,
            query_key_bias=common["bias"] and not kind.content_bias,
            content_bias=common["bias"] and kind.content_bias, **common,
        )
    return layer.to(device=weight.device, dtype=weight.dtype)


def install_layers(model: nn.Module, layout: Layout) -> list[InstalledLayer]:
    """Replace every self-attention module by an empty converted one shaped by ``layout`` and retag the model and
    config as collaborative (``build_layers``, then ``put_layers``)."""
    installed = build_layers(model, layout)
    put_layers(model, installed, layout)
    return installed


def build_layers(model: nn.Module, layout: Layout) -> list[InstalledLayer]:
    """An empty converted layer shaped by ``layout`` for every self-attention module, the model left as it is. A layer
    with fewer heads, or with shared values, also gets a narrower output projection (BERT, RoBERTa: the one beside
    the attention module), and a latent layer a new one of the same width (the value bias it drops is folded into
    that projection's bias)."""
    family = family_of(model.config)
    found = attention_modules(model, family)
    if len(layout.ranks) != len(found):
        raise ValueError(f"got {len(layout.ranks)} ranks for {len(found)} attention layers")
    built = []
    for (name, module), spec in zip(found, layout.specs(family.num_heads(found[0][1]))):
        entry = InstalledLayer(name, module, build_layer(family, module, spec))
        if family.output is None and (spec.num_heads != family.num_heads(module) or spec.value_size is not None
                                      or spec.kind.variant == "mla"):
            old = family.output_projection(model, name)
            width = spec.value_size or spec.num_heads * family.head_dim(module)
            entry.old_outer_output = old
            entry.new_outer_output = nn.Linear(width, old.out_features, bias=old.bias is not None).to(old.weight)
        built.append(entry)
    return built


def put_layers(model: nn.Module, built: list[InstalledLayer], layout: Layout) -> None:
    """Put the layers of ``build_layers`` (and their new output projections) into the model and retag it."""
    family = family_of(model.config)
    for entry in built:
        replace_module(model, entry.name, entry.new)
        if entry.new_outer_output is not None:
            replace_module(model, family.output_projection_name(entry.name), entry.new_outer_output)
    _retag(model, layout)


def _retag(model: nn.Module, layout: Layout) -> None:
    """Turn every transformers model and config inside ``model`` into its collaborative class."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    for module in model.modules():
        if isinstance(module, transformers.PreTrainedModel):
            config = module.config
            if not is_collaborative(config):
                config.__class__ = _COLLAB_CONFIGS[family_of(config).model_type]
                vars(config).pop("model_type", None)  # a loaded config may shadow the class's model_type
            for field, value in layout.config_fields().items():
                setattr(config, field, value)
            if type(module) in _COLLAB_MODELS:
                module.__class__ = _COLLAB_MODELS[type(module)]
                # transformers keys the output recorders (output_attentions=True) by class: a plain dict keyed by
                # the class's name up to 5.22, a registry that takes the model from 5.23 on
                if type(_CAN_RECORD_REGISTRY) is dict:
                    _CAN_RECORD_REGISTRY[str(module.__class__)] = module._can_record_outputs
                else:
                    _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


QUERY_KEY_PARTS = ("query", "key", "mixing", "mixing_core", "content_bias")


def query_key_count(module: nn.Module, family: Family) -> int:
    """Parameters that form one layer's attention scores: query and key projections with their biases (plain), or
    those plus mixing, Tucker core and content bias (converted)."""
    if isinstance(module, ConvertedSelfAttention):
        counts = module.parameter_counts()
        return sum(counts.get(part, 0) for part in QUERY_KEY_PARTS)
    tensors = [t for part in ("query", "key") for t in family.projection(module, part) if t is not None]
    return sum(t.numel() for t in tensors)


def attention_parameters(model: nn.Module) -> dict[str, int]:
    """Parameters of the self-attention modules, all of them and the query/key part, plain or converted."""
    family = family_of(model.config)
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    layers = layers or [module for _, module in attention_modules(model, family)]
    return {
        "attention_params": sum(p.numel() for layer in layers for p in layer.parameters()),
        "query_key_params": sum(query_key_count(layer, family) for layer in layers),
    }


def _collab_config_class(family: Family) -> type:
    if not is_dataclass(family.config_class):
        raise ImportError(
            "collab_attn needs a transformers whose configs are strict dataclasses (5.4 and newer): "
            f"{family.config_class.__name__} of the installed transformers {transformers.__version__} is not one; "
            "install the range collab-attn declares (pip install -e .)"
        )
    namespace = {
        "__annotations__": {
            "collab_method": str, "collab_ranks": list[int] | None, "collab_heads": list[int] | None,
            "collab_tucker_core_size": int | None, "collab_mixing_init": str | None,
            "collab_value_ranks": list[int] | None,
        },
        "model_type": family.collab_model_type,
        "collab_method": "collaborative",  # the layer kind a CP conversion builds
        "collab_ranks": None,
        "collab_heads": None,
        "collab_tucker_core_size": None,
        "collab_mixing_init": None,
        "collab_value_ranks": None,
    }
    name = "Collab" + family.config_class.__name__
    cls = strict(type(name, (family.config_class,), namespace))
    cls.__module__ = __name__
    return cls


def _collab_model_class(base: type, config_class: type) -> type:
    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        install_layers(self, Layout.of(config))
        self.init_weights()  # only the new layers: the others are marked initialized

    @torch.no_grad()
    def _init_weights(self, module):
        base._init_weights(self, module)
        if isinstance(module, CollaborativeAttention) and not getattr(module.mixing, "_is_hf_initialized", False):
            module.reset_mixing()

    namespace = {
        "__init__": __init__,
        "_init_weights": _init_weights,
        "config_class": config_class,
        "_can_record_outputs": {**(base._can_record_outputs or {}), "attentions": ConvertedSelfAttention},
        "__module__": __name__,
        "__doc__": f"{base.__name__} with converted self-attention (see collab_attn.reparametrize).",
    }
    return type("Collab" + base.__name__, (base,), namespace)

AUTO_CLASSES = [
    getattr(transformers, name)
    for name in dir(transformers)
    if name.startswith("AutoModel") and hasattr(getattr(transformers, name), "_model_mapping")
]
_COLLAB_CONFIGS: dict[str, type] = {}
_COLLAB_MODELS: dict[type, type] = {}


def _modeling_module(family: Family):
    return importlib.import_module(f"transformers.models.{family.model_type}.modeling_{family.model_type}")


def _is_concrete_model(cls) -> bool:
    return (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
            and transformers.PreTrainedModel not in cls.__bases__)


def head_classes(family: Family) -> list[type]:
    """Every model class transformers exports for ``family`` (its modeling module's ``__all__``), the bare model and
    each head class, without the abstract ``*PreTrainedModel`` base: the classes ``reparametrize`` converts."""
    module = _modeling_module(family)
    exported = (getattr(module, name) for name in getattr(module, "__all__", ()))
    return [cls for cls in exported if _is_concrete_model(cls)]


def _model_classes(family: Family) -> list[type]:
    """``head_classes`` and the family's inner models that are ``PreTrainedModel`` s too (OPT's ``OPTDecoder``):
    each gets a collaborative class, whose output recorders find the converted layers."""
    module = _modeling_module(family)
    inner = [cls for cls in vars(module).values() if _is_concrete_model(cls) and cls.__module__ == module.__name__]
    return list(dict.fromkeys(head_classes(family) + inner))


def check_head_class(model: nn.Module, family: Family) -> None:
    """Refuse a model whose class is not one ``head_classes`` lists: its converted checkpoint could not be rebuilt
    by any collaborative class, so it would save but not load back."""
    supported = head_classes(family)
    if type(model) not in supported:
        raise ValueError(
            f"{type(model).__name__} is not a {family.model_type} model class that transformers exports, so no "
            "collaborative class could load it back once converted; convert one of: "
            + ", ".join(cls.__name__ for cls in supported)
        )


def collab_model_class(cls: type) -> type:
    """The collaborative class that mirrors the transformers class ``cls`` (``GPT2DoubleHeadsModel`` ->
    ``CollabGPT2DoubleHeadsModel``): how to load a converted checkpoint of a head class that no Auto class maps."""
    if cls not in _COLLAB_MODELS:
        raise ValueError(
            f"{cls.__name__} has no collaborative class; supported: {', '.join(c.__name__ for c in _COLLAB_MODELS)}"
        )
    return _COLLAB_MODELS[cls]


def collab_config_class(model_type: str) -> type:
    """The collaborative config class of a family (``"bert"``, ``"gpt2"``, ...): build one with ``collab_ranks`` (and
    ``collab_mixing_init``) to train a collaborative model from scratch with the Auto classes."""
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"unknown family {model_type!r}; choose one of {', '.join(FAMILIES)}")
    return _COLLAB_CONFIGS[family.model_type]


def register() -> None:
    """Make a collaborative class for every head class of every family and register the configs and the classes
    the Auto classes map with them (idempotent)."""
    for family in FAMILIES.values():
        if family.model_type in _COLLAB_CONFIGS:
            continue
        config_class = _collab_config_class(family)
        _COLLAB_CONFIGS[family.model_type] = config_class
        globals()[config_class.__name__] = config_class
        transformers.AutoConfig.register(family.collab_model_type, config_class, exist_ok=True)
        for base in _model_classes(family):
            _COLLAB_MODELS[base] = _collab_model_class(base, config_class)
            globals()[_COLLAB_MODELS[base].__name__] = _COLLAB_MODELS[base]
        for auto in AUTO_CLASSES:
            base_name = auto._model_mapping._model_mapping.get(family.model_type)
            base = getattr(transformers, base_name) if isinstance(base_name, str) else None
            if base in _COLLAB_MODELS:
                auto.register(config_class, _COLLAB_MODELS[base], exist_ok=True)


register()
