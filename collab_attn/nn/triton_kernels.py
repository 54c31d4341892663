"""The decoding step of the shared-key layouts as Triton kernels (flash-decoding; issue 67).

One decoding step scores one query row per head against every cached key. In every shared-key layout the heads
read one key per token: collaborative keys (``CollaborativeAttention``, the cached shared key and the heads' content
logits), the rotated shared pairs of the rotary layers (a shared key of width 2R), and MLA absorbed (the packed row:
the rotated kept keys and the latent, with the latent as the value). Two operators cover them:

- ``keys_only`` (``collab_attn::triton_keys_only_decode``): one shared key per token, scored by every head's query,
  and a value per head or per group of heads (``values`` (B, G, S, Dv), head ``h`` reading group ``h // (H / G)``).
  One program per head, chunk and batch element; the heads of a (batch, chunk) run side by side, so the shared key
  is read from memory once and from the cache by the others.
- ``shared_kv`` (``collab_attn::triton_shared_kv_decode``): one shared key and one shared value per token
  (multi-query attention over the shared widths; MLA absorbed: the value a view of the key's row). One program per
  chunk and batch element scores every head at once (two ``tl.dot``), so the cache is read once.

Both add the heads' content logits (B, H, S) and an additive padding mask (B, S) inside the kernel, never as a
(B, H, 1, S) mask tensor, and split the sequence into chunks (flash-decoding: batch 1 at a long context still fills
the GPU): each program keeps a running maximum, sum and weighted sum of values over its chunk in float32, and a
third kernel rescales the chunks into the softmax over the whole sequence (with one chunk the kernel writes the
output itself). Any width: a block of the next power of two covers it and loads past the width are masked (the
cache is never padded). float32 and bfloat16 (and float16) inputs; every sum in float32; the output in the queries'
dtype.

The operators are ``torch.library`` custom ops with shape functions (registered at import, without triton), so a
static cache's decoding step compiles with ``torch.compile(fullgraph=True)`` and runs under CUDA graphs; triton is
imported on the first call. ``applies(tensor)`` says whether a layer takes them, by the switch
``COLLAB_ATTN_TRITON``: ``1`` forces them wherever they apply (on the CPU only under Triton's interpreter,
``TRITON_INTERPRET=1``, which is how the tests run them), ``0`` keeps them off, unset takes them for CUDA tensors
of compute capability 8.0 or newer when triton is installed. The variable is read once, by the first call; any
other value is refused.
``present_path()`` turns them off at call time for what runs inside it, so that one process can time both.
"""

from __future__ import annotations

import importlib.util
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

SWITCH = "COLLAB_ATTN_TRITON"
# Keys per tile inside a chunk, and warps per program: first guesses, not measured on a GPU yet. Compiled for sm_90
# (ptxas -v), 16 keys per tile keeps a GPT-2 layer's programs at 96 to 142 registers without spills (32 keys: 179 to
# 243), so more programs share a multiprocessor to hide the memory's latency.
BLOCK_KEYS = 16
WARPS: int | None = None  # warps per program; None: 4, or 8 for the shared kernel above 128 wide
# (both read at every call: benchmarks/decode_kernels.py --triton-tiles sweeps them)
BLOCK_CHUNKS = 16  # chunks per tile of the combine

_state: dict[str, object] = {}


# ----------------------------------------------------------------------------------------------------------------
# The switch


@torch.compiler.assume_constant_result
def _switch() -> str | None:
    """``COLLAB_ATTN_TRITON`` as read on the first call: ``"0"``, ``"1"`` or None (unset)."""
    if "switch" not in _state:
        value = os.environ.get(SWITCH)
        if value not in (None, "0", "1"):
            raise ValueError(f"{SWITCH}={value!r}: set it to 1 (the Triton kernels wherever they apply), 0 (never) "
                             "or leave it unset (the kernels for CUDA tensors when triton is installed)")
        _state["switch"] = value
    return _state["switch"]


@torch.compiler.assume_constant_result
def installed() -> bool:
    """Whether triton can be imported here (nothing is imported to find out)."""
    if "installed" not in _state:
        _state["installed"] = importlib.util.find_spec("triton") is not None
    return _state["installed"]


