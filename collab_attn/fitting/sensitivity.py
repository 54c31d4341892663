"""Where a converted model's distance from the original sits, layer by layer (docs/design.md, "Fitting converted
layers to what the original computes").

``layer_sensitivity(converted, original, batches)`` measures the loss ``fit_end_to_end`` trains on (the KL of the
next-token distributions, or the relative squared error of the last hidden states of a model without logits) of
``converted`` against ``original`` on ``batches``, and per converted attention layer two more:

- ``restored``: the converted model with that one layer's original attention put back: the loss left if that layer
  were exact (``loss - restored``: what the layer's error costs in the converted model);
- ``alone``: the original model with only that layer converted: what the layer's error costs by itself.

Where the layers' costs add up, ``loss - restored`` and ``alone`` agree and the ``alone`` column sums to ``loss``;
where they do not, the layers' errors compound (or cancel). The attention modules are swapped between the two models
(with the output projection beside them in BERT and RoBERTa), never copied, and put back afterwards. The original's
outputs on ``batches`` are held for all the measurements (4 bytes per token and vocabulary entry: a few thousand
tokens of a 49,152-entry vocabulary take 0.8 GB).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from collab_attn.fitting.checks import check_seed_and_progress, check_source, checked_batches
from collab_attn.fitting.end_to_end import divergence, model_output, token_mask
from collab_attn.models.families import family_of


@dataclass
class LayerSensitivity:
    name: str
    restored: float  # the converted model's loss with this layer's original attention put back
    alone: float  # the original's loss with only this layer converted


@dataclass
class Sensitivity:
    loss: float  # the converted model's loss against the original
    kind: str  # "kl" (nats per token) or "relative squared error" (of the last hidden states)
    tokens: int  # non-padding tokens measured on
    layers: list[LayerSensitivity] = field(default_factory=list)
    seconds: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        """A per-layer Markdown table: the loss with the layer restored, what that sheds, the loss of the layer
        alone; then the sums beside the converted model's loss."""
        rows = [f"| layer | loss with it restored | shed (of {self.loss:.4f}) | loss with it alone |",
                "|---|---:|---:|---:|"]
        for layer in self.layers:
            rows.append(f"| {layer.name} | {layer.restored:.4f} | {self.loss - layer.restored:.4f} | "
                        f"{layer.alone:.4f} |")
        shed = sum(self.loss - layer.restored for layer in self.layers)
        rows.append(f"| sum ({self.tokens:,} tokens, {self.kind}) | | {shed:.4f} | "
                    f"{sum(layer.alone for layer in self.layers):.4f} |")
        return "\n".join(rows)


def layer_sensitivity(
    converted: nn.Module,
    original: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    progress: bool = True,
) -> Sensitivity:
    """Measure how much each converted attention layer of ``converted`` adds to its loss against ``original`` (see
    the module doc). ``batches``: tokenized batches as ``fit_to_original`` takes them (the measured tokens; held-out
    text says what the model will do, fitting text what the fit saw). Both models run in eval mode and are left as
    they were, with their own modules. ``converted`` may have been trained beyond its attention layers (distilled):
    its other weights must still be near ``original``'s (``collab_attn.identity.check_same_source``)."""
    check_seed_and_progress(0, progress)
    names = check_source(converted, original, trained=True)
    device = next(converted.parameters()).device
    batches = checked_batches(original, batches, device)
    family = family_of(original.config)
    swapped = [[name] if family.output is not None else [name, family.output_projection_name(name)] for name in names]
    modes = [(m, m.training) for m in (converted, original)]
    start = time.perf_counter()
    converted.eval()
    original.eval()
    try:
        with torch.no_grad():
            references = [model_output(original, batch) for batch in batches]
            what = references[0][0]
            report = Sensitivity(_loss(converted, batches, references), "kl" if what == "logits" else
                                 "relative squared error", int(sum(token_mask(b).sum() for b in batches)))
            for name, paths in tqdm(list(zip(names, swapped)), desc="layer sensitivity", disable=not progress):
                with _swapped(converted, original, paths):
                    restored = _loss(converted, batches, references)
                with _swapped(original, converted, paths):
                    alone = _loss(original, batches, references)
                report.layers.append(LayerSensitivity(name, restored, alone))
    finally:
        for model, mode in modes:
            model.train(mode)
    report.seconds = time.perf_counter() - start
    return report


def _loss(model: nn.Module, batches: list[dict], references: list[tuple[str, torch.Tensor]]) -> float:
    """``model``'s loss against the held reference outputs, weighted by each batch's non-padding tokens."""
    total = weight = 0.0
    for batch, (what, reference) in zip(batches, references):
        tokens = float(token_mask(batch).sum())
        total += tokens * float(divergence(what, reference, model_output(model, batch)[1], token_mask(batch)))
        weight += tokens
    return total / weight


@contextmanager
def _swapped(model: nn.Module, source: nn.Module, paths: list[str]):
    """``model`` with the modules at ``paths`` taken from ``source`` for the duration."""
    own = [model.get_submodule(path) for path in paths]
    try:
        for path in paths:
            model.set_submodule(path, source.get_submodule(path))
        yield
    finally:
        for path, module in zip(paths, own):
            model.set_submodule(path, module)
