"""Concatenated and collaborative multi-head attention as plain torch modules.

Concatenated heads (Vaswani et al.): head ``h`` scores ``(X Wq_h + bq_h)(Y Wk_h + bk_h)^T / sqrt(d_head)``.

Collaborative heads (Cordonnier et al., 2020): all heads share ``Wq~, Wk~`` of width ``rank`` and head ``h``
keeps a mixing vector ``m_h``; it scores ``(X Wq~ diag(m_h) Wk~^T Y^T + 1 (Y c_h)^T) / sqrt(d_head)``, where
``c_h`` is the content bias (what the query bias of head ``h`` becomes). With ``tucker_core_size`` set, each head
mixes with a full ``rank x rank`` matrix ``M_h = sum_g mixing[h, g] core[g]`` instead of ``diag(m_h)``.

Both modules take the same inputs: ``query_states`` (batch, tgt, d_model), optional ``key_value_states``
(batch, src, kv_dim) for cross-attention, an ``attention_mask`` and ``is_causal``; they return
``(output, weights)`` where ``weights`` is (batch, heads, tgt, src) when ``need_weights=True``, else ``None``.
Without weights the fused ``scaled_dot_product_attention`` kernel runs; with weights, a plain softmax.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

MIXING_INITS = ("concatenate", "ones", "random")


def additive_mask(
    attention_mask: torch.Tensor | None,
    is_causal: bool,
    tgt_len: int,
    src_len: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """Turn any supported mask into a float tensor added to the logits, broadcastable to (B, H, T, S).

    ``attention_mask`` may be
    - 2-D (batch, src): 1 for tokens to attend, 0 for padding (the Hugging Face convention);
    - 3-D (batch, tgt, src) or 4-D (batch, 1 | heads, tgt, src) booleans: True where attention is allowed;
    - 3-D or 4-D floats: added to the logits as they are (0 to keep, a large negative number to block).
    Blocked positions get the dtype's most negative finite value rather than -inf, so a row with every key
    blocked gives uniform weights instead of NaN.
    """
    blocked = torch.finfo(dtype).min
    mask = None
    if attention_mask is not None:
        if attention_mask.dim() == 2:
            keep = attention_mask.to(torch.bool)[:, None, None, :]
        elif attention_mask.dim() in (3, 4):
            keep = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
        else:
            raise ValueError(
                f"attention_mask must be 2-D (batch, src), 3-D or 4-D, got shape {tuple(attention_mask.shape)}"
            )
        if keep.dtype == torch.bool:
            mask = torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, blocked)
        else:
            mask = keep.to(dtype)
    if is_causal:
        future = torch.ones(tgt_len, src_len, dtype=torch.bool, device=device).triu(src_len - tgt_len + 1)
        causal = torch.zeros(tgt_len, src_len, dtype=dtype, device=device).masked_fill(future, blocked)
        mask = causal if mask is None else (mask + causal).clamp(min=blocked)
    return mask


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    dropout: float,
    need_weights: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """softmax(query key^T * scale + bias) value, per head.

    query (B, H, T, E), key (B, H | 1, S, E), value (B, H, S, Dv), bias broadcastable to (B, H, T, S).
    Returns the context (B, T, H * Dv) and, when asked, the attention weights (B, H, T, S).
    """
    batch, heads, tgt_len, _ = query.shape
    if need_weights:
        logits = torch.matmul(query, key.transpose(-1, -2)) * scale
        if bias is not None:
            logits = logits + bias
        weights = logits.softmax(dim=-1)
        context = torch.matmul(F.dropout(weights, p=dropout), value)
    else:
        weights = None
        key = key.expand(batch, heads, *key.shape[2:])
        context = F.scaled_dot_product_attention(query, key, value, attn_mask=bias, dropout_p=dropout, scale=scale)
    return context.transpose(1, 2).reshape(batch, tgt_len, -1), weights


class _Attention(nn.Module):
    """What both attention modules share: sizes, masks, the output projection, parameter counts."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        head_dim: int | None,
        kv_dim: int | None,
        dropout: float,
        output_projection: bool,
        bias: bool,
    ):
        super().__init__()
        if num_heads <= 0 or d_model <= 0:
            raise ValueError(f"d_model and num_heads must be positive, got {d_model} and {num_heads}")
        if head_dim is None:
            if d_model % num_heads:
                raise ValueError(f"d_model ({d_model}) is not a multiple of num_heads ({num_heads}); pass head_dim")
            head_dim = d_model // num_heads
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.kv_dim = kv_dim or d_model
        self.dropout = dropout
        self.scale = 1.0 / math.sqrt(head_dim)
        self.value = nn.Linear(self.kv_dim, num_heads * head_dim, bias=bias)
        self.output = nn.Linear(num_heads * head_dim, d_model, bias=bias) if output_projection else None

    def parameter_counts(self) -> dict[str, int]:
        """Number of parameters per component (query, key, value, output, ...) and their total."""
        counts: dict[str, int] = {}
        for name, param in self.named_parameters():
            component = name.split(".")[0]
            counts[component] = counts.get(component, 0) + param.numel()
        counts["total"] = sum(counts.values())
        return counts

    def _inputs(self, query_states, key_value_states, attention_mask, is_causal):
        keys_from = query_states if key_value_states is None else key_value_states
        bias = additive_mask(
            attention_mask, is_causal, query_states.shape[1], keys_from.shape[1], query_states.dtype,
            query_states.device,
        )
        values = self.value(keys_from).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        return keys_from, bias, values

    def _finish(self, context: torch.Tensor) -> torch.Tensor:
        return context if self.output is None else self.output(context)

    def _dropout(self) -> float:
        return self.dropout if self.training else 0.0


