"""The attention modules behind the call contract of a transformers 5.x self-attention module.

A converted layer is either collaborative (``CollaborativeSelfAttention``: ``cp``, ``tucker``) or concatenated heads
(``ConcatenatedSelfAttention``: ``svd``, ``prune``). Both take ``(hidden_states, attention_mask, **kwargs)`` and
return ``(output, attention_weights)``, with weights only when ``output_attentions=True`` is passed down.
``residual_norm_eps`` adds ALBERT's dropout, residual connection and LayerNorm, which live inside ALBERT's attention
module. What they cannot do (cross-attention, a key/value cache) raises rather than being ignored.
"""

from __future__ import annotations

from torch import nn

from collab_attn.nn.attention import CollaborativeAttention, MultiHeadAttention

# Every name under which transformers 5.x hands a self-attention module its key/value cache.
CACHE_KEYWORDS = ("cache", "past_key_values", "past_key_value", "layer_past")


class ConvertedSelfAttention(nn.Module):
    """What both converted layers add to their attention module: the transformers call contract."""

    def _init_contract(self, d_model: int, is_causal: bool, residual_norm_eps: float | None, hidden_dropout: float):
        self.is_causal = is_causal
        if residual_norm_eps is None:
            self.output_dropout = self.LayerNorm = None
        else:
            self.output_dropout = nn.Dropout(hidden_dropout)
            self.LayerNorm = nn.LayerNorm(d_model, eps=residual_norm_eps)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, **kwargs):
        if encoder_hidden_states is not None:
            raise NotImplementedError(
                f"{type(self).__name__} converts self-attention only; cross-attention (encoder_hidden_states) is "
                "not supported"
            )
        cached = [name for name in CACHE_KEYWORDS if kwargs.get(name) is not None]
        if cached:
            raise NotImplementedError(
                f"{type(self).__name__} has no key/value cache but was given one ({cached[0]}=); run the model "
                "with use_cache=False"
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


class CollaborativeSelfAttention(ConvertedSelfAttention, CollaborativeAttention):
    """Collaborative heads (shared query/key projections of width ``rank``, per-head mixing) in a transformers
    model."""

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
        CollaborativeAttention.__init__(
            self, d_model, num_heads, rank, head_dim=head_dim, dropout=dropout, bias=bias,
            output_projection=output_projection, tucker_core_size=tucker_core_size,
            mixing_init="concatenate" if rank % num_heads == 0 else "ones",
        )
        self._init_contract(d_model, is_causal, residual_norm_eps, hidden_dropout)


class ConcatenatedSelfAttention(ConvertedSelfAttention, MultiHeadAttention):
    """Concatenated heads of any query/key head size (SVD-truncated heads) and any head count (pruned heads) in a
    transformers model. The logit scale stays the original model's ``logit_scale``."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        query_key_head_dim: int,
        *,
        head_dim: int,
        dropout: float,
        bias: bool,
        query_key_bias: bool,
        content_bias: bool,
        logit_scale: float,
        output_projection: bool,
        is_causal: bool = False,
        residual_norm_eps: float | None = None,
        hidden_dropout: float = 0.0,
    ):
        MultiHeadAttention.__init__(
            self, d_model, num_heads, head_dim=head_dim, query_key_head_dim=query_key_head_dim, dropout=dropout,
            bias=bias, query_key_bias=query_key_bias, content_bias=content_bias, logit_scale=logit_scale,
            output_projection=output_projection,
        )
        self._init_contract(d_model, is_causal, residual_norm_eps, hidden_dropout)
