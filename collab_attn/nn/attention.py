"""Concatenated and collaborative multi-head attention as plain torch modules.

Concatenated heads (Vaswani et al.): head ``h`` scores ``(X Wq_h + bq_h)(Y Wk_h + bk_h)^T / sqrt(d_head)``.

Collaborative heads (Cordonnier et al., 2020): all heads share ``Wq~, Wk~`` of width ``rank`` and head ``h``
keeps a mixing vector ``m_h``; it scores ``(X Wq~ diag(m_h) Wk~^T Y^T + 1 (Y c_h)^T) / sqrt(d_head)``, where
``c_h`` is the content bias (what the query bias of head ``h`` becomes). With ``tucker_core_size`` set, each head
mixes with a full ``rank x rank`` matrix ``M_h = sum_g mixing[h, g] core[g]`` instead of ``diag(m_h)``. With
``value_rank`` D_v the heads share the values too: one value per token ``Y A`` of width D_v (cached once for all
heads) and a value mixing vector ``n_h`` per head; the output is ``sum_h (P_h Y A) diag(n_h) B`` with ``B`` the
(D_v, d_model) output projection, the CP form of the per-head products ``Wv_h Wo_h``; with ``tucker_core_size`` as well,
each head mixes its sum with a full ``D_v x D_v`` matrix ``N_h = sum_g value_mixing[h, g] value_core[g]`` (their
Tucker form).

``MultiHeadAttention`` is the one concatenated-heads class: its query/key head size may be smaller than its value
head size (``query_key_head_dim``: SVD-truncated heads, small-key models trained from scratch) and it may carry the
same content bias instead of query/key biases (``content_bias=True``).

Both modules take the same inputs: ``query_states`` (batch, tgt, d_model), optional ``key_value_states``
(batch, src, kv_dim) for cross-attention, an ``attention_mask`` and ``is_causal``; they return
``(output, weights)`` where ``weights`` is (batch, heads, tgt, src) when ``need_weights=True``, else ``None``.
``MultiHeadAttention`` runs ``scaled_dot_product_attention`` without weights and a plain softmax with them.
``CollaborativeAttention`` computes all heads' logits in one ``bmm`` against the shared keys; at inference on the
CPU it does so one batch element and a block of query rows at a time (``CollaborativeAttention._in_cpu_blocks``).
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, ClassVar, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels, triton_kernels

if TYPE_CHECKING:
    from typing_extensions import Unpack

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
    blocked gives uniform weights instead of NaN. On the CPU a 3-D or 4-D mask that is the same for every query (a
    padding mask as transformers passes it, (batch, 1, tgt, src)) comes back as (batch, 1, 1, src): it then rides in
    the logits product of ``CollaborativeAttention._in_cpu_blocks`` (on a GPU the check would wait for the device).
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
        if (keep.device.type == "cpu" and keep.shape[2] > 1 and not torch.compiler.is_compiling()
                and torch.equal(keep, keep[:, :, :1].expand_as(keep))):
            keep = keep[:, :, :1]
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
    Returns the context (B, T, H * Dv) and, when asked, the attention weights (B, H, T, S). The fused
    ``scaled_dot_product_attention`` runs unless weights are asked for, or unless ``E != Dv`` on a GPU, where its
    memory-efficient kernel finds no kernel for some such pairs in half precision ("cutlassF: no kernel found").
    On the CPU its flash kernel wants ``E == Dv`` (else it falls back to an unfused one, slower at inference),
    so at inference narrower queries and keys (SVD-truncated heads) are padded with zero columns to ``Dv``, which
    changes no dot product; training keeps the unfused kernel (with dropout and a backward the padding did not pay).
    """
    batch, heads, tgt_len, width = query.shape
    needs_grad = _needs_grad(query, key)
    if query.device.type == "cpu" and width < value.shape[-1] and not need_weights and not needs_grad:
        query, key = _widen(query, value.shape[-1]), _widen(key, value.shape[-1])
    if need_weights or (query.shape[-1] != value.shape[-1] and query.device.type != "cpu"):
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


