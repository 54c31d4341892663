"""Re-fine-tuning with knowledge distillation from the uncompressed model (``refit=distill``), as compression work on
BERT does (DynaBERT, CoFi, TinyBERT). The student is the converted model, the teacher the model it was converted
from, in eval mode with no gradient, run on each batch beside the student (its logits are never stored).

Per batch, with student logits ``s``, teacher logits ``t``, labels ``y`` and temperature ``T``::

    loss = alpha * CE(s, y) + (1 - alpha) * T^2 * KL(softmax(t / T) || softmax(s / T))     (classification)
    loss = alpha * MSE(s, y) + (1 - alpha) * MSE(s, t)                                     (regression: STS-B)
         + hidden_weight * mean over layers of MSE(student hidden state, teacher hidden state)
         + attention_weight * mean over layers and heads of KL(teacher attention row || student attention row)

A language model's logits (batch, tokens, vocabulary) count every position as one example (next-token targets
in ``labels``). The KL term is Hinton et al.'s: the divergence of the student's softened distribution from the
teacher's (its gradient is that of the cross-entropy against the teacher's soft targets), scaled by ``T^2`` so that
its gradients keep their size as ``T`` changes. The per-layer terms average over real tokens only (padding is
masked out) and compare every layer's output and every head's attention map with the teacher's same layer and head;
a pruned student's heads are compared with the teacher heads it kept (``teacher_heads``).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch
import torch.nn.functional as F
import transformers


@dataclasses.dataclass(frozen=True)
class DistillSettings:
    """The ``refit.distill`` block. ``alpha``: weight of the loss on the labels (1: no distillation, 0: the teacher
    alone); ``temperature``: softening of both distributions in the KL term; ``hidden_weight`` and
    ``attention_weight``: the optional per-layer terms (0: off, and their outputs are not even computed). The
    defaults are ``configs/refit/distill.yaml``'s, chosen on MRPC seed 0."""

    alpha: float = 0.5
    temperature: float = 4.0
    hidden_weight: float = 0.0
    attention_weight: float = 0.0

    @classmethod
    def from_config(cls, block: dict) -> DistillSettings:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(block) - known)
        if unknown:
            raise ValueError(f"refit.distill.{unknown[0]} is not a distillation setting; choose from {sorted(known)}")
        settings = cls(**block)
        for name in known:
            value = getattr(settings, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"refit.distill.{name} must be a number, got {value!r}")
        if not 0.0 <= settings.alpha <= 1.0:
            raise ValueError(
                f"refit.distill.alpha={settings.alpha} must lie in [0, 1] (1: labels only, 0: teacher only)"
            )
        if settings.temperature <= 0:
            raise ValueError(f"refit.distill.temperature={settings.temperature} must be positive")
        for name in ("hidden_weight", "attention_weight"):
            if getattr(settings, name) < 0:
                raise ValueError(f"refit.distill.{name}={getattr(settings, name)} must be 0 (off) or positive")
        return settings

    @classmethod
    def from_refit(cls, refit: dict) -> DistillSettings | None:
        """The settings of a ``refit`` group with a ``distill`` block, or None (plain re-fine-tuning)."""
        block = refit.get("distill")
        return None if block is None else cls.from_config(dict(block))


def distillation_loss(
    student, teacher, labels: torch.Tensor, settings: DistillSettings, regression: bool,
    attention_mask: torch.Tensor | None = None, teacher_heads: list[list[int]] | None = None,
) -> dict[str, torch.Tensor]:
    """The loss and each of its terms (``loss``, ``label_loss``, ``teacher_loss`` and, where their weight is not 0,
    ``hidden_loss`` and ``attention_loss``) from the student's and the teacher's model outputs (``logits``, and
    ``hidden_states``/``attentions`` where the per-layer terms are on)."""
    s, t = student.logits.float(), teacher.logits.float()
    if s.dim() == 3:  # a language model: every position's next-token distribution is one example
        s, t, labels = s.flatten(0, 1), t.flatten(0, 1), labels.flatten()
    if regression:
        s, t = s.squeeze(-1), t.squeeze(-1)
        terms = {"label_loss": F.mse_loss(s, labels.float()), "teacher_loss": F.mse_loss(s, t)}
    else:
        T = settings.temperature
        soft_teacher = F.log_softmax(t / T, dim=-1)
        kl = F.kl_div(F.log_softmax(s / T, dim=-1), soft_teacher, log_target=True, reduction="batchmean")
        terms = {"label_loss": F.cross_entropy(s, labels), "teacher_loss": T * T * kl}
    loss = settings.alpha * terms["label_loss"] + (1 - settings.alpha) * terms["teacher_loss"]
    if settings.hidden_weight:
        terms["hidden_loss"] = hidden_state_loss(student.hidden_states, teacher.hidden_states, attention_mask)
        loss = loss + settings.hidden_weight * terms["hidden_loss"]
    if settings.attention_weight:
        terms["attention_loss"] = attention_map_loss(
            student.attentions, teacher.attentions, attention_mask, teacher_heads
        )
        loss = loss + settings.attention_weight * terms["attention_loss"]
    return {"loss": loss, **terms}


