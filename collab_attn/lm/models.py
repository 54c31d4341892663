"""The GPT-2-architecture character models: nanoGPT's GPT as a ``GPT2LMHeadModel`` config (tied embeddings, GELU,
dropout on embeddings, attention and residuals), and the same architecture with a smaller query/key size.

``kind`` and ``key_size`` (the query/key width of a layer, D_k for concatenated heads, D~ for collaborative ones):

- ``concat`` at ``key_size = n_embd``: the plain ``GPT2LMHeadModel`` (nanoGPT's model);
- ``concat`` below it: concatenated heads of query/key head size ``key_size / n_head`` (values keep ``n_embd /
  n_head``), the library's ``concatenated`` layer kind built from a config;
- ``collab``: collaborative heads with shared query/key projections of width ``key_size`` and one mixing vector per
  head, started ``random`` (N(0, 1)) or at ``ones`` (the ``collaborative`` layer kind).
- ``gqa``: grouped-query heads, ``key_size / (n_embd / n_head)`` key/value heads (the key width; ``n_embd`` is
  multi-head attention); ``mqa``: one key/value head (``key_size`` is the head size, or null);
- ``mla``: latent attention without rotary positions, one latent of width ``key_size`` cached per token.

Both converted layouts keep GPT-2's logit scale ``1 / sqrt(n_embd / n_head)`` and replace the query/key biases by a
per-head content bias (the key bias never changes a softmax row). GPT-2 initializes its attention output projection
with std ``0.02 / sqrt(2 n_layer)`` and its biases at zero; ``build_model`` does the same for the converted layers
so that every variant starts alike.
"""

from __future__ import annotations

import math

import torch
import transformers

from collab_attn.models.hf import Layout, attention_parameters, collab_config_class
from collab_attn.models.layers import ConvertedSelfAttention
from collab_attn.nn import attention as nn_attention
from collab_attn.nn.variants import cache_numbers_per_token

KINDS = ("concat", "collab", "gqa", "mqa", "mla")
# A model built to train from scratch starts its mixing at random or at ones; "concatenate" (block mixing) is how a
# conversion starts, and is refused here.
MIXING_INITS = tuple(init for init in nn_attention.MIXING_INITS if init != "concatenate")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "dropout")


def default_key_size(kind: str, n_embd: int, n_head: int) -> int:
    """``key_size`` when none is given: ``n_embd`` (multi-head width), the head size for ``mqa``."""
    return n_embd // n_head if kind == "mqa" else n_embd


def gpt_config(
    vocab_size: int,
    block_size: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    dropout: float = 0.0,
    kind: str = "concat",
    key_size: int | None = None,
    mixing_init: str = "random",
    value_size: int | None = None,
) -> transformers.GPT2Config:
    """The config of one variant; bad combinations raise ``ValueError``. ``value_size``: collaborative heads that
    share their values too, one value of that width per token (None: a value head per head)."""
    if kind not in KINDS:
        raise ValueError(f"unknown attention {kind!r}; choose one of {KINDS}")
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
    key_size = default_key_size(kind, n_embd, n_head) if key_size is None else int(key_size)
    if not 0 < key_size <= n_embd:
        raise ValueError(f"key_size must be in 1..n_embd={n_embd}, got {key_size}")
    common = dict(
        vocab_size=vocab_size, n_positions=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, activation_function="gelu",
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if value_size is not None and (kind != "collab" or not 0 < int(value_size) <= n_embd):
        raise ValueError(f"value_size={value_size} needs attention=collab and a width in 1..n_embd={n_embd}")
    if kind == "concat" and key_size == n_embd:
        return transformers.GPT2Config(**common)
    if kind == "concat":
        if key_size % n_head:
            raise ValueError(f"concatenated heads need key_size a multiple of n_head={n_head}, got {key_size}")
        return _layout_config(common, Layout("concatenated", "concatenated", [key_size] * n_layer))
    if kind in ("gqa", "mqa", "mla"):
        return _scratch_layout_config(common, kind, key_size, n_embd // n_head, n_head, n_layer)
    if mixing_init not in MIXING_INITS:
        raise ValueError(f"unknown mixing_init {mixing_init!r}; choose one of {MIXING_INITS}")
    values = None if value_size is None else [int(value_size)] * n_layer
    layout = Layout("collaborative", "collaborative", [key_size] * n_layer, mixing_init=mixing_init, value_ranks=values)
    return _layout_config(common, layout)


def _layout_config(common: dict, layout: Layout):
    """A GPT-2 config whose attention layers are built from ``layout``."""
    return collab_config_class("gpt2")(**common, **layout.config_fields())


def _scratch_layout_config(common: dict, kind: str, key_size: int, head_dim: int, n_head: int, n_layer: int):
    """The config of the grouped-query (``gqa``, ``mqa``) or latent (``mla``) variant; ``key_size`` is its cache
    width per token and layer and kind (the keys' width for grouped heads, the latent's for latent attention)."""
    if kind == "mqa" and key_size != head_dim:
        raise ValueError(f"attention=mqa has one key/value head: key_size must be the head size {head_dim} (or null), "
                         f"got {key_size}")
    if kind == "gqa" and (key_size % head_dim or n_head % (key_size // head_dim)):
        raise ValueError(f"attention=gqa needs key_size = kv_heads x {head_dim} with kv_heads dividing n_head={n_head}"
                         f", got {key_size}")
    layer = "mla" if kind == "mla" else "gqa"
    return _layout_config(common, Layout(layer, layer, [key_size] * n_layer))


def build_model(config: transformers.GPT2Config, seed: int) -> transformers.PreTrainedModel:
    """A freshly initialized model for ``config`` (seeded), converted layers initialized as GPT-2's."""
    transformers.set_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    std = config.initializer_range / math.sqrt(2 * config.n_layer)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, ConvertedSelfAttention):
                module.output.weight.normal_(0.0, std)
                content = getattr(module, "content_bias", None)
                if content is not None:
                    content.weight.zero_()
    return model


def key_size_of(model) -> int:
    """The query/key width of the model's first attention layer."""
    ranks = getattr(model.config, "collab_ranks", None)
    return int(ranks[0]) if ranks else model.config.n_embd


def parameter_counts(model) -> dict[str, int]:
    """All parameters (tied embeddings once), those of attention, and those forming the attention scores."""
    return {"total": sum(p.numel() for p in model.parameters()), **attention_parameters(model)}


def cache_bytes(model, dtype_bytes: int = 2) -> int:
    """Key/value cache bytes per token over all layers, as the library's cache stores them: plain GPT-2 caches
    ``2 x n_embd`` numbers per layer; a converted layer what it hands its cache per token
    (``collab_attn.nn.variants.cache_numbers_per_token``: its key of width ``key_size`` plus one content-bias logit
    per head and the values of its heads, or one shared value; grouped-query keys and values; a latent; ...)."""
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    if not layers:
        return model.config.n_layer * 2 * model.config.n_embd * dtype_bytes
    return sum(cache_numbers_per_token(layer) for layer in layers) * dtype_bytes
