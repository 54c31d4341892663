"""Decompose the stacked head products ``Wq_h^T Wk_h`` into shared key/query projections and mixings.

The tensor ``T[h] = Wq_h^T Wk_h`` (heads x d_in x d_in) holds every head's bilinear form. A rank-``R`` CP
decomposition ``T[h] ~= Q diag(m_h) K^T`` gives collaborative attention with shared query ``Q`` (d_in x R), shared
key ``K`` and mixing vectors ``m_h``. Tucker with ranks (core_size, R, R) gives ``T[h] ~= Q M_h K^T`` with
``M_h = sum_g A[h, g] G[g]``: full mixing matrices built from a small core ``G``.

Two solvers: ``"implicit"`` (default; ``cp_als``) runs ALS / HOOI on the per-head projections and never
forms the tensor; ``"tensorly"`` forms the dense tensor and calls tensorly's ``parafac`` / ``tucker`` on its
PyTorch backend, scoped to each call (the global backend is left alone). From the same initialization both follow
the same iterations; the paper's settings are ``solver="tensorly", init="random", n_iter_max=100``.

Activation-aware fitting (``covariance=``): with ``S = (C + eps I)^{1/2}`` for the second-moment matrix ``C`` of
the layer's inputs, the products are decomposed as ``S Wq_h^T Wk_h S`` (the projections ``Wq_h S``, ``Wk_h S``)
and mapped back with ``S^{-1}``, so that the fit weights directions by how much the inputs use them: the error is
then the expected error of the attention logits ``x^T Wq_h^T Wk_h y`` (see ``collab_attn.fitting.calibration``).

Scale: every solver fits the tensor normalized to unit norm and scales the factors back (see ``cp_als``), so the
relative error and the factors (up to that scale) do not depend on the scale of the weights or of the covariance.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass

import torch

from collab_attn.decomposition.cp_als import (
    DEFAULT_N_ITER_MAX,
    DEFAULT_PATIENCE,
    DEFAULT_TOL,
    HeadProducts,
    cp_als,
    cp_relative_error,
    tucker_hooi,
    tucker_relative_error,
)
from collab_attn.decomposition.whitening import whitening_pair

METHODS = ("cp", "tucker")
SOLVERS = ("implicit", "tensorly")


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
    # activation-aware fits: the relative error of the whitened products (the RMS relative logit error over the
    # calibration inputs); None for plain fits
    weighted_error: float | None = None
    n_iter: int | None = None  # ALS / HOOI iterations run (None for tensorly)

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


def check_finite(where: str = "", **tensors: torch.Tensor | None) -> None:
    """Raise a ValueError naming the first of ``tensors`` (name=tensor, None skipped) holding NaN or Inf."""
    for name, tensor in tensors.items():
        if tensor is not None and not torch.isfinite(tensor).all():
            prefix = f"{where}: " if where else ""
            raise ValueError(f"{prefix}the {name.replace('_', ' ')} weights contain NaN or Inf; fix or retrain the "
                             "checkpoint first")


def head_products(w_query: torch.Tensor, w_key: torch.Tensor) -> torch.Tensor:
    """Stack ``Wq_h^T Wk_h`` over heads: (heads, head_dim, d_in) x 2 -> (heads, d_in, d_in)."""
    return torch.einsum("hai,haj->hij", w_query, w_key)


def _balance_cp(mixing: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
    """Rescale each rank-one term so that mixing columns have unit norm and the query/key columns equal norms
    (the product is unchanged); a zero term stays zero."""
    m_norm, q_norm, k_norm = (f.norm(dim=0) for f in (mixing, query, key))
    scale = (m_norm * q_norm * k_norm).sqrt()
    safe = lambda x: torch.where(x > 0, x, torch.ones_like(x))  # noqa: E731
    return mixing / safe(m_norm), query * scale / safe(q_norm), key * scale / safe(k_norm)


def decompose_heads(
    w_query: torch.Tensor,
    w_key: torch.Tensor,
    rank: int,
    method: str = "cp",
    seed: int = 0,
    *,
    solver: str = "implicit",
    init="svd",
    n_iter_max: int = DEFAULT_N_ITER_MAX,
    tol: float = DEFAULT_TOL,
    patience: int = DEFAULT_PATIENCE,
    tucker_core_size: int | None = None,
    linesearch: bool | None = None,
    covariance: torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None = None,
    whitening_eps: float | None = None,
    device: torch.device | str | None = None,
) -> HeadDecomposition:
    """Decompose the head products of one attention layer at the given rank.

    ``w_query`` and ``w_key`` are (heads, head_dim, d_in): the per-head rows of the query and key
    ``nn.Linear`` weights (``weight.view(heads, head_dim, d_in)``). ``init`` is ``"svd"`` or ``"random"`` (the
    paper's code used random init with 100 iterations); ``seed`` fixes every random choice. ``n_iter_max`` caps the
    iterations of both solvers. The implicit solver stops once the relative error improved by less than ``tol`` of
    its value in each of ``patience`` iterations in a row (``cp_als.converged``; ``tol=0`` runs every iteration);
    tensorly applies its own rule to ``tol`` (absolute change of the error below ``tol``, once). For Tucker,
    ``tucker_core_size`` (default: heads) is the size of the head mode of the core.

    ``solver``: ``"implicit"`` (ALS from the projections, see ``cp_als``; its large products run in
    float32, the rest in float64) or ``"tensorly"`` (dense tensor, tensorly). ``linesearch`` (CP only): extrapolate
    the factors as tensorly's line search does; None means on for ``"implicit"``, off for ``"tensorly"`` (its
    default, the paper's setting).

    ``covariance``: activation-aware fitting. The (d_in, d_in) second moment ``E[x x^T]`` of the layer's inputs,
    or a (query side, key side) pair; see ``collab_attn.fitting.calibration``. ``whitening_eps`` regularizes it (a
    fraction of its mean eigenvalue; default ``calibration.DEFAULT_EPS``). ``relative_error`` stays the error of
    the raw products; ``weighted_error`` is the error of the whitened ones.

    ``device``: where the decomposition runs (None: where ``w_query`` is); the factors come back on it, in float32.

    CP factors are returned balanced: unit-norm mixing columns, query and key columns of equal norm.
    """
    if method not in METHODS:
        raise ValueError(f"unknown decomposition method {method!r}; choose one of {METHODS}")
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {SOLVERS}")
    if w_query.dim() != 3 or w_query.shape != w_key.shape:
        raise ValueError(
            "w_query and w_key must both be (heads, head_dim, d_in), got "
            f"{tuple(w_query.shape)} and {tuple(w_key.shape)}"
        )
    check_finite(query=w_query, key=w_key)
    heads, head_dim, d_in = w_query.shape
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank <= d_in:
        raise ValueError(f"rank must be an integer in [1, d_in={d_in}], got {rank!r}")
    core_size = tucker_core_size or heads

    start = time.perf_counter()
    raw = HeadProducts(w_query, w_key, device=device)
    if covariance is None:
        work, back_query, back_key = raw, None, None
    else:
        (s_query, back_query), (s_key, back_key) = (
            tuple(m.to(raw.device) for m in pair) for pair in whitening_pair(covariance, d_in, whitening_eps)
        )
        work = HeadProducts(raw.a @ s_query, raw.b @ s_key)

    if solver == "implicit":
        factors, n_iter = _implicit(work, rank, method, seed, init, n_iter_max, tol, patience, core_size, linesearch)
    else:
        factors, n_iter = _dense(work, rank, method, seed, init, n_iter_max, tol, core_size, linesearch), None
    weighted_error = None
    mixing, query, key, core = (None if f is None else f.to(torch.float64) for f in factors)
    if covariance is not None:
        weighted_error = _error(work, mixing, query, key, core)
        query, key = back_query @ query, back_key @ key
    if core is None:
        mixing, query, key = _balance_cp(mixing, query, key)
    if query.is_cuda:
        torch.cuda.synchronize(query.device)
    seconds = time.perf_counter() - start
    result = HeadDecomposition(
        method, query.float(), key.float(), mixing.float(), None if core is None else core.float(),
        float("nan"), seconds, None if weighted_error is None else float(weighted_error), n_iter,
    )
    result.relative_error = _error(raw, result.mixing, result.shared_query, result.shared_key, result.core)
    return result


def _implicit(work: HeadProducts, rank, method, seed, init, n_iter_max, tol, patience, core_size, linesearch):
    """``decompose_heads``'s fit by the implicit solver: the factors (mixing, query, key, core or None) and the
    number of iterations run."""
    if method == "cp":
        fit = cp_als(
            work, None, rank, init=init, n_iter_max=n_iter_max, tol=tol, patience=patience, seed=seed,
            linesearch=True if linesearch is None else linesearch, matmul_dtype=torch.float32,
        )
        return (fit.mixing, fit.query, fit.key, None), len(fit.errors)
    if init not in ("svd", "random"):
        raise ValueError(f"unknown init {init!r}; choose 'svd' or 'random'")
    fit = tucker_hooi(work, None, rank, core_size, init=init, n_iter_max=n_iter_max, tol=tol, patience=patience,
                      seed=seed)
    return (fit.mixing, fit.query, fit.key, fit.core), len(fit.errors)


def _dense(work: HeadProducts, rank, method, seed, init, n_iter_max, tol, core_size, linesearch):
    """``decompose_heads``'s fit by tensorly, on the unit-norm dense tensor (float32: at the weights' own scale its
    Grams under- or overflow), the factors scaled back as ``cp_als`` / ``tucker_hooi`` do."""
    unit, query_scale, key_scale = work.normalized()
    if method == "cp" and isinstance(init, (tuple, list)) and len(init) == 3:
        init = (init[0], torch.as_tensor(init[1]) * query_scale, torch.as_tensor(init[2]) * key_scale)
    mixing, query, key, core = _tensorly(unit.dense().float(), rank, method, seed, init, n_iter_max, tol, core_size,
                                         linesearch)
    if core is None:
        return mixing, query.double() / query_scale, key.double() / key_scale, None
    return mixing, query, key, core.double() / (query_scale * key_scale)


def _error(tensor: HeadProducts, mixing, query, key, core) -> float:
    if core is None:
        return cp_relative_error(tensor, mixing, query, key)
    return tucker_relative_error(tensor, mixing, query, key, core)


def _tensorly(products, rank, method, seed, init, n_iter_max, tol, core_size, linesearch):
    """(mixing, query, key, core) from tensorly's dense solvers (imported here: a second of every process's start
    otherwise, and the default solver does not use them)."""
    import tensorly as tl
    from tensorly.decomposition import parafac, tucker

    with tl.backend_context("pytorch"), warnings.catch_warnings():
        # tensorly warns when the rank exceeds the head mode and fills the rest of the SVD init at random
        warnings.filterwarnings("ignore", message=".*n_eigenvecs.*larger than", category=UserWarning)
        if method == "cp":
            if isinstance(init, (tuple, list)):
                init = (None, [torch.as_tensor(f, dtype=products.dtype, device=products.device) for f in init])
            weights, (mixing, shared_query, shared_key) = parafac(
                products, rank, n_iter_max=n_iter_max, init=init, tol=tol, random_state=seed,
                linesearch=bool(linesearch),
            )
            return mixing * weights, shared_query, shared_key, None
        core, (mixing, shared_query, shared_key) = tucker(
            products, [core_size, rank, rank], n_iter_max=n_iter_max, init=init, tol=tol, random_state=seed
        )
        return mixing, shared_query, shared_key, core
