"""Collaborative attention that keeps rotary positions (RoPE) exactly, as a plain torch module.

Rotary models (Llama, Qwen2, Mistral, SmolLM) rotate each pair ``(i, i + d_h/2)`` of a head's query and key by
``p theta_i`` at position ``p`` (transformers' ``rotate_half`` layout). Written as one complex number per pair, the
rotation is a multiplication by ``e^(j p theta_i)``, and it commutes with any complex multiplication. So the heads
can share query/key *pairs* that each rotate with one frequency band (``pair_bands``), and each head keeps one
complex mixing number per shared pair (see "Rotary positions" in docs/design.md):

    logit_h(t, s) = scale * Re( sum_r  q_r(x_t) m_hr e^(j p_t theta_(b_r))  conj( k_r(y_s) e^(j p_s theta_(b_r)) ) )

with ``q_r``, ``k_r`` the shared complex query and key of pair ``r`` and ``b_r`` its band.

Layout (what a conversion writes): R pairs per layer.

- ``query``, ``key``: ``nn.Linear(d, 2R)``; their 2R outputs are ``[real parts of the R pairs ; imaginary parts]``,
  so transformers' ``rotate_half`` on the 2R vector rotates pair ``r``, i.e. ``(z_r, z_(r+R))``, by its angle.
- ``pair_bands`` (persistent buffer, (R,) int64): the RoPE band ``0 .. head_dim/2 - 1`` each pair rotates with.
- ``mixing`` (heads, 2R): ``[real parts ; imaginary parts]`` of each head's complex mixing number per pair (CP).
  Tucker (``tucker_core_size`` K): ``mixing`` (heads, K) real weights of ``mixing_core`` (K, 2, R, R), K complex
  R x R slices ``[real ; imaginary]``; head ``h`` mixes with ``C_h = sum_g mixing[h, g] core_g``, its query for pair
  ``s`` being ``sum_r C_h[r, s] q_r`` over the pairs ``r`` of the same band as ``s`` (entries across bands are
  never read: a rotation commutes only with mixing inside one band). Head ``h`` scores
  ``Re(sum_(r,s) q_r C_h[r, s] conj(k_s))`` (rotations included); CP is the diagonal ``C_h``.
- values: grouped like the source (``value``: d -> kv_heads * head_dim, head ``h`` reads group
  ``h // (heads / kv_heads)``, ``output``: heads * head_dim -> d), or shared (``value_rank`` D_v: ``value``: d -> D_v,
  ``value_mixing`` (heads, D_v), ``output``: D_v -> d), as ``CollaborativeAttention`` shares them; with
  ``tucker_core_size`` through a core of value mixing matrices (``value_mixing`` (heads, K), ``value_core`` (K, D_v,
  D_v)), as there.

Positions come from the caller as transformers computes them: ``position_embeddings = (cos, sin)``, each
(batch, seq, head_dim), with ``cos[..., i] == cos[..., i + head_dim/2]`` the cosine of band ``i`` (rope scaling
already folded in). The cache (``kv_cache`` hook, as in ``collab_attn.nn.attention``) receives the keys already
rotated, (batch, 1, seq, 2R), and the values, (batch, kv_heads, seq, head_dim) or shared (batch, 1, seq, D_v):
``2R + kv_heads head_dim`` (or ``2R + D_v``) numbers per token.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from collab_attn.kinds.collaborative.collaborative_attention import init_head_mixing, share_values
from collab_attn.nn.attention import AttentionArguments
from collab_attn.nn.rotary import SharedPairsAttention, attend_shared_pairs

if TYPE_CHECKING:
    from typing_extensions import Unpack

ROTARY_MIXING_INITS = ("concatenate", "ones", "random")


class RotaryCollaborativeAttention(SharedPairsAttention):
    """Collaborative heads with rotary-exact shared keys: ``pairs`` shared query/key pairs, each rotating with its
    RoPE band (``pair_bands``), and a complex mixing number per head and pair (the module docstring has the layout).

    ``kv_heads`` (default ``num_heads``): value groups, as the source model's key/value heads; ignored with
    ``value_rank``, which shares one value of width D_v across heads (per-head ``value_mixing``).
    ``pair_bands`` (default ``default_pair_bands``, ``r mod (head_dim / 2)``: with ``pairs = heads * head_dim / 2`` and
    ``mixing_init="concatenate"`` this is the source's own layout, head ``h`` owning pairs
    ``h d_h/2 .. (h+1) d_h/2 - 1``, pair ``h d_h/2 + i`` rotating with band ``i``).
    ``bias``: biases of the query, key and value projections; ``output_bias`` (default: ``bias``) that of the output
    projection (Qwen2 has q/k/v biases and no o_proj bias). ``logit_scale``: default ``1 / sqrt(head_dim)``.
    ``mixing_init``: ``"concatenate"`` (head ``h`` gets mixing 1 on its own block of ``pairs / heads`` pairs, 0
    elsewhere), ``"ones"`` (1 everywhere) or ``"random"`` (standard normal real and imaginary parts); shared values
    start as ones (normal for ``"random"``). ``tucker_core_size``: mix through a core of that many complex pair x
    pair slices (module doc) instead of one complex number per pair; "concatenate" then needs one slice per head
    (slice ``h`` the identity on head ``h``'s block); "ones" gives identity slices weighted ``1 / K``.

    ``forward``: every rotary kind's (``RotaryAttention``), keys at ``key_position_embeddings`` where given.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        pairs: int,
        *,
        kv_heads: int | None = None,
        pair_bands: torch.Tensor | list[int] | None = None,
        mixing_init: str = "concatenate",
        value_rank: int | None = None,
        tucker_core_size: int | None = None,
        **common: Unpack[AttentionArguments],
    ):
        super().__init__(d_model, num_heads, pairs, kv_heads, **common)
        bias = self.projection_bias
        if mixing_init not in ROTARY_MIXING_INITS:
            raise ValueError(f"unknown mixing_init {mixing_init!r}; choose one of {ROTARY_MIXING_INITS}")
        if tucker_core_size is not None and (not isinstance(tucker_core_size, int)
                                             or isinstance(tucker_core_size, bool) or tucker_core_size <= 0):
            raise ValueError(f"tucker_core_size must be a positive integer or None, got {tucker_core_size!r}")
        if mixing_init == "concatenate" and tucker_core_size not in (None, num_heads):
            raise ValueError(f"mixing_init='concatenate' gives each head its own core slice: tucker_core_size must be "
                             f"num_heads ({num_heads}), got {tucker_core_size}; or use mixing_init='ones'/'random'")
        if mixing_init == "concatenate" and pairs % num_heads:
            raise ValueError(
                f"mixing_init='concatenate' splits the pairs ({pairs}) into num_heads ({num_heads}) equal blocks; "
                "choose a number of pairs that is a multiple of num_heads or mixing_init='ones'/'random'"
            )
        self.mixing_init = mixing_init
        self.query = nn.Linear(d_model, 2 * pairs, bias=bias)
        self.key = nn.Linear(self.kv_dim, 2 * pairs, bias=bias)
        self.tucker_core_size = tucker_core_size
        if tucker_core_size is None:
            self.mixing = nn.Parameter(torch.empty(num_heads, 2 * pairs))
            self.mixing_core = None
        else:
            self.mixing = nn.Parameter(torch.empty(num_heads, tucker_core_size))
            self.mixing_core = nn.Parameter(torch.empty(tucker_core_size, 2, pairs, pairs))
        self._register_pair_bands(pair_bands, pairs)
        self.value_rank = value_rank
        if value_rank is not None:
            share_values(self, value_rank, tucker_core_size)
        else:
            self.value = nn.Linear(self.kv_dim, self.kv_heads * self.head_dim, bias=bias)
            self.value_mixing = self.value_core = None
        self.reset_mixing()

    @torch.no_grad()
    def reset_mixing(self) -> None:
        """Set the mixing (and the shared values' mixing) to ``self.mixing_init``."""
        if self.mixing.device.type == "meta":
            return
        heads, pairs = self.num_heads, self.pairs
        if self.mixing_core is not None:
            self._reset_core()
        elif self.mixing_init == "random":
            nn.init.normal_(self.mixing)
        elif self.mixing_init == "ones":
            self.mixing.zero_()[:, :pairs] = 1.0
        else:  # head h: 1 + 0j on its own block of pairs
            self.mixing.zero_()[:, :pairs] = torch.eye(heads).repeat_interleave(pairs // heads, dim=1)
        if self.value_mixing is not None:
            init_head_mixing(self.value_mixing, self.value_core, "random" if self.mixing_init == "random" else "ones")

    def _reset_core(self) -> None:
        core_size, pairs = self.mixing.shape[1], self.pairs
        self.mixing_core.zero_()
        if self.mixing_init == "random":
            nn.init.normal_(self.mixing, std=core_size**-0.5)
            nn.init.normal_(self.mixing_core, std=pairs**-0.5)
        elif self.mixing_init == "ones":
            self.mixing.fill_(1.0 / core_size)
            self.mixing_core[:, 0] = torch.eye(pairs)
        else:  # slice h: the identity on head h's own block of pairs
            self.mixing.copy_(torch.eye(core_size))
            blocks = torch.eye(core_size).repeat_interleave(pairs // core_size, dim=1)
            self.mixing_core[:, 0] = torch.diag_embed(blocks)

    def mixing_matrices(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Tucker: each head's complex mixing ``C_h`` over the pairs, real and imaginary parts (heads, R, R) each,
        with the entries across bands set to zero."""
        bands = self.pair_bands
        same_band = (bands[:, None] == bands[None, :]).to(self.mixing_core.dtype)
        matrices = torch.einsum("hg,gcrs->chrs", self.mixing, self.mixing_core) * same_band
        return matrices[0], matrices[1]

    def head_queries(self, rotated_queries: torch.Tensor) -> torch.Tensor:
        """Each head's queries (B, H, T, 2R) from the rotated shared ones (B, T, 2R): pair ``r`` times the head's
        complex mixing number ``m_hr`` (a rotation commutes with it, so rotating first is the same)."""
        if self.mixing_core is not None:  # head h's pair s: sum_r q_r C_h[r, s] (complex, within s's band)
            re, im = rotated_queries.chunk(2, dim=-1)  # (B, T, R)
            c_re, c_im = (part.to(re.dtype) for part in self.mixing_matrices())
            mixed = torch.einsum("btr,hrs->bhts", torch.cat([re, -im], -1), torch.cat([c_re, c_im], 1)), \
                torch.einsum("btr,hrs->bhts", torch.cat([re, im], -1), torch.cat([c_im, c_re], 1))
            return torch.cat(mixed, dim=-1)
        re, im = rotated_queries[:, None].chunk(2, dim=-1)  # (B, 1, T, R)
        m_re, m_im = self.mixing[:, None].to(re.dtype).chunk(2, dim=-1)  # (H, 1, R); autocast: the queries' dtype
        return torch.cat([re * m_re - im * m_im, re * m_im + im * m_re], dim=-1)

    def _attend(self, query_states, position_embeddings, keys, values, mask, causal, need_weights):
        shared_values = self.value_mixing is not None
        queries = self.head_queries(self._rotated(self.query(query_states), position_embeddings))
        context, weights = attend_shared_pairs(queries, keys, values, mask, self.scale, self._dropout(),
                                               need_weights, shared_values, causal)
        if shared_values and self.value_core is not None:  # (B, T, H, D_v) -> sum_h context_h N_h: (B, T, D_v)
            return torch.einsum("bthv,hvw->btw", context, self.value_mixing_matrices()), weights
        if shared_values:  # (B, T, H, D_v) -> sum_h context_h diag(n_h): (B, T, D_v)
            return torch.einsum("bthv,hv->btv", context, self.value_mixing), weights
        return context.flatten(2), weights

    def value_mixing_matrices(self) -> torch.Tensor:
        """Tucker values: each head's (D_v, D_v) mixing ``N_h = sum_g value_mixing[h, g] value_core[g]``."""
        return torch.einsum("hg,gvw->hvw", self.value_mixing, self.value_core)
