"""CP and Tucker decompositions of the stacked head products that never form the tensor.

The tensor is ``T[h] = A_h^T B_h`` (heads x d_in x d_in) with ``A_h = Wq_h`` and ``B_h = Wk_h`` (head_dim x d_in).
Every slice has rank at most ``head_dim``, so everything alternating least squares needs can be computed from
the per-head projections (``A``, ``B`` stacked: (heads * head_dim) x d_in) instead of the d_in^2 x heads tensor:

- MTTKRP for the shared query ``Q``: ``sum_{h,j} T[h,i,j] M[h,r] K[j,r] = (A^T ((B K) * M_rep))[i,r]``,
- for the shared key ``K``: ``(B^T ((A Q) * M_rep))[j,r]``,
- for the mixing ``M``: ``M[h,r] <- sum_a (A_h Q)[a,r] (B_h K)[a,r]``,
- Grams ``(M^T M) * (K^T K)`` etc., and ``||T||^2 = sum_h <A_h A_h^T, B_h B_h^T>``,

which costs ``O(heads * head_dim * d_in * rank)`` per update instead of ``O(heads * d_in^2 * rank)`` (plus a
Khatri-Rao product of ``d_in^2 x rank`` that dense solvers build). The update order (mixing, query, key), the
Gram-matrix solve are those of tensorly's ``parafac``, so from the same initialization both follow the same path up to
rounding; tests check that. The arithmetic runs in float64 (the four large products per iteration optionally in
float32), on the device the projections are on.

Stopping rule (``converged``, CP and Tucker): stop once the relative error improved by less than ``tol`` of its value
in each of the last ``patience`` iterations (one quiet iteration is not enough: line search makes every other step
larger), or once the fit is exact to rounding (error below ``EXACT_FIT``). ``tol=0`` runs every iteration.

``init="svd"`` takes ``Q`` and ``K`` from the leading eigenvectors of the query and key unfoldings' Gram
matrices ``sum_h A_h^T B_h B_h^T A_h`` and ``sum_h B_h^T A_h A_h^T B_h`` (the left singular vectors tensorly's
``init="svd"`` computes from the dense unfoldings); the mixing needs no initialization, since it is updated
first. ``init="random"`` draws the factors exactly as tensorly's ``init="random"`` does for the same seed.

Tucker (``tucker_hooi``): higher-order orthogonal iteration for ranks (core_size, rank, rank), again from the
projections: the Gram matrix of each projected unfolding is a small product of the Gram blocks of ``A`` and ``B``.

Scale: both solvers work on the tensor normalized to unit Frobenius norm (``HeadProducts.normalized``: ``A`` and
``B`` rescaled separately) and scale the factors back, so the fit does not depend on the scale of the weights: at
``1e-10`` the Grams of the products (~1e-40) would underflow float32 and ALS would diverge. Every tolerance is
relative (to ``||T||``, or the condition bound of ``_inverse_gram``), so none needs adjusting to the scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

CP_INITS = ("svd", "random")
SINGLE_PRECISION_UNTIL = 0.03  # relative error below which cp_als switches float32 products to float64
# Default stopping rule: < 0.05% relative improvement in each of 3 iterations in a row. On MiniLM it stops after
# 15-60 iterations below the error of the paper's 100 random-init iterations at every rank from 64 to 256
# (experiments/benchmarks/LOG.md, section 6).
DEFAULT_TOL = 5e-4
DEFAULT_N_ITER_MAX = 100
DEFAULT_PATIENCE = 3
EXACT_FIT = 1e-7  # relative errors below this are rounding noise (the error is a difference of squared norms)


def converged(errors: list[float], tol: float, patience: int = DEFAULT_PATIENCE) -> bool:
    """The stopping rule (see the module doc) on the errors so far, one per iteration."""
    if not tol or not errors:
        return False
    if errors[-1] < EXACT_FIT:
        return True
    if len(errors) <= patience:
        return False
    recent = errors[-patience - 1 :]
    return all(abs(before - after) < tol * after for before, after in zip(recent, recent[1:]))


# ---------------------------------------------------------------------------------------------------------------
# The implicit tensor


class HeadProducts:
    """The tensor ``T[h] = A_h^T B_h`` given by its per-head factors ``A``, ``B``: (heads, head_dim, d_in).

    ``A`` and ``B`` may have several rows per head that are not the original projections (a whitened or
    compressed version): only the products matter.
    """

    def __init__(
        self, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype = torch.float64, device: torch.device | str = None
    ):
        if a.dim() != 3 or a.shape != b.shape:
            raise ValueError(f"A and B must both be (heads, head_dim, d_in), got {tuple(a.shape)} and {tuple(b.shape)}")
        device = a.device if device is None else torch.device(device)
        self.a = a.detach().to(device, dtype)
        self.b = b.detach().to(device, dtype)
        self.heads, self.head_dim, self.d_in = self.a.shape
        self.a_flat = self.a.reshape(-1, self.d_in)  # (heads * head_dim, d_in)
        self.b_flat = self.b.reshape(-1, self.d_in)
        self._grams: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        return self.heads, self.d_in, self.d_in

    @property
    def device(self) -> torch.device:
        return self.a.device

    def head_grams(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``A_h A_h^T`` and ``B_h B_h^T``: (heads, head_dim, head_dim) each."""
        if self._grams is None:
            self._grams = self.a @ self.a.transpose(1, 2), self.b @ self.b.transpose(1, 2)
        return self._grams

    def norm_sq(self) -> float:
        """``||T||_F^2 = sum_h <A_h A_h^T, B_h B_h^T>``."""
        gram_a, gram_b = self.head_grams()
        return float((gram_a * gram_b).sum())

    def dense(self) -> torch.Tensor:
        """The tensor itself (heads, d_in, d_in): for tests and the dense solvers."""
        return torch.einsum("hai,haj->hij", self.a, self.b)

    def query_unfolding_gram(self) -> torch.Tensor:
        """``T_(1) T_(1)^T = sum_h A_h^T (B_h B_h^T) A_h``: (d_in, d_in)."""
        _, gram_b = self.head_grams()
        return self.a_flat.T @ (gram_b @ self.a).reshape(-1, self.d_in)

    def key_unfolding_gram(self) -> torch.Tensor:
        """``T_(2) T_(2)^T = sum_h B_h^T (A_h A_h^T) B_h``: (d_in, d_in)."""
        gram_a, _ = self.head_grams()
        return self.b_flat.T @ (gram_a @ self.b).reshape(-1, self.d_in)

    def head_unfolding_gram(self) -> torch.Tensor:
        """``<T_h, T_g>`` for all pairs of heads: (heads, heads)."""
        h, e = self.heads, self.head_dim
        cross_a = (self.a_flat @ self.a_flat.T).reshape(h, e, h, e)
        cross_b = (self.b_flat @ self.b_flat.T).reshape(h, e, h, e)
        return torch.einsum("hagb,hagb->hg", cross_a, cross_b)

    def project(self, query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
        """``Q^T T[h] K`` for every head: (heads, rank_q, rank_k)."""
        return (self.a @ query).transpose(1, 2) @ (self.b @ key)

    def normalized(self) -> tuple[HeadProducts, float, float]:
        """``(unit, query_scale, key_scale)``: the tensor of the projections ``A * query_scale`` and ``B * key_scale``,
        chosen so that ``||unit|| = 1`` and the two scaled projections have equal largest entries; hence
        ``T = unit / (query_scale * key_scale)``, and a fit ``Q, K`` of ``unit`` is the fit ``Q / query_scale``,
        ``K / key_scale`` of ``T`` (or the core divided by the product, for Tucker).

        The scales are taken from the largest entries first and the norm of the rescaled tensor after, so neither
        under- nor overflows in float64 whatever the scale of the weights. A zero tensor comes back as it is (scales
        1). Scaling ``A`` or ``B`` by any factor gives the same ``unit`` up to rounding.
        """
        a_max, b_max = float(self.a.abs().max()), float(self.b.abs().max())
        if not (0 < a_max < math.inf and 0 < b_max < math.inf):
            return self, 1.0, 1.0
        first = HeadProducts(self.a / a_max, self.b / b_max)
        root = first.norm_sq() ** 0.25  # entries at most 1: no overflow; zero only if the heads cancel exactly
        if not root > 0:
            return self, 1.0, 1.0
        unit = HeadProducts(first.a / root, first.b / root)
        return unit, 1.0 / (a_max * root), 1.0 / (b_max * root)


def leading_eigenvectors(gram: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` leading eigenvectors (columns, sign-fixed: largest entry positive) and eigenvalues of a PSD
    matrix, in decreasing order."""
    values, vectors = torch.linalg.eigh(gram)
    values, vectors = values.flip(0)[:k], vectors.flip(1)[:, :k]
    signs = torch.sign(vectors.gather(0, vectors.abs().argmax(0, keepdim=True)))
    signs[signs == 0] = 1
    return vectors * signs, values.clamp_min(0)


def _inverse_gram(gram: torch.Tensor) -> torch.Tensor:
    """The inverse of a symmetric PSD ``gram`` (rank x rank, float64) by Cholesky, or its pseudo-inverse (the
    minimum-norm least-squares solve) where it is numerically singular. ALS multiplies each right-hand side by it:
    ``rhs @ gram^{-1}`` is tensorly's ``solve(G^T, mttkrp^T)^T``, but one rank^3 inversion lets the large product run
    in the factors' precision.

    Cholesky succeeds on many numerically singular Grams (e.g. a factor column orthogonal to the tensor, as when the
    rank exceeds the tensor's CP rank: its mixing column is zero), and its inverse is then rounding noise of size
    ~1/eps: the factors jump by ~1e15 and, in float32, overflow to inf (the next Gram is NaN and ``pinv``'s ``eigh``
    fails). So the Cholesky inverse is kept only while ``tr(G) tr(G^-1)`` (an upper bound on the condition number
    of a PSD matrix, at most ``rank^2`` times too large, and free) stays below ``1 / (rank * eps)``, where ``pinv``
    starts dropping eigenvalues; above, ``pinv`` gives the same solve for a merely ill-conditioned Gram.
    """
    factor, info = torch.linalg.cholesky_ex(gram)
    if int(info) == 0:
        inverse = torch.cholesky_inverse(factor)
        condition_bound = float(gram.diagonal().sum() * inverse.diagonal().sum())
        if condition_bound * gram.shape[-1] * torch.finfo(gram.dtype).eps < 1:  # False if NaN
            return inverse
    if not bool(torch.isfinite(gram).all()):  # pinv's eigh would only say that it failed to converge
        raise FloatingPointError("CP-ALS diverged: a Gram matrix of the factors holds inf or NaN")
    return torch.linalg.pinv(gram, hermitian=True)


# ---------------------------------------------------------------------------------------------------------------
# CP


@dataclass
class CPResult:
    """Factors of ``T[h] ~= query @ diag(mixing[h]) @ key.T`` (float64) and the relative error per iteration."""

    mixing: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    errors: list[float] = field(default_factory=list)
    converged: bool = False

    @property
    def relative_error(self) -> float:
        return self.errors[-1] if self.errors else float("nan")

    @property
    def n_iter(self) -> int:
        return len(self.errors)


def cp_init(
    tensor: HeadProducts, rank: int, init="svd", seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Initial (mixing, query, key).

    ``"svd"``: leading eigenvectors of the query/key unfolding Grams (what tensorly's ``init="svd"`` gives for
    those modes, up to signs; computed in single precision: ALS only starts from them); the mixing is ones (ALS
    updates it first, so its initial value is never used).
    ``"random"``: uniform [0, 1) factors drawn as tensorly's ``random_cp`` draws them for this seed.
    A (mixing, query, key) tuple is used as given.
    """
    heads, d_in, _ = tensor.shape
    device = tensor.device
    if isinstance(init, (tuple, list)):
        mixing, query, key = (torch.as_tensor(f).detach().to(device, torch.float64).clone() for f in init)
        if mixing.shape != (heads, rank) or query.shape != (d_in, rank) or key.shape != (d_in, rank):
            raise ValueError("init factors must be (heads, rank), (d_in, rank), (d_in, rank)")
        return mixing, query, key
    rng = np.random.RandomState(seed)
    if init == "random":
        return tuple(torch.from_numpy(rng.random_sample((size, rank))).to(device) for size in (heads, d_in, d_in))
    if init != "svd":
        raise ValueError(f"unknown init {init!r}; choose one of {CP_INITS} or pass (mixing, query, key)")
    query, _ = leading_eigenvectors(tensor.query_unfolding_gram().float(), rank)
    key, _ = leading_eigenvectors(tensor.key_unfolding_gram().float(), rank)
    return torch.ones(heads, rank, dtype=torch.float64, device=device), query.double(), key.double()


def cp_als(
    w_query: torch.Tensor | HeadProducts,
    w_key: torch.Tensor | None,
    rank: int,
    *,
    init="svd",
    n_iter_max: int = DEFAULT_N_ITER_MAX,
    tol: float = DEFAULT_TOL,
    patience: int = DEFAULT_PATIENCE,
    seed: int = 0,
    linesearch: bool = False,
    matmul_dtype: torch.dtype = torch.float64,
    l2_reg: float = 0.0,
) -> CPResult:
    """Rank-``rank`` CP of ``T[h] = w_query[h]^T w_key[h]`` by ALS on the projections (see the module doc).

    Stops after ``n_iter_max`` iterations or by the stopping rule (``converged``: relative improvement below ``tol``
    in ``patience`` iterations in a row; ``tol=0`` never stops early). ``linesearch`` extrapolates the
    factors every other iteration from the sixth on, as tensorly's ``parafac(linesearch=True)`` does (jump
    ``iteration ** (1 / acc_pow)``, kept only if it lowers the error): on attention heads it reaches the error
    of plain ALS in about 60% of the work. ``matmul_dtype=torch.float32`` keeps the factors and every product of
    their size in single precision (about twice as fast); the rank x rank Gram matrices, their inverses and the
    errors stay float64. Below a relative error of ``SINGLE_PRECISION_UNTIL`` it goes on in double. ``l2_reg``
    adds ``l2_reg * I`` to each Gram matrix of the normalized problem (below), so it is relative to the tensor's
    scale. Runs on the device of ``w_query`` (or of the ``HeadProducts``). Deterministic for a given ``seed``.

    ALS runs on the unit-norm tensor (``HeadProducts.normalized``) and scales the factors back: the query factor
    takes the scale of the query projections, the key factor that of the keys, the mixing none. Explicit ``init``
    factors are given for the tensor itself and are rescaled likewise; ``"random"`` factors are drawn for the
    unit-norm tensor (ALS updates the mixing first, which makes the path the same for any scale).
    """
    tensor = w_query if isinstance(w_query, HeadProducts) else HeadProducts(w_query, w_key)
    tensor, query_scale, key_scale = tensor.normalized()
    if isinstance(init, (tuple, list)) and len(init) == 3:
        init = (init[0], torch.as_tensor(init[1]) * query_scale, torch.as_tensor(init[2]) * key_scale)
    result = _cp_als(tensor, rank, init, n_iter_max, tol, patience, seed, linesearch, matmul_dtype, l2_reg)
    result.query, result.key = result.query / query_scale, result.key / key_scale
    return result


def _cp_als(
    tensor: HeadProducts, rank: int, init, n_iter_max: int, tol: float, patience: int, seed: int, linesearch: bool,
    matmul_dtype: torch.dtype, l2_reg: float,
) -> CPResult:
    """``cp_als`` on a (normalized) tensor: the factors of ``tensor`` itself."""
    heads, head_dim = tensor.heads, tensor.head_dim
    mixing, query, key = cp_init(tensor, rank, init, seed)
    norm_sq = tensor.norm_sq()
    if norm_sq == 0:
        return CPResult(torch.zeros_like(mixing), query, key, [0.0], True)
    ridge = l2_reg * torch.eye(rank, dtype=torch.float64, device=tensor.device)
    dtype = matmul_dtype
    a_flat, b_flat = tensor.a_flat.to(dtype), tensor.b_flat.to(dtype)
    mixing, query, key = (f.to(dtype) for f in (mixing, query, key))

    def times(flat: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:  # (heads, head_dim, rank)
        return (flat @ factor).view(heads, head_dim, rank)

    def transposed_times(flat: torch.Tensor, per_head: torch.Tensor) -> torch.Tensor:  # (d_in, rank)
        return flat.T @ per_head.reshape(-1, rank)

    def gram(factor: torch.Tensor) -> torch.Tensor:  # (rank, rank), float64
        return (factor.T @ factor).to(torch.float64)

    def solve(gram_product: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:  # rhs @ (gram_product + ridge)^-1
        return rhs @ _inverse_gram(gram_product + ridge).to(rhs.dtype)

    def error(grams, inner: torch.Tensor) -> float:
        norm_approx_sq = float((grams[0] * grams[1] * grams[2]).sum())
        return abs(norm_sq + norm_approx_sq - 2 * float(inner)) ** 0.5 / norm_sq**0.5

    result = CPResult(mixing, query, key)
    a_query, b_key = times(a_flat, query), None
    gram_query, gram_key = gram(query), gram(key)
    acc_pow, acc_fail, max_fail = 2.0, 0, 4  # tensorly's line search settings
    for iteration in range(n_iter_max):
        last = (mixing, query, key)
        # mixing: M[h] <- sum_a (A_h Q)[a] * (B_h K)[a], then the Gram solve
        if b_key is None:
            b_key = times(b_flat, key)
        mixing = solve(gram_query * gram_key, (a_query * b_key).sum(1))
        gram_mixing = gram(mixing)
        # query: A^T ((B K) * M)
        query = solve(gram_mixing * gram_key, transposed_times(a_flat, b_key * mixing[:, None]))
        gram_query = gram(query)
        # key: B^T ((A Q) * M)
        a_query = times(a_flat, query)
        mttkrp_key = transposed_times(b_flat, a_query * mixing[:, None])
        key = solve(gram_mixing * gram_query, mttkrp_key)
        gram_key, b_key = gram(key), None
        # ||T - T^||^2 = ||T||^2 + ||T^||^2 - 2 <T, T^>, with <T, T^> from the last MTTKRP (tensorly's trick)
        current = error((gram_mixing, gram_query, gram_key), (mttkrp_key * key).sum(dtype=torch.float64))
        if linesearch and iteration % 2 == 0 and iteration > 5:
            jump = iteration ** (1.0 / acc_pow)
            trial = [old + (new - old) * jump for old, new in zip(last, (mixing, query, key))]
            trial_a_query, trial_b_key = times(a_flat, trial[1]), times(b_flat, trial[2])
            trial_grams = tuple(gram(f) for f in trial)
            trial_inner = ((trial_a_query * trial_b_key).sum(1) * trial[0]).sum(dtype=torch.float64)
            trial_error = error(trial_grams, trial_inner)
            if trial_error < current:
                (mixing, query, key), current, acc_fail = trial, trial_error, 0
                a_query, b_key = trial_a_query, trial_b_key
                _, gram_query, gram_key = trial_grams
            else:
                acc_fail += 1
                if acc_fail == max_fail:
                    acc_pow, acc_fail = acc_pow + 1.0, 0
        result.errors.append(current)
        if dtype != torch.float64 and current < SINGLE_PRECISION_UNTIL:
            # single precision leaves ~1e-7 noise in the squared error: go on in double near an exact fit
            dtype = torch.float64
            a_flat, b_flat = tensor.a_flat, tensor.b_flat
            mixing, query, key = (f.to(dtype) for f in (mixing, query, key))
            a_query, b_key = times(a_flat, query), None
            gram_query, gram_key = gram(query), gram(key)
        if converged(result.errors, tol, patience):
            result.converged = True
            break
    result.mixing, result.query, result.key = (f.to(torch.float64) for f in (mixing, query, key))
    return result


def cp_relative_error(tensor: HeadProducts, mixing: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> float:
    """Exact ``||T - [[M, Q, K]]|| / ||T||`` without forming either tensor (computed at unit scale)."""
    tensor, query_scale, key_scale = tensor.normalized()
    mixing, query, key = (f.to(torch.float64) for f in (mixing, query, key))
    query, key = query * query_scale, key * key_scale
    norm_sq = tensor.norm_sq()
    inner = float((tensor.project(query, key).diagonal(dim1=1, dim2=2) * mixing).sum())
    norm_approx_sq = float(((mixing.T @ mixing) * (query.T @ query) * (key.T @ key)).sum())
    return abs(norm_sq + norm_approx_sq - 2 * inner) ** 0.5 / norm_sq**0.5


# ---------------------------------------------------------------------------------------------------------------
# Tucker


@dataclass
class TuckerResult:
    """``T[h] ~= query @ (sum_g mixing[h, g] core[g]) @ key.T`` with orthonormal factors (float64)."""

    mixing: torch.Tensor
    query: torch.Tensor
    key: torch.Tensor
    core: torch.Tensor
    errors: list[float] = field(default_factory=list)
    converged: bool = False

    @property
    def relative_error(self) -> float:
        return self.errors[-1] if self.errors else float("nan")


def tucker_hooi(
    w_query: torch.Tensor | HeadProducts,
    w_key: torch.Tensor | None,
    rank: int,
    core_size: int | None = None,
    *,
    init: str = "svd",
    n_iter_max: int = DEFAULT_N_ITER_MAX,
    tol: float = DEFAULT_TOL,
    patience: int = DEFAULT_PATIENCE,
    seed: int = 0,
) -> TuckerResult:
    """Tucker with ranks (core_size, rank, rank) by HOOI from the projections.

    ``init="svd"`` is the HOSVD (leading eigenvectors of each unfolding's Gram), ``"random"`` orthonormalized
    uniform noise drawn from ``seed``. Each HOOI step (modes in tensorly's order: heads, query, key) replaces one
    factor by the leading eigenvectors of the Gram matrix of the tensor projected on the two other factors; these
    Grams come from ``A``, ``B`` and the factors at ``O(d_in^2 * heads * head_dim)`` cost. Stops by the rule of
    ``converged`` (as ``cp_als``). Runs on the device of the projections. HOOI runs on the unit-norm tensor
    (``HeadProducts.normalized``); the factors stay orthonormal and the core takes the tensor's scale back.
    """
    tensor = w_query if isinstance(w_query, HeadProducts) else HeadProducts(w_query, w_key)
    tensor, query_scale, key_scale = tensor.normalized()
    result = _tucker_hooi(tensor, rank, core_size, init, n_iter_max, tol, patience, seed)
    result.core = result.core / (query_scale * key_scale)
    return result


def _tucker_hooi(
    tensor: HeadProducts, rank: int, core_size: int | None, init: str, n_iter_max: int, tol: float, patience: int,
    seed: int,
) -> TuckerResult:
    """``tucker_hooi`` on a (normalized) tensor."""
    heads, head_dim, d_in = tensor.heads, tensor.head_dim, tensor.d_in
    core_size = core_size or heads
    norm_sq = tensor.norm_sq()
    a_flat, b_flat = tensor.a_flat, tensor.b_flat
    if init == "svd":
        query, _ = leading_eigenvectors(tensor.query_unfolding_gram(), rank)
        key, _ = leading_eigenvectors(tensor.key_unfolding_gram(), rank)
    elif init == "random":
        rng = np.random.RandomState(seed)
        query, key = (
            torch.linalg.qr(torch.from_numpy(rng.random_sample((d_in, rank))).to(tensor.device))[0] for _ in range(2)
        )
    else:
        raise ValueError(f"unknown init {init!r} for Tucker; choose 'svd' or 'random'")
    result = TuckerResult(torch.empty(0), query, key, torch.empty(0))
    a_query = (a_flat @ query).view(heads, head_dim, rank)
    for _ in range(n_iter_max):
        # heads: leading eigenvectors of the Gram of Q^T T[h] K over heads
        b_key = (b_flat @ key).view(heads, head_dim, rank)
        flat = (a_query.transpose(1, 2) @ b_key).reshape(heads, -1)
        mixing, _ = leading_eigenvectors(flat @ flat.T, core_size)
        head_mix = mixing @ mixing.T  # (heads, heads): projection on the head factor
        # query: Gram of T x_0 M^T x_2 K^T along mode 1 = A^T [ (M M^T)[h,g] (B_h K)(B_g K)^T ]_{h,g} A
        inner = torch.einsum("hg,har,gbr->hagb", head_mix, b_key, b_key).reshape(heads * head_dim, -1)
        query, _ = leading_eigenvectors(a_flat.T @ inner @ a_flat, rank)
        a_query = (a_flat @ query).view(heads, head_dim, rank)
        inner = torch.einsum("hg,har,gbr->hagb", head_mix, a_query, a_query).reshape(heads * head_dim, -1)
        key, _ = leading_eigenvectors(b_flat.T @ inner @ b_flat, rank)
        b_key = (b_flat @ key).view(heads, head_dim, rank)
        core = torch.einsum("hg,hrs->grs", mixing, a_query.transpose(1, 2) @ b_key)
        # orthonormal factors: ||T - T^||^2 = ||T||^2 - ||core||^2
        result.errors.append(max(norm_sq - float((core**2).sum()), 0.0) ** 0.5 / norm_sq**0.5)
        result.mixing, result.query, result.key, result.core = mixing, query, key, core
        if converged(result.errors, tol, patience):
            result.converged = True
            break
    return result


def tucker_relative_error(
    tensor: HeadProducts, mixing: torch.Tensor, query: torch.Tensor, key: torch.Tensor, core: torch.Tensor
) -> float:
    """Exact ``||T - [[core; M, Q, K]]|| / ||T||`` without forming either tensor (factors need not be orthonormal;
    computed at unit scale)."""
    tensor, query_scale, key_scale = tensor.normalized()
    mixing, query, key, core = (f.to(torch.float64) for f in (mixing, query, key, core))
    query, key = query * query_scale, key * key_scale
    mats = torch.einsum("hg,grs->hrs", mixing, core)  # M_h
    norm_sq = tensor.norm_sq()
    inner = float((tensor.project(query, key) * mats).sum())
    norm_approx_sq = float(torch.einsum("hrs,rt,hts->", mats @ (key.T @ key), query.T @ query, mats))
    return abs(norm_sq + norm_approx_sq - 2 * inner) ** 0.5 / norm_sq**0.5
