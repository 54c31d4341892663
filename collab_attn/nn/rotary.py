"""What the rotary kinds share, as plain torch: the pairs' rotation, the one rotary ``forward`` (``RotaryAttention``:
positions, cache, mask; each kind gives its keys and values as cached and its attention at the queries' positions),
and the shared key of rotary pairs with its ``pair_bands`` (``SharedPairsAttention``, under the rotary collaborative
and rotary shared-key kinds).

Positions come from the caller as transformers computes them: ``position_embeddings = (cos, sin)``, each
(batch, seq, head_dim), with ``cos[..., i] == cos[..., i + head_dim/2]`` the cosine of band ``i`` (rope scaling
already folded in). The kinds live in ``collab_attn/kinds/rotary_*/``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from collab_attn.nn import triton_kernels
from collab_attn.nn.attention import AttentionArguments, SharedKeyValueAttention, grouped_attend

if TYPE_CHECKING:
    from typing_extensions import Unpack


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


class RotaryAttention(SharedKeyValueAttention):
    """The forward every rotary kind runs (``_context``, under ``BaseAttention.forward``): its keys and values as the
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


class SharedPairsAttention(RotaryAttention):
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


