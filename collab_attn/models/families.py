"""The model families ``reparametrize`` converts, and where each keeps its self-attention weights.

Encoders: BERT, RoBERTa, DistilBERT, ALBERT (any head class; BERT and RoBERTa also as decoders). Decoders: GPT-2
(query, key and value fused in one ``Conv1D``, ``c_attn``) and OPT, with learned absolute positions added to the
embeddings, so ``Wq_h^T Wk_h`` is what each head's logits are made of; and the rotary-position decoders Llama, Qwen2
and Mistral (grouped key/value heads: head h reads key/value group h // (heads / kv_heads)), whose heads rotate each
pair of query/key dimensions by its frequency band's angle between the projections: per band, each head's logit form
is one complex rank-1 matrix, and a conversion that mixes heads within a band keeps the rotation exactly
(docs/design.md, "Rotary positions"; ``collab_attn.decomposition.rotary_cp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import transformers
from torch import nn
from transformers.models.albert.modeling_albert import AlbertAttention
from transformers.models.bert.modeling_bert import BertSelfAttention
from transformers.models.distilbert.modeling_distilbert import DistilBertSelfAttention
from transformers.models.gpt2.modeling_gpt2 import GPT2Attention
from transformers.models.llama.modeling_llama import LlamaAttention
from transformers.models.mistral.modeling_mistral import MistralAttention
from transformers.models.opt.modeling_opt import OPTAttention
from transformers.models.qwen2.modeling_qwen2 import Qwen2Attention
from transformers.models.roberta.modeling_roberta import RobertaSelfAttention

COLLAB_PREFIX = "collab_attn_"
PARTS = ("query", "key", "value")


@dataclass(frozen=True)
class Family:
    """Where a model family keeps its self-attention and what its parts are called.

    ``query``/``key``/``value``: the projections' attribute names (``nn.Linear``; GPT-2: one fused ``Conv1D``, the
    same name three times); ``output``: the output projection inside the attention module (None: beside it, as
    BERT's ``<attention>.output.dense``); ``dropout``: the attention-weight dropout (a module or a float);
    ``output_dropout``: a dropout after the output projection inside the module (GPT-2, ALBERT);
    ``has_residual_norm``: ALBERT's residual connection + LayerNorm inside the attention module.
    """

    model_type: str
    config_class: type
    attention_class: type
    query: str
    key: str
    value: str
    output: str | None
    dropout: str
    output_dropout: str | None = None
    has_residual_norm: bool = False
    decoder: bool = False  # always causal (GPT-2, OPT); BERT and RoBERTa are causal with is_decoder=True
    rotary: bool = False  # rotary positions (Llama, Qwen2, Mistral): the model hands each layer its (cos, sin)

    @property
    def collab_model_type(self) -> str:
        return COLLAB_PREFIX + self.model_type

    @property
    def fused(self) -> bool:
        return self.query == self.key == self.value

    def num_heads(self, module: nn.Module) -> int:
        for name in ("num_attention_heads", "n_heads", "num_heads"):
            if hasattr(module, name):
                return getattr(module, name)
        if hasattr(module, "num_key_value_groups"):  # Llama's attention keeps its counts in its config
            return module.config.num_attention_heads
        raise AttributeError(f"{type(module).__name__} has no head count")

    def kv_heads(self, module: nn.Module) -> int:
        """Key/value heads: fewer than the query heads where they are grouped (head h reads group h // (heads /
        kv_heads))."""
        return self.num_heads(module) // getattr(module, "num_key_value_groups", 1)

    def head_dim(self, module: nn.Module) -> int:
        return getattr(module, "attention_head_size", None) or module.head_dim

    def sliding_window(self, module: nn.Module) -> int | None:
        """How many of the latest positions each query of this layer sees (the model masks the rest), or None for
        all of them: Qwen2 sets it per layer (its sliding layers), Mistral for every layer from the config."""
        if not self.rotary:
            return None
        if hasattr(module, "sliding_window"):
            return module.sliding_window
        return getattr(module.config, "sliding_window", None)

    def logit_scale(self, module: nn.Module) -> float:
        """What the logits are multiplied by: ``1/sqrt(head_dim)``, and GPT-2's ``scale_attn_*`` options."""
        return float(module.scaling)

    def dropout_p(self, module: nn.Module, name: str | None) -> float:
        if name is None:
            return 0.0
        value = getattr(module, name)
        return value.p if isinstance(value, nn.Module) else float(value)

    def projection(self, module: nn.Module, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The (out, in) weight and the bias of the query, key or value projection, as an ``nn.Linear`` holds them."""
        layer = getattr(module, getattr(self, part))
        if not self.fused:
            return layer.weight, layer.bias
        width = layer.weight.shape[1] // 3  # Conv1D: weight (in, 3 * out)
        columns = slice(PARTS.index(part) * width, (PARTS.index(part) + 1) * width)
        return layer.weight[:, columns].T, layer.bias[columns]

    def d_in(self, module: nn.Module) -> int:
        return self.projection(module, "query")[0].shape[1]

    def head_weights(self, module: nn.Module):
        """(heads, head_dim, d_in) query and (kv_heads, head_dim, d_in) key weights and their (heads or kv_heads,
        head_dim) biases (float32, CPU, detached)."""
        head_dim = self.head_dim(module)
        tensors = []
        for part in ("query", "key"):  # grouped keys: (kv_heads, head_dim, d_in)
            weight, bias = self.projection(module, part)
            tensors.append(weight.detach().float().cpu().reshape(-1, head_dim, weight.shape[1]))
            tensors.append(None if bias is None else bias.detach().float().cpu().reshape(-1, head_dim))
        w_query, b_query, w_key, b_key = tensors
        return w_query, w_key, b_query, b_key

    def value_output_weights(self, model: nn.Module, name: str, module: nn.Module):
        """Layer ``name``'s value side per head: (heads, head_dim, d_in) value weights ``Wv_h``, (heads, head_dim,
        d_out) transposed output columns ``Wo_h^T``, the (heads * head_dim) value bias and the (d_out) output bias
        (float32, CPU, detached; biases None where absent). Head h adds ``P_h X Wv_h^T Wo_h^T`` to the output."""
        return self.value_output_weights_of(module, self.output_projection(model, name))

    def value_output_weights_of(self, module: nn.Module, output: nn.Module):
        """``value_output_weights`` of ``module`` whose output projection is ``output``."""
        heads, head_dim = self.num_heads(module), self.head_dim(module)
        groups = heads // self.kv_heads(module)  # grouped values: each read by ``groups`` heads, given per head
        weight, bias = self.projection(module, "value")
        out_weight, out_bias = self.output_weights(output)
        detached = [None if t is None else t.detach().float().cpu() for t in (weight, out_weight, bias, out_bias)]
        w_value, w_output, b_value, b_output = detached
        w_value = w_value.reshape(-1, head_dim, w_value.shape[1]).repeat_interleave(groups, dim=0)
        if b_value is not None:
            b_value = b_value.reshape(-1, head_dim).repeat_interleave(groups, dim=0).flatten()
        return w_value, w_output.T.reshape(heads, head_dim, -1), b_value, b_output

    def output_projection_name(self, name: str) -> str:
        return f"{name}.{self.output}" if self.output is not None else f"{name.rpartition('.')[0]}.output.dense"

    def output_projection(self, model: nn.Module, name: str) -> nn.Module:
        """The map that reads layer ``name``'s concatenated head outputs: inside the attention module (DistilBERT,
        ALBERT, GPT-2, OPT) or beside it (BERT, RoBERTa: ``<attention>.output.dense``)."""
        return model.get_submodule(self.output_projection_name(name))

    def output_weights(self, projection: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
        """An output projection's (out, in) weight and bias (GPT-2's ``Conv1D`` stores the weight transposed)."""
        weight = projection.weight if isinstance(projection, nn.Linear) else projection.weight.T
        return weight, projection.bias

    def is_self_attention(self, module: nn.Module) -> bool:
        return isinstance(module, self.attention_class) and not getattr(module, "is_cross_attention", False)

    def check(self, config) -> None:
        """Refuse settings of this family's attention that a converted layer cannot reproduce."""
        if getattr(config, "reorder_and_upcast_attn", False):
            raise ValueError(
                "reorder_and_upcast_attn=True (GPT-2's float32 scores under mixed precision) is not reproduced by "
                "collaborative attention; load the model with reorder_and_upcast_attn=False"
            )
        if not self.rotary:
            return
        rope = getattr(config, "rope_parameters", None) or {}
        partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise ValueError(f"partial_rotary_factor={partial}: only part of each head rotates, and collab_attn "
                             "pairs every query/key dimension with a frequency band; convert a fully rotary model")


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
        output_dropout="output_dropout", has_residual_norm=True,
    ),
    "gpt2": Family(
        "gpt2", transformers.GPT2Config, GPT2Attention, "c_attn", "c_attn", "c_attn", "c_proj", "attn_dropout",
        output_dropout="resid_dropout", decoder=True,
    ),
    "opt": Family(
        "opt", transformers.OPTConfig, OPTAttention, "q_proj", "k_proj", "v_proj", "out_proj", "dropout", decoder=True
    ),
    **{
        name: Family(name, config, attention, "q_proj", "k_proj", "v_proj", "o_proj", "attention_dropout",
                     decoder=True, rotary=True)
        for name, config, attention in (
            ("llama", transformers.LlamaConfig, LlamaAttention),
            ("qwen2", transformers.Qwen2Config, Qwen2Attention),
            ("mistral", transformers.MistralConfig, MistralAttention),
        )
    },
}


