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

``positions="rope"`` builds the same sizes as a Llama model instead (``rope_config``): rotary positions, as Llama
applies them (``rope_theta``), no position embedding, RMSNorm and a SwiGLU MLP of nanoGPT's MLP parameter count. Its
attention options:

- ``concat``: Llama's own attention (``key_size = n_embd`` only); ``gqa`` / ``mqa``: Llama's grouped heads;
- ``collab``: collaborative heads whose ``key_size / 2`` shared query/key pairs rotate each with one RoPE band
  (the ``rotary-collaborative`` layer kind), a value per head or one shared value of ``value_size``;
- ``mla``: DeepSeek-V2's latent attention with a decoupled rotary key of ``rope_dim`` dimensions shared by every
  head beside the latent of ``key_size`` (the ``rotary-mla`` layer kind with one key/value group);
- ``tpa``: tensor product attention, keys of rank ``key_size``, values of rank ``value_size`` (default: the keys'),
  queries of rank ``query_rank``, RoPE on the key and query factors (the ``rotary-tpa`` layer kind).

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

KINDS = ("concat", "collab", "gqa", "mqa", "mla", "tpa")
POSITIONS = ("learned", "rope")
ROPE_THETA = 10000.0  # Llama's rotary frequency base
TPA_QUERY_RANK = 6  # TPA's paper trains its models with query rank 6 (its "T6")
# A model built to train from scratch starts its mixing at random or at ones; "concatenate" (block mixing) is how a
# conversion starts, and is refused here.
MIXING_INITS = tuple(init for init in nn_attention.MIXING_INITS if init != "concatenate")
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "dropout")


