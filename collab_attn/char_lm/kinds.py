"""The attention kinds of the character models, one class each and one instance each in ``ATTENTION``: everything
that differs between kinds, read by ``models`` (the configs), ``runs`` (run names, records, size settings) and
``budgets`` (the sizes each takes).

A kind's ``rank`` is its query/key width (D_k for concatenated heads, D~ for collaborative ones) or, for the
variants, the width that sets its cache. With learned positions a kind is a GPT-2 model whose attention layers are
the library's converted layer kind ``layer`` (``collab_attn.kinds.LAYER_KINDS``; None: GPT-2's own); with
rotary positions a Llama model whose layers are ``rotary_layer`` (None: Llama's own). Both converted layouts keep
GPT-2's logit scale ``1 / sqrt(n_embd / n_head)`` and replace the query/key biases by a per-head content bias (the
key bias never changes a softmax row).
"""

from __future__ import annotations

from dataclasses import dataclass

import transformers

from collab_attn.kinds.collaborative import collaborative_attention
from collab_attn.models.hf import Layout, collab_config_class

TPA_QUERY_RANK = 6  # TPA's paper trains its models with query rank 6 (its "T6")
# A model built to train from scratch starts its mixing at random or at ones; "concatenate" (block mixing) is how a
# conversion starts, and is refused here.
MIXING_INITS = tuple(init for init in collaborative_attention.MIXING_INITS if init != "concatenate")


@dataclass(frozen=True)
class Sizes:
    """What a kind's config is built from: the model's widths and the variant's sizes, ``rank`` resolved, the
    others as given (None: the kind's default)."""

    n_layer: int
    n_head: int
    n_embd: int
    rank: int
    mixing_init: str
    value_rank: int | None
    rope_dim: int | None
    query_rank: int | None

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


class AttentionKind:
    """One attention kind of the character models. ``takes``: the optional sizes it accepts (``value_rank``,
    ``mixing_init``, ``rope_dim``, ``query_rank``); ``needs_rope``: why it has rotary positions only (None: it has
    both); ``size_alias``: the setting that gives its ``rank`` in the kind's own terms (``rank_from``)."""

    name: str
    layer: str | None = None
    rotary_layer: str | None = None
    takes: frozenset[str] = frozenset()
    needs_rope: str | None = None
    size_alias: str | None = None

    def default_rank(self, n_embd: int, n_head: int) -> int:
        """``rank`` when none is given."""
        return n_embd

    def ranks(self, n_embd: int, n_head: int, rotary: bool) -> list[int]:
        """Every ``rank`` it takes at this width (``rotary``: as a rotary model takes it)."""
        return list(range(1, n_embd + 1))

    def rank_from(self, alias: int, head_dim: int) -> int:
        """``rank`` from the value of ``size_alias``."""
        return alias

    def named_sizes(self, rank: int, value_rank: int | None, rope_dim: int | None, query_rank: int | None,
                    head_dim: int, rotary: bool) -> dict[str, int | None]:
        """The sizes a run name states after its rank, by their letter, in order (None: not named)."""
        return {"v": value_rank}

    def learned_config(self, common: dict, sizes: Sizes) -> transformers.PreTrainedConfig:
        """The GPT-2 config (``common``: its fields shared by every kind); bad sizes raise ``ValueError``."""
        raise NotImplementedError(f"attention={self.name} has no learned positions")

    def rotary_config(self, common: dict, sizes: Sizes) -> transformers.PreTrainedConfig:
        """The Llama config (``common``: its fields shared by every kind); bad sizes raise ``ValueError``."""
        raise NotImplementedError


def _layout_config(common: dict, layer: str, n_layer: int, family: str = "gpt2", **layer_sizes):
    """A config of ``family`` whose ``n_layer`` attention layers are all of ``layer`` at ``layer_sizes`` (None: the
    default)."""
    layout = Layout.uniform(layer, layer, n_layer, **layer_sizes)
    return collab_config_class(family)(**common, **layout.config_fields())


def _check_mixing(mixing_init: str) -> None:
    if mixing_init not in MIXING_INITS:
        raise ValueError(f"unknown mixing_init {mixing_init!r}; choose one of {MIXING_INITS}")


