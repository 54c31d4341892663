"""Hugging Face integration: converted models that save, load, train and generate like any other.

For each supported family (``collab_attn.models.families``: BERT, RoBERTa, DistilBERT, ALBERT, GPT-2, OPT) this module
defines a config class with its own ``model_type`` (``collab_attn_bert``, ...) and one model class per head class of
that family (``CollabBertModel``, ``CollabBertForSequenceClassification``, ...), each a subclass of the transformers
class it mirrors whose self-attention modules are converted layers (``collab_attn.models.layers``). The config
records the ``Layout``: the conversion method (``collab_method``), the kind of layer it built (``collab_layer``, a
key of ``LAYER_KINDS``) and the layers' sizes, one config field each (``collab_attn.kinds.SIZES``:
``collab_ranks``, the query/key width per layer; ``collab_heads``, heads per layer where pruning removed some;
``collab_value_ranks``, the values' width per layer where they were cut; and the sizes of particular kinds),
from which the model class rebuilds the layers. Importing ``collab_attn`` registers them
with the Auto classes, so ``AutoModel*.from_pretrained`` loads a converted checkpoint of any method. Without
``collab_attn`` the Auto classes refuse the unknown ``collab_attn_*`` model type instead of building a different
model.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, is_dataclass

import torch
import transformers
from huggingface_hub.dataclasses import strict
from torch import nn

from collab_attn.kinds import LAYER_KINDS, SIZES, ConvertedSelfAttention, LayerSpec  # noqa: F401
from collab_attn.models.families import (  # noqa: F401  (re-exported: the HF layer's vocabulary)
    COLLAB_PREFIX,
    FAMILIES,
    AttentionSite,
    Family,
    attention_modules,
    attention_sites,
    family_of,
    find_attention,
    is_collaborative,
)


def forward_inputs(model: nn.Module, batch: Mapping) -> dict:
    """The entries of ``batch`` that ``model.forward`` names as parameters. A tokenizer may return inputs the model
    does not take (``token_type_ids`` from a BERT-style tokenizer saved beside a Llama): a forward with ``**kwargs``
    ignores them, ``generate`` refuses them ("model_kwargs are not used by the model")."""
    parameters = inspect.signature(model.forward).parameters
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return {k: v for k, v in batch.items() if k in named}


# The layer kind of a checkpoint saved before configs recorded it (``collab_layer``), by its ``collab_method``: a
# conversion method's name, or a layer kind already (models built from a config).
OLD_METHOD_KINDS = {"cp": "collaborative", "tucker": "collaborative", "svd": "concatenated", "prune": "kept-heads",
                    "key-svd": "shared-key", "kv-svd": "mla"}


@dataclass
class Layout:
    """What a converted model's config records, and from which its layers are rebuilt: the conversion ``method``
    (or, for a model built from a config, its layer kind), the ``kind`` of layer it built (a key of
    ``LAYER_KINDS``) and its ``sizes``: per layer, under the names of its kind's spec (``LayerSpec``; ``SIZES``
    gives each one's config field). ``rank`` is always there; ``heads`` where pruning changed them (else each
    site's); a size left out (or None) is the layer's default."""

    method: str
    kind: str
    sizes: dict[str, list]

    @classmethod
    def uniform(cls, method: str, kind: str, layers: int, **sizes) -> Layout:
        """Every one of ``layers`` layers at the same sizes (None: the default)."""
        return cls(method, kind, {name: [value] * layers for name, value in sizes.items() if value is not None})

    def __post_init__(self):
        if self.kind not in LAYER_KINDS:
            raise ValueError(f"unknown layer kind {self.kind!r}; choose one of {tuple(LAYER_KINDS)}")
        self.sizes = {name: list(values) for name, values in self.sizes.items()
                      if values is not None and any(value is not None for value in values)}
        takes = LAYER_KINDS[self.kind].Spec.size_names()
        unknown = [name for name in self.sizes if name not in takes]
        if unknown:
            also = [kind for kind, cls in LAYER_KINDS.items() if set(unknown) <= set(cls.Spec.size_names())]
            raise ValueError(f"layer kind {self.kind!r} takes no {', '.join(unknown)} (its sizes: {', '.join(takes)})"
                             + (f"; the kinds that do: {also}" if also else ""))
        if "rank" not in self.sizes:
            raise ValueError("a layout needs the rank of every layer (sizes['rank'])")
        for name, values in self.sizes.items():
            if len(values) != len(self.ranks):
                raise ValueError(f"the layout has {len(self.ranks)} ranks but {len(values)} values of {name}")

    @property
    def ranks(self) -> list[int]:
        return self.sizes["rank"]

    @property
    def value_ranks(self) -> list[int] | None:
        return self.sizes.get("value_rank")

    def with_sizes(self, **sizes) -> Layout:
        """The same layout with these sizes (per layer) replaced or added."""
        return Layout(self.method, self.kind, {**self.sizes, **sizes})

    def specs(self, default_heads: int) -> list[LayerSpec]:
        """One spec of the kind per layer (``heads``: ``default_heads`` where pruning left them unchanged)."""
        sizes = {"heads": [default_heads] * len(self.ranks), **self.sizes}
        spec = LAYER_KINDS[self.kind].Spec
        return [spec(self.kind, **{name: values[layer] for name, values in sizes.items()})
                for layer in range(len(self.ranks))]

    def config_fields(self) -> dict:
        """The ``collab_*`` config fields that record this layout (``Layout.of`` reads it back from them)."""
        fields = {"collab_method": self.method, "collab_layer": self.kind}
        for name, size in SIZES.items():
            values = self.sizes.get(name)
            if values is not None and not size.per_layer:
                if any(value != values[0] for value in values):
                    raise ValueError(f"{name} is recorded once per model, but the layout gives its layers {values}")
                values = values[0]
            fields[size.config] = values
        return fields

    @classmethod
    def of(cls, config) -> Layout:
        """The layout a config records; a config saved before it recorded the layer kind gets the kind its method
        builds (``OLD_METHOD_KINDS``)."""
        if not config.collab_ranks:
            raise ValueError(
                f"{type(config).__name__} needs config.collab_ranks; convert a model with collab_attn.reparametrize"
            )
        kind = config.collab_layer
        if kind is None:
            kind = config.collab_method if config.collab_method in LAYER_KINDS else OLD_METHOD_KINDS.get(
                config.collab_method)
            if kind is None:
                raise ValueError(f"the config records neither collab_layer nor a known collab_method "
                                 f"({config.collab_method!r}): it was not saved by collab_attn")
        layers, sizes = len(config.collab_ranks), {}
        for name, size in SIZES.items():
            value = getattr(config, size.config, None)  # configs saved before a size existed lack its field
            if value is not None:
                sizes[name] = list(value) if size.per_layer else [value] * layers
        return cls(config.collab_method, kind, sizes)


@dataclass
class InstalledLayer:
    """One converted layer and the site it replaces, with the new output projection where the model keeps it beside
    the attention module and the layer needs another (``replaces_outer_output``)."""

    site: AttentionSite
    new: ConvertedSelfAttention
    new_outer_output: nn.Linear | None = None

    @property
    def name(self) -> str:
        return self.site.name


def build_layer(site: AttentionSite, spec: LayerSpec) -> ConvertedSelfAttention:
    """An empty converted layer of ``spec.kind`` shaped by ``spec`` to replace the module at ``site``, with the
    site's sliding window (which cache layers it may write into)."""
    kind = LAYER_KINDS[spec.kind]
    if not isinstance(spec, kind.Spec):
        raise TypeError(f"a {spec.kind!r} layer is built from a {kind.Spec.__name__}, got a {type(spec).__name__}")
    return kind.build(site, spec)