@torch.compiler.assume_constant_result
def _capable(index: int | None) -> bool:
    """Whether the GPU ``index`` (None: the current one) is one the kernels are on by default for: compute capability
    8.0 or newer (Ampere, Hopper, ...: bfloat16 tensor-core products). Older GPUs take them only when forced."""
    key = ("capable", index)
    if key not in _state:
        _state[key] = torch.cuda.get_device_capability(index) >= (8, 0)
    return _state[key]


def interpreting() -> bool:
    """Whether Triton runs its kernels in its interpreter on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


_present = False


@contextmanager
def present_path() -> Iterator[None]:
    """Inside: ``applies()`` is False, so every layer decodes through its present path (what it runs without the
    kernels), eager or compiled (a compiled step traced on one path recompiles for the other: the flag is one of its
    guards). ``benchmarks/decode.py --triton`` times both in one process this way."""
    global _present
    before, _present = _present, True
    try:
        yield
    finally:
        _present = before


def applies(tensor: torch.Tensor) -> bool:
    """Whether a decoding step on ``tensor``'s device takes the Triton kernels (the module's docstring), outside
    ``present_path()``.

    ``COLLAB_ATTN_TRITON=1`` where they cannot run (triton not installed, or a CPU tensor without
    ``TRITON_INTERPRET=1``) is an error, not a quiet fallback."""
    switch = _switch()
    if switch == "0" or _present:
        return False
    if switch is None:
        return tensor.device.type == "cuda" and installed() and _capable(tensor.device.index)
    if not installed():
        raise RuntimeError(f"{SWITCH}=1 asks for the Triton kernels, but triton is not installed "
                           "(pip install -e '.[dev]')")
    if tensor.device.type == "cpu" and not interpreting():
        raise RuntimeError(f"{SWITCH}=1 on a CPU tensor: the Triton kernels run on the CPU only in Triton's "
                           "interpreter; set TRITON_INTERPRET=1 before triton is imported")
    if tensor.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"{SWITCH}=1 on a {tensor.device.type} tensor: the Triton kernels run on CUDA (or on the "
                           "CPU in Triton's interpreter)")
    return True


# ----------------------------------------------------------------------------------------------------------------
# The public calls


def keys_only(queries, keys, values, content=None, mask=None, scale: float = 1.0, chunk: int = 0,
              content_scale: float = 1.0) -> torch.Tensor:
    """``softmax(scale * queries keys^T + content_scale * content + mask) values`` per head, one query row per head.

    queries (B, H, R); keys (B, S, R), one per token for every head (any view, e.g. the shared key of a packed
    cache); values (B, G, S, Dv), G dividing H, head ``h`` reading group ``h // (H / G)``; content (B, H, S) or None
    (any view: the content columns of a packed cache); mask (B, S) additive, or None; ``chunk`` keys per program (0:
    chosen for the device). Returns (B, H, Dv) in the queries' dtype."""
    return torch.ops.collab_attn.triton_keys_only_decode(queries, keys, values, content, mask, float(scale), chunk,
                                                         float(content_scale))


def shared_kv(queries, keys, values, content=None, mask=None, scale: float = 1.0, chunk: int = 0,
              content_scale: float = 1.0) -> torch.Tensor:
    """``keys_only`` with one value per token shared by every head: values (B, S, Dv) (may be a view of the keys'
    rows, as MLA absorbed reads its latent). Returns (B, H, Dv) in the queries' dtype."""
    return torch.ops.collab_attn.triton_shared_kv_decode(queries, keys, values, content, mask, float(scale), chunk,
                                                         float(content_scale))


DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def takes_step(tgt_len: int, tensors, mask: torch.Tensor | None, dropout: float) -> bool:
    """Whether a layer's step goes through the kernels: one query row, inference (no gradient to keep, no dropout),
    floating inputs the kernels take, a mask that is the same for every head, and ``applies`` (the switch). The layer
    must not have been asked for attention weights (it checks that itself)."""
    if tgt_len != 1 or dropout:
        return False
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return False
    if any(t.dtype not in DTYPES for t in tensors) or (mask is not None and mask.dtype not in DTYPES):
        return False
    if mask is not None and (mask.dim() > 4 or mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape)).shape[1:3]
                             != (1, 1)):
        return False
    return applies(tensors[0])