def grouped_attend(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    dropout: float,
    need_weights: bool,
    causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``attend`` for query heads that share key/value heads: queries (B, H, T, E), keys (B, G, S, E), values
    (B, G, S, Dv), G dividing H; query head ``h`` reads key/value head ``h // (H / G)``. ``bias`` is broadcastable
    to (B, H, T, S). Returns the context (B, T, H, Dv) and, when asked, the weights (B, H, T, S).

    The keys and values are never copied per query head: the ``r = H / G`` query heads of a group are stacked as
    ``r T`` query rows of one head (B, G, r T, E), which ``attend`` then treats as G ordinary heads; only a bias
    that differs between query rows is tiled to match those rows.

    ``causal=True`` adds the causal mask (query ``t`` sees keys up to ``t``; T == S, see ``causal_prompt``) to
    ``bias``. Without weights and with a bias that is the same for every query row (None, or per key and head: the
    content logits) it runs ``_causal_attend``, which skips the keys a block of query rows cannot see."""
    batch, heads, tgt_len, _ = queries.shape
    groups = keys.shape[1]
    if heads % groups:
        raise ValueError(f"{heads} query heads cannot share {groups} key/value heads")
    if causal and tgt_len != keys.shape[2]:
        raise ValueError(f"causal=True is for a prompt with no cached positions: {tgt_len} queries, "
                         f"{keys.shape[2]} keys; pass the causal mask in bias instead")
    if causal:
        if not need_weights and (bias is None or bias.dim() < 2 or bias.shape[-2] == 1):
            return _causal_attend(queries, keys, values, bias, scale, dropout), None
        causal_bias = additive_mask(None, True, tgt_len, tgt_len, queries.dtype, queries.device)
        bias = causal_bias if bias is None else (bias + causal_bias).clamp(min=torch.finfo(queries.dtype).min)
    group = heads // groups
    if group == 1:
        context, weights = attend(queries, keys, values, bias, scale, dropout, need_weights)
        return context.view(batch, tgt_len, heads, -1), weights
    queries = queries.reshape(batch, groups, group * tgt_len, queries.shape[-1])
    bias = _grouped_bias(bias, groups, group, tgt_len)
    if need_weights:  # the weights per query head, (B, H, T, S), are the ones the context is made of
        logits = torch.matmul(queries, keys.transpose(-1, -2)) * scale
        weights = (logits if bias is None else logits + bias).softmax(dim=-1).view(batch, heads, tgt_len, -1)
        grouped = F.dropout(weights.view(batch, groups, group * tgt_len, -1), p=dropout)
        context = torch.matmul(grouped, values).transpose(1, 2)  # (B, r T, G, Dv)
    else:
        context, weights = attend(queries, keys, values, bias, scale, dropout, need_weights)
    # (B, r T, G Dv): row j T + t of group g belongs to head g r + j
    return context.reshape(batch, group, tgt_len, groups, -1).permute(0, 2, 3, 1, 4).flatten(2, 3), weights


def causal_prompt(attention_mask: torch.Tensor | None, is_causal: bool, tgt_len: int, src_len: int) -> bool:
    """Whether a pass is a causal prompt with no mask besides the causal one and no position cached before it (a
    prefill as transformers runs it without padding): ``grouped_attend(..., causal=True)`` then takes it. On the CPU
    (outside ``torch.compile``) a 3-D or 4-D mask that is exactly the causal one counts too: transformers' eager
    attention hands the layers that mask where sdpa hands them none, and both then take the same path."""
    if tgt_len != src_len or tgt_len < 2:
        return False
    if attention_mask is None:
        return is_causal
    if (attention_mask.dim() not in (3, 4) or attention_mask.shape[-2:] != (tgt_len, src_len)
            or attention_mask.device.type != "cpu" or torch.compiler.is_compiling()):
        return False
    return _is_causal_mask(attention_mask)


# The last mask ``_is_causal_mask`` read (a weak reference, its version counter) and the answer: a model hands every
# layer the same mask, which is read once per forward instead of once per layer.
_last_mask: tuple = (None, -1, False)


def _is_causal_mask(attention_mask: torch.Tensor) -> bool:
    """Whether a (..., T, T) CPU mask, boolean or additive, is exactly the causal one."""
    global _last_mask
    tgt_len, src_len = attention_mask.shape[-2:]
    if attention_mask.is_inference():  # no version counter to tell a changed mask by
        return _reads_causal(attention_mask, tgt_len, src_len)
    seen, version, answer = _last_mask
    if seen is not None and seen() is attention_mask and attention_mask._version == version:
        return answer
    answer = _reads_causal(attention_mask, tgt_len, src_len)
    _last_mask = (weakref.ref(attention_mask), attention_mask._version, answer)
    return answer


def _reads_causal(attention_mask: torch.Tensor, tgt_len: int, src_len: int) -> bool:
    below = torch.ones(tgt_len, src_len, dtype=torch.bool).tril()
    if attention_mask.dtype == torch.bool:
        return bool((attention_mask == below).all())
    blocked = torch.finfo(attention_mask.dtype).min
    return bool(((attention_mask == 0) == below).all() and (attention_mask.masked_select(~below) <= blocked).all())


def _causal_attend(queries, keys, values, bias, scale: float, dropout: float) -> torch.Tensor:
    """``grouped_attend(..., causal=True)`` through ``scaled_dot_product_attention(is_causal=True)``, whose kernels
    skip the keys that a block of query rows cannot see (half the scores of a prompt) where an explicit (T, S) mask
    makes them score every key. A bias per key and head (B | 1, H | 1, 1, S) rides in the product: head ``h``'s
    queries get a one-hot column ``e_h`` and the keys one column per head holding ``bias_h / scale``. Queries, keys
    and values are padded with zero columns to one width, a multiple of 8 (the fused kernels want equal widths),
    which changes no dot product; the key/value heads are expanded to the query heads (a view for one shared head).
    Returns the context (B, T, H, Dv)."""
    batch, heads, tgt_len, _ = queries.shape
    groups, src_len, value_width = keys.shape[1], keys.shape[2], values.shape[-1]
    if bias is not None:
        bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape)).expand(batch, heads, 1, src_len)
        columns = (bias[:, :, 0].transpose(1, 2) / scale).clamp(min=torch.finfo(queries.dtype).min)  # (B, S, H)
        one_hot = torch.eye(heads, dtype=queries.dtype, device=queries.device)
        queries = torch.cat([queries, one_hot[None, :, None].expand(batch, heads, tgt_len, heads)], dim=-1)
        keys = torch.cat([keys, columns[:, None].expand(batch, groups, src_len, heads)], dim=-1)
    width = -(-max(queries.shape[-1], value_width) // 8) * 8
    queries, keys, values = (_widen(x, width) for x in (queries, keys, values))
    if groups == 1:
        keys, values = keys.expand(batch, heads, src_len, width), values.expand(batch, heads, src_len, width)
    else:
        keys, values = (x.repeat_interleave(heads // groups, dim=1) for x in (keys, values))
    context = F.scaled_dot_product_attention(queries, keys, values, dropout_p=dropout, is_causal=True, scale=scale)
    return context[..., :value_width].transpose(1, 2)


def _grouped_bias(bias: torch.Tensor | None, groups: int, group: int, tgt_len: int) -> torch.Tensor | None:
    """A bias broadcastable to (B, H, T, S), H = groups * group, laid out for queries stacked as (B, G, r T, E)."""
    if bias is None:
        return None
    bias = bias.reshape((1,) * (4 - bias.dim()) + tuple(bias.shape))
    batch, heads, rows, src_len = bias.shape
    if heads == 1 and rows == 1:
        return bias  # the same for every query row of every head (padding): broadcasts as it is
    bias = bias.expand(batch, heads, tgt_len, src_len)
    if heads == 1:
        return bias[:, :, None].expand(batch, 1, group, tgt_len, src_len).reshape(batch, 1, group * tgt_len, src_len)
    return bias.reshape(batch, groups, group * tgt_len, src_len)


QUERY_KEY_PARTS = ("query", "key", "mixing", "mixing_core", "content_bias")  # what forms the attention scores


class AttentionArguments(TypedDict, total=False):
    """The keywords every attention module of ``collab_attn.nn`` takes besides its sizes, with ``_Attention``'s
    defaults: ``head_dim`` (each head's value width; None: ``d_model / num_heads``), ``kv_dim`` (the width of
    ``key_value_states`` the keys and values are read from; None: ``d_model``; refused by the modules that read them
    at ``d_model``'s width only), ``dropout`` (on the attention weights, in training), ``bias`` (of the
    projections), ``output_bias`` (of the output projection; None: ``bias``), ``output_projection`` (False: the
    caller applies its own) and ``logit_scale`` (what the logits are multiplied by; None: ``1 / sqrt(head_dim)``)."""

    head_dim: int | None
    kv_dim: int | None
    dropout: float
    bias: bool
    output_bias: bool | None
    output_projection: bool
    logit_scale: float | None


def head_size(d_model: int, num_heads: int, head_dim: int | None) -> int:
    """``head_dim``, by default ``d_model / num_heads``; a clear error for sizes that cannot be."""
    if num_heads <= 0 or d_model <= 0:
        raise ValueError(f"d_model and num_heads must be positive, got {d_model} and {num_heads}")
    if head_dim is None:
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) is not a multiple of num_heads ({num_heads}); pass head_dim")
        head_dim = d_model // num_heads
    return head_dim


class _Attention(nn.Module):
    """What every attention module shares: sizes, masks, the output projection, parameter counts."""

    takes_kv_dim: ClassVar[bool] = True  # reads keys and values from states of another width (``kv_dim``)

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        head_dim: int | None = None,
        kv_dim: int | None = None,
        dropout: float = 0.0,
        bias: bool = True,
        output_bias: bool | None = None,
        output_projection: bool = True,
        logit_scale: float | None = None,
    ):
        super().__init__()
        head_dim = head_size(d_model, num_heads, head_dim)
        if kv_dim is not None and not self.takes_kv_dim:
            raise ValueError(f"{type(self).__name__} reads its keys and values from states of d_model's width: "
                             f"kv_dim must be None, got {kv_dim}")
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.kv_dim = kv_dim or d_model
        self.dropout = dropout
        self.projection_bias = bias
        self.output_bias = bias if output_bias is None else output_bias
        self.scale = 1.0 / math.sqrt(head_dim) if logit_scale is None else logit_scale
        self.value = nn.Linear(self.kv_dim, num_heads * head_dim, bias=bias)
        self.output = nn.Linear(num_heads * head_dim, d_model, bias=self.output_bias) if output_projection else None

    def cache_width(self) -> int:
        """Numbers the ``kv_cache`` hook is handed per token (keys and values together) for this layer: what a
        key/value cache holds per token (``cache_numbers_per_token``)."""
        raise NotImplementedError

    def parameter_counts(self) -> dict[str, int]:
        """Number of parameters per component (query, key, value, output, ...) and their total."""
        counts: dict[str, int] = {}
        for name, param in self.named_parameters():
            component = name.split(".")[0]
            counts[component] = counts.get(component, 0) + param.numel()
        counts["total"] = sum(counts.values())
        return counts

    def query_key_params(self) -> int:
        """Parameters that form the attention scores: query and key projections with their biases, and (collaborative)
        mixing, Tucker core and content bias."""
        counts = self.parameter_counts()
        return sum(counts.get(part, 0) for part in QUERY_KEY_PARTS)

    def forward(
        self,
        query_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
        kv_cache=None,
        **positions,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(output, weights or None)`` from the inputs the module docstring describes: the layer's own attention
        (``_context``), then the output projection. ``positions``: the keywords of the rotary kinds
        (``collab_attn.nn.rotary._RotaryAttention``); the others take none."""
        context, weights = self._context(query_states, key_value_states, attention_mask, is_causal, need_weights,
                                         kv_cache, **positions)
        return self._finish(context), weights

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        """The context (B, T, width) before the output projection and the weights (B, H, T, S), or None where they
        were not asked for."""
        raise NotImplementedError

    def _keys_values_mask(self, query_states, key_value_states, attention_mask, is_causal, kv_cache,
                          scale_content: bool = True, build_mask: bool = True):
        """Keys, values, the additive mask over every key the queries attend to, and the content logits (B, H, 1, S)
        (None without content bias); ``_plus(mask, content)`` is the whole bias of the logits.

        ``kv_cache``, when given, is called with this call's packed keys (``_pack``: (B, 1 or H, S, width)) and values
        (B, H, S, head_dim; shared values: (B, 1, S, D_v)) and returns those of every position so far (a key/value
        cache's update); the mask then covers the cached positions too, and a causal mask is aligned to the last
        query. ``scale_content=False`` leaves the content logits unscaled (the Triton kernels scale them as they read
        them); ``build_mask=False`` returns no mask (a caller that may not need it builds it with ``_mask_over``)."""
        keys_from = query_states if key_value_states is None else key_value_states
        keys = self._key_heads(self.key(keys_from))
        content = None if self.content_bias is None else self.content_bias(keys_from)  # (B, S, H)
        values = self.value(keys_from)
        shared = getattr(self, "value_mixing", None) is not None  # one value per token: (B, 1, S, D_v)
        values = values[:, None] if shared else values.unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        if kv_cache is not None:
            packed, values = kv_cache(self._pack(keys, content), values)
            keys, content = self._unpack(packed)
        mask = self._mask_over(query_states, attention_mask, is_causal, values.shape[2]) if build_mask else None
        if content is not None:
            # bq_h . Wk_h y_s does not depend on the query: one logit offset per head and key, (B, H, 1, S). The
            # query bias of head h is exactly this term.
            content = content.transpose(1, 2)[:, :, None, :]
            if scale_content:
                content = content * self.scale
        return keys, values, mask, content

    def _mask_over(self, query_states, attention_mask, is_causal, src_len: int) -> torch.Tensor | None:
        """The additive mask of the queries over ``src_len`` keys (``additive_mask``)."""
        return additive_mask(attention_mask, is_causal, query_states.shape[1], src_len, query_states.dtype,
                             query_states.device)

    def _finish(self, context: torch.Tensor) -> torch.Tensor:
        return context if self.output is None else self.output(context)

    def _dropout(self) -> float:
        return self.dropout if self.training else 0.0


class MultiHeadAttention(_Attention):
    """Standard multi-head attention with concatenated heads.

    With the defaults its parameter count is ``4 d_model^2 (+ 4 d_model biases)`` whatever ``num_heads`` is, since
    each head is ``d_model / num_heads`` wide. ``query_key_head_dim`` makes each head's queries and keys narrower
    than its values (``head_dim``); the logits are scaled by ``logit_scale``, by default
    ``1 / sqrt(query_key_head_dim)`` (Vaswani et al.'s ``1 / sqrt(d_k)``). ``content_bias=True`` replaces the
    query/key biases by one content bias vector per head (what a conversion turns the query bias into; the key bias
    never changes a softmax row); ``query_key_bias`` (default: ``bias and not content_bias``) sets the query/key
    biases alone.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        *,
        query_key_head_dim: int | None = None,
        query_key_bias: bool | None = None,
        content_bias: bool = False,
        **common: Unpack[AttentionArguments],
    ):
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        query_key_head_dim = self.head_dim if query_key_head_dim is None else query_key_head_dim
        if not isinstance(query_key_head_dim, int) or query_key_head_dim <= 0:
            raise ValueError(f"query_key_head_dim must be a positive integer, got {query_key_head_dim!r}")
        query_key_bias = (bias and not content_bias) if query_key_bias is None else query_key_bias
        self.query_key_head_dim = query_key_head_dim
        if common.get("logit_scale") is None:
            self.scale = 1.0 / math.sqrt(query_key_head_dim)
        self.query = nn.Linear(d_model, num_heads * query_key_head_dim, bias=query_key_bias)
        self.key = nn.Linear(self.kv_dim, num_heads * query_key_head_dim, bias=query_key_bias)
        self.content_bias = nn.Linear(self.kv_dim, num_heads, bias=False) if content_bias else None

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        keys, values, mask, content = self._keys_values_mask(
            query_states, key_value_states, attention_mask, is_causal, kv_cache
        )
        queries = self._key_heads(self.query(query_states))
        bias = _plus(mask, content)
        return attend(queries, keys, values, bias, self.scale, self._dropout(), need_weights)

    def _key_heads(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, H * k) -> (B, H, S, k)."""
        return x.unflatten(-1, (self.num_heads, self.query_key_head_dim)).transpose(1, 2)

    def _pack(self, keys: torch.Tensor, content: torch.Tensor | None) -> torch.Tensor:
        """What a cache stores per key: each head's key, and its content logit as one more column, (B, H, S, k[+1])."""
        return keys if content is None else torch.cat([keys, content.transpose(1, 2)[..., None]], dim=-1)

    def _unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.content_bias is None:
            return packed, None
        return packed[..., :-1], packed[..., -1].transpose(1, 2)

    def cache_width(self) -> int:
        """Each head's key and value, and its content logit where it has a content bias."""
        heads = self.num_heads
        return heads * (self.query_key_head_dim + self.head_dim) + (heads if self.content_bias is not None else 0)


class CollaborativeAttention(_Attention):
    """Collaborative multi-head attention: shared key/query projections of width ``rank``, per-head mixing.

    ``mixing_init``: ``"concatenate"`` gives head ``h`` its own block of ``rank / num_heads`` dimensions, which
    reproduces concatenated heads exactly when ``rank = num_heads * head_dim``; ``"ones"`` lets every head use
    every dimension; ``"random"`` draws each entry from a standard normal (for training from scratch).
    ``tucker_core_size``: mix with full matrices built from a core of that many ``rank x rank`` slices.
    ``logit_scale``: what the logits are multiplied by (default ``1 / sqrt(head_dim)``).
    ``value_rank``: share the values too (see the module's docstring); the value mixing starts like the key mixing
    (``"ones"`` for ``"concatenate"``, which has no block form here), with ``tucker_core_size`` a core of that many
    ``value_rank x value_rank`` slices. None keeps a value head per head.
    With a value per head the logits are explicit: a path through ``scaled_dot_product_attention`` (values padded
    with zeros to the rank) was slower in every case measured, on the CPU and on an H100, and was removed
    (experiments/benchmarks/LOG.md, sections 4 and 10). With shared values (``value_rank``) at inference the
    layer is multi-query attention in disguise: each head's mixing goes into its query, its content logits into the
    mask, and all heads attend over the one shared key/value head through the fused kernel (``grouped_attend``;
    section 16 there); a causal prompt into an empty cache hands the kernel no mask but ``is_causal``, so that it
    skips the keys each block of rows cannot see (the content logits then ride in the product; section 19). A
    decoding step on the CPU in float32 scores through ``cpu_kernels`` instead, and with a value per head sums the
    values through it too (section 18). A decoding step (one query row, inference) on a GPU
    takes the Triton kernels of ``triton_kernels`` (the content logits and a padding mask added inside the kernel;
    ``COLLAB_ATTN_TRITON`` switches them). With weights asked for, or a gradient to keep, the explicit path runs.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        rank: int,
        *,
        mixing_init: str = "concatenate",
        tucker_core_size: int | None = None,
        value_rank: int | None = None,
        **common: Unpack[AttentionArguments],
    ):
        super().__init__(d_model, num_heads, **common)
        bias = self.projection_bias
        if value_rank is not None:
            _share_values(self, value_rank, tucker_core_size)
        else:
            self.value_mixing = self.value_core = None
        self.value_rank = value_rank
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
        self.mixing, self.mixing_core = _head_mixing(num_heads, rank, tucker_core_size)
        self._built_mixing: dict[str, tuple] = {}  # Tucker: the per-head matrices outside training (``_tucker``)
        self.reset_mixing()

    @torch.no_grad()
    def reset_mixing(self) -> None:
        """Set the mixing to ``self.mixing_init``; Tucker cores start as identities (every head alike). The values
        (drawn first) have no block form: ``"concatenate"`` starts them as ``"ones"``."""
        if self.mixing.device.type == "meta":
            return
        if self.value_mixing is not None:
            init = "ones" if self.mixing_init == "concatenate" else self.mixing_init
            _init_head_mixing(self.value_mixing, self.value_core, init)
        _init_head_mixing(self.mixing, self.mixing_core, self.mixing_init)

    def mixing_matrices(self) -> torch.Tensor:
        """The per-head ``rank x rank`` mixing, (heads, rank, rank): ``diag(m_h)`` for CP, ``M_h`` for Tucker (kept
        for reuse without gradients: read it, do not write into it)."""
        if self.mixing_core is None:
            return torch.diag_embed(self.mixing)
        return self._tucker("key", self.mixing, self.mixing_core)

    def value_mixing_matrices(self) -> torch.Tensor:
        """The per-head ``value_rank x value_rank`` value mixing, (heads, D_v, D_v): ``diag(n_h)`` for CP, ``N_h``
        for Tucker."""
        if self.value_mixing is None:
            raise ValueError("this layer keeps a value head per head (value_rank=None): it has no value mixing")
        if self.value_core is None:
            return torch.diag_embed(self.value_mixing)
        return self._tucker("value", self.value_mixing, self.value_core)

    def _tucker(self, side: str, mixing: torch.Tensor, core: torch.Tensor) -> torch.Tensor:
        """``sum_g mixing[h, g] core[g]`` for every head, (heads, width, width). Building them costs ``core_size``
        times the per-step mixing itself, so without gradients (generation, evaluation, inference mode; not while
        compiling) they are built once and kept until either parameter changes: held are the parameters' tensors as
        they were (so their storage cannot be reused by another) and their in-place version counters (an optimizer
        step, a ``load_state_dict`` bump them)."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return torch.einsum("hg,gvw->hvw", mixing, core)
        versions = (mixing._version, core._version)
        held = self._built_mixing.get(side)
        if held is not None:
            old_mixing, old_core, old_versions, built = held
            if (old_versions == versions and old_mixing.data_ptr() == mixing.data_ptr()
                    and old_core.data_ptr() == core.data_ptr() and built.dtype == torch.result_type(mixing, core)
                    and built.device == mixing.device):
                return built
        built = torch.einsum("hg,gvw->hvw", mixing, core)
        self._built_mixing[side] = (mixing.detach(), core.detach(), versions, built)
        return built

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache):
        batch, tgt_len, _ = query_states.shape
        # a decoding step that may go through the Triton kernels: they scale the content logits as they read them
        maybe_triton = (not need_weights and tgt_len == 1 and query_states.dtype in triton_kernels.DTYPES
                        and triton_kernels.applies(query_states))
        keys, values, _, content = self._keys_values_mask(
            query_states, key_value_states, attention_mask, is_causal, kv_cache, scale_content=not maybe_triton,
            build_mask=False,
        )  # keys: (B, S, rank), one per position, shared by all heads
        shared_queries = self.query(query_states)  # (B, T, rank)
        shared_values = self.value_mixing is not None
        prompt = (shared_values and not need_weights and causal_prompt(attention_mask, is_causal, tgt_len,
                                                                        keys.shape[1])
                  and not _needs_grad(shared_queries, keys, values))
        # a causal prompt (two or more queries: never a decoding step) takes the causal mask inside the fused kernel
        # below: the (T, S) mask is never made
        mask = None if prompt else self._mask_over(query_states, attention_mask, is_causal, keys.shape[1])
        triton_step = maybe_triton and triton_kernels.takes_step(tgt_len, (shared_queries, keys, values), mask,
                                                                 self._dropout())
        if maybe_triton and not triton_step and content is not None:
            content = content * self.scale
        if triton_step:
            # a decoding step through the Triton kernels (GPU; the CPU under Triton's interpreter): (B, H, 1, D)
            context = triton_kernels.step(self._mixed(shared_queries), keys, values[:, 0] if shared_values else values,
                                          mask, content, content_scale=self.scale,
                                          shared_values=shared_values)[:, :, None]
            weights = None
        elif not need_weights and _cpu_kernels_pay(shared_queries, keys, values):
            # a decoding step on the CPU: the scores in one pass over the shared keys (cpu_kernels), (B, H, T, D)
            context, weights = self._through_cpu_kernels(shared_queries, keys, values, _plus(mask, content)), None
        elif not need_weights and not shared_values and _blocks_pay(shared_queries, keys, values, self.num_heads):
            return self._in_cpu_blocks(shared_queries, keys, values, mask, content).flatten(2), None
        elif not need_weights and shared_values and (prompt or _fused_pays(shared_queries, keys, values)):
            # every head attends over the one shared key/value head: multi-query attention, its heads stacked as
            # the query rows of one head through the fused kernel, which reads the cache once (B, T, H, D_v); a
            # causal prompt with the causal mask inside the kernel, which then skips the keys a row cannot see
            context, weights = grouped_attend(self._mixed(shared_queries), keys[:, None], values,
                                              content if prompt else _plus(mask, content), 1.0, self._dropout(),
                                              False, prompt)
            context = context.transpose(1, 2)  # (B, H, T, D_v), as the explicit path gives it
        else:
            context, weights = self._explicit(shared_queries, keys, values, _plus(mask, content))
        if shared_values and self.value_core is not None:  # (B, H, T, D_v) -> sum_h context_h N_h: (B, T, D_v)
            context = torch.einsum("bhtv,hvw->btw", context, self.value_mixing_matrices())
        elif shared_values:  # (B, H, T, D_v) -> sum_h context_h diag(n_h): (B, T, D_v)
            context = torch.einsum("bhtv,hv->btv", context, self.value_mixing)
        else:
            context = context.transpose(1, 2).reshape(batch, tgt_len, -1)
        return context, (weights if need_weights else None)

    def _mixed(self, shared_queries: torch.Tensor) -> torch.Tensor:
        """Each head's queries (B, H, T, rank) from the shared ones (B, T, rank): q_t (scale * M_h), M_h = diag(m_h)
        for CP. Head h's logits are then (X Wq~) (scale * M_h) (Y Wk~)^T + scale * 1 (Y c_h)^T: the scale goes into
        the small factors (mixing, content bias), never into a (batch, heads, tgt, src) tensor."""
        if self.mixing_core is not None:
            return torch.einsum("btr,hrs->bhts", shared_queries * self.scale, self.mixing_matrices())
        # Expanding before the product keeps the loop over a contiguous output: broadcasting (B, 1, T, rank) *
        # (H, 1, rank) directly is several times slower.
        expanded = shared_queries[:, None].expand(-1, self.num_heads, -1, -1)
        return expanded * (self.mixing * self.scale)[:, None, :]

    def _explicit(self, shared_queries, keys, values, bias) -> tuple[torch.Tensor, torch.Tensor]:
        """Context (B, H, T, head_dim) and weights from shared queries (B, T, rank) and keys (B, S, rank)."""
        queries = self._mixed(shared_queries)
        heads, tgt_len = queries.shape[1:3]
        # All heads' logits in one bmm, (B, H * T, rank) x (B, rank, S): the shared keys are never copied per
        # head, and their gradient is one product instead of a per-head one summed over heads.
        logits = torch.bmm(queries.flatten(1, 2), keys.transpose(1, 2)).unflatten(1, (heads, tgt_len))
        if bias is not None:
            # In place when no gradient flows (saves a (B, H, T, S) tensor); with gradients, an in-place update of
            # the unflattened view would make the backward copy the whole logits back into the bmm output.
            logits = logits + bias if logits.requires_grad else logits.add_(bias)
        weights = logits.softmax(dim=-1)
        return torch.matmul(F.dropout(weights, p=self._dropout()), values), weights

    def _through_cpu_kernels(self, shared_queries, keys, values, bias) -> torch.Tensor:
        """``_explicit``'s context (B, H, T, head_dim or D_v) through ``cpu_kernels`` (inference, float32, CPU): the
        scores in one pass over the shared keys; each head's weights times its values in one pass over them, or with
        shared values all heads' weights times the one value per token in a single matrix product."""
        queries = self._mixed(shared_queries)
        heads, tgt_len = queries.shape[1:3]
        logits = cpu_kernels.shared_key_scores(queries.flatten(1, 2), keys).unflatten(1, (heads, tgt_len))
        if bias is not None:
            logits = logits + bias
        weights = F.dropout(logits.softmax(dim=-1), p=self._dropout())
        if self.value_mixing is None:
            return cpu_kernels.weighted_values(weights, values)
        return torch.bmm(weights.flatten(1, 2), values[:, 0]).unflatten(1, (heads, tgt_len))

    def _key_heads(self, keys: torch.Tensor) -> torch.Tensor:
        return keys  # (B, S, rank): one key per position, shared by all heads

    def _pack(self, keys: torch.Tensor, content: torch.Tensor | None) -> torch.Tensor:
        """What a cache stores per key: the shared key and the heads' content logits, (B, 1, S, rank [+ heads])."""
        return (keys if content is None else torch.cat([keys, content], dim=-1))[:, None]

    def _unpack(self, packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        packed = packed[:, 0]
        if self.content_bias is None:
            return packed, None
        return packed[..., : self.rank], packed[..., self.rank :]

    def cache_width(self) -> int:
        """The shared key, one content logit per head where there is a content bias, and the values: each head's, or
        the one shared value (``value_rank``)."""
        content = self.num_heads if self.content_bias is not None else 0
        values = self.num_heads * self.head_dim if self.value_rank is None else self.value_rank
        return self.rank + content + values

    def _in_cpu_blocks(self, shared_queries, keys, values, mask, content) -> torch.Tensor:
        """The explicit path's context, (B, T, H, head_dim), one batch element and as many query rows at a time as
        keep the block's logits within ``CPU_LOGITS_BLOCK`` (one row at least), for inference on the CPU.

        The block's mixed queries, logits and weights stay in the core's cache and are written in place into
        buffers allocated once; the weighted sum goes straight to its place in the output. The biases that do not
        depend on the query (the content logits, a padding mask) ride in the logits product: the keys get one column
        per head holding that head's bias, and head ``h``'s queries a one-hot column ``e_h``, so no pass over the
        logits adds them; a mask that does (causal) is added block by block, and a block scores only the keys up to
        the last one that any of its rows may see (under a causal mask, about half the work of a prefill).
        shared_queries (B, T, rank), keys (B, S, rank), values (B, H, S, head_dim), mask broadcastable to
        (B, H, T, S), content (B, H, 1, S)."""
        batch, tgt_len, rank = shared_queries.shape
        heads, src_len = self.num_heads, keys.shape[1]
        if mask is not None:
            mask = mask.reshape((1,) * (4 - mask.dim()) + mask.shape)  # a causal mask alone is (T, S)
        per_key = content
        if mask is not None and mask.shape[2] == 1:
            per_key, mask = _plus(mask, content), None
        bias_columns = 0
        if per_key is not None:
            # (B, S, H); -inf would make NaN of the zeros that the other heads' queries put against it
            per_key = per_key[:, :, 0].transpose(1, 2).expand(batch, src_len, heads)
            keys = torch.cat([keys, per_key.clamp(min=torch.finfo(per_key.dtype).min)], dim=-1)
            bias_columns = heads
        rows = max(1, min(tgt_len, CPU_LOGITS_BLOCK // (heads * src_len)))
        queries = shared_queries.new_empty(heads, rows, rank + bias_columns)
        if bias_columns:
            queries[..., rank:] = torch.eye(heads, dtype=queries.dtype)[:, None, :]
        logits = shared_queries.new_empty(heads * rows * src_len)
        seen = None if mask is None else _keys_seen(mask, src_len)
        context = shared_queries.new_empty(batch, tgt_len, heads, self.head_dim)
        tucker = self.mixing_core is not None
        mixing = (self.mixing_matrices() if tucker else self.mixing[:, None, :]) * self.scale
        dropout = self._dropout()
        for b in range(batch):
            keys_t = keys[b].T.expand(heads, -1, -1)  # the shared keys, one view for every head
            element = b if mask is not None and mask.shape[0] > 1 else 0
            for start in range(0, tgt_len, rows):
                stop = min(start + rows, tgt_len)
                width = src_len if seen is None else int(seen[element, start:stop].max())
                block_queries = queries[:, : stop - start]
                block_logits = logits[: heads * (stop - start) * width].view(heads, stop - start, width)
                if tucker:
                    block_queries[..., :rank] = torch.matmul(shared_queries[b, start:stop], mixing)
                else:
                    torch.mul(shared_queries[b, None, start:stop], mixing, out=block_queries[..., :rank])
                torch.bmm(block_queries, keys_t[..., :width], out=block_logits)
                if mask is not None:
                    block_logits.add_(mask[element, :, start:stop, :width])
                torch.softmax(block_logits, dim=-1, out=block_logits)
                if dropout:
                    F.dropout(block_logits, p=dropout, inplace=True)
                torch.bmm(block_logits, values[b, :, :width], out=context[b, start:stop].transpose(0, 1))
        return context


def _head_mixing(heads: int, width: int, core_size: int | None) -> tuple[nn.Parameter, nn.Parameter | None]:
    """Uninitialized per-head mixing of a shared space of ``width``: one vector per head (CP) and no core, or with a
    Tucker core of ``core_size`` slices, (heads, core_size) weights of the (core_size, width, width) slices."""
    if core_size is None:
        return nn.Parameter(torch.empty(heads, width)), None
    return nn.Parameter(torch.empty(heads, core_size)), nn.Parameter(torch.empty(core_size, width, width))


def _share_values(module: _Attention, value_rank, core_size: int | None) -> None:
    """Give ``module`` one value of width ``value_rank`` per token for every head, mixed per head on its way to the
    output projection (``value_mixing``, through ``value_core`` with a Tucker core of ``core_size`` slices)."""
    if not isinstance(value_rank, int) or isinstance(value_rank, bool) or value_rank <= 0:
        raise ValueError(f"value_rank must be a positive integer or None, got {value_rank!r}")
    module.value = nn.Linear(module.kv_dim, value_rank, bias=module.projection_bias)
    module.value_mixing, module.value_core = _head_mixing(module.num_heads, value_rank, core_size)
    if module.output is not None:
        module.output = nn.Linear(value_rank, module.d_model, bias=module.output_bias)


@torch.no_grad()
def _init_head_mixing(mixing: nn.Parameter, core: nn.Parameter | None, init: str) -> None:
    """One side's mixing (``_head_mixing``) set to ``init``. CP vectors: ones, standard normal (``"random"``) or
    each head's own block of the width (``"concatenate"``). Tucker: identity core slices, and weights of
    ``1 / core_size`` (``"random"``: normal with standard deviation ``core_size^-1/2``)."""
    heads, width = mixing.shape
    if core is not None:
        core.copy_(torch.eye(core.shape[1]).expand_as(core))
    if init == "concatenate" and core is None:
        mixing.copy_(torch.eye(heads).repeat_interleave(width // heads, dim=1))
    elif init == "random":
        nn.init.normal_(mixing, std=1.0 if core is None else width**-0.5)
    else:
        mixing.fill_(1.0 if core is None else 1.0 / width)


def _keys_seen(mask: torch.Tensor, src_len: int) -> torch.Tensor:
    """For each query row of a (B, H, T, S) additive mask, how many leading keys it needs: one past the last key
    that any head may attend to, (B, T). The keys after it get exactly zero weight, so dropping them changes
    nothing. A row that may attend to no key at all keeps every key, as it must (it gets uniform weights over all
    of them): its reversed row has no allowed key, so ``argmax`` finds none and returns 0."""
    allowed = (mask > torch.finfo(mask.dtype).min).any(dim=1)  # (B, T, S)
    return src_len - allowed.flip(-1).to(torch.uint8).argmax(dim=-1)


# Logits per block on the CPU: 2^20 float32 values (4 MiB), so that a block's scores, softmax and weighted sum run
# while it is still in the cache instead of streaming all (B, H, T, S) logits through memory four times; inputs
# with fewer logits run in one piece. Of 2^16 to 2^22, tried on MiniLM's layer at lengths 128 to 1,024 (1 thread),
# 2^20 was as fast as any within the noise.
CPU_LOGITS_BLOCK = 1 << 20


def _plus(mask: torch.Tensor | None, content: torch.Tensor | None) -> torch.Tensor | None:
    """The whole additive bias of the logits: the mask plus the content logits, either of which may be None."""
    if content is None or mask is None:
        return content if mask is None else mask
    return mask + content


def _needs_grad(*tensors: torch.Tensor) -> bool:
    """Whether a gradient flows back into any of ``tensors`` (the fused and blocked paths are for inference)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _blocks_pay(queries, keys, values, heads: int) -> bool:
    """Whether ``_in_cpu_blocks`` runs: on the CPU, with no gradient to keep (the backward of the pieces costs more
    than they save), on more logits than one block, and not under ``torch.compile`` (its loops and the keys each
    block sees depend on the data; the compiler fuses the one-piece path instead)."""
    if torch.compiler.is_compiling():
        return False
    needs_grad = _needs_grad(queries, keys, values)
    logits = queries.shape[0] * heads * queries.shape[1] * keys.shape[1]
    return keys.device.type == "cpu" and not needs_grad and logits > CPU_LOGITS_BLOCK


def _cpu_kernels_pay(queries, keys, values) -> bool:
    """Whether a step runs through ``cpu_kernels``: a decoding step (one query row; ``weighted_values`` makes one pass
    over the values per row, where a prefill's matrix product reuses them, and a prefill's scores are a large product
    that ``bmm`` runs well), on the CPU in float32, without a gradient to keep, on a machine where the kernels
    built."""
    needs_grad = _needs_grad(queries, keys, values)
    return (queries.shape[1] == 1 and keys.device.type == "cpu" and not needs_grad
            and all(t.dtype == torch.float32 for t in (queries, keys, values)) and cpu_kernels.available())


def _fused_pays(queries, keys, values) -> bool:
    """Whether shared-value heads run as multi-query attention through ``scaled_dot_product_attention``: without a
    gradient to keep (inference: decoding and prefill; training keeps the explicit path, whose content-bias gradient
    the fused kernels do not give), and where a fused kernel takes the widths. On the CPU the shared keys no wider
    than the shared values (``attend`` pads narrower queries and keys with zero columns for the flash kernel). On a
    GPU equal widths that are a multiple of 16 bytes: the mask (the content logits) rules out the flash kernel, and
    the memory-efficient one wants that alignment; otherwise sdpa falls back to its math kernel, which measured
    slower than the explicit path on an H200 (``experiments/benchmarks/LOG.md``, section 16)."""
    needs_grad = _needs_grad(queries, keys, values)
    if needs_grad:
        return False
    if keys.device.type == "cpu":
        return keys.shape[-1] <= values.shape[-1]
    aligned = 16 // keys.element_size()
    return keys.shape[-1] == values.shape[-1] and keys.shape[-1] % aligned == 0


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` padded with zero columns on its last dimension to ``width``."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))
