"""Attention maps of a model on one sentence (or sentence pair) and BertViz pages comparing two models.

- ``load_for_viewing``: a checkpoint of a supported family with eager attention (the only implementation that
  returns attention maps for the original modules): encoders, optionally as a causal decoder (``is_decoder=True``),
  and the decoders GPT-2 and OPT, whose maps are causal (BertViz draws them as it draws GPT-2's own).
- ``collaborative_copy``: a copy of such a model converted as ``MethodSettings`` say (the original is left alone).
- ``attention_maps``: run a (possibly padded) batch with ``output_attentions=True`` and return, per sequence,
  its tokens and the per-layer attention maps with padded positions sliced off.
- ``comparison_page``: one HTML page with the BertViz head view or model view of several models side by side.
  The page is written offline; BertViz's JavaScript loads require.js, d3 and jQuery from cdnjs when it is opened.
"""

from __future__ import annotations

import copy
import html
import re
from dataclasses import dataclass

import torch
from transformers import AutoModel

from collab_attn.models.checkpoints import load_model_and_tokenizer, resolve_model
from collab_attn.models.conversion import ReparamReport, reparametrize
from collab_attn.models.hf import family_of, is_collaborative
from collab_attn.models.settings import MethodSettings

CAUSAL_FAMILIES = ("bert", "roberta")
_REQUIRE_JS = re.compile(r'<script src="[^"]*require[^"]*"></script>')


@dataclass
class AttentionMaps:
    """One sequence: its tokens, where sentence B starts (None for one sentence), and one (heads, n, n) map per
    layer, where ``n = len(tokens)`` and rows are queries."""

    tokens: list[str]
    sentence_b_start: int | None
    layers: list[torch.Tensor]


def load_for_viewing(name_or_path: str = "minilm", causal: bool | None = None):
    """``(model, tokenizer)`` in eval mode with eager attention. ``causal``: None runs the model as it is (GPT-2 and
    OPT causal, encoders bidirectional); True runs BERT or RoBERTa as a decoder (``is_decoder=True``); False refuses
    a decoder family, which has no bidirectional form."""
    model, tokenizer = load_model_and_tokenizer(name_or_path, AutoModel)
    if is_collaborative(model.config):
        raise ValueError(f"{name_or_path} is already collaborative; view the original checkpoint instead")
    check_causal(model.config, causal)
    if causal and not family_of(model.config).decoder:
        model = AutoModel.from_pretrained(resolve_model(name_or_path), is_decoder=True, attn_implementation="eager")
    else:
        model.set_attn_implementation("eager")
    return model.eval(), tokenizer


def check_causal(config, causal: bool | None) -> None:
    """Refuse a ``causal`` setting the model's family cannot run: False for a decoder (GPT-2, OPT: always causal),
    True for an encoder that has no decoder form (DistilBERT, ALBERT)."""
    family = family_of(config)
    if family.decoder and causal is False:
        raise ValueError(f"causal=false: {family.model_type} is a decoder and always causal; leave causal unset")
    if causal and not family.decoder and family.model_type not in CAUSAL_FAMILIES:
        raise ValueError(f"causal=true needs a model that can run as a decoder ({', '.join(CAUSAL_FAMILIES)}, or "
                         f"a decoder family: gpt2, opt), not {family.model_type}")


def is_causal(model) -> bool:
    """Whether ``model`` attends only to the past: a decoder family, or BERT/RoBERTa built with is_decoder."""
    return family_of(model.config).decoder or bool(getattr(model.config, "is_decoder", False))


def collaborative_copy(
    model, method: MethodSettings, seed: int = 0, *, calibration=None, progress: bool = True
) -> tuple[object, ReparamReport]:
    """A deep copy of ``model`` converted as ``method`` says (``reparametrize(copy, seed=seed, calibration=...,
    **method.reparametrize_kwargs())``), and the report. ``calibration``: input statistics of ``model`` for
    activation-aware fitting (``collab_attn.glue.calibrate.calibrate``), or None."""
    converted = copy.deepcopy(model)
    report = reparametrize(
        converted, seed=seed, calibration=calibration, progress=progress, **method.reparametrize_kwargs()
    )
    return converted.eval(), report


