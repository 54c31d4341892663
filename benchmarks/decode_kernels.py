"""One decoding step of one collaborative attention layer, written several ways, against the original's fused
kernel: what the compiler, ``torch.nn.attention.flex_attention`` and multi-query attention through the fused kernel
give for collaborative heads, and how fast each reads its cache.

    python benchmarks/decode_kernels.py                             # CPU, float32, batch 8, context 8192, D~ = 192
    python benchmarks/decode_kernels.py --device cuda --dtype bfloat16 --batch 32

The step: one new query per sequence, 12 heads of 64 (GPT-2 small's layer), a cache of ``--context`` positions.
- ``original sdpa``: concatenated heads, ``scaled_dot_product_attention`` on per-head keys and values (what GPT-2's
  attention runs).
- ``collab explicit``: the library's reference path (``CollaborativeAttention._explicit``): the heads' mixed
  queries against the one shared key in a single ``bmm``, the content logits added, softmax, the per-head values.
- ``collab compiled``: the same function under ``torch.compile(fullgraph=True)`` (the compiler may fuse the
  softmax and the weighted sum).
- ``collab kernels``: the library's decoding path on the CPU in float32 (``collab_attn.nn.cpu_kernels``): the
  same arithmetic in one pass over the shared keys and one over the values; ``collab kernels compiled``: the same
  under ``torch.compile`` (the operators stay opaque; the compiler takes the rest).
- ``collab sdpa``: the shared key expanded (a view) to every head and ``scaled_dot_product_attention`` with the
  content logits as its additive mask (query/key width D~, value width 64: the unfused kernel where they differ).
- ``collab flex``: ``flex_attention`` (compiled, as it must be) with the shared key expanded to every head and the
  content logit added by a ``score_mod``; it takes query/key and value widths that differ.
With shared values (``--value-rank`` D_v, default 186: keys and values at a quarter of the original's cache):
- ``collab kv explicit``: the explicit path as it was before issue 55: logits against the shared key, softmax, the
  product with the one value per token broadcast over the heads, then each head's value mixing summed.
- ``collab kv fused``: the library's path (``collab_attn.nn.attention.grouped_attend``): the heads stacked as the
  query rows of one key/value head, the content logits as the mask, one ``scaled_dot_product_attention`` call
  (multi-query attention), then the value mixing; ``collab kv fused compiled``: the same under ``torch.compile``.
- ``collab kv kernels``: the library's decoding path on the CPU in float32: the scores through
  ``cpu_kernels.shared_key_scores``, the content logits added, softmax, one ``bmm`` of all heads' weights with the
  one value per token, the value mixing; ``collab kv kernels compiled``: the same under ``torch.compile``.
Where the Triton kernels run (``collab_attn.nn.triton_kernels``: a GPU with triton, unless ``COLLAB_ATTN_TRITON=0``;
the CPU only under ``COLLAB_ATTN_TRITON=1 TRITON_INTERPRET=1``, which checks that they run and measures nothing):
- ``collab triton``: the library's decoding step on a GPU, keys only: one flash-decoding kernel over the shared key,
  the content logits and the per-head values (``triton_kernels.keys_only``), chunks combined in torch.
- ``collab kv triton``: the same for shared keys and values (``triton_kernels.shared_kv``), then the value mixing.
- ``--triton-tiles 32:4 16:8 ...`` adds both again per setting of keys per tile and warps per program
  (``collab triton 32:4``, ...): a sweep of the kernels' first guesses (``triton_kernels.BLOCK_KEYS``, ``WARPS``).
Every run also times a plain copy (``torch.empty(n).copy_(src)``, at least 256 MiB on a GPU so that it does not fit
its L2 cache) taking turns with the variants: ``copy GB/s`` is the bytes it reads and writes over its median, and each
row's ``of copy`` its own GB/s (the cache it reads) over that: the share of the memory's measured speed it reaches.
The keys-only variants read the same cache, the kv variants theirs; the script checks that each agrees with its
explicit form (max |difference|), counts the bytes each reads (keys, content logits and values; ``GB/s``: those bytes
over the median step) and times
``--repeats`` steps of each after ``--warmup``, taking turns step by step. The table (and each printed line) gives
the median step, the range of the steps (the step-to-step spread), the ratio to ``original sdpa`` and its verdict:
``faster`` or ``slower`` only where the two variants' ranges do not overlap (``collab_attn.stats.timing_verdict``),
``tie`` otherwise (and always with a single repeat). The JSON keeps every step's time. Results:
``experiments/benchmarks/decode_kernels_<device>_<dtype>_<UTC time>.{md,json}`` (``--out``: a new path; results
are never overwritten).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.nn import cpu_kernels, triton_kernels  # noqa: E402
from collab_attn.nn.attention import grouped_attend  # noqa: E402
from collab_attn.stats import timing, timing_verdict  # noqa: E402

HEADS, HEAD_DIM = 12, 64


def collab_explicit(queries, keys, values, content):
    """queries (B, H, 1, D~) already mixed and scaled, keys (B, S, D~), values (B, H, S, 64), content (B, H, 1, S)."""
    batch, heads, tgt, rank = queries.shape
    logits = torch.bmm(queries.reshape(batch, heads * tgt, rank), keys.transpose(1, 2)).view(batch, heads, tgt, -1)
    return torch.matmul((logits + content).softmax(dim=-1), values)


def collab_kernels(queries, keys, values, content):
    batch, heads, tgt, rank = queries.shape
    logits = cpu_kernels.shared_key_scores(queries.reshape(batch, heads * tgt, rank), keys).view(batch, heads, tgt, -1)
    return cpu_kernels.weighted_values((logits + content).softmax(dim=-1), values)


def collab_sdpa(queries, keys, values, content):
    expanded = keys[:, None].expand(-1, queries.shape[1], -1, -1)
    return F.scaled_dot_product_attention(queries, expanded, values, attn_mask=content, scale=1.0)


def make_flex(backend: str = "inductor"):
    compiled = torch.compile(flex_attention, fullgraph=True, dynamic=False, backend=backend)

    def collab_flex(queries, keys, values, content):
        per_key = content[:, :, 0]  # (B, H, S): head h's content logit of each key

        def add_content(score, b, h, q_idx, kv_idx):
            return score + per_key[b, h, kv_idx]

        expanded = keys[:, None].expand(-1, queries.shape[1], -1, -1)
        return compiled(queries, expanded, values, score_mod=add_content, scale=1.0)

    return collab_flex


def collab_kv_explicit(queries, keys, values, content, value_mixing):
    """queries (B, H, 1, D~), keys (B, S, D~), values (B, 1, S, D_v), content (B, H, 1, S), value_mixing (H, D_v)."""
    batch, heads, tgt, rank = queries.shape
    logits = torch.bmm(queries.reshape(batch, heads * tgt, rank), keys.transpose(1, 2)).view(batch, heads, tgt, -1)
    context = torch.matmul((logits + content).softmax(dim=-1), values)  # (B, H, 1, D_v)
    return torch.einsum("bhtv,hv->btv", context, value_mixing)


def collab_kv_fused(queries, keys, values, content, value_mixing):
    context, _ = grouped_attend(queries, keys[:, None], values, content, 1.0, 0.0, False)  # (B, 1, H, D_v)
    return torch.einsum("bthv,hv->btv", context, value_mixing)


def collab_kv_kernels(queries, keys, values, content, value_mixing):
    batch, heads, tgt, rank = queries.shape
    logits = cpu_kernels.shared_key_scores(queries.reshape(batch, heads * tgt, rank), keys).view(batch, heads, tgt, -1)
    weights = (logits + content).softmax(dim=-1).view(batch, heads * tgt, -1)
    context = torch.bmm(weights, values[:, 0]).view(batch, heads, tgt, -1)  # (B, H, 1, D_v)
    return torch.einsum("bhtv,hv->btv", context, value_mixing)


def collab_triton(queries, keys, values, content):
    return triton_kernels.keys_only(queries[:, :, 0], keys, values, content[:, :, 0])[:, :, None]


def collab_kv_triton(queries, keys, values, content, value_mixing):
    context = triton_kernels.shared_kv(queries[:, :, 0], keys, values[:, 0], content[:, :, 0])  # (B, H, D_v)
    return torch.einsum("bhv,hv->bv", context, value_mixing)[:, None]


def with_tiles(fn, block_keys: int, warps: int):
    """``fn`` run with ``block_keys`` keys per tile and ``warps`` warps per program in the Triton kernels."""
    def tiled(*inputs):
        before = triton_kernels.BLOCK_KEYS, triton_kernels.WARPS
        triton_kernels.BLOCK_KEYS, triton_kernels.WARPS = block_keys, warps
        try:
            return fn(*inputs)
        finally:
            triton_kernels.BLOCK_KEYS, triton_kernels.WARPS = before

    return tiled


def tile_setting(text: str) -> tuple[int, int]:
    """``KEYS:WARPS`` (``--triton-tiles``): keys per tile, a power of two from 16, and warps, a power of two."""
    try:
        keys, warps = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give keys per tile and warps as KEYS:WARPS, e.g. 32:4") from None
    if keys < 16 or keys & (keys - 1) or warps < 1 or warps & (warps - 1):
        raise argparse.ArgumentTypeError(f"{text!r}: keys per tile must be a power of two from 16, warps a power "
                                         "of two")
    return keys, warps


def copy_seconds(destination, source) -> float:
    """Seconds for ``destination.copy_(source)`` (the GPU synchronized on both sides)."""
    if source.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    destination.copy_(source)
    if source.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def original_sdpa(queries, keys, values):
    return F.scaled_dot_product_attention(queries, keys, values)


def timed(fn, *inputs) -> float:
    if inputs[0].device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        fn(*inputs)
    if inputs[0].device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


REFERENCE = "original sdpa"


def timed_row(name: str, seconds: list[float], reference: list[float], difference: float | None) -> dict:
    """A variant's row: the median of its steps (milliseconds), their range and every step, and the ratio to the
    median of ``reference`` (``original sdpa``'s steps) with its verdict (``-`` for the reference itself)."""
    runs, versus = [1e3 * t for t in seconds], timing_verdict(seconds, reference)
    spread = timing(runs)
    return {"variant": name, "ms": spread.median, "ms_low": spread.low, "ms_high": spread.high, "ms_runs": runs,
            "vs_original": versus.ratio, "verdict": "-" if name == REFERENCE else versus.verdict,
            "max_abs_difference": difference}


def main(argv=None) -> dict:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])  # its errors: one error: line
    parser.add_argument("--batch", type=cli.positive_arg, default=8)
    parser.add_argument("--context", type=cli.positive_arg, default=8192)
    parser.add_argument("--rank", type=cli.positive_arg, default=192,
                        help="the shared key width D~ (keys-only variants)")
    parser.add_argument("--value-rank", type=cli.positive_arg, default=186,
                        help="the shared key and value width of the kv variants (186: a quarter of the cache)")
    parser.add_argument("--repeats", type=cli.positive_arg, default=10)
    parser.add_argument("--warmup", type=cli.count_arg, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--threads", type=cli.positive_arg, default=None)
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for the compiled variants (default inductor; aot_eager: the same "
                             "graphs without generating kernels, for checks: its timings measure nothing)")
    parser.add_argument("--triton-tiles", type=tile_setting, nargs="+", default=[], metavar="KEYS:WARPS",
                        help="also the Triton rows at these keys per tile and warps per program (where they run)")
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/benchmarks/decode_kernels_"
                             "<device>_<dtype>_<UTC time>); results are never overwritten")
    args = parser.parse_args(argv)
    try:
        args.device = cli.device("--device", args.device)
        cli.compile_backend("--compile-backend", args.compile_backend)
        out = cli.result_stem("--out", args.out, ROOT / "experiments" / "benchmarks" /
                              f"decode_kernels_{args.device}_{args.dtype}")
    except cli.BadInput as error:
        parser.error(str(error))
    if args.triton_tiles and not triton_kernels.applies(torch.empty(0, device=args.device)):
        parser.error("--triton-tiles: the Triton kernels do not run here (a GPU with triton, or the CPU under "
                     f"{triton_kernels.SWITCH}=1 TRITON_INTERPRET=1)")
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype, device = getattr(torch, args.dtype), args.device
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    b, s, r, v = args.batch, args.context, args.rank, args.value_rank
    backend = args.compile_backend
    collab_inputs = (randn(b, HEADS, 1, r) / r**0.5, randn(b, s, r), randn(b, HEADS, s, HEAD_DIM),
                     randn(b, HEADS, 1, s))
    kv_inputs = (randn(b, HEADS, 1, v) / v**0.5, randn(b, s, v), randn(b, 1, s, v), randn(b, HEADS, 1, s),
                 randn(HEADS, v))
    original_inputs = (randn(b, HEADS, 1, HEAD_DIM), randn(b, HEADS, s, HEAD_DIM), randn(b, HEADS, s, HEAD_DIM))
    element = collab_inputs[0].element_size()
    cache_bytes = {"original": 2 * b * s * HEADS * HEAD_DIM * element,  # what each step reads: keys, content, values
                   "collab": b * s * (r + HEADS + HEADS * HEAD_DIM) * element,
                   "collab kv": b * s * (2 * v + HEADS) * element}
    variants = {  # name: (function, its inputs, the explicit form it must agree with, the cache it reads)
        "original sdpa": (original_sdpa, original_inputs, None, "original"),
        "collab explicit": (collab_explicit, collab_inputs, "collab explicit", "collab"),
        "collab compiled": (torch.compile(collab_explicit, fullgraph=True, dynamic=False, backend=backend),
                            collab_inputs, "collab explicit", "collab"),
        "collab kernels": (collab_kernels, collab_inputs, "collab explicit", "collab"),
        "collab kernels compiled": (torch.compile(collab_kernels, fullgraph=True, dynamic=False, backend=backend),
                                    collab_inputs, "collab explicit", "collab"),
        "collab sdpa": (collab_sdpa, collab_inputs, "collab explicit", "collab"),
        "collab flex": (make_flex(backend), collab_inputs, "collab explicit", "collab"),
        "collab kv explicit": (collab_kv_explicit, kv_inputs, "collab kv explicit", "collab kv"),
        "collab kv fused": (collab_kv_fused, kv_inputs, "collab kv explicit", "collab kv"),
        "collab kv fused compiled": (torch.compile(collab_kv_fused, fullgraph=True, dynamic=False, backend=backend),
                                     kv_inputs,
                                     "collab kv explicit", "collab kv"),
        "collab kv kernels": (collab_kv_kernels, kv_inputs, "collab kv explicit", "collab kv"),
        "collab kv kernels compiled": (torch.compile(collab_kv_kernels, fullgraph=True, dynamic=False,
                                                     backend=backend), kv_inputs, "collab kv explicit", "collab kv"),
    }
    if not (device == "cpu" and dtype == torch.float32 and cpu_kernels.available()):
        for name in ("collab kernels", "collab kernels compiled", "collab kv kernels", "collab kv kernels compiled"):
            del variants[name]  # CPU, float32, AVX2 only
    if triton_kernels.applies(collab_inputs[0]):
        variants["collab triton"] = (collab_triton, collab_inputs, "collab explicit", "collab")
        variants["collab kv triton"] = (collab_kv_triton, kv_inputs, "collab kv explicit", "collab kv")
        for keys, warps in args.triton_tiles:
            variants[f"collab triton {keys}:{warps}"] = (with_tiles(collab_triton, keys, warps), collab_inputs,
                                                         "collab explicit", "collab")
            variants[f"collab kv triton {keys}:{warps}"] = (with_tiles(collab_kv_triton, keys, warps), kv_inputs,
                                                            "collab kv explicit", "collab kv")
    # the copy: as large as the largest cache read, and at least 256 MiB on a GPU (more than its L2 cache)
    copy_numel = max(max(cache_bytes.values()), (256 << 20) if device == "cuda" else 0) // element
    copy_inputs = (torch.empty(copy_numel, device=device, dtype=dtype), torch.ones(copy_numel, device=device,
                                                                                    dtype=dtype))
    with torch.inference_mode():
        references = {name: fn(*inputs).float() for name, (fn, inputs, _, _) in variants.items()
                      if name in ("collab explicit", "collab kv explicit")}
        differences = {name: float((fn(*inputs).float() - references[explicit]).abs().max())
                       for name, (fn, inputs, explicit, _) in variants.items() if explicit is not None}
    times = {name: [] for name in variants}
    copy_times = []
    for step in range(args.warmup + args.repeats):
        for name, (fn, inputs, _, _) in variants.items():
            seconds = timed(fn, *inputs)
            if step >= args.warmup:
                times[name].append(seconds)
        seconds = copy_seconds(*copy_inputs)  # the copy takes its turn with the variants
        if step >= args.warmup:
            copy_times.append(seconds)
    copy_spread = timing([1e3 * t for t in copy_times])
    copy_moved = 2 * copy_numel * element  # read and written
    copied = {"mb": copy_moved / 1e6, "ms": copy_spread.median, "ms_low": copy_spread.low,
              "ms_high": copy_spread.high, "ms_runs": [1e3 * t for t in copy_times],
              "gb_per_s": copy_moved / 1e6 / copy_spread.median}
    print(f"{'copy':24s} {copied['ms']:9.3f} ms  [{copied['ms_low']:.3f}-{copied['ms_high']:.3f}]  "
          f"{copied['mb']:.0f} MB read and written: {copied['gb_per_s']:.1f} GB/s, the memory's measured speed",
          flush=True)
    rows = [timed_row(name, seconds, times[REFERENCE], differences.get(name)) for name, seconds in times.items()]
    for row in rows:
        read = cache_bytes[variants[row["variant"]][3]]
        row.update(cache_mb=read / 1e6, gb_per_s=read / 1e6 / row["ms"])
        row["of_copy"] = row["gb_per_s"] / copied["gb_per_s"]
        print(f"{row['variant']:24s} {row['ms']:9.3f} ms  [{row['ms_low']:.3f}-{row['ms_high']:.3f}]  "
              f"({row['vs_original']:.2f}x, {row['verdict']})  {row['cache_mb']:.0f} MB at {row['gb_per_s']:.1f} GB/s",
              flush=True)
    environment = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "CPU",
                   "torch": torch.__version__, "threads": torch.get_num_threads()}
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "environment": environment, "rows": rows,
              "copy": copied}
    lines = [
        f"# One collaborative decoding step, several ways ({device}, {args.dtype})",
        "",
        f"Batch {b}, context {s}, 12 heads of 64; keys-only D~ = {r}, shared keys and values (kv) D~ = D_v = {v}; "
        f"median of {args.repeats} steps after {args.warmup}, "
        "taking turns, and their range (the step-to-step spread); the verdict says faster or slower than `original "
        "sdpa` only where the two ranges do not overlap (`collab_attn.stats.timing_verdict`), tie otherwise. "
        f"{environment['device']}, torch {environment['torch']}, {environment['threads']} threads.",
        "",
        f"The memory's measured speed: a copy of {copied['mb'] / 2:.0f} MB (read and written: {copied['mb']:.0f} MB) "
        f"in {copied['ms']:.3f} ms [{copied['ms_low']:.3f}-{copied['ms_high']:.3f}], taking turns with the variants: "
        f"**{copied['gb_per_s']:.1f} GB/s**; `of copy` is a row's GB/s (the cache it reads) over that.",
        "",
        "```bash",
        f"python benchmarks/decode_kernels.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        "```",
        "",
        "| variant | ms / step | range | vs original sdpa | verdict | cache MB read | GB/s | max abs difference to "
        "explicit | of copy |",
        "|---|---:|---:|---:|---|---:|---:|---:|---:|",
    ] + [f"| {row['variant']} | {row['ms']:.3f} | {row['ms_low']:.3f}-{row['ms_high']:.3f} | "
         f"{row['vs_original']:.2f}x | {row['verdict']} | {row['cache_mb']:.0f} | {row['gb_per_s']:.1f} | "
         f"{'' if row['max_abs_difference'] is None else format(row['max_abs_difference'], '.1e')} | "
         f"{row['of_copy']:.0%} |" for row in rows]
    write_text_atomic(out.with_suffix(".json"), json.dumps(result, indent=2))
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')} and .json")
    return result


if __name__ == "__main__":
    main()
