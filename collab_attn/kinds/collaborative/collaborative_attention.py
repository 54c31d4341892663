"""Collaborative multi-head attention as a plain torch module.

Collaborative heads (Cordonnier et al., 2020): all heads share ``Wq~, Wk~`` of width ``rank`` and head ``h``
keeps a mixing vector ``m_h``; it scores ``(X Wq~ diag(m_h) Wk~^T Y^T + 1 (Y c_h)^T) / sqrt(d_head)``, where
``c_h`` is the content bias (what the query bias of head ``h`` becomes). With ``tucker_core_size`` set, each head
mixes with a full ``rank x rank`` matrix ``M_h = sum_g mixing[h, g] core[g]`` instead of ``diag(m_h)``. With
``value_rank`` D_v the heads share the values too: one value per token ``Y A`` of width D_v (cached once for all
heads) and a value mixing vector ``n_h`` per head; the output is ``sum_h (P_h Y A) diag(n_h) B`` with ``B`` the
(D_v, d_model) output projection, the CP form of the per-head products ``Wv_h Wo_h``; with ``tucker_core_size`` as well,
each head mixes its sum with a full ``D_v x D_v`` matrix ``N_h = sum_g value_mixing[h, g] value_core[g]`` (their
Tucker form).

``CollaborativeAttention`` computes all heads' logits in one ``bmm`` against the shared keys; at inference on the
CPU it does so one batch element and a block of query rows at a time (``CollaborativeAttention._in_cpu_blocks``).
Inputs and outputs as every module's (``collab_attn.nn.attention``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from collab_attn.nn import cpu_kernels, triton_kernels
from collab_attn.nn.attention import (
    AttentionArguments,
    BaseAttention,
    causal_prompt,
    grad_flows,
    grouped_attend,
    logit_bias,
)

if TYPE_CHECKING:
    from typing_extensions import Unpack

MIXING_INITS = ("concatenate", "ones", "random")


class CollaborativeAttention(BaseAttention):
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
            share_values(self, value_rank, tucker_core_size)
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
            init_head_mixing(self.value_mixing, self.value_core, init)
        init_head_mixing(self.mixing, self.mixing_core, self.mixing_init)

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
                  and not grad_flows(shared_queries, keys, values))
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
            context, weights = self._through_cpu_kernels(shared_queries, keys, values, logit_bias(mask, content)), None
        elif not need_weights and not shared_values and _blocks_pay(shared_queries, keys, values, self.num_heads):
            return self._in_cpu_blocks(shared_queries, keys, values, mask, content).flatten(2), None
        elif not need_weights and shared_values and (prompt or _fused_pays(shared_queries, keys, values)):
            # every head attends over the one shared key/value head: multi-query attention, its heads stacked as
            # the query rows of one head through the fused kernel, which reads the cache once (B, T, H, D_v); a
            # causal prompt with the causal mask inside the kernel, which then skips the keys a row cannot see
            context, weights = grouped_attend(self._mixed(shared_queries), keys[:, None], values,
                                              content if prompt else logit_bias(mask, content), 1.0, self._dropout(),
                                              False, prompt)
            context = context.transpose(1, 2)  # (B, H, T, D_v), as the explicit path gives it
        else:
            context, weights = self._explicit(shared_queries, keys, values, logit_bias(mask, content))
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
            per_key, mask = logit_bias(mask, content), None
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


def share_values(module: BaseAttention, value_rank, core_size: int | None) -> None:
    """Give ``module`` one value of width ``value_rank`` per token for every head, mixed per head on its way to the
    output projection (``value_mixing``, through ``value_core`` with a Tucker core of ``core_size`` slices)."""
    if not isinstance(value_rank, int) or isinstance(value_rank, bool) or value_rank <= 0:
        raise ValueError(f"value_rank must be a positive integer or None, got {value_rank!r}")
    module.value = nn.Linear(module.kv_dim, value_rank, bias=module.projection_bias)
    module.value_mixing, module.value_core = _head_mixing(module.num_heads, value_rank, core_size)
    if module.output is not None:
        module.output = nn.Linear(value_rank, module.d_model, bias=module.output_bias)


@torch.no_grad()
def init_head_mixing(mixing: nn.Parameter, core: nn.Parameter | None, init: str) -> None:
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


def _blocks_pay(queries, keys, values, heads: int) -> bool:
    """Whether ``_in_cpu_blocks`` runs: on the CPU, with no gradient to keep (the backward of the pieces costs more
    than they save), on more logits than one block, and not under ``torch.compile`` (its loops and the keys each
    block sees depend on the data; the compiler fuses the one-piece path instead)."""
    if torch.compiler.is_compiling():
        return False
    needs_grad = grad_flows(queries, keys, values)
    logits = queries.shape[0] * heads * queries.shape[1] * keys.shape[1]
    return keys.device.type == "cpu" and not needs_grad and logits > CPU_LOGITS_BLOCK


def _cpu_kernels_pay(queries, keys, values) -> bool:
    """Whether a step runs through ``cpu_kernels``: a decoding step (one query row; ``weighted_values`` makes one pass
    over the values per row, where a prefill's matrix product reuses them, and a prefill's scores are a large product
    that ``bmm`` runs well), on the CPU in float32, without a gradient to keep, on a machine where the kernels
    built."""
    needs_grad = grad_flows(queries, keys, values)
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
    needs_grad = grad_flows(queries, keys, values)
    if needs_grad:
        return False
    if keys.device.type == "cpu":
        return keys.shape[-1] <= values.shape[-1]
    aligned = 16 // keys.element_size()
    return keys.shape[-1] == values.shape[-1] and keys.shape[-1] % aligned == 0
