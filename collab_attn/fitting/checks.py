"""What every fit and measurement of a converted model checks first: that ``original`` is the model ``converted`` was
made from (``check_source``), the tokenized batches (``checked_batches``), and the ``seed`` and ``progress`` arguments
(``check_seed_and_progress``). ``fit_to_original``, ``fit_end_to_end``, ``layer_sensitivity`` and ``allocate_cache``
share them.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
from torch import nn

from collab_attn.fitting.calibration import MODEL_INPUTS
from collab_attn.identity import check_same_source
from collab_attn.kinds import ConvertedSelfAttention
from collab_attn.models.families import family_of, find_attention, is_collaborative
from collab_attn.models.hf import forward_inputs

# config fields that say nothing about what a model computes, or that a conversion sets
_IGNORED_CONFIG = ("model_type", "architectures", "transformers_version", "_name_or_path", "name_or_path", "dtype",
                   "torch_dtype", "output_attentions", "output_hidden_states", "return_dict", "use_cache",
                   "_commit_hash", "_attn_implementation_autoset", "_attn_implementation_internal")


def check_source(converted: nn.Module, original: nn.Module, trained: bool = False) -> list[str]:
    """The names of the converted layers, once ``original`` is shown to be the model ``converted`` was made from: the
    same family, layers and config, and the same weights outside the attention layers
    (``collab_attn.identity.check_same_source``; ``trained``: a converted model trained further, e.g. distilled,
    whose other weights moved a little)."""
    for name, model in (("converted", converted), ("original", original)):
        if not hasattr(model, "config"):
            raise ValueError(f"{name} must be a transformers model, got {type(model).__name__}")
    if is_collaborative(original.config):
        raise ValueError("original must be the model before the conversion (its concatenated heads); pass the "
                         "unconverted model, e.g. a copy made before reparametrize")
    layers = [n for n, m in converted.named_modules() if isinstance(m, ConvertedSelfAttention)]
    if not is_collaborative(converted.config) or not layers:
        raise ValueError("converted has no converted attention layers: pass a model converted by "
                         "collab_attn.reparametrize (and its original as original)")
    family = family_of(original.config)
    if family is not family_of(converted.config):
        raise ValueError(f"original is a {original.config.model_type} model but converted was made from a "
                         f"{converted.config.model_type.removeprefix('collab_attn_')} model: pass its own original")
    names = [name for name, _ in find_attention(original)[1]]
    if names != layers:
        raise ValueError(f"converted has {len(layers)} converted layers ({layers[:1]}...) but original has "
                         f"{len(names)} attention layers ({names[:1]}...): pass the model converted was made from")
    ours, theirs = (_structural(model.config) for model in (converted, original))
    differ = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differ:
        raise ValueError(f"converted's config differs from original's in {differ[:5]}: pass the model converted was "
                         "made from as original")
    check_same_source(converted, original, trained=trained)
    return layers


def _structural(config) -> dict:
    return {k: v for k, v in config.to_dict().items() if k not in _IGNORED_CONFIG and not k.startswith("collab_")}


def check_seed_and_progress(seed, progress) -> None:
    """The arguments every fit and measurement takes: an integer ``seed`` and a ``progress`` flag."""
    if type(seed) is not int:
        raise ValueError(f"seed must be an integer, got {seed!r}")
    if not isinstance(progress, bool):
        raise ValueError(f"progress must be True or False, got {progress!r}")


def _check_ids(batch: Mapping, vocabulary: int | None) -> None:
    """``input_ids`` a 2-D tensor of token ids the model has (an id past its vocabulary would fail deep in the
    embedding, or on a GPU as a device-side assert); an ``attention_mask`` of the same shape."""
    ids = batch["input_ids"]
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex():
        raise ValueError("each batch's input_ids must be a 2-D tensor of token ids (batch, tokens), got "
                         + (f"a {ids.dim()}-D {ids.dtype} tensor" if isinstance(ids, torch.Tensor)
                            else type(ids).__name__))
    if ids.numel() and (int(ids.min()) < 0 or (vocabulary is not None and int(ids.max()) >= vocabulary)):
        raise ValueError(f"input_ids hold token ids from {int(ids.min())} to {int(ids.max())}, outside the model's "
                         f"vocabulary of {vocabulary}: tokenize with the model's own tokenizer")
    mask = batch.get("attention_mask")
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != ids.shape):
        raise ValueError(f"each batch's attention_mask must be a tensor shaped like its input_ids {tuple(ids.shape)}, "
                         f"got {tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__}")


def checked_batches(model: nn.Module, batches: Iterable[Mapping[str, torch.Tensor]], device) -> list[dict]:
    """``batches`` checked (token ids the model has, masks shaped like them) and kept as the inputs ``model``'s
    forward takes, on ``device``; empty batches left out."""
    if batches is None or isinstance(batches, (Mapping, torch.Tensor, str)):
        raise ValueError("batches must be a list of tokenized batches (dicts with input_ids, attention_mask, ...), "
                         "as collect_calibration takes; got "
                         + ("None" if batches is None else f"one {type(batches).__name__}: pass [batch]"))
    try:
        vocabulary = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocabulary = None
    kept = []
    for batch in batches:
        if not isinstance(batch, Mapping) or "input_ids" not in batch:
            raise ValueError("each batch must be a dict with input_ids (and attention_mask, ...), as "
                             f"collect_calibration takes; got {type(batch).__name__}")
        _check_ids(batch, vocabulary)
        taken = forward_inputs(model, batch)  # what the model's forward names (no token_type_ids beside a Llama)
        inputs = {k: v.to(device) for k, v in taken.items() if k in MODEL_INPUTS and v is not None}
        if inputs["input_ids"].numel():
            kept.append(inputs)
    if not kept:
        raise ValueError("no fitting tokens: pass at least one non-empty batch (dicts with input_ids, "
                         "attention_mask, ...)")
    return kept
