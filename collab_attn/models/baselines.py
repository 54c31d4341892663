"""Matched-budget baselines for collaborative attention: other ways to spend the same key/query parameters.

Both take the key/query size ``rank`` (D~) that collaborative attention would get, so the GLUE table compares
methods at (about) the same query/key parameter count:

- ``truncate_heads(model, rank)``: concatenated heads with a smaller query/key head size ``k = rank / heads``.
  Each head's product ``P_h = Wq_h^T Wk_h`` (d_in x d_in, rank <= head_dim) is cut to its best rank-``k``
  approximation by an SVD, split ``sqrt(S)`` to each side: new per-head projections of size ``k``. Biases as in
  ``reparametrize``: the query bias becomes the content bias ``c_h = Wk_h^T bq_h`` (exact), the key bias and
  the other terms constant over the keys are dropped (exact, the softmax ignores them). Values, the output
  projection and the logit scale ``1/sqrt(head_dim)`` are unchanged. Query/key parameters per layer:
  ``2 d_in rank + heads d_in``, collaborative attention's minus its ``heads x rank`` mixing.
- ``head_importance(...)`` then ``prune_heads(model, rank, importance)``: head pruning by importance scores
  (Michel, Levy & Neubig, 2019, "Are Sixteen Heads Really Better than One?"). The importance of head ``h`` is the
  mean over task examples of ``|dL/d xi_h|``, ``xi_h`` a gate on the head's context output, normalized per layer
  by its L2 norm; the least important heads are removed globally (never a layer's last one) until the kept
  query/key parameters fit in those of collaborative attention at ``rank``.

Both change the model in place (only once everything is computed) and return a ``ReparamReport``, so the GLUE
pipeline records them like a decomposition. The models they make run forward, backward and ``Trainer`` like the
original; they are not meant to be saved and reloaded (their configs still describe the original layers).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from collab_attn.decomposition.rank_selection import query_key_params
from collab_attn.models.conversion import (
    LayerReport,
    ReparamReport,
    _count,
    _fill,
    _head_weights,
    _query_key_count,
    per_layer_ranks,
)
from collab_attn.models.hf import CollaborativeSelfAttention, Family, attention_modules, family_of, replace_module
from collab_attn.nn.attention import CollaborativeAttention, attend

BASELINES = ("svd", "prune")


def check_rank(method: str, rank: int | Sequence[int], num_layers: int, heads: int, head_dim: int) -> list[int]:
    """Per-layer key/query sizes D~ for a baseline, with the errors a user can act on."""
    if method not in BASELINES:
        raise ValueError(f"unknown baseline {method!r}; choose one of {BASELINES}")
    ranks = per_layer_ranks(rank, num_layers, heads * head_dim)
    if method == "svd":
        for layer, value in enumerate(ranks):
            if value % heads:
                lower, upper = max(heads, value - value % heads), value - value % heads + heads
                raise ValueError(
                    f"rank {value} for layer {layer} is not a multiple of the {heads} heads: the SVD baseline gives "
                    f"each head rank / heads query/key dimensions; choose e.g. {lower} or {upper}"
                )
    return ranks


def _layers(model: nn.Module) -> tuple[Family, list[tuple[str, nn.Module]]]:
    family = family_of(model.config)
    found = attention_modules(model, family)
    if not found:
        raise ValueError(f"found no {family.attention_class.__name__} modules in {type(model).__name__}")
    return family, found


# ---------------------------------------------------------------------------------------------------------------
# SVD-truncated concatenated heads


@dataclass
class TruncatedHeads:
    """The rank-``k`` truncation of every head product of one layer."""

    w_query: torch.Tensor  # (heads, k, d_in): w_query[h].T @ w_key[h] is the best rank-k approximation of P_h
    w_key: torch.Tensor  # (heads, k, d_in)
    singular_values: torch.Tensor  # (heads, head_dim), of each original product P_h

    @property
    def k(self) -> int:
        return self.w_query.shape[1]

    @property
    def head_errors(self) -> torch.Tensor:
        """||P_h - P_h,k||_F / ||P_h||_F per head: the norm of the dropped singular values (0 for a zero head)."""
        energy = self.singular_values.square()
        return (energy[:, self.k :].sum(-1) / energy.sum(-1).clamp_min(1e-300)).sqrt()

    @property
    def relative_error(self) -> float:
        """The relative error of the stacked head products, the measure ``decompose_heads`` reports."""
        energy = self.singular_values.square()
        return float((energy[:, self.k :].sum() / energy.sum().clamp_min(1e-300)).sqrt())


def truncate_head_products(w_query: torch.Tensor, w_key: torch.Tensor, k: int) -> TruncatedHeads:
    """Best rank-``k`` approximation of each ``P_h = w_query[h].T @ w_key[h]`` as new (heads, k, d_in) projections.

    ``P_h`` is never formed: with thin QRs ``w_query[h].T = Qa Ra`` and ``w_key[h].T = Qb Rb``,
    ``P_h = Qa (Ra Rb^T) Qb^T``, so the SVD ``U S V^T`` of the head_dim x head_dim core gives ``P_h``'s SVD
    ``(Qa U) S (Qb V)^T``. Each side keeps ``sqrt(S_k)``. Computed in float64.
    """
    heads, head_dim, _ = w_query.shape
    if not 0 < k <= head_dim:
        raise ValueError(f"k must be in [1, {head_dim}] (the head size), got {k}")
    q_basis, q_factor = torch.linalg.qr(w_query.double().transpose(1, 2))  # (H, d_in, hd), (H, hd, hd)
    k_basis, k_factor = torch.linalg.qr(w_key.double().transpose(1, 2))
    left, singular, right_t = torch.linalg.svd(q_factor @ k_factor.transpose(1, 2))
    root = singular[:, :k].sqrt()[:, None, :]  # (H, 1, k)
    new_query = (q_basis @ left[:, :, :k] * root).transpose(1, 2)
    new_key = (k_basis @ right_t[:, :k].transpose(1, 2) * root).transpose(1, 2)
    return TruncatedHeads(new_query.float(), new_key.float(), singular.float())


class _ConcatenatedHeads(CollaborativeAttention):
    """The attention of ``TruncatedSelfAttention``: concatenated heads of query/key size ``rank / heads``.

    The shared ``query`` / ``key`` maps of width ``rank`` are read as ``heads`` blocks of ``k = rank / heads``
    (head h: columns ``h k .. (h + 1) k``): collaborative attention with block mixing, computed as separate heads
    (``attend``: the fused kernel unless weights are asked for; values keep their head size ``head_dim``).
    """

    def forward(self, query_states, key_value_states=None, attention_mask=None, is_causal=False, need_weights=False):
        keys_from, bias, values = self._inputs(query_states, key_value_states, attention_mask, is_causal)
        shape = (self.num_heads, self.rank // self.num_heads)
        queries = self.query(query_states).unflatten(-1, shape).transpose(1, 2)  # (B, H, T, k)
        keys = self.key(keys_from).unflatten(-1, shape).transpose(1, 2)  # (B, H, S, k)
        if self.content_bias is not None:
            # the query bias's term bq_h . Wk_h y_s = c_h . y_s: one logit offset per head and key, (B, H, 1, S)
            content = self.content_bias(keys_from).transpose(1, 2)[:, :, None, :] * self.scale
            bias = content if bias is None else bias + content
        context, weights = attend(queries, keys, values, bias, self.scale, self._dropout(), need_weights)
        return self._finish(context), weights


class TruncatedSelfAttention(CollaborativeSelfAttention, _ConcatenatedHeads):
    """Concatenated heads whose query/key head size ``rank / heads`` is below the value head size.

    It plugs into BERT-family models exactly like ``CollaborativeSelfAttention``, whose transformers call
    contract (``forward``: masks, ``output_attentions``, ALBERT's residual LayerNorm) it inherits; in this class's
    method order that adapter calls ``_ConcatenatedHeads.forward`` for the attention itself. The block mixing is a
    fixed buffer rather than a parameter: it is neither trained nor counted, so ``parameter_counts()`` gives
    the query/key cost of concatenated heads (``query``, ``key``, ``content_bias``).
    """

    @classmethod
    def replacing(cls, module: nn.Module, family: Family, rank: int) -> TruncatedSelfAttention:
        """An empty layer shaped to replace ``module`` at key/query size ``rank`` (same device and dtype)."""
        layer = family.build_layer(module, rank, tucker_core_size=None)  # every family's sizes, dropouts, norms
        layer.__class__ = cls  # same state; only the attention differs
        blocks = torch.eye(layer.num_heads).repeat_interleave(rank // layer.num_heads, dim=1)
        del layer.mixing
        layer.register_buffer("mixing", blocks.to(layer.query.weight), persistent=False)
        return layer


def _install_output_recorders(model: nn.Module) -> None:
    """Install transformers' ``output_attentions`` recorders now: they pick modules by class on the first forward,
    so layers swapped in before it would be missed; ``replace_module`` carries installed ones over."""
    from transformers import PreTrainedModel
    from transformers.utils.output_capturing import maybe_install_capturing_hooks

    if isinstance(model, PreTrainedModel):
        maybe_install_capturing_hooks(model)


def truncate_heads(model: nn.Module, rank: int | Sequence[int]) -> ReparamReport:
    """Replace every self-attention layer by SVD-truncated concatenated heads of query/key size ``rank / heads``.

    ``rank``: the key/query size D~ (one int, or one per attention layer), a multiple of the number of heads;
    ``heads x head_dim`` keeps every head whole (exact up to float error). The model is changed only once every
    layer is computed. Returns a ``ReparamReport`` (method ``"svd"``): per layer the relative error of the stacked
    head products, seconds and parameter counts.
    """
    family, found = _layers(model)
    heads, head_dim = family.num_heads(found[0][1]), found[0][1].attention_head_size
    ranks = check_rank("svd", rank, len(found), heads, head_dim)
    report = ReparamReport(method="svd", model_params_before=_count(model), solver="svd")
    planned = []
    for (name, module), layer_rank in zip(found, ranks):
        start = time.perf_counter()
        w_query, w_key, b_query = _head_weights(module, family)
        for label, tensor in (("query", w_query), ("key", w_key), ("query bias", b_query)):
            if tensor is not None and not torch.isfinite(tensor).all():
                raise ValueError(f"{name}: the {label} weights contain NaN or Inf; fix the checkpoint first")
        truncated = truncate_head_products(w_query, w_key, layer_rank // heads)
        factors = {
            "shared_query": truncated.w_query.flatten(0, 1).T,
            "shared_key": truncated.w_key.flatten(0, 1).T,
            "mixing": torch.eye(heads).repeat_interleave(truncated.k, dim=1),
        }
        if b_query is not None:
            factors["content_bias"] = torch.einsum("hai,ha->hi", w_key, b_query)
        planned.append((factors, truncated.relative_error, time.perf_counter() - start))

    _install_output_recorders(model)
    for (name, module), layer_rank, (factors, error, seconds) in zip(found, ranks, planned):
        layer = TruncatedSelfAttention.replacing(module, family, layer_rank)
        _fill(layer, module, family, factors)
        replace_module(model, name, layer)
        report.layers.append(
            LayerReport(
                name, layer_rank, error, seconds, _count(module), _count(layer),
                _query_key_count(module, family), _query_key_count(layer, family),
            )
        )
    report.model_params_after = _count(model)
    return report


# ---------------------------------------------------------------------------------------------------------------
# Head pruning by importance (Michel et al., 2019)


def _output_projection(model: nn.Module, name: str, module: nn.Module, family: Family) -> nn.Linear:
    """The linear map that reads a layer's concatenated head outputs: inside the attention module (DistilBERT,
    ALBERT) or beside it (BERT, RoBERTa: ``<attention>.output.dense``)."""
    if family.output is not None:
        return getattr(module, family.output)
    return model.get_submodule(name.rpartition(".")[0]).output.dense


@contextmanager
def head_gates(model: nn.Module, gates: list):
    """Multiply head ``h`` of attention layer ``l``'s context output by ``gates[l][..., h]`` inside the block.

    ``gates[l]`` is a (heads,) tensor, or (batch, heads) for one gate per example; the list is read at every
    forward, so its entries may be swapped between batches. Gate 0 switches a head off, 1 leaves it alone.
    """
    family, found = _layers(model)
    if len(gates) != len(found):
        raise ValueError(f"got {len(gates)} gates for {len(found)} attention layers")
    handles = []

    def gate_heads(index: int, heads: int, projection: nn.Module, args: tuple) -> tuple:
        context, *rest = args  # (batch, tokens, heads * head_dim)
        gate = gates[index].to(context.dtype)
        gate = gate.reshape(-1, 1, heads, 1) if gate.dim() == 2 else gate.reshape(1, 1, heads, 1)
        return (context.unflatten(-1, (heads, -1)) * gate).flatten(-2), *rest

    try:
        for index, (name, module) in enumerate(found):
            projection = _output_projection(model, name, module, family)
            hook = partial(gate_heads, index, family.num_heads(module))
            handles.append(projection.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class HeadImportance:
    """Head importance scores of one model: per attention layer, one score per head."""

    scores: list[torch.Tensor]  # normalized per layer by the L2 norm (what pruning ranks)
    raw: list[torch.Tensor]  # mean over examples of |dL/d xi_h|
    samples: int
    seed: int
    seconds: float


def head_importance(
    model: nn.Module,
    dataset,
    collator,
    *,
    samples: int = 256,
    batch_size: int = 32,
    seed: int = 0,
) -> HeadImportance:
    """Michel et al.'s head importance: the mean over ``samples`` examples of ``|dL/d xi_h|``.

    ``dataset``: tokenized task examples with ``labels`` (e.g. the pipeline's ``data["train"]``), of which
    ``samples`` are drawn without replacement with ``seed``; ``collator`` pads a list of them into a batch
    (``transformers.DataCollatorWithPadding``). ``L`` is the model's own loss, so ``model`` is a fine-tuned task
    model. Each example has its own gates (a (batch, heads) gate per layer), so one backward pass per batch
    gives every example's gradient, and the result does not depend on ``batch_size``. Dropout is off meanwhile.
    """
    if not isinstance(samples, int) or samples < 1:
        raise ValueError(f"importance samples must be a positive integer, got {samples!r}")
    if len(dataset) == 0 or "labels" not in dataset[0]:
        raise ValueError("head importance needs task examples with labels (the task loss is differentiated)")
    start = time.perf_counter()
    family, found = _layers(model)
    heads = [family.num_heads(module) for _, module in found]
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(dataset), generator=generator)[:samples].tolist()
    totals = [torch.zeros(h, dtype=torch.float64) for h in heads]
    gates: list = [None] * len(found)
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad(), head_gates(model, gates):
            for begin in range(0, len(order), batch_size):
                batch = collator([dataset[i] for i in order[begin : begin + batch_size]])
                batch = {key: value.to(device) for key, value in batch.items()}
                size = batch["labels"].shape[0]
                gates[:] = [torch.ones(size, h, device=device, requires_grad=True) for h in heads]
                loss = model(**batch).loss * size  # the model's mean loss -> the sum of per-example losses
                grads = torch.autograd.grad(loss, gates, allow_unused=True)
                for total, grad in zip(totals, grads):
                    if grad is not None:
                        total += grad.detach().abs().sum(0).double().cpu()
    finally:
        model.train(was_training)
    raw = [(total / len(order)).float() for total in totals]
    scores = [r / r.norm() if r.norm() > 0 else r for r in raw]
    return HeadImportance(scores, raw, len(order), seed, time.perf_counter() - start)


@dataclass
class PruneReport(ReparamReport):
    """A ``ReparamReport`` that also lists, per layer, the heads kept and the importance scores used."""

    kept_heads: list[list[int]] = field(default_factory=list)
    importance: list[list[float]] = field(default_factory=list)
    budget: int = 0  # query/key parameters of collaborative attention at the same rank, all layers

    def to_dict(self) -> dict:
        return super().to_dict() | {
            "kept_heads": self.kept_heads, "importance": self.importance, "query_key_budget": self.budget,
        }


def heads_to_keep(scores: Sequence[torch.Tensor], count: int) -> list[list[int]]:
    """The ``count`` most important heads over all layers, at least one per layer (each layer's best first)."""
    ranked = sorted(
        ((-float(score), layer, head) for layer, row in enumerate(scores) for head, score in enumerate(row))
    )
    keep: list[set[int]] = [set() for _ in scores]
    for _, layer, head in ranked:  # each layer's best head first ...
        if not keep[layer]:
            keep[layer].add(head)
    kept = len(scores)
    for _, layer, head in ranked:  # ... then the best of the rest, over all layers
        if kept >= count:
            break
        if head not in keep[layer]:
            keep[layer].add(head)
            kept += 1
    return [sorted(heads) for heads in keep]


@torch.no_grad()
def _slice(linear: nn.Linear, rows: torch.Tensor | None = None, columns: torch.Tensor | None = None) -> None:
    """Keep only ``rows`` (outputs) or ``columns`` (inputs) of ``linear``, in place."""
    if rows is not None:
        linear.weight = nn.Parameter(linear.weight[rows].clone())
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].clone())
        linear.out_features = len(rows)
    if columns is not None:
        linear.weight = nn.Parameter(linear.weight[:, columns].clone())
        linear.in_features = len(columns)


