"""PNG plots of what a collaborative conversion did: mixing matrices, per-head spectra, attention differences.

Figures are plain ``matplotlib.figure.Figure`` objects rendered by the Agg canvas, so nothing here touches
pyplot's global state or needs a display. Each ``plot_*`` function writes its PNG and returns the figure it drew.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure

from collab_attn.analysis.views import AttentionMaps
from collab_attn.decomposition.decompose import head_products
from collab_attn.kinds import CollaborativeSelfAttention
from collab_attn.models.hf import attention_modules, family_of


def collaborative_layers(model) -> list[CollaborativeSelfAttention]:
    """The collaborative self-attention modules of a converted model, in layer order."""
    layers = [module for module in model.modules() if isinstance(module, CollaborativeSelfAttention)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no collaborative attention layers; convert it first")
    return layers


def _query_key_weights(model) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per self-attention layer of an original model, the (heads, head_dim, d_in) query and key weights."""
    family = family_of(model.config)
    weights = []
    for _, module in attention_modules(model, family):
        w_query, w_key, _, _ = family.head_weights(module)
        weights.append((w_query, w_key))
    return weights


def _singular_values(left: torch.Tensor, middle: torch.Tensor, right: torch.Tensor) -> torch.Tensor:
    """Singular values of ``left @ middle @ right^T`` for (..., d, a), (..., a, b), (..., d, b) stacks (broadcast).

    With thin QRs ``left = Q_l R_l`` and ``right = Q_r R_r``, the product is ``Q_l C Q_r^T`` with ``C = R_l middle
    R_r^T`` and orthonormal ``Q_l``, ``Q_r``, so ``C`` (a x b) has the same nonzero singular values. They are the
    square roots of the eigenvalues of ``C C^T``, taken in float64: LAPACK's SVD is very slow on the rank-deficient
    matrices heads give (a head's ``Wq_h^T Wk_h`` has rank head_dim at most).
    """
    core = torch.linalg.qr(left.double())[1] @ middle.double() @ torch.linalg.qr(right.double())[1].mT
    return torch.linalg.eigvalsh(core @ core.mT).clamp_min(0).sqrt().flip(-1).float()


@contextmanager
def _one_thread() -> Iterator[None]:
    """Run small LAPACK calls on one thread: they gain nothing from more, and on a busy machine MKL's OpenMP
    threads can make them a hundred times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def effective_rank(singular_values: torch.Tensor) -> torch.Tensor:
    """exp(entropy of the normalized singular values), over the last dimension (Roy & Vetterli, 2007)."""
    total = singular_values.sum(-1, keepdim=True).clamp_min(torch.finfo(singular_values.dtype).tiny)
    p = singular_values / total
    return torch.exp(-torch.xlogy(p, p).sum(-1))


@torch.no_grad()
def head_statistics(original, converted) -> dict[str, np.ndarray]:
    """Per layer and head, (layers, heads) arrays about the bilinear forms ``T_h = Wq_h^T Wk_h`` of the original
    and ``T~_h = Wq~ M_h Wk~^T`` of the converted model: their effective ranks, the relative error
    ``|T_h - T~_h| / |T_h|``, and each head's share of its layer's energy ``|T_h|^2 / sum_g |T_g|^2``."""
    stats = {"original_effective_rank": [], "collaborative_effective_rank": [], "relative_error": [],
             "energy_share": []}
    pairs = zip(_query_key_weights(original), collaborative_layers(converted), strict=True)
    with _one_thread():
        for (w_query, w_key), layer in pairs:
            _add_head_statistics(stats, w_query, w_key, layer)
    return {name: torch.stack(rows).numpy() for name, rows in stats.items()}


def _add_head_statistics(stats: dict, w_query: torch.Tensor, w_key: torch.Tensor, layer) -> None:
    """Append one layer's rows to the lists of ``head_statistics``."""
    shared_query = layer.query.weight.detach().float().cpu().T
    shared_key = layer.key.weight.detach().float().cpu().T
    mixing = layer.mixing_matrices().detach().float().cpu()
    before = head_products(w_query, w_key)
    after = torch.einsum("ir,hrs,js->hij", shared_query, mixing, shared_key)
    norms = torch.linalg.matrix_norm(before)
    identity = torch.eye(w_query.shape[1]).expand(len(w_query), -1, -1)
    stats["original_effective_rank"].append(effective_rank(_singular_values(w_query.mT, identity, w_key.mT)))
    stats["collaborative_effective_rank"].append(effective_rank(_singular_values(shared_query, mixing, shared_key)))
    stats["relative_error"].append(torch.linalg.matrix_norm(before - after) / norms)
    stats["energy_share"].append(norms**2 / (norms**2).sum())


