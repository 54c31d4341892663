"""Multi-head latent attention with partial rotary positions (MHA2MLA, Ji et al. 2025), as a plain torch module.

Rotary models rotate each pair ``(i, i + d_h/2)`` of a head's query and key by ``p theta_i`` at position ``p``
(transformers' ``rotate_half`` layout; band ``i < d_h/2``). Here each key/value group ``g`` keeps ``r`` of its
``d_h/2`` bands rotating (``rope_bands[g]``, ascending); the rest of its key dimensions ("nope") no longer rotate and
come, with the values, from one latent per token:

    c = W_down y                                    (latent_size numbers, shared by every group)
    k_rope(g) = RoPE_g(W_kr,g y + b_kr,g)           (2 r numbers per group, rotated with group g's kept bands)
    k_nope(g) = W_uk,g c + b_uk,g,   v(g) = W_uv,g c
    logit_h(t, s) = scale * ( RoPE_g(q_h,rope(x_t)) . k_rope(g)(y_s) + q_h,nope(x_t) . k_nope(g)(y_s) )

for query head ``h`` of group ``g = h // (heads / kv_heads)``; ``q_h`` is the head's whole original query, split
into the dimensions of its group's kept bands and the others. Head ``h`` adds ``P_h v(g)`` to the context, then the
output projection. With every band kept (``r = d_h/2``) and the values at full width this is the source's grouped
attention; with ``r = 0`` no dimension rotates.

Layout (what a conversion writes; G = kv_heads, r = rope_pairs):

- ``query``: ``nn.Linear(d, heads * head_dim)``, the source's queries in the source's layout.
- ``rope_key``: ``nn.Linear(d, G * 2r)``; group ``g``'s 2r outputs are its key dimensions ``[rope_bands[g] ;
  rope_bands[g] + d_h/2]`` (real parts of the kept pairs, then imaginary parts), so ``rotate_pairs`` rotates them.
- ``latent``: ``nn.Linear(d, latent_size, bias=False)``: ``W_down``.
- ``nope_key``: ``nn.Linear(latent_size, G * (d_h - 2r))``: ``W_uk``; group ``g``'s outputs are its other key
  dimensions in ascending order. Its bias is the source's key bias there: it does not rotate, so it is kept as it is.
- ``value``: ``nn.Linear(latent_size, G * head_dim, bias=False)``: ``W_uv``; a value bias belongs in the output bias
  (every attention row sums to one).
- ``rope_bands`` (persistent buffer, (G, r) int64): each group's kept bands, strictly increasing.

Positions come from the caller as transformers computes them: ``position_embeddings = (cos, sin)``, each (batch,
seq, head_dim), band ``i`` at column ``i`` (and again at ``i + head_dim/2``). The cache (``kv_cache`` hook, as in
``collab_attn.nn.attention``) receives one packed row per token as its keys, (batch, 1, seq, 2 r G + latent_size):
every group's rotated kept keys, group after group, then the latent; and an empty tensor (batch, 1, seq, 0) as its
values (``LatentAttention``'s layout): ``2 r G + latent_size`` numbers per token.

Two exact forms of one function. At inference (no gradient to keep) the layer is absorbed, as MLA decodes: head
``h``'s query becomes ``[0 .. RoPE(q_h,rope) in group g's slot .. 0 | q_h,nope W_uk,g]``, which scores against the
packed row itself (the kept keys of its group, then the latent); every head attends over that one key/value head
through the fused kernel (``grouped_attend``), and ``W_uv,g`` maps each head's weighted latent afterwards. The nope
keys' bias adds ``q_h,nope . b_uk,g`` to a whole softmax row and drops out. No per-head key or value is formed, and
the cache is read once. While training, and for a causal prompt into an empty cache (a prefill, as DeepSeek-V2
serves it: per-head scores are ``head_dim`` wide where absorbed ones are the whole packed row), the plain form
expands the latent into the nope keys and the values.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch
from torch import nn

from collab_attn.nn import triton_kernels
from collab_attn.nn.attention import AttentionArguments, grad_flows, grouped_attend
from collab_attn.nn.rotary import RotaryAttention, bands_as_built, check_rotary_head_dim, given_positions, rotate_pairs

if TYPE_CHECKING:
    from typing_extensions import Unpack


def _linear(d_in: int, d_out: int, bias: bool) -> nn.Linear:
    """``nn.Linear``, quietly also when it has no outputs (no rotary pairs kept, or every band kept)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        return nn.Linear(d_in, d_out, bias=bias)