def _is_rotary(config) -> bool:
    rope = ("rope_theta", "rope_parameters", "rope_scaling", "rotary_dim", "rotary_pct", "partial_rotary_factor")
    return any(getattr(config, name, None) is not None for name in rope) or "rotary" in str(
        getattr(config, "position_embedding_type", "")
    )


@dataclass(frozen=True)
class AttentionSite:
    """One self-attention module of a model and every fact about it that a conversion uses, read once
    (``attention_sites``): where it is, its shape, its call settings and its output projection (inside the module,
    or beside it as BERT's ``<attention>.output.dense``)."""

    name: str
    module: nn.Module
    family: Family
    heads: int
    kv_heads: int  # key/value heads (grouped: fewer than the heads)
    head_dim: int
    d_in: int
    bias: bool  # the query, key and value projections have biases
    logit_scale: float
    dropout: float
    output_dropout: float | None  # a dropout after the output projection inside the module (GPT-2, ALBERT)
    residual_norm_eps: float | None  # ALBERT's residual connection + LayerNorm inside the module
    is_causal: bool
    layer_idx: int | None
    output_name: str  # the output projection's module name in the model
    output: nn.Module
    output_inside: bool  # the output projection is part of the attention module
    output_bias: bool
    rotary: bool  # rotary positions: the model hands the layer its (cos, sin)
    sliding_window: int | None  # the latest positions a query sees, the model's mask applying it (None: all)

    @classmethod
    def of(cls, model: nn.Module, family: Family, name: str, module: nn.Module) -> AttentionSite:
        weight, bias = family.projection(module, "query")
        output_name = family.output_projection_name(name)
        output = model.get_submodule(output_name)
        return cls(
            name, module, family, family.num_heads(module), family.kv_heads(module), family.head_dim(module),
            weight.shape[1], bias is not None, family.logit_scale(module), family.dropout_p(module, family.dropout),
            family.dropout_p(module, family.output_dropout) if family.output_dropout else None,
            module.LayerNorm.eps if family.has_residual_norm else None, bool(getattr(module, "is_causal", False)),
            getattr(module, "layer_idx", None), output_name, output, family.output is not None,
            output.bias is not None, family.rotary, family.sliding_window(module),
        )

    @property
    def width(self) -> int:
        """heads x head_dim: the query/key (and value) width, exact for every method."""
        return self.heads * self.head_dim

    @property
    def weight(self) -> torch.Tensor:
        """The query projection's weight: where the module's parameters live (device, dtype)."""
        return self.family.projection(self.module, "query")[0]

    def projection(self, part: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.family.projection(self.module, part)

    @property
    def query_key_params(self) -> int:
        """Parameters that form the attention scores: the query and key projections with their biases."""
        return sum(t.numel() for part in ("query", "key") for t in self.projection(part) if t is not None)

    def output_weights(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self.family.output_weights(self.output)

    def head_weights(self):
        return self.family.head_weights(self.module)

    def value_output_weights(self):
        return self.family.value_output_weights_of(self.module, self.output)


def attention_sites(model: nn.Module) -> tuple[Family, list[AttentionSite]]:
    """The family of ``model`` and one ``AttentionSite`` per distinct self-attention module, in layer order; a clear
    error when there are none."""
    family, found = find_attention(model)
    return family, [AttentionSite.of(model, family, name, module) for name, module in found]


def family_of(config) -> Family:
    """The family of a (plain or collaborative) config; a clear error for anything else."""
    model_type = config.model_type.removeprefix(COLLAB_PREFIX)
    if model_type not in FAMILIES:
        if _is_rotary(config):
            rotary = ", ".join(name for name, family in FAMILIES.items() if family.rotary)
            raise ValueError(
                f"unsupported rotary architecture {config.model_type!r}: collab_attn converts the rotary families "
                f"{rotary} (and {', '.join(name for name, f in FAMILIES.items() if not f.rotary)}); a model of the "
                "Llama architecture under another name loads as LlamaForCausalLM"
            )
        raise ValueError(
            f"unsupported architecture {config.model_type!r}: collab_attn converts the self-attention of "
            f"{', '.join(FAMILIES)} models"
        )
    family = FAMILIES[model_type]
    family.check(config)
    return family


def is_collaborative(config) -> bool:
    return config.model_type.startswith(COLLAB_PREFIX)


def attention_modules(model: nn.Module, family: Family) -> list[tuple[str, nn.Module]]:
    """The distinct self-attention modules of ``model`` in layer order (ALBERT's shared layers count once)."""
    return [(name, module) for name, module in model.named_modules() if family.is_self_attention(module)]


def find_attention(model: nn.Module) -> tuple[Family, list[tuple[str, nn.Module]]]:
    """The family of ``model`` and its distinct self-attention modules; a clear error when there are none."""
    family = family_of(model.config)
    found = attention_modules(model, family)
    if not found:
        raise ValueError(f"found no {family.attention_class.__name__} modules in {type(model).__name__}")
    return family, found