@torch.no_grad()
def mixing_weights(layer: CollaborativeSelfAttention) -> np.ndarray:
    """What each head takes from each shared dimension, (heads, width).

    CP: ``m_h[r] |q~_r| |k~_r|``, the Frobenius norm (with sign) of head h's rank-one term ``m_h[r] q~_r k~_r^T``,
    so that columns are comparable whatever the scale of the shared projections. Tucker: the head factor
    (heads x core size); the shared dimensions are mixed by the core.
    """
    mixing = layer.mixing.float()
    if layer.mixing_core is None:
        mixing = mixing * torch.linalg.vector_norm(layer.query.weight.float(), dim=1)
        mixing = mixing * torch.linalg.vector_norm(layer.key.weight.float(), dim=1)
    return mixing.cpu().numpy()


def _by_dominant_head(weights: np.ndarray) -> np.ndarray:
    """Column order: grouped by the head with the largest |weight|, strongest first within a group."""
    magnitude = np.abs(weights)
    return np.lexsort((-magnitude.max(0), magnitude.argmax(0)))


def _save(fig: Figure, path: str | Path) -> Figure:
    fig.savefig(Path(path), dpi=110, bbox_inches="tight")
    return fig


def plot_mixing(model, path: str | Path) -> Figure:
    """One heatmap per layer of the heads x shared-dimension mixing (columns grouped by their dominant head)."""
    layers = collaborative_layers(model)
    tucker = layers[0].mixing_core is not None
    fig = Figure(figsize=(12, 1.2 + 1.5 * len(layers)), layout="constrained")
    axes = fig.subplots(len(layers), 1, squeeze=False)[:, 0]
    for index, (ax, layer) in enumerate(zip(axes, layers)):
        weights = mixing_weights(layer)
        if not tucker:
            weights = weights[:, _by_dominant_head(weights)]
        limit = float(np.abs(weights).max()) or 1.0
        image = ax.imshow(weights, aspect="auto", cmap="RdBu_r", vmin=-limit, vmax=limit, interpolation="nearest")
        ax.set_ylabel(f"layer {index}\nhead")
        ax.set_yticks(range(layer.num_heads))
        ax.tick_params(labelsize=6)
        fig.colorbar(image, ax=ax, pad=0.01, aspect=10)
    shared = "shared key/query dimension (grouped by the head that uses it most)"
    axes[-1].set_xlabel("core index" if tucker else shared)
    what = "Tucker head factor (heads x core)" if tucker else "CP mixing m_h[r] |q_r| |k_r| (heads x rank)"
    fig.suptitle(f"{what}, rank {layers[0].rank}")
    return _save(fig, path)


def _heatmap(fig: Figure, ax, values: np.ndarray, title: str, fmt: str, vmin=None, vmax=None, cmap="viridis"):
    image = ax.imshow(values, aspect="auto", cmap=cmap, vmin=vmin, vmax=vmax, interpolation="nearest")
    for (row, col), value in np.ndenumerate(values):
        color = "black" if image.norm(value) > 0.6 else "white"  # these colormaps are bright at the top
        ax.text(col, row, format(value, fmt), ha="center", va="center", fontsize=6, color=color)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(values.shape[1]))
    ax.set_yticks(range(values.shape[0]))
    ax.tick_params(labelsize=7)
    fig.colorbar(image, ax=ax, pad=0.01)


