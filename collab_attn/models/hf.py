"""Hugging Face integration: collaborative BERT-family models that save, load and run like any other.

For each supported family (BERT, RoBERTa, DistilBERT, ALBERT) this module defines a config class with its own
``model_type`` (``collab_attn_bert``, ...) and one model class per head class of that family (``CollabBertModel``,
``CollabBertForSequenceClassification``, ...), each a subclass of the transformers class it mirrors whose
self-attention modules are ``CollaborativeSelfAttention``. Importing ``collab_attn`` registers them with the Auto
classes, so ``AutoModel*.from_pretrained`` loads a converted checkpoint. Without ``collab_attn`` the Auto classes
refuse the unknown ``collab_attn_*`` model type instead of building a different model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers.models.albert.modeling_albert import AlbertAttention
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.distilbert.modeling_distilbert import DistilBertSelfAttention
from transformers.models.roberta.modeling_roberta import RobertaSelfAttention

from collab_attn.nn.attention import CollaborativeAttention

COLLAB_PREFIX = "collab_attn_"


class CollaborativeSelfAttention(CollaborativeAttention):
    """``CollaborativeAttention`` behind the call contract of a transformers 5.x self-attention module.

    It takes ``(hidden_states, attention_mask, **kwargs)`` and returns ``(output, attention_weights)``, with weights
    only when ``output_attentions=True`` is passed down. ``residual_norm_eps`` adds ALBERT's dropout, residual
    connection and LayerNorm, which live inside ALBERT's attention module.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rank: int,
        *,
        head_dim: int,
        dropout: float,
        bias: bool,
        output_projection: bool,
        tucker_core_size: int | None = None,
        is_causal: bool = False,
        residual_norm_eps: float | None = None,
        hidden_dropout: float = 0.0,
    ):
        super().__init__(
            d_model, num_heads, rank, head_dim=head_dim, dropout=dropout, bias=bias,
            output_projection=output_projection, tucker_core_size=tucker_core_size,
            mixing_init="concatenate" if rank % num_heads == 0 else "ones",
        )
        self.is_causal = is_causal
        if residual_norm_eps is None:
            self.output_dropout = self.LayerNorm = None
        else:
            self.output_dropout = nn.Dropout(hidden_dropout)
            self.LayerNorm = nn.LayerNorm(d_model, eps=residual_norm_eps)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, past_key_values=None, **kwargs):
        if encoder_hidden_states is not None or past_key_values is not None:
            raise NotImplementedError(
                "collaborative self-attention does not use encoder_hidden_states or a key/value cache; "
                "run the model with use_cache=False"
            )
        output, weights = super().forward(
            hidden_states,
            attention_mask=attention_mask,
            is_causal=self.is_causal and attention_mask is None,
            need_weights=bool(kwargs.get("output_attentions", False)),
        )
        if self.LayerNorm is not None:
            output = self.LayerNorm(hidden_states + self.output_dropout(output))
        return output, weights


@dataclass(frozen=True)
class Family:
    """Where a model family keeps its self-attention and what its parts are called."""

    model_type: str
    config_class: type
    attention_class: type
    query: str
    key: str
    value: str
    output: str | None  # output projection inside the attention module (DistilBERT, ALBERT)
    dropout: str
    has_residual_norm: bool = False  # ALBERT: dropout + residual + LayerNorm inside the attention module

    @property
    def collab_model_type(self) -> str:
        return COLLAB_PREFIX + self.model_type

    def num_heads(self, module: nn.Module) -> int:
        return getattr(module, "num_attention_heads", None) or module.n_heads

    def build_layer(self, module: nn.Module, rank: int, tucker_core_size: int | None) -> CollaborativeSelfAttention:
        """An empty collaborative layer shaped to replace ``module`` (same device and dtype)."""
        query = getattr(module, self.query)
        layer = CollaborativeSelfAttention(
            query.in_features,
            self.num_heads(module),
            rank,
            head_dim=module.attention_head_size,
            dropout=getattr(module, self.dropout).p,
            bias=query.bias is not None,
            output_projection=self.output is not None,
            tucker_core_size=tucker_core_size,
            is_causal=bool(getattr(module, "is_causal", False)),
            residual_norm_eps=module.LayerNorm.eps if self.has_residual_norm else None,
            hidden_dropout=module.output_dropout.p if self.has_residual_norm else 0.0,
        )
        return layer.to(device=query.weight.device, dtype=query.weight.dtype)


FAMILIES: dict[str, Family] = {
    "bert": Family("bert", transformers.BertConfig, BertSelfAttention, "query", "key", "value", None, "dropout"),
    "roberta": Family(
        "roberta", transformers.RobertaConfig, RobertaSelfAttention, "query", "key", "value", None, "dropout"
    ),
    "distilbert": Family(
        "distilbert", transformers.DistilBertConfig, DistilBertSelfAttention, "q_lin", "k_lin", "v_lin", "out_lin",
        "dropout",
    ),
    "albert": Family(
        "albert", transformers.AlbertConfig, AlbertAttention, "query", "key", "value", "dense", "attention_dropout",
        has_residual_norm=True,
    ),
}