def step(queries, keys, values, mask=None, content=None, scale: float = 1.0, shared_values: bool = False,
         content_scale: float = 1.0):
    """A layer's decoding step through the kernels, in the layers' shapes: queries (B, H, 1, R), keys (B, S, R),
    values (B, G, S, Dv) (a value per group of heads) or, with ``shared_values``, (B, S, Dv); ``mask`` the layer's
    additive mask (broadcastable to (B, 1, 1, S): ``takes_step`` said so), ``content`` (B, H, 1, S) or None, multiplied
    by ``content_scale`` in the kernel. Returns the context (B, H, Dv)."""
    batch, src_len = keys.shape[0], keys.shape[1]
    _, mask = padding_mask(mask, batch, src_len)
    content = None if content is None else content.expand(batch, -1, 1, src_len)[:, :, 0]
    call = shared_kv if shared_values else keys_only
    return call(queries[:, :, 0], keys, values, content, mask, scale, content_scale=content_scale)


def padding_mask(mask: torch.Tensor | None, batch: int, src_len: int) -> tuple[bool, torch.Tensor | None]:
    """An additive mask as the layers hold it (broadcastable to (B, H, 1, S)) as the kernels take it, (B, S) (a
    view): ``(True, mask)`` when it is the same for every head (padding, a static cache's unfilled positions, a
    decoding step's causal row), ``(False, None)`` when it differs between heads (the layer keeps its present
    path)."""
    if mask is None:
        return True, None
    mask = mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))
    if mask.shape[1] != 1 or mask.shape[2] != 1:
        return False, None
    return True, mask[:, 0, 0].expand(batch, src_len)


# ----------------------------------------------------------------------------------------------------------------
# The operators


def _check(name, queries, keys, values, content, mask, values_dims):
    batch, heads, width = queries.shape
    if keys.dim() != 3 or keys.shape[0] != batch or keys.shape[2] != width:
        raise ValueError(f"{name}: keys must be (B, S, R) = ({batch}, S, {width}), got {tuple(keys.shape)}")
    src_len = keys.shape[1]
    if src_len == 0:
        raise ValueError(f"{name}: no keys to attend to")
    if values.dim() != values_dims or values.shape[0] != batch or values.shape[-2] != src_len:
        raise ValueError(f"{name}: values of shape {tuple(values.shape)} do not fit queries {tuple(queries.shape)} "
                         f"and keys {tuple(keys.shape)}")
    if content is not None and tuple(content.shape) != (batch, heads, src_len):
        raise ValueError(f"{name}: content must be (B, H, S) = {(batch, heads, src_len)}, got {tuple(content.shape)}")
    if mask is not None and tuple(mask.shape) != (batch, src_len):
        raise ValueError(f"{name}: mask must be (B, S) = {(batch, src_len)}, got {tuple(mask.shape)}")
    devices = {t.device for t in (queries, keys, values, content, mask) if t is not None}
    if len(devices) != 1:
        raise ValueError(f"{name}: the inputs are on several devices: {sorted(map(str, devices))}")


def _chunk_size(chunk: int, src_len: int, programs_per_chunk: int, device: torch.device,
                most_chunks: int | None = None) -> int:
    """Keys per program: ``chunk`` when given, else enough chunks for about four programs per multiprocessor, each of
    at least ``4 BLOCK_KEYS`` keys and at most ``most_chunks`` of them; one chunk on the CPU (the interpreter)."""
    if chunk < 0:
        raise ValueError(f"chunk must be positive (or 0: chosen for the device), got {chunk}")
    if chunk:
        return chunk
    if device.type != "cuda":
        return src_len
    wanted = 4 * torch.cuda.get_device_properties(device).multi_processor_count
    most = math.ceil(src_len / (4 * BLOCK_KEYS)) if most_chunks is None else min(most_chunks, src_len)
    chunks = max(1, min(math.ceil(wanted / programs_per_chunk), most))
    return math.ceil(src_len / chunks)


def _block(width: int) -> int:
    return max(16, triton_next_power_of_2(width))


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _outputs(queries, chunks: int, value_width: int):
    """Where a kernel writes: with one chunk the output itself, (B, H, Dv) in the queries' dtype (no maxima and
    sums); with several the float32 partial results (B, H, C, Dv), running maxima and sums (B, H, C)."""
    batch, heads = queries.shape[:2]
    if chunks == 1:
        return queries.new_empty(batch, heads, value_width), None, None
    partial = queries.new_empty(batch, heads, chunks, value_width, dtype=torch.float32)
    maxima = queries.new_empty(batch, heads, chunks, dtype=torch.float32)
    return partial, maxima, torch.empty_like(maxima)


