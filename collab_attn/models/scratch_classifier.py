"""A small transformer encoder classifier for training from scratch, as a transformers model.

Token + learned position embeddings, ``num_layers`` pre-LN encoder layers, a final LayerNorm, mean or [CLS]
pooling and a linear head. Its self-attention is one of

- ``"concat"``: concatenated heads (``MultiHeadAttention``) with queries and keys ``rank / num_heads`` wide per
  head, values ``d_model / num_heads``; at ``rank = d_model`` the standard layer;
- ``"collab"``: collaborative heads (``CollaborativeAttention``) with shared query/key projections of width
  ``rank`` and one mixing vector per head, initialized by ``mixing_init`` (random by default, as the
  paper's translation code does).

``ScratchConfig`` and ``ScratchForSequenceClassification`` are registered with ``AutoConfig`` and
``AutoModelForSequenceClassification`` (model type ``collab_attn_scratch``) when this module is imported (importing
``collab_attn`` does), so ``save_pretrained`` / ``from_pretrained`` round-trip and ``transformers.Trainer`` trains
the model like any other.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from huggingface_hub.dataclasses import strict
from torch import nn
from transformers import initialization as init
from transformers.modeling_outputs import SequenceClassifierOutput

from collab_attn.deprecation import conflict, warn_renamed
from collab_attn.kinds.collaborative.collaborative_attention import MIXING_INITS, CollaborativeAttention
from collab_attn.kinds.concatenated.concatenated_attention import MultiHeadAttention

ATTENTION_KINDS = ("concat", "collab")
POOLINGS = ("mean", "cls")
INIT_STD = 0.02  # BERT's


@strict
class ScratchConfig(transformers.PreTrainedConfig):
    """Sizes of the classifier (``num_labels`` as in every transformers config). ``rank``: the query/key width
    (None: ``d_model``); ``ffn_dim=None`` means ``4 d_model``. ``key_size``, the old name of ``rank``, is still
    taken (a keyword, or a saved config.json holding it) with a ``FutureWarning``; both given different values is
    refused (``collab_attn.deprecation``). The attribute ``key_size`` is gone: read ``rank``."""

    model_type = "collab_attn_scratch"

    vocab_size: int = 30522
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 8
    ffn_dim: int | None = None
    max_length: int = 64
    dropout: float | int = 0.1
    attention: str = "concat"
    rank: int | None = None
    mixing_init: str = "random"
    pooling: str = "mean"
    pad_token_id: int | None = 0

    def __post_init__(self, **kwargs):
        key_size = kwargs.pop("key_size", None)
        if key_size is not None:  # the deprecated name of rank
            if self.rank is not None and self.rank != key_size:
                raise ValueError(conflict("key_size", "rank", key_size, self.rank))
            warn_renamed("key_size", "rank", "ScratchConfig", stacklevel=5)
            self.rank = key_size
        super().__post_init__(**kwargs)

    def validate_architecture(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTION_KINDS}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; choose one of {POOLINGS}")
        if self.mixing_init not in MIXING_INITS:
            raise ValueError(f"unknown mixing_init {self.mixing_init!r}; choose one of {MIXING_INITS}")
        if min(self.vocab_size, self.d_model, self.num_layers, self.num_heads, self.max_length) <= 0:
            raise ValueError("vocab_size, d_model, num_layers, num_heads and max_length must be positive")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})")
        if self.resolved_rank <= 0 or (self.ffn_dim is not None and self.ffn_dim <= 0):
            raise ValueError(f"rank and ffn_dim must be positive, got {self.rank} and {self.ffn_dim}")
        if self.attention == "concat" and self.resolved_rank % self.num_heads:
            raise ValueError(
                f"concatenated heads split rank ({self.resolved_rank}) into num_heads ({self.num_heads}) "
                "equal parts; choose a multiple of num_heads"
            )

    @property
    def resolved_rank(self) -> int:
        return self.d_model if self.rank is None else self.rank


def build_attention(config: ScratchConfig) -> MultiHeadAttention | CollaborativeAttention:
    """The self-attention of one layer: concatenated or collaborative heads at ``config.rank``."""
    rank = config.resolved_rank
    if config.attention == "collab":
        return CollaborativeAttention(
            config.d_model, config.num_heads, rank, dropout=config.dropout, mixing_init=config.mixing_init
        )
    return MultiHeadAttention(
        config.d_model, config.num_heads, query_key_head_dim=rank // config.num_heads, dropout=config.dropout
    )


class EncoderLayer(nn.Module):
    """Pre-LN block: ``x + attention(LN(x))``, then ``x + FFN(LN(x))`` (GELU), dropout on both branches."""

    def __init__(self, config: ScratchConfig):
        super().__init__()
        ffn_dim = config.ffn_dim or 4 * config.d_model
        self.attention_norm = nn.LayerNorm(config.d_model)
        self.attention = build_attention(config)
        self.ffn_norm = nn.LayerNorm(config.d_model)
        self.ffn = nn.Sequential(nn.Linear(config.d_model, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, config.d_model))
        self.dropout = nn.Dropout(config.dropout)

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor, need_weights: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attended, weights = self.attention(self.attention_norm(x), attention_mask=attention_mask,
                                           need_weights=need_weights)
        x = x + self.dropout(attended)
        return x + self.dropout(self.ffn(self.ffn_norm(x))), weights


class ScratchForSequenceClassification(transformers.PreTrainedModel):
    """``forward(input_ids, attention_mask=None, labels=None)`` returns a ``SequenceClassifierOutput`` whose
    ``logits`` are (batch, num_labels), with the mean cross-entropy as ``loss`` when ``labels`` are given. Padding
    (mask 0) is masked in every attention layer and left out of mean pooling. Also accepted: ``output_attentions``,
    ``output_hidden_states``, ``return_dict`` and ``num_items_in_batch`` (from ``Trainer``: the loss is then the
    summed cross-entropy over that many examples); any other keyword raises ``TypeError``."""

    config_class = ScratchConfig
    base_model_prefix = "scratch"
    main_input_name = "input_ids"
    accepts_loss_kwargs = True

    def __init__(self, config: ScratchConfig):
        super().__init__(config)
        self.token_embedding = nn.Embedding(config.vocab_size, config.d_model)
        self.position_embedding = nn.Embedding(config.max_length, config.d_model)
        self.embedding_dropout = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_layers))
        self.final_norm = nn.LayerNorm(config.d_model)
        self.classifier = nn.Linear(config.d_model, config.num_labels)
        self.post_init()

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        # BERT's initialization for linear maps and embeddings. The collaborative mixing is a plain Parameter of the
        # attention module, not a Linear: it keeps the attention module's own ``mixing_init``.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            init.normal_(module.weight, mean=0.0, std=INIT_STD)
        if isinstance(module, nn.Linear) and module.bias is not None:
            init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.token_embedding

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.token_embedding = value

    def parameter_counts(self) -> dict[str, int]:
        """Total parameters, attention parameters per layer, and query/key parameters per layer.

        Query/key parameters are everything that forms the attention scores: query and key projections with their
        biases (concatenated), or shared projections, mixing and content bias (collaborative). Values and the output
        projection are the same in both kinds and not counted there.
        """
        layer_counts = self.layers[0].attention.parameter_counts()
        return {
            "total": sum(p.numel() for p in self.parameters()),
            "attention_per_layer": layer_counts["total"],
            "query_key_per_layer": self.layers[0].attention.query_key_params(),
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        *,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ) -> SequenceClassifierOutput | tuple:
        if kwargs:
            raise TypeError(f"{type(self).__name__}.forward got unsupported arguments {sorted(kwargs)}")
        output_attentions = self.config.output_attentions if output_attentions is None else output_attentions
        if output_hidden_states is None:
            output_hidden_states = self.config.output_hidden_states
        batch, length = input_ids.shape
        if length > self.config.max_length:
            raise ValueError(f"sequence of {length} tokens is longer than max_length {self.config.max_length}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = torch.arange(length, device=input_ids.device)
        x = self.embedding_dropout(self.token_embedding(input_ids) + self.position_embedding(positions)[None])
        hidden_states, attentions = [x], []
        for layer in self.layers:
            x, weights = layer(x, attention_mask, need_weights=bool(output_attentions))
            hidden_states.append(x)
            attentions.append(weights)
        x = self.final_norm(x)
        if self.config.pooling == "cls":
            pooled = x[:, 0]
        else:
            keep = attention_mask.to(x.dtype)[..., None]
            pooled = (x * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        logits = self.classifier(pooled)
        loss = None
        if labels is not None:
            if num_items_in_batch is None:
                loss = F.cross_entropy(logits, labels)
            else:
                loss = F.cross_entropy(logits, labels, reduction="sum") / num_items_in_batch
        output = SequenceClassifierOutput(
            loss=loss,
            logits=logits,
            hidden_states=tuple(hidden_states) if output_hidden_states else None,
            attentions=tuple(attentions) if output_attentions else None,
        )
        use_return_dict = self.config.return_dict if return_dict is None else return_dict
        return output if use_return_dict else output.to_tuple()


transformers.AutoConfig.register(ScratchConfig.model_type, ScratchConfig, exist_ok=True)
transformers.AutoModelForSequenceClassification.register(
    ScratchConfig, ScratchForSequenceClassification, exist_ok=True
)

__all__ = ["ScratchConfig", "ScratchForSequenceClassification", "build_attention"]
