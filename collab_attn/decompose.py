"""Decompose the stacked head products ``Wq_h^T Wk_h`` into shared key/query projections and mixings.

The tensor ``T[h] = Wq_h^T Wk_h`` (heads x d_in x d_in) holds every head's bilinear form. A rank-``R`` CP
decomposition ``T[h] ~= Q diag(m_h) K^T`` gives collaborative attention with shared query ``Q`` (d_in x R), shared
key ``K`` and mixing vectors ``m_h``. Tucker with ranks (core_size, R, R) gives ``T[h] ~= Q M_h K^T`` with
``M_h = sum_g A[h, g] G[g]``: full mixing matrices built from a small core ``G``.

tensorly does the arithmetic on its PyTorch backend, scoped to each call (the global backend is left alone).
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import tensorly as tl
import torch
from tensorly.decomposition import parafac, tucker

METHODS = ("cp", "tucker")


@dataclass
class HeadDecomposition:
    """Shared projections and per-head mixing that approximate the stacked head products.

    ``shared_query`` and ``shared_key`` are (d_in, rank). For CP, ``mixing`` is (heads, rank) and ``core`` is
    None; for Tucker, ``mixing`` is (heads, core_size) and ``core`` is (core_size, rank, rank).
    """

    method: str
    shared_query: torch.Tensor
    shared_key: torch.Tensor
    mixing: torch.Tensor
    core: torch.Tensor | None
    relative_error: float
    seconds: float

    @property
    def rank(self) -> int:
        return self.shared_query.shape[1]

    def mixing_matrices(self) -> torch.Tensor:
        """(heads, rank, rank): ``diag(m_h)`` for CP, ``M_h`` for Tucker."""
        if self.core is None:
            return torch.diag_embed(self.mixing)
        return torch.einsum("hg,grs->hrs", self.mixing, self.core)

    def head_products(self) -> torch.Tensor:
        """The reconstruction of ``Wq_h^T Wk_h``, (heads, d_in, d_in)."""
        return torch.einsum("ir,hrs,js->hij", self.shared_query, self.mixing_matrices(), self.shared_key)


def head_products(w_query: torch.Tensor, w_key: torch.Tensor) -> torch.Tensor:
    """Stack ``Wq_h^T Wk_h`` over heads: (heads, head_dim, d_in) x 2 -> (heads, d_in, d_in)."""
    return torch.einsum("hai,haj->hij", w_query, w_key)


def decompose_heads(
    w_query: torch.Tensor,
    w_key: torch.Tensor,
    rank: int,
    method: str = "cp",
    seed: int = 0,
    *,
    init: str = "svd",
    n_iter_max: int = 100,
    tol: float = 1e-8,
    tucker_core_size: int | None = None,
) -> HeadDecomposition:
    """Decompose the head products of one attention layer at the given rank.

    ``w_query`` and ``w_key`` are (heads, head_dim, d_in): the per-head rows of the query and key
    ``nn.Linear`` weights (``weight.view(heads, head_dim, d_in)``). ``init`` is ``"svd"`` or ``"random"`` (the
    paper's code used random init with 100 iterations); ``seed`` fixes every random choice.
    For Tucker, ``tucker_core_size`` (default: heads) is the size of the head mode of the core.
    """
    if method not in METHODS:
        raise ValueError(f"unknown decomposition method {method!r}; choose one of {METHODS}")
    if w_query.dim() != 3 or w_query.shape != w_key.shape:
        raise ValueError(
            "w_query and w_key must both be (heads, head_dim, d_in), got "
            f"{tuple(w_query.shape)} and {tuple(w_key.shape)}"
        )
    if not (torch.isfinite(w_query).all() and torch.isfinite(w_key).all()):
        raise ValueError("the query/key weights contain NaN or Inf; fix or retrain the checkpoint first")
    heads, head_dim, d_in = w_query.shape
    if not isinstance(rank, int) or not 0 < rank <= d_in:
        raise ValueError(f"rank must be an integer in [1, d_in={d_in}], got {rank!r}")

    products = head_products(w_query.detach().float().cpu(), w_key.detach().float().cpu())
    start = time.perf_counter()
    with tl.backend_context("pytorch"), warnings.catch_warnings():
        # tensorly warns when the rank exceeds the head mode and fills the rest of the SVD init at random
        warnings.filterwarnings("ignore", message=".*n_eigenvecs.*larger than", category=UserWarning)
        if method == "cp":
            weights, (mixing, shared_query, shared_key) = parafac(
                products, rank, n_iter_max=n_iter_max, init=init, tol=tol, random_state=seed
            )
            result = HeadDecomposition(
                "cp", shared_query, shared_key, mixing * weights, None, float("nan"), float("nan")
            )
        else:
            core_size = tucker_core_size or heads
            core, (mixing, shared_query, shared_key) = tucker(
                products, [core_size, rank, rank], n_iter_max=n_iter_max, init=init, tol=tol, random_state=seed
            )
            result = HeadDecomposition("tucker", shared_query, shared_key, mixing, core, float("nan"), float("nan"))
    result.seconds = time.perf_counter() - start
    result.relative_error = float(torch.linalg.norm(products - result.head_products()) / torch.linalg.norm(products))
    return result