def install_layers(model: nn.Module, layout: Layout) -> list[InstalledLayer]:
    """Replace every self-attention module by an empty converted one shaped by ``layout`` and retag the model and
    config as collaborative (``build_layers``, then ``put_layers``)."""
    installed = build_layers(attention_sites(model)[1], layout)
    put_layers(model, installed, layout)
    return installed


def build_layers(sites: list[AttentionSite], layout: Layout) -> list[InstalledLayer]:
    """An empty converted layer shaped by ``layout`` for every attention site, the model left as it is, with a new
    output projection beside the layer where its kind asks for one (``replaces_outer_output``: fewer heads, cut
    values, a latent layer's folded bias), of the width the new layer's values have."""
    if len(layout.ranks) != len(sites):
        raise ValueError(f"got {len(layout.ranks)} ranks for {len(sites)} attention layers")
    built = []
    for site, spec in zip(sites, layout.specs(sites[0].heads)):
        entry = InstalledLayer(site, build_layer(site, spec))
        if not site.output_inside and LAYER_KINDS[spec.kind].replaces_outer_output(site, spec):
            old = site.output
            entry.new_outer_output = nn.Linear(entry.new.value.out_features, old.out_features,
                                               bias=old.bias is not None).to(old.weight)
        built.append(entry)
    return built


def put_layers(model: nn.Module, built: list[InstalledLayer], layout: Layout) -> None:
    """Put the layers of ``build_layers`` (and their new output projections) into the model, each where its original
    was, in the same train/eval mode and with the forward hooks transformers uses to record outputs; then retag it."""
    for entry in built:
        for name, new in ((entry.name, entry.new), (entry.site.output_name, entry.new_outer_output)):
            if new is None:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            old = getattr(parent, child)
            new.train(old.training)
            new._forward_hooks.update(old._forward_hooks)
            setattr(parent, child, new)
    _retag(model, layout, built[0].site.family)