def default_key_size(kind: str, n_embd: int, n_head: int) -> int:
    """``key_size`` when none is given: ``n_embd`` (multi-head width), the head size for ``mqa``, rank 2 for ``tpa``
    (its paper's keys and values)."""
    return {"mqa": n_embd // n_head, "tpa": 2}.get(kind, n_embd)


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
    positions: str = "learned",
    rope_theta: float = ROPE_THETA,
    rope_dim: int | None = None,
    query_rank: int | None = None,
) -> transformers.PreTrainedConfig:
    """The config of one variant; bad combinations raise ``ValueError``. ``value_size``: collaborative heads that
    share their values too, one value of that width per token (None: a value head per head); tensor product
    attention's value rank. ``positions``: ``"learned"`` (GPT-2) or ``"rope"`` (``rope_config``, which takes
    ``rope_theta``, ``rope_dim`` and ``query_rank``)."""
    if kind not in KINDS:
        raise ValueError(f"unknown attention {kind!r}; choose one of {KINDS}")
    if positions not in POSITIONS:
        raise ValueError(f"unknown positions {positions!r}; choose one of {POSITIONS}")
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
    key_size = default_key_size(kind, n_embd, n_head) if key_size is None else int(key_size)
    if not 0 < key_size <= n_embd:
        raise ValueError(f"key_size must be in 1..n_embd={n_embd}, got {key_size}")
    if positions == "rope":
        return rope_config(vocab_size, block_size, n_layer, n_head, n_embd, dropout, kind, key_size, mixing_init,
                           value_size, rope_theta, rope_dim, query_rank)
    for name, value in (("rope_dim", rope_dim), ("query_rank", query_rank)):
        if value is not None:
            raise ValueError(f"{name}={value} is a size of rotary models: it needs positions=rope")
    if rope_theta != ROPE_THETA:
        raise ValueError(f"rope_theta={rope_theta} needs positions=rope")
    if kind == "tpa":
        raise ValueError("attention=tpa rotates its key factors: it needs positions=rope")
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
        return _layout_config(common, Layout.uniform("concatenated", "concatenated", n_layer, rank=key_size))
    if kind in ("gqa", "mqa", "mla"):
        return _scratch_layout_config(common, kind, key_size, n_embd // n_head, n_head, n_layer)
    if mixing_init not in MIXING_INITS:
        raise ValueError(f"unknown mixing_init {mixing_init!r}; choose one of {MIXING_INITS}")
    layout = Layout.uniform("collaborative", "collaborative", n_layer, rank=key_size, mixing_init=mixing_init,
                            value_rank=None if value_size is None else int(value_size))
    return _layout_config(common, layout)


def _layout_config(common: dict, layout: Layout, family: str = "gpt2"):
    """A config of ``family`` whose attention layers are built from ``layout``."""
    return collab_config_class(family)(**common, **layout.config_fields())


def rope_config(vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float,
                kind: str, key_size: int, mixing_init: str, value_size: int | None, rope_theta: float,
                rope_dim: int | None, query_rank: int | None) -> transformers.LlamaConfig:
    """The Llama config of one variant with rotary positions (the module docstring lists them). The MLP's hidden
    width is ``8 n_embd / 3`` rounded up to a multiple of 8, so that SwiGLU's three matrices hold as many numbers
    as GPT-2's two of ``4 n_embd``. ``dropout``: Llama's attention dropout; ``build_model`` adds the same dropout
    on the embeddings and on each block's attention and MLP outputs, where GPT-2 has it."""
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"rotary positions pair a head's dimensions: n_embd / n_head = {head_dim} must be even")
    if not rope_theta > 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")
    if rope_dim is not None and kind != "mla":
        raise ValueError(f"rope_dim={rope_dim} is the decoupled rotary key of attention=mla, not of attention={kind}")
    if query_rank is not None and kind != "tpa":
        raise ValueError(f"query_rank={query_rank} is a size of attention=tpa, not of attention={kind}")
    if value_size is not None and kind not in ("collab", "tpa"):
        raise ValueError(f"value_size={value_size} needs attention=collab or attention=tpa")
    kv_heads = n_head
    if kind in ("gqa", "mqa"):
        _check_grouped(kind, key_size, head_dim, n_head)
        kv_heads = key_size // head_dim
    common = dict(
        vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=-(-8 * n_embd // 24) * 8,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=kv_heads,
        max_position_embeddings=block_size, rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        attention_dropout=dropout, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if kind == "concat" and key_size != n_embd:
        raise ValueError(f"positions=rope has concatenated heads at their full width only (key_size={n_embd}); "
                         "narrower query/key heads would drop rotary bands: use attention=collab")
    if kind in ("concat", "gqa", "mqa"):
        return transformers.LlamaConfig(**common)  # Llama's own attention
    if kind == "collab":
        if key_size % 2:
            raise ValueError(f"rotary collaborative heads share key_size / 2 query/key pairs: key_size must be even, "
                             f"got {key_size}")
        if mixing_init not in MIXING_INITS:
            raise ValueError(f"unknown mixing_init {mixing_init!r}; choose one of {MIXING_INITS}")
        if value_size is not None and not 0 < int(value_size) <= n_embd:
            raise ValueError(f"value_size must be in 1..n_embd={n_embd}, got {value_size}")
        layout = Layout.uniform("rotary-collaborative", "rotary-collaborative", n_layer, rank=key_size,
                                mixing_init=mixing_init, value_rank=None if value_size is None else int(value_size))
        return _layout_config(common, layout, "llama")
    if kind == "mla":
        rope_dim = head_dim // 2 if rope_dim is None else int(rope_dim)
        if rope_dim % 2 or not 0 <= rope_dim <= head_dim:
            raise ValueError(f"rope_dim must be an even number of a head's {head_dim} dimensions, got {rope_dim}")
        layout = Layout.uniform("rotary-mla", "rotary-mla", n_layer, rank=key_size, rope_pairs=rope_dim // 2)
        return _layout_config({**common, "num_key_value_heads": 1}, layout, "llama")  # one decoupled rotary key
    query_rank = TPA_QUERY_RANK if query_rank is None else int(query_rank)
    value_rank = key_size if value_size is None else int(value_size)
    if min(query_rank, value_rank) <= 0:
        raise ValueError(f"query_rank and value_size must be positive, got {query_rank} and {value_rank}")
    layout = Layout.uniform("rotary-tpa", "rotary-tpa", n_layer, rank=key_size, value_rank=value_rank,
                            query_rank=query_rank)
    return _layout_config(common, layout, "llama")


def _scratch_layout_config(common: dict, kind: str, key_size: int, head_dim: int, n_head: int, n_layer: int):
    """The config of the grouped-query (``gqa``, ``mqa``) or latent (``mla``) variant; ``key_size`` is its cache
    width per token and layer and kind (the keys' width for grouped heads, the latent's for latent attention)."""
    if kind in ("gqa", "mqa"):
        _check_grouped(kind, key_size, head_dim, n_head)
    layer = "mla" if kind == "mla" else "gqa"
    return _layout_config(common, Layout.uniform(layer, layer, n_layer, rank=key_size))


def _check_grouped(kind: str, key_size: int, head_dim: int, n_head: int) -> None:
    """A clear error for a key width that is not whole key/value heads dividing the query heads."""
    if kind == "mqa" and key_size != head_dim:
        raise ValueError(f"attention=mqa has one key/value head: key_size must be the head size {head_dim} (or null), "
                         f"got {key_size}")
    if kind == "gqa" and (key_size % head_dim or n_head % (key_size // head_dim)):
        raise ValueError(f"attention=gqa needs key_size = kv_heads x {head_dim} with kv_heads dividing n_head={n_head}"
                         f", got {key_size}")


def build_model(config: transformers.PreTrainedConfig, seed: int) -> transformers.PreTrainedModel:
    """A freshly initialized model for ``config`` (seeded), converted layers initialized as GPT-2's: the projections
    into the residual stream (attention output; a rotary model's MLP output too, which GPT-2 scales alike) with std
    ``0.02 / sqrt(2 n_layer)``, content biases at zero. A rotary model with dropout gets it where GPT-2 has it
    (``_residual_dropout``)."""
    transformers.set_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    std = config.initializer_range / math.sqrt(2 * config.num_hidden_layers)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, ConvertedSelfAttention):
                module.output.weight.normal_(0.0, std)
                content = getattr(module, "content_bias", None)
                if content is not None:
                    content.weight.zero_()
            elif name.endswith(("self_attn.o_proj", "mlp.down_proj")):
                module.weight.normal_(0.0, std)
    if "llama" in config.model_type:
        _residual_dropout(model, config.attention_dropout)
    return model


def _residual_dropout(model: transformers.PreTrainedModel, p: float) -> None:
    """GPT-2's ``embd_pdrop`` and ``resid_pdrop`` on a Llama model, which has attention dropout only: dropout of
    ``p`` on the token embeddings and on each block's attention and MLP outputs, while training (forward hooks, so
    the weights and their names stay Llama's)."""
    if not p:
        return

    def drop(module, inputs, output):
        if isinstance(output, tuple):
            return (torch.nn.functional.dropout(output[0], p, module.training), *output[1:])
        return torch.nn.functional.dropout(output, p, module.training)

    model.model.embed_tokens.register_forward_hook(drop)
    for block in model.model.layers:
        block.self_attn.register_forward_hook(drop)
        block.mlp.register_forward_hook(drop)


def key_size_of(model) -> int:
    """The query/key width of the model's first attention layer."""
    ranks = getattr(model.config, "collab_ranks", None)
    return int(ranks[0]) if ranks else model.config.hidden_size


def parameter_counts(model) -> dict[str, int]:
    """All parameters (tied embeddings once), those of attention, and those forming the attention scores."""
    return {"total": sum(p.numel() for p in model.parameters()), **attention_parameters(model)}


def cache_bytes(model, dtype_bytes: int = 2) -> int:
    """Key/value cache bytes per token over all layers, as the library's cache stores them: plain GPT-2 caches
    ``2 x n_embd`` numbers per layer; a converted layer what it hands its cache per token
    (``collab_attn.nn.variants.cache_numbers_per_token``: its key of width ``key_size`` plus one content-bias logit
    per head and the values of its heads, or one shared value; grouped-query keys and values; a latent; ...)."""
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    config = model.config
    if layers:
        return sum(cache_numbers_per_token(layer) for layer in layers) * dtype_bytes
    if config.model_type == "gpt2":
        return config.n_layer * 2 * config.n_embd * dtype_bytes
    head_dim = config.hidden_size // config.num_attention_heads  # Llama: keys and values of its key/value heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype_bytes
