"""Sizes of every attention variant at matched key/value-cache bytes, and at matched attention parameters, read from
the models themselves (``cache_bytes`` and ``parameter_counts`` of a model built on the meta device), not by hand.

For a target fraction of the concatenated model's cache (or attention parameters), each variant gets the size
(``rank``: the key width of concatenated and collaborative heads, the key width kv_heads x head size of grouped
heads, the latent of latent attention; ``collab-kv``: collaborative heads sharing keys and values, value_rank =
rank) whose cost is closest to the target, with the exact ratio it reaches. A
variant whose cost cannot come within ``REACH`` of the target at any size (collaborative heads that share only their
keys keep per-head values, half the original cache) is marked unreachable and reports its closest size.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import transformers

from collab_attn.char_lm.kinds import ATTENTION
from collab_attn.char_lm.models import cache_bytes, gpt_config, parameter_counts

REACH = 0.1  # a size counts as matching when its ratio is within 10% of the target fraction
# Every attention option, and collaborative heads that share their values too at value_rank = rank: each variant
# as the kind it builds and whether its values take the keys' size.
SHARED_VALUES = "collab-kv"
_BUILDS = {**{name: (kind, False) for name, kind in ATTENTION.items()}, SHARED_VALUES: (ATTENTION["collab"], True)}
VARIANTS = tuple(_BUILDS)


@dataclass(frozen=True)
class Sized:
    """One variant at one size: its cache bytes per token (bf16, all layers) and attention parameters."""

    kind: str
    rank: int
    cache_bytes: int
    attention_params: int


@dataclass(frozen=True)
class Match:
    kind: str
    target: float  # the fraction of the original asked for
    sized: Sized
    ratio: float  # the fraction reached
    reached: bool  # within REACH of the target


def candidate_sizes(kind: str, n_embd: int, n_head: int, positions: str = "learned") -> list[int]:
    """Every ``rank`` a variant takes at this width (``positions="rope"``: as a rotary model takes it)."""
    attention, _ = _BUILDS[kind]
    return attention.ranks(n_embd, n_head, positions == "rope")


def sized(kind: str, rank: int, model: dict, positions: str = "learned") -> Sized:
    """Build the variant on the meta device and read its costs (each variant once per process: the costs depend on
    its sizes alone). Tensor product attention's values take the keys' rank, latent attention's rotary key its
    default width."""
    return _sized(kind, rank, tuple(sorted(model.items())), positions)


@functools.cache
def _sized(kind: str, rank: int, model_items: tuple, positions: str) -> Sized:
    model = dict(model_items, positions=positions)
    attention, shares_values = _BUILDS[kind]
    config = gpt_config(2, 8, **model, kind=attention.name, rank=rank,
                        value_rank=rank if shares_values else None)
    with torch.device("meta"):
        built = transformers.AutoModelForCausalLM.from_config(config)
    return Sized(kind, rank, cache_bytes(built), parameter_counts(built)["attention_params"])


def all_sizes(model: dict, kinds: Sequence[str] | None = None, positions: str = "learned") -> dict[str, list[Sized]]:
    """Every size of every variant for ``model`` (``n_layer``, ``n_head``, ``n_embd``, ``dropout``); by default
    every variant the positions take (tensor product attention needs rotary ones)."""
    if kinds is None:
        kinds = [kind for kind, (attention, _) in _BUILDS.items() if positions == "rope" or not attention.needs_rope]
    return {kind: [sized(kind, k, model, positions)
                   for k in candidate_sizes(kind, model["n_embd"], model["n_head"], positions)]
            for kind in kinds}


def matched(sizes: dict[str, list[Sized]], fractions: Sequence[float], cost: str) -> list[Match]:
    """Per fraction and variant, the size whose ``cost`` (``cache_bytes`` or ``attention_params``) is closest to that
    fraction of the full concatenated model's."""
    original = getattr(max(sizes["concat"], key=lambda s: s.rank), cost)
    rows = []
    for fraction in fractions:
        for kind, options in sizes.items():
            best = min(options, key=lambda s: (abs(getattr(s, cost) / original - fraction), s.rank))
            ratio = getattr(best, cost) / original
            rows.append(Match(kind, fraction, best, ratio, abs(ratio - fraction) <= REACH * fraction))
    return rows


def table(rows: Sequence[Match], cost: str) -> str:
    """A Markdown table of ``matched``'s rows."""
    name = {"cache_bytes": "cache", "attention_params": "attention parameters"}[cost]
    lines = [f"| target {name} | attention | rank | cache B/token (bf16) | attention params | reached |",
             "|---:|---|---:|---:|---:|---|"]
    for row in rows:
        reached = f"{row.ratio:.3f}x" if row.reached else f"no (closest {row.ratio:.3f}x)"
        lines.append(f"| {row.target:g} | {row.kind} | {row.sized.rank} | {row.sized.cache_bytes:,} "
                     f"| {row.sized.attention_params:,} | {reached} |")
    return "\n".join(lines)