def _retag(model: nn.Module, layout: Layout, family: Family) -> None:
    """Turn every transformers model and config inside ``model`` (of ``family``) into its collaborative class."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    for module in model.modules():
        if isinstance(module, transformers.PreTrainedModel):
            config = module.config
            if not is_collaborative(config):
                config.__class__ = _COLLAB_CONFIGS[family.model_type]
                vars(config).pop("model_type", None)  # a loaded config may shadow the class's model_type
            for field, value in layout.config_fields().items():
                setattr(config, field, value)
            if getattr(module, "_tp_plan", None):
                module._tp_plan = without_attention(module._tp_plan, family)
            if type(module) in _COLLAB_MODELS:
                module.__class__ = _COLLAB_MODELS[type(module)]
                # transformers keys the output recorders (output_attentions=True) by class: a plain dict keyed by
                # the class's name up to 5.22, a registry that takes the model from 5.23 on
                if type(_CAN_RECORD_REGISTRY) is dict:
                    _CAN_RECORD_REGISTRY[str(module.__class__)] = module._can_record_outputs
                else:
                    _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


def query_key_count(module: nn.Module, family: Family) -> int:
    """Parameters that form one layer's attention scores, plain (``AttentionSite.query_key_params``) or converted
    (``query_key_params`` of the layer)."""
    if isinstance(module, ConvertedSelfAttention):
        return module.query_key_params()
    return sum(t.numel() for part in ("query", "key") for t in family.projection(module, part) if t is not None)


def attention_parameters(model: nn.Module) -> dict[str, int]:
    """Parameters of the self-attention modules, all of them and the query/key part, plain or converted."""
    family = family_of(model.config)
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    layers = layers or [module for _, module in attention_modules(model, family)]
    return {
        "attention_params": sum(p.numel() for layer in layers for p in layer.parameters()),
        "query_key_params": sum(query_key_count(layer, family) for layer in layers),
    }


def without_attention(plan: dict[str, str] | None, family: Family) -> dict[str, str] | None:
    """A tensor-parallel plan without its entries for the attention projections (they end in the family's query,
    key, value or output name): a converted layer has other weights, and no per-head split of them is defined."""
    if plan is None:
        return None
    projections = {family.query, family.key, family.value, family.output}
    return {pattern: style for pattern, style in plan.items() if pattern.rsplit(".", 1)[-1] not in projections}


def _collab_config_class(family: Family) -> type:
    if not is_dataclass(family.config_class):
        raise ImportError(
            "collab_attn needs a transformers whose configs are strict dataclasses (5.4 and newer): "
            f"{family.config_class.__name__} of the installed transformers {transformers.__version__} is not one; "
            "install the range collab-attn declares (pip install -e .)"
        )
    namespace = {
        "__annotations__": {"collab_method": str, "collab_layer": str | None,
                            **{size.config: size.type for size in SIZES.values()}},
        "model_type": family.collab_model_type,
        "base_model_tp_plan": without_attention(family.config_class.base_model_tp_plan, family),
        "collab_method": "collaborative",  # the layer kind a CP conversion builds
        "collab_layer": None,  # None in checkpoints saved before configs recorded it (``Layout.of``)
        **{size.config: None for size in SIZES.values()},  # the sizes of the layers (``Layout``)
    }
    name = "Collab" + family.config_class.__name__
    cls = strict(type(name, (family.config_class,), namespace))
    cls.__module__ = __name__
    return cls


def _collab_model_class(base: type, config_class: type) -> type:
    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        # a head class that builds its inner model through the Auto classes (Llama's sequence classifier) got a
        # converted one: its layers are in place
        if not any(isinstance(module, ConvertedSelfAttention) for module in self.modules()):
            install_layers(self, Layout.of(config))
        self.init_weights()  # only the new layers: the others are marked initialized

    @torch.no_grad()
    def _init_weights(self, module):
        base._init_weights(self, module)
        # collaborative layers, rotary ones included: the mixing (and shared values' mixing) their init gives
        if hasattr(module, "reset_mixing") and not getattr(module.mixing, "_is_hf_initialized", False):
            module.reset_mixing()
        # buffers the layer derives in its constructor (rotary bands): a model built on the meta device gets them back;
        # loaded ones (flagged by transformers) stay
        for name, value in (module.default_buffers() if hasattr(module, "default_buffers") else {}).items():
            buffer = getattr(module, name)
            if not getattr(buffer, "_is_hf_initialized", False):
                buffer.copy_(value)

    namespace = {
        "__init__": __init__,
        "_init_weights": _init_weights,
        "config_class": config_class,
        "_can_record_outputs": {**(base._can_record_outputs or {}), "attentions": ConvertedSelfAttention},
        # converted layers read the masks of eager and sdpa attention: transformers refuses the other implementations
        "_supports_flash_attn": False, "_supports_flex_attn": False, "_supports_attention_backend": False,
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
HEAD_CLASSES: dict[str, list[type]] = {}  # ``head_classes`` of every family by its model type (``register``)


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
        HEAD_CLASSES[family.model_type] = head_classes(family)
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