def encode(tokenizer, sentence: str, sentence_pair: str | None = None):
    """One sequence (no padding), truncated to the model's maximum length."""
    if not isinstance(sentence, str) or not sentence.strip():
        raise ValueError("sentence must be a non-empty string")
    if sentence_pair is not None and (not isinstance(sentence_pair, str) or not sentence_pair.strip()):
        raise ValueError("sentence_pair must be a non-empty string or null")
    return tokenizer(sentence, sentence_pair, truncation=True, return_tensors="pt")


def _sentence_b_start(batch, index: int, kept: torch.Tensor) -> int | None:
    if not getattr(batch, "encodings", None):
        return None
    sequence_ids = batch.sequence_ids(index)
    starts = [i for i, position in enumerate(kept.tolist()) if sequence_ids[position] == 1]
    return starts[0] if starts else None


@torch.no_grad()
def attention_maps(model, tokenizer, batch) -> list[AttentionMaps]:
    """Per-sequence attention maps of ``batch`` (a tokenizer output, possibly padded), padded positions removed."""
    model.eval()
    kwargs = {"use_cache": False} if is_causal(model) else {}
    attentions = model(**batch, output_attentions=True, **kwargs).attentions
    if not attentions or any(a is None for a in attentions):
        raise RuntimeError("the model returned no attention maps; load it with attn_implementation='eager'")
    mask = batch.get("attention_mask")
    result = []
    for index, ids in enumerate(batch["input_ids"]):
        kept = torch.arange(len(ids)) if mask is None else mask[index].bool().nonzero().squeeze(1)
        layers = [layer[index][:, kept][:, :, kept].float().cpu() for layer in attentions]
        tokens = tokenizer.convert_ids_to_tokens(ids[kept].tolist())
        result.append(AttentionMaps(tokens, _sentence_b_start(batch, index, kept), layers))
    return result


def sentence_attention(model, tokenizer, sentence: str, sentence_pair: str | None = None) -> AttentionMaps:
    """Attention maps of ``model`` on one sentence or sentence pair."""
    return attention_maps(model, tokenizer, encode(tokenizer, sentence, sentence_pair))[0]


def bertviz_html(maps: AttentionMaps, view: str = "head", decimals: int = 4) -> str:
    """The HTML of BertViz's ``head_view`` or ``model_view`` of ``maps`` (light mode for the model view), with the
    weights rounded to ``decimals`` places to keep the page small."""
    from bertviz import head_view, model_view

    attention = [layer.double().round(decimals=decimals)[None] for layer in maps.layers]
    if view == "head":
        shown = head_view(attention, maps.tokens, maps.sentence_b_start, html_action="return")
    elif view == "model":
        shown = model_view(attention, maps.tokens, maps.sentence_b_start, display_mode="light", html_action="return")
    else:
        raise ValueError(f"unknown view {view!r}; choose 'head' or 'model'")
    return shown.data


def comparison_page(
    panels: list[tuple[str, AttentionMaps]], view: str = "head", title: str = "", intro: str = ""
) -> str:
    """A standalone HTML page with the BertViz ``view`` of each ``(name, maps)`` side by side (same tokens)."""
    if len({tuple(maps.tokens) for _, maps in panels}) > 1:
        raise ValueError("the panels of one page must show the same tokens")
    bodies = [bertviz_html(maps, view) for _, maps in panels]
    require = _REQUIRE_JS.search(bodies[0])
    columns = "\n".join(
        f'<div class="panel"><h2>{html.escape(name)}</h2>\n{_REQUIRE_JS.sub("", body)}\n</div>'
        for (name, _), body in zip(panels, bodies)
    )
    return f"""<!DOCTYPE html>
<html>
<head>
<meta charset="utf-8">
<title>{html.escape(title)}</title>
{require.group(0) if require else ""}
<style>
body {{ font-family: 'Helvetica Neue', Helvetica, Arial, sans-serif; margin: 1.5em; }}
.panels {{ display: flex; flex-wrap: wrap; gap: 3em; align-items: flex-start; }}
.panel h2 {{ font-size: 1.1em; margin-bottom: 0.3em; }}
</style>
</head>
<body>
<h1>{html.escape(title)}</h1>
<p>{html.escape(intro)}</p>
<div class="panels">
{columns}
</div>
</body>
</html>
"""