def _real_tokens(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The attention mask as floats (batch, tokens); every token where there is none. ``like``: (batch, tokens, ...)."""
    return torch.ones(like.shape[:2], device=like.device) if mask is None else mask.float()


def hidden_state_loss(student_states, teacher_states, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean squared error between every layer's output (the embeddings left out: the conversion does not touch
    them), averaged over real tokens and hidden units, then over layers."""
    if len(student_states) != len(teacher_states):
        raise ValueError(f"the student has {len(student_states) - 1} layers and the teacher "
                         f"{len(teacher_states) - 1}: hidden_weight needs the same depth")
    weights = _real_tokens(mask, student_states[0])[..., None]
    per_layer = [
        ((s.float() - t.float()) ** 2 * weights).sum() / (weights.sum() * s.shape[-1])
        for s, t in zip(student_states[1:], teacher_states[1:])
    ]
    return torch.stack(per_layer).mean()


def attention_map_loss(
    student_maps, teacher_maps, mask: torch.Tensor | None = None, teacher_heads=None
) -> torch.Tensor:
    """KL(teacher row || student row) of every head's attention distribution, averaged over the real query tokens
    and heads, then over layers. ``teacher_heads[l]``: which teacher head each student head of layer ``l`` is
    (a pruned student); None: head ``h`` is head ``h``."""
    if not student_maps or len(student_maps) != len(teacher_maps):
        raise ValueError(f"the student returned {len(student_maps)} layers of attention maps and the teacher "
                         f"{len(teacher_maps)}: a model returns them only with eager attention (load it with "
                         "attn_implementation='eager', as load_teacher does)")
    queries = _real_tokens(mask, student_maps[0][:, 0])[:, None, :]  # (batch, 1, query)
    per_layer = []
    for layer, (s, t) in enumerate(zip(student_maps, teacher_maps)):
        if teacher_heads is not None:
            t = t[:, list(teacher_heads[layer])]
        if s.shape != t.shape:
            raise ValueError(f"layer {layer}: the student's attention maps {tuple(s.shape)} do not match the "
                             f"teacher's {tuple(t.shape)}; a pruned student needs teacher_heads")
        s, t = s.float(), t.float()
        # padded keys have probability 0 under both: they add nothing (xlogy(0, 0) = 0)
        rows = (torch.xlogy(t, t) - torch.xlogy(t, s.clamp_min(1e-12))).sum(-1)  # (batch, head, query)
        per_layer.append((rows * queries).sum() / (queries.sum() * s.shape[1]))
    return torch.stack(per_layer).mean()


class DistillationTrainer(transformers.Trainer):
    """A ``Trainer`` whose training loss is ``distillation_loss`` against ``teacher``; each term's running mean is
    logged beside the Trainer's ``loss`` (``distill_label_loss``, ``distill_teacher_loss``, ...). Evaluation reports
    the model's own loss on the labels (``eval_loss``), so that curves compare with a plain re-training's."""

    def __init__(self, *args, teacher, distill: DistillSettings, regression: bool, teacher_heads=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.teacher = teacher.eval().requires_grad_(False).to(self.args.device)
        self.distill, self.regression, self.teacher_heads = distill, regression, teacher_heads
        self.loss_is_scaled_for_ga = False  # a per-batch mean: the Trainer divides it over accumulated batches
        self._sums, self._counts = {}, defaultdict(int)  # detached tensors: no device sync until a log
        self._evaluating = False

    def prediction_step(self, *args, **kwargs):
        self._evaluating = True
        try:
            return super().prediction_step(*args, **kwargs)
        finally:
            self._evaluating = False

    def _outputs_wanted(self) -> dict:
        return {"output_hidden_states": bool(self.distill.hidden_weight),
                "output_attentions": bool(self.distill.attention_weight)}

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self._evaluating:  # the model's own loss on the labels, as a plain (re-)training reports it
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        labels = inputs.pop("labels")
        wanted = self._outputs_wanted()
        outputs = model(**inputs, **wanted)
        with torch.no_grad():
            teacher_outputs = self.teacher(**inputs, **wanted)
        terms = distillation_loss(outputs, teacher_outputs, labels, self.distill, self.regression,
                                  inputs.get("attention_mask"), self.teacher_heads)
        if model.training:
            for name, value in terms.items():
                if name != "loss":
                    self._sums[name] = self._sums.get(name, 0) + value.detach()
                    self._counts[name] += 1
        return (terms["loss"], outputs) if return_outputs else terms["loss"]

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: add each term's mean since the last one
            logs.update({f"distill_{name}": (total / self._counts[name]).item() for name, total in self._sums.items()})
            self._sums.clear()
            self._counts.clear()
        super().log(logs, start_time)


def load_teacher(path, attention_maps: bool):
    """The teacher from its checkpoint folder; with eager attention where its attention maps are needed (the SDPA
    implementation does not return them)."""
    extra = {"attn_implementation": "eager"} if attention_maps else {}
    return transformers.AutoModelForSequenceClassification.from_pretrained(path, **extra)
