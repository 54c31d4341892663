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

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from collab_attn.nn import triton_kernels
from collab_attn.nn.attention import AttentionArguments, _init_head_mixing, _share_values, grouped_attend
from collab_attn.nn.variants import _SharedKeyValueAttention

if TYPE_CHECKING:
    from typing_extensions import Unpack

ROTARY_MIXING_INITS = ("concatenate", "ones", "random")


def check_rotary_head_dim(head_dim: int) -> None:
    """Rotary positions pair a head's dimensions ``i`` and ``i + head_dim / 2``: refuse an odd head size."""
    if head_dim % 2:
        raise ValueError(f"rotary positions pair dimensions i and i + head_dim/2: head_dim ({head_dim}) must be even")


def default_pair_bands(pairs: int, head_dim: int) -> list[int]:
    """The bands ``pairs`` shared pairs rotate with when none are given: pair ``r`` with band ``r mod head_dim/2``
    (at ``pairs = heads x head_dim / 2``, head ``h``'s own block of pairs holds every band once)."""
    return [r % (head_dim // 2) for r in range(pairs)]


def bands_as_built(bands) -> list | None:
    """Band indices as the constructor got them, in plain Python (nested lists for rows), to build the buffer again
    (``default_buffers``); None for a tensor without data (one on the meta device)."""
    if isinstance(bands, torch.Tensor) and bands.device.type == "meta":
        return None
    return torch.as_tensor(bands, device="cpu").tolist()


def rotate_pairs(z: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the pairs of ``z`` (..., 2R) laid out ``[real parts ; imaginary parts]`` by the angles whose cosines and
    sines are ``cos``, ``sin`` (..., R): ``(re cos - im sin, re sin + im cos)``, i.e. transformers'
    ``z * cat(cos, cos) + rotate_half(z) * cat(sin, sin)``."""
    re, im = z.chunk(2, dim=-1)
    return torch.cat([re * cos - im * sin, re * sin + im * cos], dim=-1)


def attend_shared_pairs(queries, keys, values, mask, scale: float, dropout: float, need_weights: bool,
                        shared_values: bool, causal: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Every head's queries (B, H, T, 2R) against the rotated shared pairs as cached (B, 1, S, 2R), with grouped
    values (B, G, S, D) or one shared value (B, 1, S, D_v): the context (B, T, H, D) and, when asked, the weights. A
    decoding step goes through the Triton kernels where they apply (the pairs are one shared key of width 2R);
    otherwise ``grouped_attend`` (``causal``: a causal prompt, as it takes it), the keys never copied per head."""
    if not need_weights and triton_kernels.takes_step(queries.shape[2], (queries, keys, values), mask, dropout):
        context = triton_kernels.step(queries, keys[:, 0], values[:, 0] if shared_values else values, mask,
                                      scale=scale, shared_values=shared_values)[:, None]  # (B, 1, H, D)
        return context, None
    groups = values.shape[1]  # shared values: one group of all heads
    return grouped_attend(queries, keys.expand(-1, groups, -1, -1), values, mask, scale, dropout, need_weights,
                          causal)


def given_positions(module: nn.Module, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
    """``position_embeddings`` = (cos, sin) as given, or the clear error where there are none."""
    if position_embeddings is None:
        raise ValueError(f"{type(module).__name__} needs position_embeddings=(cos, sin), each (batch, seq, head_dim) "
                         "as a transformers rotary embedding computes them; none were given")
    return position_embeddings


class _RotaryAttention(_SharedKeyValueAttention):
    """The forward every rotary kind runs (``_context``, under ``_Attention.forward``): its keys and values as the
    cache holds them (rotated at the keys' positions), the cache, the mask over every key, then its attention at the
    queries' positions. Nothing reaches the cache before the positions are there.

    A kind gives ``_keys_values(keys_from, key_positions) -> (keys, values)`` and ``_attend(query_states,
    position_embeddings, keys, values, mask, causal, need_weights) -> (context (B, T, width), weights or None)``,
    the context before the output projection; it may refuse states in ``_check_states``. ``takes_key_positions =
    False``: its keys sit at the queries' positions and it refuses ``key_position_embeddings``.

    ``forward(query_states, key_value_states=None, attention_mask=None, is_causal=False, need_weights=False,
    kv_cache=None, position_embeddings=None, key_position_embeddings=None) -> (output, weights or None)``;
    ``position_embeddings`` (a keyword, as ``key_position_embeddings``) is required; ``key_position_embeddings``
    gives the keys' positions where they differ from the queries' (by default the keys sit at the queries' positions).
    """

    takes_key_positions: ClassVar[bool] = True

    def _context(self, query_states, key_value_states, attention_mask, is_causal, need_weights, kv_cache,
                 position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                 key_position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None):
        if key_position_embeddings is not None and not self.takes_key_positions:
            raise TypeError(f"{type(self).__name__}.forward() got an unexpected keyword argument "
                            "'key_position_embeddings'")
        self._check_states(query_states, key_value_states)
        given_positions(self, position_embeddings)
        keys_from = query_states if key_value_states is None else key_value_states
        key_positions = position_embeddings if key_position_embeddings is None else key_position_embeddings
        keys, values = self._keys_values(keys_from, key_positions)
        if kv_cache is not None:
            keys, values = kv_cache(keys, values)
        mask, causal = self._mask_or_causal(query_states, attention_mask, is_causal, keys.shape[2])
        return self._attend(query_states, position_embeddings, keys, values, mask, causal, need_weights)

    def _check_states(self, query_states: torch.Tensor, key_value_states: torch.Tensor | None) -> None:
        """A kind's own refusal of the states, before anything is computed (none here)."""


class _SharedPairsAttention(_RotaryAttention):
    """What the layers whose shared key is ``pairs`` rotary pairs share: their sizes, the ``pair_bands`` buffer
    (each pair's band, checked when built, loaded and after any change), the pairs' rotation, the keys and values as
    the cache holds them, and the cache width (the rotated shared key, 2R, and the values: ``kv_heads head_dim``, or
    D_v when shared)."""

    def __init__(self, d_model: int, num_heads: int, pairs: int, kv_heads: int | None,
                 **common: Unpack[AttentionArguments]):
        """The opening every kind shares: the sizes checked first (an even ``head_dim``, ``pairs`` a positive
        integer, ``kv_heads`` by ``_kv_heads``) and kept, with the shared key's width ``rank``."""
        super().__init__(d_model, num_heads, **common)
        check_rotary_head_dim(self.head_dim)
        if not isinstance(pairs, int) or isinstance(pairs, bool) or pairs <= 0:
            raise ValueError(f"pairs must be a positive integer, got {pairs!r}")
        self.kv_heads = self._kv_heads(kv_heads)
        self.pairs = pairs
        self.rank = 2 * pairs  # the shared key's width in numbers (and the shared queries' in collaborative heads)

    def _register_pair_bands(self, pair_bands, pairs: int) -> None:
        """Build, check and register ``pair_bands`` (None: ``default_pair_bands``)."""
        if pair_bands is None:
            pair_bands = default_pair_bands(pairs, self.head_dim)
        self._bands_as_built = bands_as_built(pair_bands)
        pair_bands = torch.as_tensor(pair_bands)
        if pair_bands.shape != (pairs,):
            raise ValueError(f"pair_bands must have one band per pair, shape ({pairs},), got {tuple(pair_bands.shape)}")
        self._check_bands(pair_bands)
        self.register_buffer("pair_bands", pair_bands.to(torch.int64).clone(), persistent=True)
        self._bands_checked: tuple | None = None

    def _check_bands(self, bands: torch.Tensor) -> None:
        """A clear error for bands that are not integers in ``0 .. head_dim/2 - 1``."""
        if bands.device.type == "meta":
            return
        if bands.dtype.is_floating_point or bands.dtype.is_complex or bands.dtype == torch.bool:
            raise ValueError(f"pair_bands must hold integers (RoPE band indices), got dtype {bands.dtype}")
        bands_count = self.head_dim // 2
        if bands.numel() and (int(bands.min()) < 0 or int(bands.max()) >= bands_count):
            raise ValueError(
                f"pair_bands must lie in 0 .. {bands_count - 1} (head_dim {self.head_dim} has {bands_count} RoPE "
                f"bands), got values from {int(bands.min())} to {int(bands.max())}"
            )

    def default_buffers(self) -> dict[str, torch.Tensor]:
        """The buffers as the constructor made them (its ``pair_bands``, or the default): what a model's
        ``_init_weights`` writes back into a layer built on the meta device (a checkpoint's bands then load over
        them). Empty where the constructor got the bands as a tensor without data."""
        return {} if self._bands_as_built is None else {"pair_bands": torch.tensor(self._bands_as_built)}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        bands = state_dict.get(prefix + "pair_bands")
        if bands is not None and bands.shape == self.pair_bands.shape:
            self._check_bands(bands)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _checked_bands(self) -> torch.Tensor:
        """``pair_bands``, checked once after each change (construction, ``load_state_dict``, a replaced or written
        buffer: a new tensor or a bumped in-place version); never under ``torch.compile``."""
        bands = self.pair_bands
        if not torch.compiler.is_compiling():
            key = (bands.data_ptr(), bands.device, None if bands.is_inference() else bands._version)
            if key != self._bands_checked:
                self._check_bands(bands)
                self._bands_checked = key
        return bands

    def pair_angles(self, position_embeddings) -> tuple[torch.Tensor, torch.Tensor]:
        """The cosines and sines of each pair's angle, (batch, seq, R) each, from transformers' ``(cos, sin)``
        (batch, seq, head_dim): band ``i`` sits at column ``i`` (and again at ``i + head_dim/2``)."""
        cos, sin = given_positions(self, position_embeddings)
        if cos.shape[-1] != self.head_dim or sin.shape[-1] != self.head_dim:
            raise ValueError(
                f"position_embeddings must be (cos, sin) of last size head_dim ({self.head_dim}), got "
                f"{tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        bands = self._checked_bands()
        return cos.index_select(-1, bands), sin.index_select(-1, bands)

    def _rotated(self, z: torch.Tensor, position_embeddings) -> torch.Tensor:
        """``z`` (B, [H,] S, 2R) rotated pair by pair at the positions of ``position_embeddings`` (their length must
        be S), every head alike."""
        cos, sin = self.pair_angles(position_embeddings)
        if cos.shape[-2] != z.shape[-2]:
            raise ValueError(
                f"position_embeddings cover {cos.shape[-2]} positions but the input has {z.shape[-2]} tokens"
            )
        cos, sin = cos.to(z.dtype), sin.to(z.dtype)
        if z.dim() == 4:  # (B, H, S, 2R): one angle per token and pair for every head
            cos, sin = cos[:, None], sin[:, None]
        return rotate_pairs(z, cos, sin)

    def _keys_values(self, keys_from: torch.Tensor, key_positions) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared key rotated as cached (B, 1, S, 2R), and the values: one per token (B, 1, S, D_v) where they
        are shared (``value_rank``), else grouped (B, kv_heads, S, head_dim)."""
        keys = self._rotated(self.key(keys_from), key_positions)[:, None]
        values = self.value(keys_from)
        return keys, values[:, None] if self.value_rank is not None else self._heads(values, self.kv_heads)

    def cache_width(self) -> int:
        """Numbers the ``kv_cache`` hook is handed per token: the rotated shared key (2R) and the values
        (``kv_heads head_dim``, or D_v when shared)."""
        return self.rank + (self.kv_heads * self.head_dim if self.value_rank is None else self.value_rank)


class RotaryCollaborativeAttention(_SharedPairsAttention):
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

    ``forward``: every rotary kind's (``_RotaryAttention``), keys at ``key_position_embeddings`` where given.
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
            _share_values(self, value_rank, tucker_core_size)
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
            _init_head_mixing(self.value_mixing, self.value_core, "random" if self.mixing_init == "random" else "ones")

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