def _head_energy(module: nn.Module, family: Family) -> torch.Tensor:
    """||Wq_h^T Wk_h||_F^2 per head, from the head_dim x head_dim Gram matrices."""
    w_query, w_key, _ = _head_weights(module, family)
    w_query, w_key = w_query.double(), w_key.double()
    return (w_query @ w_query.transpose(1, 2) * (w_key @ w_key.transpose(1, 2))).sum((1, 2))


def prune_heads(
    model: nn.Module, rank: int | Sequence[int], importance: HeadImportance | Sequence[torch.Tensor]
) -> PruneReport:
    """Remove the least important heads, in place, until the query/key parameters fit collaborative attention's.

    The budget is the query/key parameter count of collaborative attention at key/query size ``rank`` (one int,
    or one per layer): ``2 d_in D~ + heads D~ + heads d_in`` per layer (``rank_selection.query_key_params``).
    A concatenated head costs ``2 head_dim (d_in + 1)``; the most important heads over all layers are kept
    (``importance.scores``, or one score tensor per layer), at least one per layer, so at tiny ranks the kept
    count may exceed the budget. Query, key and value rows of a pruned head and its columns of the output
    projection are removed; the model then computes what the original does with those heads' gates at 0.

    Report: per layer the query/key size kept (``rank`` = kept heads x head_dim) and as ``relative_error`` the
    relative error of the stacked head products with the pruned ones zeroed, sqrt(energy fraction removed).
    """
    family, found = _layers(model)
    scores = list(importance.scores if isinstance(importance, HeadImportance) else importance)
    heads = [family.num_heads(module) for _, module in found]
    if [len(s) for s in scores] != heads:
        raise ValueError(f"importance has {[len(s) for s in scores]} scores per layer; the model has {heads} heads")
    head_dim = found[0][1].attention_head_size
    ranks = check_rank("prune", rank, len(found), heads[0], head_dim)
    query = getattr(found[0][1], family.query)
    bias = query.bias is not None
    budget = sum(query_key_params(r, query.in_features, h, bias=bias) for r, h in zip(ranks, heads))
    per_head = 2 * head_dim * (query.in_features + int(bias))
    keep = heads_to_keep(scores, budget // per_head)

    report = PruneReport(
        method="prune", model_params_before=_count(model), solver="importance", budget=budget,
        kept_heads=keep, importance=[s.tolist() for s in scores],
    )
    shared = importance.seconds / len(found) if isinstance(importance, HeadImportance) else 0.0
    for (name, module), kept, count in zip(found, keep, heads):
        start = time.perf_counter()
        before, qk_before = _count(module), _query_key_count(module, family)
        energy = _head_energy(module, family)
        removed = energy.sum() - energy[kept].sum()
        error = float((removed.clamp_min(0) / energy.sum().clamp_min(1e-300)).sqrt())
        if len(kept) < count:
            index = torch.tensor([h * head_dim + i for h in kept for i in range(head_dim)])
            for part in (family.query, family.key, family.value):
                _slice(getattr(module, part), rows=index)
            _slice(_output_projection(model, name, module, family), columns=index)
            if hasattr(module, "num_attention_heads"):
                module.num_attention_heads = len(kept)
            else:
                module.n_heads = len(kept)
            if hasattr(module, "all_head_size"):
                module.all_head_size = len(kept) * head_dim
        report.layers.append(
            LayerReport(
                name, len(kept) * head_dim, error, shared + time.perf_counter() - start, before, _count(module),
                qk_before, _query_key_count(module, family),
            )
        )
    report.model_params_after = _count(model)
    return report
