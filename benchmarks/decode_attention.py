"""One decoding step's attention alone, SmolLM2-135M's shapes against its exported conversions: does it take the time
of the cache bytes it reads, or of its arithmetic? Measured side by side in one process.

    python benchmarks/decode_attention.py                        # batch 8, 8,192 positions, head sizes 96 and 48
    python benchmarks/decode_attention.py --batch 1 --context 2048 --compiled

The original: 9 query heads on 3 key/value heads of 64. An export of ``key-svd`` at head size R (``--head-sizes``,
``collab_attn.export``): 9 query heads of R on one key/value head of R, so its cache is 2R numbers per token and
layer against the original's 384, while each query head still takes R numbers to score a position (9 x R in all,
against 9 x 64). Each model's step is computed three ways, all ``torch.nn.functional.scaled_dot_product_attention``
with a mask over the cached positions:

- ``expanded``: the key/value heads copied to every query head first (transformers' ``repeat_kv``): transformers
  5.25's SDPA path with a mask under ``torch.compile``, a static cache's step;
- ``gqa``: the key/value heads passed as they are with ``enable_gqa=True``: its path with no mask (a dynamic cache
  without padding), or with ``TRANSFORMERS_SDPA_FORCE_GQA=1``;
- ``folded``: the query heads of a key/value head taken as that head's query rows, one product per key/value head:
  its path for one query position with a mask outside ``torch.compile`` (``pack_gqa``: a dynamic cache with padding).

All three give the same output (checked before timing, 1e-5). ``--compiled`` times each under
``torch.compile(fullgraph=True)`` as well, as a static cache's step runs. The ways and models take turns, round by
round, ``--repeats`` rounds after ``--warmup``; each cell is the median and range, the ratio to the original's
``expanded`` step and, for an export, to the original's step computed the same way, each with its verdict
(``faster``/``slower`` only where the ranges do not overlap, ``collab_attn.stats.timing_verdict``), and GB/s: the
cache's bytes (float32) over the median time, which says how far the step is from the memory's speed. ``--clock
cpu`` times by this process's CPU time (less disturbed by other processes). Results: ``--out`` (``.md`` and
``.json``), by default ``experiments/serving/decode_attention_<UTC time>``; never overwritten.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import repeat_kv

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402
from collab_attn.cli import ArgumentParser  # noqa: E402
from collab_attn.files import write_result_pair  # noqa: E402
from collab_attn.stats import timing, timing_verdict  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention


def expanded(query, key, value, mask):
    groups = query.shape[1] // key.shape[1]
    return F.scaled_dot_product_attention(query, repeat_kv(key, groups), repeat_kv(value, groups), attn_mask=mask)


def gqa(query, key, value, mask):
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, enable_gqa=True)


def folded(query, key, value, mask):
    batch, heads, _, width = query.shape
    rows = query.view(batch, key.shape[1], heads // key.shape[1], width)  # (B, kv heads, group, R): one query row each
    return F.scaled_dot_product_attention(rows, key, value, attn_mask=mask).view(batch, heads, 1, -1)


WAYS = {"expanded": expanded, "gqa": gqa, "folded": folded}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
BASE = "original | expanded"


def tensors(batch: int, context: int, kv_heads: int, width: int, seed: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(batch, HEADS, 1, width, generator=generator)
    key, value = (torch.randn(batch, kv_heads, context, width, generator=generator) for _ in range(2))
    mask = torch.zeros(batch, 1, 1, context)  # additive: every cached position visible
    return query, key, value, mask


def cases(args) -> dict[str, tuple[tuple[torch.Tensor, ...], object, int]]:
    """(model, way[, compiled]) -> (inputs, function, cache bytes)."""
    models = {"original": (KV_HEADS, HEAD_DIM)} | {f"exported, head size {r}": (1, r) for r in args.head_sizes}
    found = {}
    for model, (kv_heads, width) in models.items():
        inputs = tensors(args.batch, args.context, kv_heads, width, seed=0)
        cache = 2 * inputs[1].numel() * inputs[1].element_size()
        reference = expanded(*inputs)
        for way, function in WAYS.items():
            error = (function(*inputs) - reference).abs().max().item()
            if error > 1e-5:
                raise RuntimeError(f"{model}, {way}: {error:.2e} from the expanded step")
            found[f"{model} | {way}"] = (inputs, function, cache)
            if args.compiled:
                found[f"{model} | {way}, compiled"] = (inputs, torch.compile(function, fullgraph=True, dynamic=False),
                                                       cache)
    return found


def measured(found: dict, args) -> dict[str, list[float]]:
    clock = CLOCKS[args.clock]
    times = {name: [] for name in found}
    with torch.inference_mode():
        for round_ in range(args.warmup + args.repeats):
            for name, (inputs, function, _) in found.items():
                start = clock()
                function(*inputs)
                if round_ >= args.warmup:
                    times[name].append(clock() - start)
    return times


def rows_of(found: dict, times: dict) -> list[dict]:
    rows = []
    for name, (_, _, cache) in found.items():
        model, way = name.split(" | ")
        spread, versus = timing(times[name]), timing_verdict(times[name], times[BASE])
        row = {"model": model, "way": way, "ms": 1e3 * spread.median, "low_ms": 1e3 * spread.low,
               "high_ms": 1e3 * spread.high, "vs_original_expanded": versus.ratio,
               "verdict": "-" if name == BASE else versus.verdict, "cache_mib": cache / 2**20,
               "gb_per_s": cache / spread.median / 1e9, "seconds": times[name]}
        if model != "original":  # against the original's step computed the same way
            same = timing_verdict(times[name], times[f"original | {way}"])
            row |= {"vs_original_same_way": same.ratio, "verdict_same_way": same.verdict}
        rows.append(row)
    return rows


def markdown(rows: list[dict], args, environment: dict) -> str:
    lines = [f"# One decoding step's attention: SmolLM2-135M's shapes against its exports, {environment['device']}",
             "", f"Batch {args.batch}, {args.context:,} cached positions, one layer, float32, {args.threads} "
             f"thread(s), {args.clock} clock; median of {args.repeats} rounds after {args.warmup} and their range; "
             "verdicts against the original's expanded step by `collab_attn.stats.timing_verdict`. GB/s: the cache's "
             f"bytes over the median time. torch {environment['torch']}.", "", "```bash", environment["command"],
             "```", "", "| model | way | ms | range | vs original, expanded | verdict | vs original, same way | "
             "verdict | cache MiB | GB/s |", "|---|---|---:|---:|---:|---|---:|---|---:|---:|"]
    lines += [f"| {r['model']} | {r['way']} | {r['ms']:.2f} | {r['low_ms']:.2f}-{r['high_ms']:.2f} | "
              f"{r['vs_original_expanded']:.2f}x | {r['verdict']} | "
              + (f"{r['vs_original_same_way']:.2f}x | {r['verdict_same_way']} | " if "verdict_same_way" in r else
                 "- | - | ")
              + f"{r['cache_mib']:.1f} | {r['gb_per_s']:.1f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--head-sizes", type=cli.positive_arg, nargs="+", default=[96, 48],
                        help="the exports' head sizes R (key-svd at 1/2 of the cache: 96; at 1/4: 48)")
    parser.add_argument("--batch", type=cli.positive_arg, default=8)
    parser.add_argument("--context", type=cli.positive_arg, default=8192)
    parser.add_argument("--compiled", action="store_true", help="each way under torch.compile(fullgraph=True) too")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    parser.add_argument("--repeats", type=cli.positive_arg, default=9)
    parser.add_argument("--warmup", type=cli.count_arg, default=2)
    parser.add_argument("--threads", type=cli.positive_arg, default=1)
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/serving/decode_attention_<UTC "
                             "time>); an existing result is never overwritten")
    args = parser.parse_args(argv)
    try:
        out = cli.result_stem("--out", args.out, ROOT / "experiments" / "serving" / "decode_attention")
    except cli.BadInput as error:
        parser.error(str(error))
    torch.set_num_threads(args.threads)
    environment = {"device": platform.processor() or "CPU", "cpus": os.cpu_count(), "torch": torch.__version__,
                   "command": " ".join(["python benchmarks/decode_attention.py",
                                        *(sys.argv[1:] if argv is None else argv)])}
    found = cases(args)
    rows = rows_of(found, measured(found, args))
    for r in rows:
        same = (f", same way {r['vs_original_same_way']:.2f}x, {r['verdict_same_way']}"
                if "verdict_same_way" in r else "")
        print(f"{r['model']:26s} {r['way']:18s} {r['ms']:8.2f} ms ({r['vs_original_expanded']:.2f}x, {r['verdict']}"
              f"{same}) {r['gb_per_s']:6.1f} GB/s", flush=True)
    write_result_pair(out, {"args": vars(args) | {"out": str(out)}, "environment": environment, "rows": rows},
                      markdown(rows, args, environment))
    return rows


if __name__ == "__main__":
    main()