def _combine(kernels, partial, maxima, sums, dtype):
    """The chunks' partial results (B, H, C, Dv), running maxima and sums (B, H, C) -> the softmax over all keys,
    (B, H, Dv) in ``dtype``: one program per head and batch element."""
    if maxima is None:  # one chunk: the kernel wrote the output
        return partial
    batch, heads, chunks, value_width = partial.shape
    out = partial.new_empty(batch, heads, value_width, dtype=dtype)
    kernels["combine"][(batch * heads,)](partial, maxima, sums, out, chunks, value_width, BLOCK_C=BLOCK_CHUNKS,
                                         BLOCK_DV=_block(value_width))
    return out


def _strides(tensor, dims):
    return (0,) * dims if tensor is None else tuple(tensor.stride())


@torch.library.custom_op("collab_attn::triton_keys_only_decode", mutates_args=())
def _keys_only_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, content: torch.Tensor | None,
                  mask: torch.Tensor | None, scale: float, chunk: int, content_scale: float) -> torch.Tensor:
    _check("keys_only", queries, keys, values, content, mask, 4)
    kernels = _kernels()
    batch, heads, width = queries.shape
    groups, src_len, value_width = values.shape[1:]
    if heads % groups:
        raise ValueError(f"keys_only: {heads} heads cannot share {groups} value groups")
    chunk = _chunk_size(chunk, src_len, batch * heads, queries.device)
    chunks = math.ceil(src_len / chunk)
    partial, maxima, sums = _outputs(queries, chunks, value_width)
    kernels["keys_only"][(heads, chunks, batch)](
        queries, keys, values, content, mask, partial, maxima, sums,
        src_len, chunk, scale, content_scale, heads // groups, width, value_width,
        *queries.stride(), *keys.stride(), *values.stride(), *_strides(content, 3), *_strides(mask, 2),
        HAS_CONTENT=content is not None, HAS_MASK=mask is not None, SPLIT=chunks > 1,
        BLOCK_S=BLOCK_KEYS, BLOCK_R=_block(width), BLOCK_DV=_block(value_width), num_warps=WARPS or 4,
    )
    return _combine(kernels, partial, maxima, sums, queries.dtype)