class Concat(AttentionKind):
    """Concatenated heads. At ``rank = n_embd`` the plain ``GPT2LMHeadModel`` (nanoGPT's model); below it,
    query/key heads of size ``rank / n_head`` (values keep ``n_embd / n_head``). With rotary positions, Llama's
    own attention at full width only (``layer`` is the narrower heads'; at full width GPT-2's own)."""

    name = "concat"
    layer = "concatenated"

    def ranks(self, n_embd, n_head, rotary):
        return [n_embd] if rotary else list(range(n_head, n_embd + 1, n_head))

    def learned_config(self, common, sizes):
        if sizes.rank == sizes.n_embd:
            return transformers.GPT2Config(**common)
        if sizes.rank % sizes.n_head:
            raise ValueError(f"concatenated heads need rank a multiple of n_head={sizes.n_head}, "
                             f"got {sizes.rank}")
        return _layout_config(common, self.layer, sizes.n_layer, rank=sizes.rank)

    def rotary_config(self, common, sizes):
        if sizes.rank != sizes.n_embd:
            raise ValueError(f"positions=rope has concatenated heads at their full width only (rank="
                             f"{sizes.n_embd}); narrower query/key heads would drop rotary bands: use attention=collab")
        return transformers.LlamaConfig(**common)


class Collab(AttentionKind):
    """Collaborative heads: shared query/key projections of width ``rank`` and one mixing vector per head,
    started ``random`` (N(0, 1)) or at ``ones``; a value per head, or one shared value of ``value_rank``. With
    rotary positions, ``rank / 2`` shared query/key pairs that rotate each with one RoPE band."""

    name = "collab"
    layer = "collaborative"
    rotary_layer = "rotary-collaborative"
    takes = frozenset({"value_rank", "mixing_init"})

    def ranks(self, n_embd, n_head, rotary):
        return list(range(2, n_embd + 1, 2)) if rotary else list(range(1, n_embd + 1))  # rotary: query/key pairs

    def learned_config(self, common, sizes):
        _check_mixing(sizes.mixing_init)
        return _layout_config(common, self.layer, sizes.n_layer, rank=sizes.rank, mixing_init=sizes.mixing_init,
                              value_rank=None if sizes.value_rank is None else int(sizes.value_rank))

    def rotary_config(self, common, sizes):
        if sizes.rank % 2:
            raise ValueError(f"rotary collaborative heads share rank / 2 query/key pairs: rank must be even, "
                             f"got {sizes.rank}")
        _check_mixing(sizes.mixing_init)
        if sizes.value_rank is not None and not 0 < int(sizes.value_rank) <= sizes.n_embd:
            raise ValueError(f"value_rank must be in 1..n_embd={sizes.n_embd}, got {sizes.value_rank}")
        return _layout_config(common, self.rotary_layer, sizes.n_layer, "llama", rank=sizes.rank,
                              mixing_init=sizes.mixing_init,
                              value_rank=None if sizes.value_rank is None else int(sizes.value_rank))


