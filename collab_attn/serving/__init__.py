"""Serve what you convert: a converted rotary model written as the standard checkpoint of its family, which
transformers, llama.cpp and vLLM run with no code of collab-attn.

``export(model, out_dir, format="transformers" | "gguf", tokenizer=...)``:

- ``"transformers"``: a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or ``MistralForCausalLM`` folder (safetensors,
  config with the rope in both the 5.x ``rope_parameters`` and the older ``rope_theta``/``rope_scaling`` fields, the
  tokenizer with its chat template, the generation config) and ``export.json`` (the source, the method, the bands,
  the frequency error, the logit check);
- ``"gguf"``: one llama.cpp file (``collab_attn.serving.gguf_file``).

Only a form that is exactly a standard layer is written (``collab_attn.serving.standard``), on a Llama, Qwen2 or
Mistral model: ``key-svd``, ``cp`` or ``tucker`` with ``value_rank == rank``, one rank and one band split for all
layers (``reparametrize(..., bands="shared")``); or ``merge-kv`` or ``drop-kv`` with one rank for all layers.
Everything else is refused before anything is written, with the reason.
The output folder (or file) is written under a temporary name and renamed once whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from collab_attn.files import atomic_directory, replacing
from collab_attn.serving.checkpoint import Exported, exportable, standard_model

FORMATS = ("transformers", "gguf")

__all__ = ["FORMATS", "Exported", "export", "exportable", "standard_model"]


def _record(model, exported: Exported) -> dict:
    config = model.config
    return {
        "source": getattr(config, "_name_or_path", None) or None,
        "method": getattr(config, "collab_method", None),
        "layer": getattr(config, "collab_layer", None),
        "family": exported.family,
        "architecture": type(exported.model).__name__,
        "head_dim": exported.head_dim,
        "num_key_value_heads": exported.kv_heads,
        "bands": exported.bands,
        "rope_factors": exported.rope.factors,
        "frequency_error": exported.rope.frequency_error,
        "inexact_frequencies": exported.rope.inexact_pairs,
        "logit_error": exported.logit_error,
        "converted_float32_error": exported.converted_float32_error,
        "output_bias": exported.output_bias,
    }


def _tokenizer(tokenizer):
    if tokenizer is None or hasattr(tokenizer, "save_pretrained"):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer)
    raise ValueError(f"tokenizer must be a transformers tokenizer, a folder holding one, or None; got "
                     f"{type(tokenizer).__name__}")


def _check_target(out: Path, format: str, overwrite: bool) -> None:
    if format == "transformers" and out.is_file():
        raise ValueError(f"{out} is a file; format='transformers' writes a folder: give a folder's path")
    if format == "transformers" and out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ValueError(f"{out} is a folder that is not empty; give a new folder or pass overwrite=True")
    if format == "gguf":
        if out.is_dir():
            raise ValueError(f"{out} is a folder; format='gguf' writes one file: give a file's path, e.g. "
                             f"{out / 'model.gguf'}")
        if out.suffix != ".gguf":
            raise ValueError(f"{out}: a GGUF file's name ends in .gguf")
        if out.exists() and not overwrite:
            raise ValueError(f"{out} exists; pass overwrite=True to replace it")
        if not out.parent.is_dir():
            raise ValueError(f"{out.parent} is not a folder to write {out.name} into")


def export(model, out_dir: str | os.PathLike, format: str = "transformers", tokenizer=None, *,
           balance: bool = True, overwrite: bool = False, vocabulary: str | os.PathLike | None = None) -> Path:
    """Write the converted causal LM ``model`` as the standard checkpoint of its family (module doc); returns the
    path written. ``tokenizer``: saved beside the weights (a tokenizer or its folder; None: none). ``balance``:
    the free scales chosen for half-precision caches (``collab_attn.serving.standard.balance_scales``).
    ``overwrite``: replace an existing output. ``vocabulary`` (gguf): a GGUF file of the source model whose
    tokenizer the file takes (``collab_attn.serving.gguf_file``)."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}: choose one of {', '.join(FORMATS)}")
    if vocabulary is not None and format != "gguf":
        raise ValueError("vocabulary= names the GGUF file whose tokenizer a GGUF export takes; format='transformers' "
                         "saves tokenizer= instead")
    out = Path(out_dir).expanduser().absolute()
    _check_target(out, format, overwrite)
    family, _ = exportable(model)  # the reasons to refuse, before any work
    tokenizer = _tokenizer(tokenizer)
    if format == "gguf":
        from collab_attn.serving.gguf_file import check_architecture, check_vocabulary, write_gguf

        check_architecture(family, model.config)
        check_vocabulary(vocabulary)
        exported = standard_model(model, balance=balance)
        with replacing(out) as tmp:
            write_gguf(exported, tmp, vocabulary)
        return out
    exported = standard_model(model, balance=balance)
    with atomic_directory(out, overwrite=overwrite) as tmp:
        exported.model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
            _name_the_tokenizer_for_older_transformers(tmp / "tokenizer_config.json")
        _add_legacy_rope_fields(tmp / "config.json", exported)
        (tmp / "export.json").write_text(json.dumps(_record(model, exported), indent=2) + "\n")
    return out


def _name_the_tokenizer_for_older_transformers(path: Path) -> None:
    """Transformers 5 names a plain ``tokenizer.json`` tokenizer ``TokenizersBackend``, a class transformers 4 does not
    have; ``PreTrainedTokenizerFast`` is the same tokenizer in both."""
    if not path.is_file():
        return
    config = json.loads(path.read_text())
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(config, indent=2) + "\n")


def _add_legacy_rope_fields(path: Path, exported: Exported) -> None:
    """Transformers before 5 (and vLLM) read the rope from ``rope_theta`` and ``rope_scaling``: write both forms."""
    config = json.loads(path.read_text())
    config |= exported.rope.legacy_fields(config["max_position_embeddings"])
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