@torch.library.custom_op("collab_attn::triton_shared_kv_decode", mutates_args=())
def _shared_kv_op(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, content: torch.Tensor | None,
                  mask: torch.Tensor | None, scale: float, chunk: int, content_scale: float) -> torch.Tensor:
    _check("shared_kv", queries, keys, values, content, mask, 3)
    kernels = _kernels()
    batch, heads, width = queries.shape
    src_len, value_width = values.shape[1:]
    # every chunk writes a float32 partial result per head (H Dv numbers) that the combine reads back: against a
    # cache of S (2 Dv + H) bfloat16 numbers that is about 2 C H / S more traffic, kept near a tenth at most
    chunk = _chunk_size(chunk, src_len, batch, queries.device, most_chunks=max(1, src_len // (20 * heads)))
    chunks = math.ceil(src_len / chunk)
    partial, maxima, sums = _outputs(queries, chunks, value_width)
    block_r, block_dv = _block(width), _block(value_width)
    kernels["shared_kv"][(chunks, batch)](
        queries, keys, values, content, mask, partial, maxima, sums,
        src_len, chunk, scale, content_scale, heads, width, value_width,
        *queries.stride(), *keys.stride(), *values.stride(), *_strides(content, 3), *_strides(mask, 2),
        HAS_CONTENT=content is not None, HAS_MASK=mask is not None, SPLIT=chunks > 1,
        FLOAT32_DOT=keys.dtype == torch.float32 or interpreting(),
        BLOCK_H=_block(heads), BLOCK_S=BLOCK_KEYS, BLOCK_R=block_r, BLOCK_DV=block_dv,
        num_warps=WARPS or (8 if max(block_r, block_dv) > 128 else 4),
    )
    return _combine(kernels, partial, maxima, sums, queries.dtype)


@_keys_only_op.register_fake
@_shared_kv_op.register_fake
def _decode_shape(queries, keys, values, content, mask, scale, chunk, content_scale):
    return queries.new_empty(*queries.shape[:2], values.shape[-1])


# ----------------------------------------------------------------------------------------------------------------
# The kernels: defined on the first call, so that triton (and TRITON_INTERPRET) is read only then


def _kernels() -> dict:
    if "kernels" in _state:
        return _state["kernels"]
    if not installed():
        raise RuntimeError("the Triton decoding kernels need triton: pip install -e '.[dev]'")
    import triton
    import triton.language as tl

    @triton.jit
    def keys_only_kernel(
        Q, K, V, C, M, OUT, MAX, SUM,
        src_len, chunk, scale, content_scale, group, width, value_width,
        sq_b, sq_h, sq_r, sk_b, sk_s, sk_r, sv_b, sv_g, sv_s, sv_d, sc_b, sc_h, sc_s, sm_b, sm_s,
        HAS_CONTENT: tl.constexpr, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr,
        BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        """One head ``h`` of one batch element ``b`` over one chunk of keys: its running maximum, sum and weighted
        sum of its group's values, written to O[b, h, chunk], MAX[b, h, chunk], SUM[b, h, chunk]."""
        h, c = tl.program_id(0), tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)  # offsets in 64 bits: a large batch's cache passes 2^31 elements
        heads, chunks = tl.num_programs(0), tl.num_programs(1)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + b * sq_b + h * sq_h + r * sq_r, mask=r < width, other=0.0).to(tl.float32)
        start = c * chunk
        stop = tl.minimum(start + chunk, src_len)
        top = tl.max(tl.full([BLOCK_S], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([BLOCK_S], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_DV], tl.float32)
        value_base = V + b * sv_b + (h // group) * sv_g
        for first in range(start, stop, BLOCK_S):
            s = first + tl.arange(0, BLOCK_S)
            valid = s < stop
            k = tl.load(K + b * sk_b + s[:, None] * sk_s + r[None, :] * sk_r,
                        mask=valid[:, None] & (r < width)[None, :], other=0.0).to(tl.float32)
            logits = tl.sum(k * q[None, :], axis=1) * scale
            if HAS_CONTENT:
                logits += tl.load(C + b * sc_b + h * sc_h + s * sc_s, mask=valid, other=0.0).to(tl.float32) \
                    * content_scale
            if HAS_MASK:
                logits += tl.load(M + b * sm_b + s * sm_s, mask=valid, other=0.0).to(tl.float32)
            # a blocked key (the dtype's most negative number, or -inf) stays finite: a row with every key blocked
            # gets uniform weights, as on the explicit path
            logits = tl.where(valid, tl.maximum(logits, -3.4028234663852886e38), float("-inf"))
            new_top = tl.maximum(top, tl.max(logits, axis=0))
            rescale = tl.exp(top - new_top)
            p = tl.exp(logits - new_top)
            v = tl.load(value_base + s[:, None] * sv_s + d[None, :] * sv_d,
                        mask=valid[:, None] & (d < value_width)[None, :], other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(p[:, None] * v, axis=0)
            total = total * rescale + tl.sum(p, axis=0)
            top = new_top
        row = (b * heads + h) * chunks + c
        if SPLIT:  # the chunk's partial results, for the combine
            tl.store(OUT + row * value_width + d, acc, mask=d < value_width)
            tl.store(MAX + row, top)
            tl.store(SUM + row, total)
        else:  # the only chunk: the output itself
            tl.store(OUT + row * value_width + d, (acc / total).to(OUT.dtype.element_ty), mask=d < value_width)

    @triton.jit
    def shared_kv_kernel(
        Q, K, V, C, M, OUT, MAX, SUM,
        src_len, chunk, scale, content_scale, heads, width, value_width,
        sq_b, sq_h, sq_r, sk_b, sk_s, sk_r, sv_b, sv_s, sv_d, sc_b, sc_h, sc_s, sm_b, sm_s,
        HAS_CONTENT: tl.constexpr, HAS_MASK: tl.constexpr, SPLIT: tl.constexpr, FLOAT32_DOT: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_DV: tl.constexpr,
    ):
        """Every head of one batch element ``b`` over one chunk of keys at once: the heads are the rows of two
        matrix products with the chunk's shared keys and values, read once."""
        c = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)  # offsets in 64 bits: a large batch's cache passes 2^31 elements
        chunks = tl.num_programs(0)
        h = tl.arange(0, BLOCK_H)
        r = tl.arange(0, BLOCK_R)
        d = tl.arange(0, BLOCK_DV)
        q = tl.load(Q + b * sq_b + h[:, None] * sq_h + r[None, :] * sq_r,
                    mask=(h < heads)[:, None] & (r < width)[None, :], other=0.0)
        q = q.to(tl.float32) if FLOAT32_DOT else q.to(K.dtype.element_ty)
        start = c * chunk
        stop = tl.minimum(start + chunk, src_len)
        top = tl.full([BLOCK_H], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for first in range(start, stop, BLOCK_S):
            s = first + tl.arange(0, BLOCK_S)
            valid = s < stop
            k = tl.load(K + b * sk_b + s[:, None] * sk_s + r[None, :] * sk_r,
                        mask=valid[:, None] & (r < width)[None, :], other=0.0)
            if FLOAT32_DOT:
                logits = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
            else:
                logits = tl.dot(q, tl.trans(k))
            logits = logits * scale
            if HAS_CONTENT:
                logits += tl.load(C + b * sc_b + h[:, None] * sc_h + s[None, :] * sc_s,
                                  mask=(h < heads)[:, None] & valid[None, :], other=0.0).to(tl.float32) * content_scale
            if HAS_MASK:
                logits += tl.load(M + b * sm_b + s * sm_s, mask=valid, other=0.0).to(tl.float32)[None, :]
            logits = tl.where(valid[None, :], tl.maximum(logits, -3.4028234663852886e38), float("-inf"))
            new_top = tl.maximum(top, tl.max(logits, axis=1))
            rescale = tl.exp(top - new_top)
            p = tl.exp(logits - new_top[:, None])
            v = tl.load(V + b * sv_b + s[:, None] * sv_s + d[None, :] * sv_d,
                        mask=valid[:, None] & (d < value_width)[None, :], other=0.0)
            if FLOAT32_DOT:
                acc = acc * rescale[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            total = total * rescale + tl.sum(p, axis=1)
            top = new_top
        row = (b * heads + h) * chunks + c
        rows = h < heads
        if SPLIT:  # the chunk's partial results, for the combine
            tl.store(OUT + row[:, None] * value_width + d[None, :], acc,
                     mask=rows[:, None] & (d < value_width)[None, :])
            tl.store(MAX + row, top, mask=rows)
            tl.store(SUM + row, total, mask=rows)
        else:  # the only chunk: the output itself
            tl.store(OUT + row[:, None] * value_width + d[None, :], (acc / total[:, None]).to(OUT.dtype.element_ty),
                     mask=rows[:, None] & (d < value_width)[None, :])

    @triton.jit
    def combine_kernel(PART, MAX, SUM, OUT, chunks, value_width, BLOCK_C: tl.constexpr, BLOCK_DV: tl.constexpr):
        """One head of one batch element (row ``b H + h``): its chunks' weighted sums rescaled to their common
        maximum, added up and divided by the rescaled sum of their weights."""
        row = tl.program_id(0).to(tl.int64)
        d = tl.arange(0, BLOCK_DV)
        top = tl.max(tl.full([BLOCK_C], float("-inf"), tl.float32), axis=0)
        total = tl.sum(tl.zeros([BLOCK_C], tl.float32), axis=0)
        acc = tl.zeros([BLOCK_DV], tl.float32)
        for first in range(0, chunks, BLOCK_C):
            c = first + tl.arange(0, BLOCK_C)
            valid = c < chunks
            maxima = tl.load(MAX + row * chunks + c, mask=valid, other=float("-inf"))
            new_top = tl.maximum(top, tl.max(maxima, axis=0))
            rescale = tl.exp(top - new_top)
            weights = tl.exp(maxima - new_top)
            partial = tl.load(PART + (row * chunks + c)[:, None] * value_width + d[None, :],
                              mask=valid[:, None] & (d < value_width)[None, :], other=0.0)
            acc = acc * rescale + tl.sum(partial * weights[:, None], axis=0)
            total = total * rescale + tl.sum(tl.load(SUM + row * chunks + c, mask=valid, other=0.0) * weights, axis=0)
            top = new_top
        tl.store(OUT + row * value_width + d, (acc / total).to(OUT.dtype.element_ty), mask=d < value_width)

    _state["kernels"] = {"keys_only": keys_only_kernel, "shared_kv": shared_kv_kernel, "combine": combine_kernel}
    return _state["kernels"]
