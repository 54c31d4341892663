"""What every attention module shares, as plain torch: masks, the attention kernels' choice, and the one
``forward`` (``BaseAttention``: sizes, the output projection, parameter counts; each kind gives its ``_context``).

Every module takes the same inputs: ``query_states`` (batch, tgt, d_model), optional ``key_value_states``
(batch, src, kv_dim) for cross-attention, an ``attention_mask`` and ``is_causal``; it returns ``(output, weights)``
where ``weights`` is (batch, heads, tgt, src) when ``need_weights=True``, else ``None``. ``SharedKeyValueAttention``
adds what the variants share (splitting heads, the mask over every key attended to), ``cache_numbers_per_token`` the
numbers a key/value cache holds per token for any module. The modules themselves live with their layer kind
(``collab_attn/kinds/<kind>/<kind>_attention.py``; ``collab_attn.nn`` names the common ones).
"""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, ClassVar, TypedDict

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    pass


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
    needs_grad = grad_flows(query, key)
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
    """The keywords every attention module of ``collab_attn.nn`` takes besides its sizes, with ``BaseAttention``'s
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


class BaseAttention(nn.Module):
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
        (``collab_attn.nn.rotary.RotaryAttention``); the others take none."""
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
        (None without content bias); ``logit_bias(mask, content)`` is the whole bias of the logits.

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


def logit_bias(mask: torch.Tensor | None, content: torch.Tensor | None) -> torch.Tensor | None:
    """The whole additive bias of the logits: the mask plus the content logits, either of which may be None."""
    if content is None or mask is None:
        return content if mask is None else mask
    return mask + content


def grad_flows(*tensors: torch.Tensor) -> bool:
    """Whether a gradient flows back into any of ``tensors`` (the fused and blocked paths are for inference)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _widen(x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` padded with zero columns on its last dimension to ``width``."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def positive_size(name: str, size) -> int:
    """The size argument ``name`` checked: a positive integer."""
    if not isinstance(size, int) or size <= 0:
        raise ValueError(f"{name} must be a positive integer, got {size!r}")
    return size


class SharedKeyValueAttention(BaseAttention):
    """What the variants share beyond ``BaseAttention``: splitting heads and the mask over every key attended to."""

    def _kv_heads(self, kv_heads: int | None) -> int:
        """``kv_heads`` checked: a positive divisor of the query heads (None: one per query head)."""
        kv_heads = self.num_heads if kv_heads is None else kv_heads
        if type(kv_heads) is not int or kv_heads <= 0 or self.num_heads % kv_heads:
            raise ValueError(f"kv_heads must be a positive divisor of num_heads ({self.num_heads}), got {kv_heads!r}")
        return kv_heads

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        """(B, S, heads * width) -> (B, heads, S, width)."""
        return x.unflatten(-1, (heads, -1)).transpose(1, 2)

    def _mask(self, query_states, attention_mask, is_causal, src_len) -> torch.Tensor | None:
        return additive_mask(
            attention_mask, is_causal, query_states.shape[1], src_len, query_states.dtype, query_states.device
        )

    def _mask_or_causal(self, query_states, attention_mask, is_causal, src_len) -> tuple[torch.Tensor | None, bool]:
        """``(mask, False)``, or ``(None, True)`` for a causal prompt (``causal_prompt``), whose causal mask
        ``grouped_attend(..., causal=True)`` applies inside the fused kernel."""
        if causal_prompt(attention_mask, is_causal, query_states.shape[1], src_len):
            return None, True
        return self._mask(query_states, attention_mask, is_causal, src_len), False


def cache_numbers_per_token(module: nn.Module) -> int:
    """Numbers the module hands its ``kv_cache`` hook per token (packed keys and values together), i.e. what a
    key/value cache holds per token for this layer (each module's ``cache_width``): GQA ``2 kv_heads head_dim``, MQA
    ``2 head_dim``, MLA ``latent_size``, shared key ``rank + H head_dim``; concatenated heads ``H
    (query_key_head_dim + head_dim)`` (``+ H`` with content bias); collaborative heads ``rank + H head_dim`` (``+ H``
    with content bias), ``rank + value_rank`` (``+ H``) when they share the values too."""
    if not isinstance(module, BaseAttention):
        raise TypeError(f"no cache layout known for {type(module).__name__}: not an attention module of collab_attn.nn")
    return module.cache_width()