def default_rope_pairs(head_dim: int) -> int:
    """MHA2MLA's share: an eighth of each head's dimensions keep rotating (``head_dim / 16`` pairs), at least one."""
    return max(1, head_dim // 16)


def dimension_order(rope_bands: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(groups, head_dim): per group, its key dimensions in the order the layer holds them, for kept bands
    ``rope_bands`` (groups, r), each row increasing: the kept bands' real parts ``i``, their imaginary parts
    ``i + head_dim/2``, then the other dimensions in ascending order."""
    rotary = torch.cat([rope_bands, rope_bands + head_dim // 2], dim=1)
    kept = torch.zeros(rope_bands.shape[0], head_dim, dtype=torch.int64, device=rope_bands.device)
    kept.scatter_(1, rotary, 1)
    return torch.argsort(1 - kept, dim=1, stable=True)  # kept dimensions first, each part ascending


class PartialRotaryLatentAttention(RotaryAttention):
    """Latent attention whose keys keep ``rope_pairs`` rotary pairs per key/value group (the module docstring has
    the computation and the layout).

    ``kv_heads`` (default ``num_heads``): the key/value groups, query head ``h`` in group ``h // (heads /
    kv_heads)``. ``rope_bands`` (default: the first ``rope_pairs`` bands for every group): (kv_heads, rope_pairs)
    band indices. ``bias``: biases of the query, kept-key and nope-key projections; ``output_bias`` (default
    ``bias``) that of the output projection. ``logit_scale``: default ``1 / sqrt(head_dim)``.

    ``forward`` (``collab_attn.nn.rotary.RotaryAttention``'s) caches the packed row of each token: its kept keys,
    rotated at ``key_position_embeddings`` where given, and its latent.
    """

    takes_kv_dim = False  # reads keys and values at d_model's width

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        latent_size: int,
        rope_pairs: int,
        *,
        kv_heads: int | None = None,
        rope_bands: torch.Tensor | list[list[int]] | None = None,
        **common: Unpack[AttentionArguments],
    ):
        super().__init__(d_model, num_heads, **common)
        check_rotary_head_dim(self.head_dim)
        bias = self.projection_bias
        bands = self.head_dim // 2
        if type(rope_pairs) is not int or not 0 <= rope_pairs <= bands:
            raise ValueError(f"rope_pairs must be an integer in 0..{bands} (head_dim {self.head_dim} has {bands} "
                             f"rotary bands), got {rope_pairs!r}")
        if type(latent_size) is not int or latent_size <= 0:
            raise ValueError(f"latent_size must be a positive integer, got {latent_size!r}")
        self.kv_heads = kv_heads = self._kv_heads(kv_heads)
        self.rope_pairs = rope_pairs
        self.latent_size = latent_size
        nope = self.head_dim - 2 * rope_pairs
        self.query = nn.Linear(d_model, num_heads * self.head_dim, bias=bias)
        self.rope_key = _linear(d_model, kv_heads * 2 * rope_pairs, bias)
        self.latent = nn.Linear(d_model, latent_size, bias=False)
        self.nope_key = _linear(latent_size, kv_heads * nope, bias)
        self.value = nn.Linear(latent_size, kv_heads * self.head_dim, bias=False)  # replaces BaseAttention's
        if rope_bands is None:
            rope_bands = [list(range(rope_pairs))] * kv_heads  # every group keeps the lowest, fastest bands
        self._bands_as_built = bands_as_built(rope_bands)
        rope_bands = torch.as_tensor(rope_bands)
        self._check_bands(rope_bands)
        self.register_buffer("rope_bands", rope_bands.to(torch.int64).clone(), persistent=True)

    def default_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers as the constructor made them (its ``rope_bands``, or the default): what a model's
        ``_init_weights`` writes back into a layer built on the meta device. Empty where the constructor got the
        bands as a tensor without data."""
        if self._bands_as_built is None:
            return {}
        bands = torch.tensor(self._bands_as_built, dtype=torch.int64)
        return {"rope_bands": bands.reshape(self.kv_heads, self.rope_pairs)}

    def _check_bands(self, bands: torch.Tensor) -> None:
        """A clear error for kept bands that are not (kv_heads, rope_pairs) strictly increasing band indices."""
        shape = (self.kv_heads, self.rope_pairs)
        if tuple(bands.shape) != shape:
            raise ValueError(f"rope_bands must be {shape} (kv_heads, rope_pairs), got {tuple(bands.shape)}")
        if bands.device.type == "meta" or not bands.numel():
            return
        if bands.dtype.is_floating_point or bands.dtype.is_complex or bands.dtype == torch.bool:
            raise ValueError(f"rope_bands must hold integers (rotary band indices), got dtype {bands.dtype}")
        count = self.head_dim // 2
        if int(bands.min()) < 0 or int(bands.max()) >= count or bool((bands.diff(dim=1) <= 0).any()):
            raise ValueError(f"each group's rope_bands must be distinct bands in 0..{count - 1}, in increasing "
                             f"order; got {bands.tolist()}")

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        bands = state_dict.get(prefix + "rope_bands")
        if bands is not None:
            self._check_bands(bands)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def dimension_order(self) -> torch.Tensor:
        """(kv_heads, head_dim): ``dimension_order`` of the layer's kept bands."""
        return dimension_order(self.rope_bands, self.head_dim)

    def band_angles(self, position_embeddings, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The cosines and sines of each group's kept bands, (batch, kv_heads, seq, rope_pairs) each, from
        transformers' ``(cos, sin)`` (batch, seq, head_dim) covering ``length`` positions."""
        cos, sin = given_positions(self, position_embeddings)
        if cos.shape[-1] != self.head_dim or sin.shape[-1] != self.head_dim:
            raise ValueError(f"position_embeddings must be (cos, sin) of last size head_dim ({self.head_dim}), got "
                             f"{tuple(cos.shape)} and {tuple(sin.shape)}")
        if cos.shape[-2] != length:
            raise ValueError(f"position_embeddings cover {cos.shape[-2]} positions but the input has {length} tokens")
        bands = self.rope_bands
        return cos[..., bands].movedim(-2, 1), sin[..., bands].movedim(-2, 1)  # (B, S, G, r) -> (B, G, S, r)

    def head_queries(self, query_states: torch.Tensor, position_embeddings) -> torch.Tensor:
        """Each head's query (B, H, T, head_dim) in its group's key order (``dimension_order``), the kept bands
        rotated."""
        group = self.num_heads // self.kv_heads
        queries = self._heads(self.query(query_states), self.num_heads)
        order = self.dimension_order().repeat_interleave(group, dim=0)  # (H, head_dim)
        queries = queries.gather(-1, order[None, :, None, :].expand_as(queries))
        cos, sin = self.band_angles(position_embeddings, queries.shape[2])
        cos, sin = (t.repeat_interleave(group, dim=1).to(queries.dtype) for t in (cos, sin))
        width = 2 * self.rope_pairs
        return torch.cat([rotate_pairs(queries[..., :width], cos, sin), queries[..., width:]], dim=-1)

    def _groups(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, kv_heads * width) -> (B, kv_heads, S, width), also for width 0."""
        return x.unflatten(-1, (self.kv_heads, x.shape[-1] // self.kv_heads)).transpose(1, 2)

    def _keys_values(self, keys_from: torch.Tensor, key_positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The packed row (B, 1, S, 2 r G + latent_size) and no values (B, 1, S, 0): what the cache holds."""
        cos, sin = self.band_angles(key_positions, keys_from.shape[1])
        rope_keys = self._groups(self.rope_key(keys_from))  # (B, G, S, 2r)
        rope_keys = rotate_pairs(rope_keys, cos.to(rope_keys.dtype), sin.to(rope_keys.dtype))
        latent = self.latent(keys_from)  # (B, S, latent_size)
        packed = torch.cat([rope_keys.transpose(1, 2).flatten(2), latent], dim=-1)[:, None]  # (B, 1, S, width)
        return packed, packed.new_empty(*packed.shape[:3], 0)

    def _attend(self, query_states, position_embeddings, packed, _values, mask, causal, need_weights):
        queries = self.head_queries(query_states, position_embeddings)  # (B, H, T, head_dim): kept bands first
        rope_width = 2 * self.rope_pairs * self.kv_heads
        needs_grad = grad_flows(queries, packed)
        if not needs_grad and not causal:  # absorbed: one key/value head, the packed row (module doc)
            absorbed = self._absorbed_queries(queries)
            if not need_weights and triton_kernels.takes_step(queries.shape[2], (absorbed, packed), mask,
                                                              self._dropout()):
                # a decoding step through the Triton kernels: the packed row as the shared key, its latent as the
                # shared value (a view: the cache is read once), (B, 1, H, latent_size)
                context = triton_kernels.step(absorbed, packed[:, 0], packed[:, 0, :, rope_width:], mask,
                                              scale=self.scale, shared_values=True)[:, None]
                weights = None
            else:
                context, weights = grouped_attend(absorbed, packed, packed, mask, self.scale, self._dropout(),
                                                  need_weights)  # (B, T, H, width)
                context = context[..., rope_width:]
            up = self.value.weight.view(self.kv_heads, self.head_dim, self.latent_size)
            up = up.repeat_interleave(self.num_heads // self.kv_heads, dim=0)  # (H, head_dim, latent_size)
            context = torch.einsum("bthc,hdc->bthd", context, up.to(context.dtype))
        else:  # plain: the nope keys and the values expanded from the latent
            rope_keys = packed[:, 0, :, :rope_width].unflatten(-1, (self.kv_heads, -1)).transpose(1, 2)
            latent = packed[:, 0, :, rope_width:]
            keys = torch.cat([rope_keys, self._groups(self.nope_key(latent))], dim=-1)
            values = self._groups(self.value(latent))
            context, weights = grouped_attend(queries, keys, values, mask, self.scale, self._dropout(), need_weights,
                                              causal)
        return context.flatten(2), weights

    def _absorbed_queries(self, queries: torch.Tensor) -> torch.Tensor:
        """Each head's query against the packed row, (B, H, T, 2 r G + latent_size): its rotated kept-band part in its
        group's slot (zeros in the others) and its nope part mapped into the latent, ``q_nope W_uk,g``."""
        batch, heads, tgt_len, _ = queries.shape
        groups, group, width = self.kv_heads, heads // self.kv_heads, 2 * self.rope_pairs
        w_up = self.nope_key.weight.view(groups, self.head_dim - width, self.latent_size)
        w_up = w_up.repeat_interleave(group, dim=0).to(queries.dtype)  # (H, nope, latent_size)
        latent_queries = torch.einsum("bhtn,hnc->bhtc", queries[..., width:], w_up)
        rope = queries[..., :width].reshape(batch, groups, group, tgt_len, width)
        slots = torch.eye(groups, dtype=queries.dtype, device=queries.device)
        rope = torch.einsum("bgjtw,gk->bgjtkw", rope, slots).reshape(batch, heads, tgt_len, groups * width)
        return torch.cat([rope, latent_queries], dim=-1)

    def query_key_params(self) -> int:
        """Parameters that form the attention scores: the queries, the kept keys and the nope keys' up-projection
        (the latent's down-projection is shared with the values, as ``LatentAttention`` counts it)."""
        return sum(p.numel() for part in (self.query, self.rope_key, self.nope_key) for p in part.parameters())

    def cache_width(self) -> int:
        """Numbers the ``kv_cache`` hook is handed per token: the rotated kept keys (2 r kv_heads) and the latent."""
        return 2 * self.rope_pairs * self.kv_heads + self.latent_size