class MultiHeadAttention(_Attention):
    """Standard multi-head attention with concatenated heads.

    Its parameter count is ``4 d_model^2 (+ 4 d_model biases)`` whatever ``num_heads`` is, since each head is
    ``d_model / num_heads`` wide.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        kv_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        output_projection: bool = True,
    ):
        super().__init__(d_model, num_heads, head_dim, kv_dim, dropout, output_projection, bias)
        self.query = nn.Linear(d_model, num_heads * self.head_dim, bias=bias)
        self.key = nn.Linear(self.kv_dim, num_heads * self.head_dim, bias=bias)

    def forward(
        self,
        query_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys_from, bias, values = self._inputs(query_states, key_value_states, attention_mask, is_causal)
        queries = self.query(query_states).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        keys = self.key(keys_from).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        context, weights = attend(queries, keys, values, bias, self.scale, self._dropout(), need_weights)
        return self._finish(context), weights


class CollaborativeAttention(_Attention):
    """Collaborative multi-head attention: shared key/query projections of width ``rank``, per-head mixing.

    ``mixing_init``: ``"concatenate"`` gives head ``h`` its own block of ``rank / num_heads`` dimensions, which
    reproduces concatenated heads exactly when ``rank = num_heads * head_dim``; ``"ones"`` lets every head use
    every dimension; ``"random"`` draws each entry from a standard normal (for training from scratch).
    ``tucker_core_size``: mix with full matrices built from a core of that many ``rank x rank`` slices.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rank: int,
        *,
        head_dim: int | None = None,
        kv_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        output_projection: bool = True,
        mixing_init: str = "concatenate",
        tucker_core_size: int | None = None,
    ):
        super().__init__(d_model, num_heads, head_dim, kv_dim, dropout, output_projection, bias)
        if not isinstance(rank, int) or rank <= 0:
            raise ValueError(f"rank must be a positive integer, got {rank!r}")
        if mixing_init not in MIXING_INITS:
            raise ValueError(f"unknown mixing_init {mixing_init!r}; choose one of {MIXING_INITS}")
        if mixing_init == "concatenate" and rank % num_heads:
            raise ValueError(
                f"mixing_init='concatenate' splits rank ({rank}) into num_heads ({num_heads}) equal blocks; "
                "choose a rank that is a multiple of num_heads or mixing_init='ones'/'random'"
            )
        self.rank = rank
        self.mixing_init = mixing_init
        self.query = nn.Linear(d_model, rank, bias=False)
        self.key = nn.Linear(self.kv_dim, rank, bias=False)
        self.content_bias = nn.Linear(self.kv_dim, num_heads, bias=False) if bias else None
        if tucker_core_size is None:
            self.mixing = nn.Parameter(torch.empty(num_heads, rank))
            self.mixing_core = None
        else:
            self.mixing = nn.Parameter(torch.empty(num_heads, tucker_core_size))
            self.mixing_core = nn.Parameter(torch.empty(tucker_core_size, rank, rank))
        self.reset_mixing()

    @torch.no_grad()
    def reset_mixing(self) -> None:
        """Set the mixing to ``self.mixing_init``; Tucker cores start as identities (every head alike)."""
        if self.mixing.device.type == "meta":
            return
        heads, width = self.mixing.shape
        if self.mixing_core is not None:
            self.mixing_core.copy_(torch.eye(self.rank).expand_as(self.mixing_core))
        if self.mixing_init == "concatenate" and self.mixing_core is None:
            block = width // heads
            self.mixing.copy_(torch.eye(heads).repeat_interleave(block, dim=1))
        elif self.mixing_init == "random":
            nn.init.normal_(self.mixing, std=1.0 if self.mixing_core is None else width**-0.5)
        else:
            self.mixing.fill_(1.0 if self.mixing_core is None else 1.0 / width)

    def mixing_matrices(self) -> torch.Tensor:
        """The per-head ``rank x rank`` mixing, (heads, rank, rank): ``diag(m_h)`` for CP, ``M_h`` for Tucker."""
        if self.mixing_core is None:
            return torch.diag_embed(self.mixing)
        return torch.einsum("hg,grs->hrs", self.mixing, self.mixing_core)

    def forward(
        self,
        query_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys_from, bias, values = self._inputs(query_states, key_value_states, attention_mask, is_causal)
        shared_queries = self.query(query_states)  # (B, T, rank)
        if self.mixing_core is None:
            queries = shared_queries[:, None] * self.mixing[None, :, None, :]
        else:
            queries = torch.einsum("btr,hrs->bhts", shared_queries, self.mixing_matrices())
        keys = self.key(keys_from)[:, None]  # (B, 1, S, rank): one key per position, shared by all heads
        if self.content_bias is not None:
            # bq_h . Wk_h y_s does not depend on the query: one logit offset per head and key, pre-scaled
            content = self.content_bias(keys_from).transpose(1, 2)[:, :, None, :] * self.scale
            bias = content if bias is None else bias + content
        context, weights = attend(queries, keys, values, bias, self.scale, self._dropout(), need_weights)
        return self._finish(context), weights