def plot_head_statistics(stats: dict[str, np.ndarray], path: str | Path, rank: int | None = None) -> Figure:
    """Four layers x heads heatmaps from ``head_statistics``: effective ranks before/after, error, energy share."""
    fig = Figure(figsize=(14, 3 + 0.8 * len(stats["relative_error"])), layout="constrained")
    axes = fig.subplots(2, 2)
    top = float(max(stats["original_effective_rank"].max(), stats["collaborative_effective_rank"].max()))
    _heatmap(fig, axes[0, 0], stats["original_effective_rank"], "effective rank of Wq_h^T Wk_h (original)", ".0f",
             0, top)
    _heatmap(fig, axes[0, 1], stats["collaborative_effective_rank"],
             "effective rank of Wq~ M_h Wk~^T (collaborative)", ".0f", 0, top)
    _heatmap(fig, axes[1, 0], stats["relative_error"], "relative error |T_h - T~_h| / |T_h|", ".2f", 0, None,
             "magma")
    _heatmap(fig, axes[1, 1], stats["energy_share"], "share of the layer's energy |T_h|^2 / sum |T_g|^2", ".2f",
             0, None, "cividis")
    fig.suptitle("Per-head bilinear forms T_h = Wq_h^T Wk_h" + ("" if rank is None else f", collaborative rank {rank}"))
    return _save(fig, path)


def attention_difference(original: AttentionMaps, collaborative: AttentionMaps) -> np.ndarray:
    """|original - collaborative| attention, (layers, heads, n, n); the two must show the same tokens."""
    if original.tokens != collaborative.tokens:
        raise ValueError("the two attention maps are over different tokens")
    return torch.stack([(a - b).abs() for a, b in zip(original.layers, collaborative.layers, strict=True)]).numpy()


def plot_attention_difference(original: AttentionMaps, collaborative: AttentionMaps, path: str | Path) -> Figure:
    """A layers x heads grid of |original - collaborative| attention maps on one colour scale."""
    diff = attention_difference(original, collaborative)
    layers, heads = diff.shape[:2]
    fig = Figure(figsize=(1.1 * heads + 1.5, 1.1 * layers + 1), layout="constrained")
    axes = fig.subplots(layers, heads, squeeze=False)
    top = float(diff.max()) or 1.0
    for (layer, head), ax in np.ndenumerate(axes):
        image = ax.imshow(diff[layer, head], cmap="magma", vmin=0, vmax=top, interpolation="nearest")
        ax.set_xticks([])
        ax.set_yticks([])
        if layer == 0:
            ax.set_title(f"head {head}", fontsize=8)
        if head == 0:
            ax.set_ylabel(f"layer {layer}\nmean {diff[layer].mean():.3f}", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, label="|attention difference|")
    fig.suptitle(f"|original - collaborative| attention on {len(original.tokens)} tokens "
                 f"(max {diff.max():.3f}, mean {diff.mean():.4f})")
    return _save(fig, path)


def plot_worst_head(original: AttentionMaps, collaborative: AttentionMaps, path: str | Path) -> Figure:
    """Original, collaborative and |difference| attention, with tokens, for the head that changed most."""
    diff = attention_difference(original, collaborative)
    layer, head = np.unravel_index(diff.sum(axis=(2, 3)).argmax(), diff.shape[:2])
    panels = [("original", original.layers[layer][head].numpy(), "Blues", 1.0),
              ("collaborative", collaborative.layers[layer][head].numpy(), "Blues", 1.0),
              ("|difference|", diff[layer, head], "magma", None)]
    size = 2.5 + 0.25 * len(original.tokens)
    fig = Figure(figsize=(3 * size, size + 0.5), layout="constrained")
    for ax, (name, values, cmap, top) in zip(fig.subplots(1, 3), panels):
        image = ax.imshow(values, cmap=cmap, vmin=0, vmax=top, interpolation="nearest")
        ax.set_xticks(range(len(original.tokens)), original.tokens, rotation=90, fontsize=7)
        ax.set_yticks(range(len(original.tokens)), original.tokens, fontsize=7)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
        ax.set_title(name)
        fig.colorbar(image, ax=ax, shrink=0.8)
    fig.suptitle(f"layer {layer}, head {head}: the head whose attention changed most")
    return _save(fig, path)