class _Grouped(AttentionKind):
    """Grouped key/value heads of the query heads' size, ``rank / (n_embd / n_head)`` of them; with rotary
    positions Llama's own grouped heads."""

    layer = "gqa"

    def check(self, sizes: Sizes) -> None:
        """A clear error for a key width that is not whole key/value heads dividing the query heads."""

    def learned_config(self, common, sizes):
        self.check(sizes)
        return _layout_config(common, self.layer, sizes.n_layer, rank=sizes.rank)

    def rotary_config(self, common, sizes):
        self.check(sizes)
        return transformers.LlamaConfig(**{**common, "num_key_value_heads": sizes.rank // sizes.head_dim})


class GQA(_Grouped):
    """Grouped-query heads (``rank = n_embd``: multi-head attention); ``kv_heads`` sets ``rank`` as
    kv_heads x head size."""

    name = "gqa"
    size_alias = "kv_heads"

    def ranks(self, n_embd, n_head, rotary):
        return [kv * (n_embd // n_head) for kv in range(1, n_head + 1) if n_head % kv == 0]

    def rank_from(self, alias, head_dim):
        return alias * head_dim

    def check(self, sizes):
        kv_heads, rest = divmod(sizes.rank, sizes.head_dim)
        if rest or sizes.n_head % kv_heads:
            raise ValueError(f"attention=gqa needs rank = kv_heads x {sizes.head_dim} with kv_heads dividing "
                             f"n_head={sizes.n_head}, got {sizes.rank}")


class MQA(_Grouped):
    """One key/value head (``rank`` is the head size, or null)."""

    name = "mqa"

    def default_rank(self, n_embd, n_head):
        return n_embd // n_head

    def ranks(self, n_embd, n_head, rotary):
        return [n_embd // n_head]

    def check(self, sizes):
        if sizes.rank != sizes.head_dim:
            raise ValueError(f"attention=mqa has one key/value head: rank must be the head size {sizes.head_dim} "
                             f"(or null), got {sizes.rank}")


class MLA(AttentionKind):
    """Latent attention: one latent of width ``rank`` (or ``latent_size``) cached per token. With rotary
    positions DeepSeek-V2's, with a decoupled rotary key of ``rope_dim`` dimensions (default: half a head) shared by
    every head beside the latent (one key/value group)."""

    name = "mla"
    layer = "mla"
    rotary_layer = "rotary-mla"
    takes = frozenset({"rope_dim"})
    size_alias = "latent_size"

    def named_sizes(self, rank, value_rank, rope_dim, query_rank, head_dim, rotary):
        return {"v": value_rank, "r": self.rope_dim_of(rope_dim, head_dim) if rotary else None}

    @staticmethod
    def rope_dim_of(rope_dim: int | None, head_dim: int) -> int:
        return head_dim // 2 if rope_dim is None else rope_dim

    def learned_config(self, common, sizes):
        return _layout_config(common, self.layer, sizes.n_layer, rank=sizes.rank)

    def rotary_config(self, common, sizes):
        rope_dim = int(self.rope_dim_of(sizes.rope_dim, sizes.head_dim))
        if rope_dim % 2 or not 0 <= rope_dim <= sizes.head_dim:
            raise ValueError(f"rope_dim must be an even number of a head's {sizes.head_dim} dimensions, got {rope_dim}")
        return _layout_config({**common, "num_key_value_heads": 1}, self.rotary_layer, sizes.n_layer, "llama",
                              rank=sizes.rank, rope_pairs=rope_dim // 2)


class TPA(AttentionKind):
    """Tensor product attention: keys of rank ``rank`` (default 2, its paper's), values of rank ``value_rank``
    (default: the keys'), queries of rank ``query_rank`` (default ``TPA_QUERY_RANK``), RoPE on the key and query
    factors."""

    name = "tpa"
    rotary_layer = "rotary-tpa"
    takes = frozenset({"value_rank", "query_rank"})
    needs_rope = "rotates its key factors"

    def default_rank(self, n_embd, n_head):
        return 2

    def ranks(self, n_embd, n_head, rotary):
        # ranks R while the factors, R (n_head + head_dim) numbers per token, cache no more than the heads they make
        head_dim = n_embd // n_head
        return list(range(1, head_dim * n_head // (head_dim + n_head) + 1))

    def named_sizes(self, rank, value_rank, rope_dim, query_rank, head_dim, rotary):
        return {"v": rank if value_rank is None else value_rank,
                "q": TPA_QUERY_RANK if query_rank is None else query_rank}

    def rotary_config(self, common, sizes):
        query_rank = TPA_QUERY_RANK if sizes.query_rank is None else int(sizes.query_rank)
        value_rank = sizes.rank if sizes.value_rank is None else int(sizes.value_rank)
        if min(query_rank, value_rank) <= 0:
            raise ValueError(f"query_rank and value_rank must be positive, got {query_rank} and {value_rank}")
        return _layout_config(common, self.rotary_layer, sizes.n_layer, "llama", rank=sizes.rank,
                              value_rank=value_rank, query_rank=query_rank)


ATTENTION: dict[str, AttentionKind] = {each.name: each for each in (Concat(), Collab(), GQA(), MQA(), MLA(), TPA())}
KINDS = tuple(ATTENTION)


def kinds_taking(size: str, rotary: bool = True) -> str:
    """The kinds that take ``size`` (with learned positions too unless ``rotary``), as an error message names them:
    ``attention=collab or attention=tpa``."""
    return " or ".join(f"attention={kind.name}" for kind in ATTENTION.values()
                       if size in kind.takes and (rotary or kind.needs_rope is None))