def family_of(config) -> Family:
    """The family of a (plain or collaborative) config; a clear error for anything else."""
    model_type = config.model_type.removeprefix(COLLAB_PREFIX)
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported architecture {config.model_type!r}: collab_attn converts the self-attention of "
            f"{', '.join(FAMILIES)} models"
        )
    return FAMILIES[model_type]


def is_collaborative(config) -> bool:
    return config.model_type.startswith(COLLAB_PREFIX)


def attention_modules(model: nn.Module, family: Family) -> list[tuple[str, nn.Module]]:
    """The distinct self-attention modules of ``model`` in layer order (ALBERT's shared layers count once)."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, family.attention_class)]


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``name`` was, in the same train/eval mode and with the forward hooks transformers uses to
    record outputs."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name)
    old = getattr(parent, child)
    new.train(old.training)
    new._forward_hooks.update(old._forward_hooks)
    setattr(parent, child, new)


def _retag(model: nn.Module, ranks: list[int], tucker_core_size: int | None) -> None:
    """Turn every transformers model and config inside ``model`` into its collaborative class."""
    from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY

    for module in model.modules():
        if isinstance(module, transformers.PreTrainedModel):
            config = module.config
            if not is_collaborative(config):
                config.__class__ = _COLLAB_CONFIGS[family_of(config).model_type]
                vars(config).pop("model_type", None)  # a loaded config may shadow the class's model_type
            config.collab_ranks = list(ranks)
            config.collab_tucker_core_size = tucker_core_size
            if type(module) in _COLLAB_MODELS:
                module.__class__ = _COLLAB_MODELS[type(module)]
                # transformers keys the output recorders (output_attentions=True) by class
                _CAN_RECORD_REGISTRY[module] = module._can_record_outputs


def install_collaborative_layers(model: nn.Module, ranks: list[int], tucker_core_size: int | None = None):
    """Replace every self-attention module by an empty collaborative one; returns the (name, old, new) triples."""
    family = family_of(model.config)
    found = attention_modules(model, family)
    if len(ranks) != len(found):
        raise ValueError(f"got {len(ranks)} ranks for {len(found)} attention layers")
    swapped = []
    for (name, module), rank in zip(found, ranks):
        layer = family.build_layer(module, rank, tucker_core_size)
        replace_module(model, name, layer)
        swapped.append((name, module, layer))
    _retag(model, ranks, tucker_core_size)
    return swapped


def _collab_config_class(family: Family) -> type:
    namespace = {
        "__annotations__": {"collab_ranks": list[int] | None, "collab_tucker_core_size": int | None},
        "model_type": family.collab_model_type,
        "collab_ranks": None,
        "collab_tucker_core_size": None,
    }
    name = "Collab" + family.config_class.__name__
    cls = strict(type(name, (family.config_class,), namespace))
    cls.__module__ = __name__
    return cls


def _collab_model_class(base: type, config_class: type) -> type:
    def __init__(self, config, *args, **kwargs):
        base.__init__(self, config, *args, **kwargs)
        if not config.collab_ranks:
            raise ValueError(
                f"{type(self).__name__} needs config.collab_ranks; convert a model with collab_attn.reparametrize"
            )
        install_collaborative_layers(self, config.collab_ranks, config.collab_tucker_core_size)
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
        "_can_record_outputs": {**(base._can_record_outputs or {}), "attentions": CollaborativeSelfAttention},
        "__module__": __name__,
        "__doc__": f"{base.__name__} with collaborative self-attention (see collab_attn.reparametrize).",
    }
    return type("Collab" + base.__name__, (base,), namespace)


AUTO_CLASSES = [
    getattr(transformers, name)
    for name in dir(transformers)
    if name.startswith("AutoModel") and hasattr(getattr(transformers, name), "_model_mapping")
]
_COLLAB_CONFIGS: dict[str, type] = {}
_COLLAB_MODELS: dict[type, type] = {}


def register() -> None:
    """Register the collaborative configs and models with the transformers Auto classes (idempotent)."""
    for family in FAMILIES.values():
        if family.model_type in _COLLAB_CONFIGS:
            continue
        config_class = _collab_config_class(family)
        _COLLAB_CONFIGS[family.model_type] = config_class
        globals()[config_class.__name__] = config_class
        transformers.AutoConfig.register(family.collab_model_type, config_class, exist_ok=True)
        for auto in AUTO_CLASSES:
            base_name = auto._model_mapping._model_mapping.get(family.model_type)
            if not isinstance(base_name, str):
                continue
            base = getattr(transformers, base_name)
            if base not in _COLLAB_MODELS:
                _COLLAB_MODELS[base] = _collab_model_class(base, config_class)
                globals()[_COLLAB_MODELS[base].__name__] = _COLLAB_MODELS[base]
            auto.register(config_class, _COLLAB_MODELS[base], exist_ok=True)


register()
