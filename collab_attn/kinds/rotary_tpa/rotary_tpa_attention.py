"""Tensor Product Attention (TPA; Zhang et al., 2025, "Tensor Product Attention Is All You Need"), as a plain torch
module with rotary positions.

Every token's queries, keys and values, each an (H, d_h) matrix over the heads, are sums of rank-one products of a
head factor ``a_r(x)`` (H numbers) and a dimension factor ``b_r(x)`` (d_h numbers), both linear in the token:

    Q(x_t) = (1 / R_q) sum_r a^q_r(x_t) b^q_r(x_t)^T,   K and V alike with ranks R_k and R_v.

Rotary positions act on each head's d_h dimensions in the same way for every head, so they commute with the head
factor: ``RoPE(K) = (1 / R_k) sum_r a^k_r RoPE(b^k_r)``. The key factors are rotated once, before the cache; head
``h`` then attends as in multi-head attention, ``softmax(scale Q_h K_h^T) V_h``, and the heads are concatenated into
the output projection.

Layout (X = q, k, v; R_X its rank): ``{query,key,value}_heads``: ``nn.Linear(d, R_X H)``, the head factors, rank
after rank; ``{query,key,value}_dims``: ``nn.Linear(d, R_X d_h)``, the dimension factors. ``query_rank=None``
keeps dense per-head queries (``query``: ``nn.Linear(d, H d_h)``), the paper's "TPA-KVonly".

The ``kv_cache`` hook receives the factors: keys (batch, 1, seq, R_k (H + d_h)), every head factor then every
rotated dimension factor, and values (batch, 1, seq, R_v (H + d_h)) in the same order: ``(R_k + R_v)(H + d_h)``
numbers per token, against ``2 H d_h`` for multi-head attention. A prompt expands the factors into per-head keys and
values (never stored) and attends through the fused kernel; a decoding step (one query row) scores against the
factors themselves, as the paper decodes, ``q_h . K_h(s) = (1 / R_k) sum_r a^k_r(s)_h (q_h . b^k_r(s))``, and sums
the values alike, so that no per-head key or value of any cached position is ever formed.

Positions come from the caller as transformers computes them: ``position_embeddings = (cos, sin)``, each (batch,
seq, head_dim), rotating the pair of dimensions ``(i, i + d_h/2)`` (``rotate_half`` layout).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from collab_attn.nn.attention import AttentionArguments, grouped_attend
from collab_attn.nn.rotary import RotaryAttention, check_rotary_head_dim, given_positions

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _rank(name: str, value, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive integer{' or None' if nullable else ''}, got {value!r}")


def rotate_dims(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary rotation of the last axis (``rotate_half`` layout): ``x cos + rotate_half(x) sin``."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-second, first], dim=-1) * sin


class TensorProductAttention(RotaryAttention):
    """Tensor product attention with rank ``key_rank`` keys and ``value_rank`` values (default: ``key_rank``) and
    rank ``query_rank`` queries (None: dense queries); the module docstring has the computation and the layout.

    ``bias``: biases of the factor projections (and of dense queries); ``output_bias`` (default ``bias``) that of the
    output projection. ``logit_scale``: default ``1 / sqrt(head_dim)``.

    ``forward``: every rotary kind's (``collab_attn.nn.rotary.RotaryAttention``); the keys sit at the queries'
    positions (no ``key_position_embeddings``), ``key_value_states`` as long as the queries.
    """

    takes_kv_dim = False  # reads keys and values at d_model's width
    takes_key_positions = False

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        key_rank: int,
        *,
        value_rank: int | None = None,
        query_rank: int | None = None,
        bias: bool = False,  # TPA's paper has no biases
        **common: Unpack[AttentionArguments],
    ):
        super().__init__(d_model, num_heads, bias=bias, **common)
        check_rotary_head_dim(self.head_dim)
        value_rank = key_rank if value_rank is None else value_rank
        _rank("key_rank", key_rank)
        _rank("value_rank", value_rank)
        _rank("query_rank", query_rank, nullable=True)
        self.key_rank, self.value_rank, self.query_rank = key_rank, value_rank, query_rank
        heads, dims = num_heads, self.head_dim
        if query_rank is None:
            self.query = nn.Linear(d_model, heads * dims, bias=bias)
        else:
            self.query_heads = nn.Linear(d_model, query_rank * heads, bias=bias)
            self.query_dims = nn.Linear(d_model, query_rank * dims, bias=bias)
        self.key_heads = nn.Linear(d_model, key_rank * heads, bias=bias)
        self.key_dims = nn.Linear(d_model, key_rank * dims, bias=bias)
        self.value_heads = nn.Linear(d_model, value_rank * heads, bias=bias)
        self.value_dims = nn.Linear(d_model, value_rank * dims, bias=bias)
        del self.value  # BaseAttention's dense value projection: the factors replace it

    def _angles(self, position_embeddings, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = given_positions(self, position_embeddings)
        if cos.shape[-1] != self.head_dim or cos.shape[-2] != length:
            raise ValueError(f"position_embeddings must be (cos, sin) of shape (batch, {length}, {self.head_dim}), got "
                             f"{tuple(cos.shape)}")
        return cos[:, :, None], sin[:, :, None]  # (B, S, 1, d_h): the same rotation for every rank

    def _factors(self, heads: nn.Linear, dims: nn.Linear, x: torch.Tensor, rank: int):
        """(B, S, R, H) head factors and (B, S, R, d_h) dimension factors of ``x``."""
        return heads(x).unflatten(-1, (rank, self.num_heads)), dims(x).unflatten(-1, (rank, self.head_dim))

    def _pack(self, head_factors: torch.Tensor, dim_factors: torch.Tensor) -> torch.Tensor:
        """(B, 1, S, R (H + d_h)): what the cache holds for one token."""
        return torch.cat([head_factors.flatten(2), dim_factors.flatten(2)], dim=-1)[:, None]

    def _unpack(self, packed: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The (B, S, R, H) head factors and (B, S, R, d_h) dimension factors a cache holds (``_pack``)."""
        packed = packed[:, 0]
        head_factors = packed[..., : rank * self.num_heads].unflatten(-1, (rank, self.num_heads))
        return head_factors, packed[..., rank * self.num_heads:].unflatten(-1, (rank, self.head_dim))

    def _expand(self, packed: torch.Tensor, rank: int) -> torch.Tensor:
        """(B, H, S, d_h) per-head keys or values from the cached factors, ``(1 / R) sum_r a_r b_r^T``."""
        return torch.einsum("bsrh,bsrd->bhsd", *self._unpack(packed, rank)) / rank

    def _factored_step(self, queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       mask: torch.Tensor | None, need_weights: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attention of (B, H, T, d_h) queries over the cached factors without expanding them (the module doc):
        the context (B, T, H, d_h) and, when asked, the weights (B, H, T, S)."""
        key_heads, key_dims = self._unpack(keys, self.key_rank)
        value_heads, value_dims = self._unpack(values, self.value_rank)
        per_rank = torch.einsum("bhtd,bsrd->bhtsr", queries, key_dims)
        logits = torch.einsum("bhtsr,bsrh->bhts", per_rank, key_heads) * (self.scale / self.key_rank)
        weights = (logits if mask is None else logits + mask).softmax(dim=-1)
        dropped = F.dropout(weights, p=self._dropout())
        per_rank = torch.einsum("bhts,bsrh->bthsr", dropped, value_heads)
        context = torch.einsum("bthsr,bsrd->bthd", per_rank, value_dims) / self.value_rank
        return context, weights if need_weights else None

    def _check_states(self, query_states: torch.Tensor, key_value_states: torch.Tensor | None) -> None:
        if key_value_states is not None and key_value_states.shape[1] != query_states.shape[1]:
            raise ValueError("TensorProductAttention rotates keys at the queries' positions: key_value_states must "
                             f"have as many tokens as the queries ({query_states.shape[1]}), got "
                             f"{key_value_states.shape[1]}")

    def _keys_values(self, keys_from: torch.Tensor, key_positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The key factors, the dimension ones rotated, and the value factors, packed (``_pack``)."""
        cos, sin = self._angles(key_positions, keys_from.shape[1])
        key_heads, key_dims = self._factors(self.key_heads, self.key_dims, keys_from, self.key_rank)
        keys = self._pack(key_heads, rotate_dims(key_dims, cos.to(key_dims.dtype), sin.to(key_dims.dtype)))
        return keys, self._pack(*self._factors(self.value_heads, self.value_dims, keys_from, self.value_rank))

    def _attend(self, query_states, position_embeddings, keys, values, mask, causal, need_weights):
        cos, sin = self._angles(position_embeddings, query_states.shape[1])
        if self.query_rank is None:
            queries = self.query(query_states).unflatten(-1, (self.num_heads, self.head_dim))  # (B, T, H, d_h)
        else:
            query_heads, query_dims = self._factors(self.query_heads, self.query_dims, query_states, self.query_rank)
            queries = torch.einsum("btrh,btrd->bthd", query_heads, query_dims) / self.query_rank
        queries = rotate_dims(queries, cos.to(queries.dtype), sin.to(queries.dtype)).transpose(1, 2)
        if queries.shape[2] == 1:  # a decoding step: scored against the factors
            context, weights = self._factored_step(queries, keys, values, mask, need_weights)
        else:
            context, weights = grouped_attend(queries, self._expand(keys, self.key_rank),
                                              self._expand(values, self.value_rank), mask, self.scale,
                                              self._dropout(), need_weights, causal)
        return context.flatten(2), weights

    def query_key_params(self) -> int:
        """Parameters that form the attention scores: the query and key factor projections (or dense queries)."""
        parts = ("query", "query_heads", "query_dims", "key_heads", "key_dims")
        return sum(p.numel() for name in parts if hasattr(self, name) for p in getattr(self, name).parameters())

    def cache_width(self) -> int:
        """Numbers the ``kv_cache`` hook is handed per token: the key and value factors."""
        return (self.key_rank + self.value_rank) * (self.num_heads + self.head_dim)
