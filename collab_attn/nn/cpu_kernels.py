"""The decoding step of keys-only collaborative heads on the CPU, through two small kernels (``cpu_kernels.cpp``).

Keys-only collaborative heads (a value per head) have no fused kernel: ``scaled_dot_product_attention`` needs a
key per head, and copying the one shared key to every head is slower than not fusing
(``experiments/benchmarks/LOG.md``, section 16). Their step is two products, which PyTorch runs far below the
machine's memory speed for this shape: the scores of a few query rows against every shared key (``torch.bmm``, a
matrix product with a dozen rows), and each head's weights times its values (``torch.matmul``, a batch of
matrix-vector products). ``shared_key_scores`` and ``weighted_values`` do the same arithmetic in one pass over
the keys and one over the values (``experiments/benchmarks/LOG.md``, section 18). With shared values the step
scores through ``shared_key_scores`` too and sums the one shared value with a plain ``bmm`` (a large product,
which PyTorch runs well).

They are compiled from source with ``torch.utils.cpp_extension`` the first time a layer asks (about 20 s, then
cached by torch: one build per environment, named by where its torch lies, and kept whichever copy of collab_attn
asks), registered as the operators ``torch.ops.collab_attn.*`` with shape functions, so that
``torch.compile(fullgraph=True)`` traces through them. ``available()`` says whether they run here: x86 with AVX2
and FMA, a C++ compiler, and ``COLLAB_ATTN_CPU_KERNELS`` not set to ``0`` (set it to keep the reference path);
the variable is read once, by the first call. ``reference_path()`` switches the layers to the reference path for
what runs inside it, at call time, so that one process can time both (``benchmarks/decode.py
--kernels-against-reference``), compiled or not. Where they cannot be built the layers take the reference path and
a warning says why.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")
SWITCH = "COLLAB_ATTN_CPU_KERNELS"
LIBRARY = "collab_attn_cpu_kernels"

logger = logging.getLogger(__name__)
_loaded: dict[str, bool] = {}


def available() -> bool:
    """Whether the kernels run on this machine, building them on the first call (see the module's docstring), and
    are not switched off by ``reference_path()``. Traced by ``torch.compile``: the switch is guarded, so a graph
    compiled on one path is not reused on the other."""
    return _built() and not _reference


@torch.compiler.assume_constant_result
def _built() -> bool:
    if "ok" not in _loaded:
        _loaded["ok"] = _load()
    return _loaded["ok"]


_reference = False


@contextmanager
def reference_path() -> Iterator[None]:
    """Inside: ``available()`` is False, so every layer decodes through the reference path (the kernels stay
    built), eager or compiled (a compiled step traced on one path recompiles for the other: the switch is one of its
    guards)."""
    global _reference
    before, _reference = _reference, True
    try:
        yield
    finally:
        _reference = before


def shared_key_scores(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """``queries @ keys^T`` per batch element: queries (B, R, W), keys (B, S, W) -> (B, R, S), float32 on the CPU.
    The keys may be any view whose last stride is 1 (the shared keys of a packed cache)."""
    return torch.ops.collab_attn.shared_key_scores(queries, keys)


def weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``weights @ values`` per head: weights (B, H, T, S), values (B, H, S, D) -> (B, H, T, D), float32 on the CPU.
    Each query row makes one pass over its head's values: meant for decoding (T = 1)."""
    return torch.ops.collab_attn.weighted_values(weights, values)


def _load() -> bool:
    switch = os.environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{SWITCH}={switch!r}: set it to 0 (the reference path) or 1 (the kernels, the default)")
    if switch == "0":
        return False
    capability = torch.backends.cpu.get_cpu_capability()
    if os.name != "posix" or platform.machine().lower() not in ("x86_64", "amd64") or capability == "DEFAULT":
        logger.info("collab_attn CPU kernels: not built (they need x86 with AVX2; this CPU reports %s, %s)",
                    platform.machine(), capability)
        return False
    from torch.utils.cpp_extension import load_inline

    logger.info("collab_attn CPU kernels: compiling %s (once per environment, about 20 s)", SOURCE.name)
    # The source goes into the build folder as it is (load_inline): the build does not depend on where collab_attn
    # lies (another checkout, a test's copy), and each environment builds in a folder of its own (the build names
    # its torch's headers), so that switching between two rebuilds neither.
    environment = hashlib.sha1(os.path.dirname(torch.__file__).encode()).hexdigest()[:10]
    try:
        # -fopenmp: at::parallel_for is OpenMP in torch's CPU wheels, and without it the kernels run on one thread
        load_inline(name=f"{LIBRARY}_{environment}", cpp_sources=[SOURCE.read_text()], no_implicit_headers=True,
                    extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"], extra_ldflags=["-fopenmp"],
                    is_python_module=False)
    except Exception as error:  # no compiler, no ninja, a read-only cache: the reference path still works
        warnings.warn(
            f"collab_attn's CPU decoding kernels did not build ({type(error).__name__}: {error}); keys-only "
            f"collaborative layers decode through the reference path. Set {SWITCH}=0 to skip the build.",
            stacklevel=3,
        )
        return False
    torch.library.register_fake("collab_attn::shared_key_scores")(_scores_shape)
    torch.library.register_fake("collab_attn::weighted_values")(_weighted_shape)
    return True


def _scores_shape(queries: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return queries.new_empty(queries.shape[0], queries.shape[1], keys.shape[1])


def _weighted_shape(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    return weights.new_empty(*weights.shape[:3], values.shape[3])
