"""The GPT-2-architecture character models: nanoGPT's GPT as a ``GPT2LMHeadModel`` config (tied embeddings, GELU,
dropout on embeddings, attention and residuals), and the same architecture with a smaller query/key size.

``kind``: the attention of every layer, ``rank`` its query/key width (or the width that sets its cache); each
kind, what it takes and how it is built: ``collab_attn.char_lm.kinds``.

``positions="rope"`` builds the same sizes as a Llama model instead (``rope_config``): rotary positions, as Llama
applies them (``rope_theta``), no position embedding, RMSNorm and a SwiGLU MLP of nanoGPT's MLP parameter count.

GPT-2 initializes its attention output projection with std ``0.02 / sqrt(2 n_layer)`` and its biases at zero;
``build_model`` does the same for the converted layers so that every variant starts alike.
"""

from __future__ import annotations

import math

import torch
import transformers

from collab_attn.char_lm.kinds import ATTENTION, KINDS, Sizes, kinds_taking
from collab_attn.deprecation import renamed_keyword
from collab_attn.kinds import ConvertedSelfAttention
from collab_attn.models.hf import attention_parameters
from collab_attn.nn.attention import cache_numbers_per_token

POSITIONS = ("learned", "rope")
ROPE_THETA = 10000.0  # Llama's rotary frequency base
MODEL_KEYS = ("n_layer", "n_head", "n_embd", "dropout")


def gpt_config(
    vocab_size: int,
    block_size: int,
    n_layer: int,
    n_head: int,
    n_embd: int,
    dropout: float = 0.0,
    kind: str = "concat",
    rank: int | None = None,
    mixing_init: str = "random",
    value_rank: int | None = None,
    positions: str = "learned",
    rope_theta: float = ROPE_THETA,
    rope_dim: int | None = None,
    query_rank: int | None = None,
    *,
    value_size: int | None = None,
) -> transformers.PreTrainedConfig:
    """The config of one variant; bad combinations raise ``ValueError``. ``value_rank``: collaborative heads that
    share their values too, one value of that width per token (None: a value head per head); tensor product
    attention's value rank. ``positions``: ``"learned"`` (GPT-2) or ``"rope"`` (``rope_config``, which takes
    ``rope_theta``, ``rope_dim`` and ``query_rank``). ``value_size``: the deprecated name of ``value_rank``
    (``collab_attn.deprecation``)."""
    value_rank = renamed_keyword("value_size", "value_rank", value_size, value_rank, "gpt_config")
    if kind not in KINDS:
        raise ValueError(f"unknown attention {kind!r}; choose one of {KINDS}")
    if positions not in POSITIONS:
        raise ValueError(f"unknown positions {positions!r}; choose one of {POSITIONS}")
    if n_embd % n_head:
        raise ValueError(f"n_embd={n_embd} is not a multiple of n_head={n_head}")
    attention = ATTENTION[kind]
    rank = attention.default_rank(n_embd, n_head) if rank is None else int(rank)
    if not 0 < rank <= n_embd:
        raise ValueError(f"rank must be in 1..n_embd={n_embd}, got {rank}")
    if positions == "rope":
        return rope_config(vocab_size, block_size, n_layer, n_head, n_embd, dropout, kind, rank, mixing_init,
                           value_rank, rope_theta, rope_dim, query_rank)
    for name, value in (("rope_dim", rope_dim), ("query_rank", query_rank)):
        if value is not None:
            raise ValueError(f"{name}={value} is a size of rotary models: it needs positions=rope")
    if rope_theta != ROPE_THETA:
        raise ValueError(f"rope_theta={rope_theta} needs positions=rope")
    if attention.needs_rope:
        raise ValueError(f"attention={kind} {attention.needs_rope}: it needs positions=rope")
    common = dict(
        vocab_size=vocab_size, n_positions=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd,
        resid_pdrop=dropout, embd_pdrop=dropout, attn_pdrop=dropout, activation_function="gelu",
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    if value_rank is not None and ("value_rank" not in attention.takes or not 0 < int(value_rank) <= n_embd):
        raise ValueError(f"value_rank={value_rank} needs {kinds_taking('value_rank', rotary=False)} and a width in "
                         f"1..n_embd={n_embd}")
    return attention.learned_config(common, Sizes(n_layer, n_head, n_embd, rank, mixing_init, value_rank,
                                                  rope_dim, query_rank))


def rope_config(vocab_size: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float,
                kind: str, rank: int, mixing_init: str, value_rank: int | None, rope_theta: float,
                rope_dim: int | None, query_rank: int | None) -> transformers.LlamaConfig:
    """The Llama config of one variant with rotary positions (``kinds`` describes each). The MLP's hidden
    width is ``8 n_embd / 3`` rounded up to a multiple of 8, so that SwiGLU's three matrices hold as many numbers
    as GPT-2's two of ``4 n_embd``. ``dropout``: Llama's attention dropout; ``build_model`` adds the same dropout
    on the embeddings and on each block's attention and MLP outputs, where GPT-2 has it."""
    head_dim = n_embd // n_head
    if head_dim % 2:
        raise ValueError(f"rotary positions pair a head's dimensions: n_embd / n_head = {head_dim} must be even")
    if not rope_theta > 0:
        raise ValueError(f"rope_theta must be positive, got {rope_theta}")
    attention = ATTENTION[kind]
    if rope_dim is not None and "rope_dim" not in attention.takes:
        raise ValueError(f"rope_dim={rope_dim} is the decoupled rotary key of {kinds_taking('rope_dim')}, not of "
                         f"attention={kind}")
    if query_rank is not None and "query_rank" not in attention.takes:
        raise ValueError(f"query_rank={query_rank} is a size of {kinds_taking('query_rank')}, not of attention={kind}")
    if value_rank is not None and "value_rank" not in attention.takes:
        raise ValueError(f"value_rank={value_rank} needs {kinds_taking('value_rank')}")
    common = dict(
        vocab_size=vocab_size, hidden_size=n_embd, intermediate_size=-(-8 * n_embd // 24) * 8,
        num_hidden_layers=n_layer, num_attention_heads=n_head, num_key_value_heads=n_head,
        max_position_embeddings=block_size, rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta)},
        attention_dropout=dropout, hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    return attention.rotary_config(common, Sizes(n_layer, n_head, n_embd, rank, mixing_init, value_rank,
                                                 rope_dim, query_rank))


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
    (``collab_attn.nn.cache_numbers_per_token``: its key of width ``rank`` plus one content-bias logit
    per head and the values of its heads, or one shared value; grouped-query keys and values; a latent; ...)."""
    layers = [m for m in model.modules() if isinstance(m, ConvertedSelfAttention)]
    config = model.config
    if layers:
        return sum(cache_numbers_per_token(layer) for layer in layers) * dtype_bytes
    if config.model_type == "gpt2":
        return config.n_layer * 2 * config.n_embd * dtype_bytes
    head_dim = config.hidden_size // config.num_attention_heads  # Llama: keys and values of its key/value heads
    return config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * dtype_bytes
