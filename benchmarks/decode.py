"""Decoding cost of a GPT-2-small-sized model against its collaborative versions: time per generated token and
key/value cache memory at long contexts, measured side by side in one process.

    python benchmarks/decode.py                                   # CPU, float32, contexts 512 to 8192
    python benchmarks/decode.py --contexts 512 2048 --repeats 5
    python benchmarks/decode.py --device cuda --dtype bfloat16 --batch 8

Models: a randomly initialized GPT-2 small (12 layers, d_model 768, 12 heads of 64, 50,257-token vocabulary,
positions up to the longest context) and the same architecture with collaborative attention at D~ = d/2, d/4, d/8
(384, 192, 96), built from the library's ``CollabGPT2LMHeadModel`` config. Decoding time does not depend on the
weights' values, so no decomposition is run and the cache is filled with random keys and values of the right shapes
(as ``model.generate`` would leave it after a prompt of ``context`` tokens) instead of running a prefill. Each
measurement is one forward pass of ``--batch`` new tokens against that cache (``use_cache``), the cache cropped back
to ``context`` after each step; the models take turns step by step, so machine noise falls on all of them alike. The
table gives the median over ``--repeats`` steps after ``--warmup`` and the cache bytes (``DynamicCache`` tensors,
all layers). Results: ``experiments/benchmarks/decode_<device>_<dtype>.{md,json}``.

``--prefill`` times the prompt pass instead: ``context`` tokens through an empty cache with the causal mask, logits
for the last position only (``logits_to_keep=1``, as ``generate`` asks), the models again taking turns. Results:
``experiments/benchmarks/prefill_<device>_<dtype>.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import collab_attn  # noqa: E402,F401  (registers the collaborative model classes)
from collab_attn.models.hf import collab_config_class  # noqa: E402

D_MODEL, HEADS, LAYERS = 768, 12, 12


def build(rank: int | None, positions: int, device: str, dtype: torch.dtype) -> transformers.PreTrainedModel:
    """GPT-2 small with concatenated heads (``rank=None``) or collaborative heads of shared key size ``rank``."""
    sizes = {"n_embd": D_MODEL, "n_head": HEADS, "n_layer": LAYERS, "n_positions": positions}
    if rank is None:
        config = transformers.GPT2Config(**sizes)
    else:
        config = collab_config_class("gpt2")(**sizes, collab_ranks=[rank] * LAYERS)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def filled_cache(model, batch: int, context: int) -> DynamicCache:
    """A cache holding ``context`` positions in the layout the model's attention layers write."""
    cache = DynamicCache()
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=model.device)
    with torch.inference_mode():
        model(ids, cache=cache, use_cache=True)  # one real step gives each layer's key and value shapes
    for layer in cache.layers:
        keys, values = layer.keys, layer.values
        layer.keys = torch.randn(*keys.shape[:2], context, keys.shape[-1], device=keys.device, dtype=keys.dtype)
        layer.values = torch.randn(*values.shape[:2], context, values.shape[-1], device=keys.device,
                                   dtype=values.dtype)
    return cache


def cache_bytes(cache: DynamicCache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def timed(model, **inputs) -> float:
    """Seconds for one forward pass of ``model`` on ``inputs`` (the GPU synchronized on both sides)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        model(**inputs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_step(model, cache: DynamicCache, ids: torch.Tensor, mask: torch.Tensor) -> float:
    """Seconds for one new token per sequence against ``cache``, which is cropped back afterwards."""
    seconds = timed(model, input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    cache.crop(-1)  # drop the step's token: every step sees `context` cached positions
    return seconds


def prefill(model, ids: torch.Tensor) -> float:
    """Seconds for the prompt pass of ``ids`` into an empty cache, logits of the last position only."""
    return timed(model, input_ids=ids, attention_mask=torch.ones_like(ids), cache=DynamicCache(), use_cache=True,
                 logits_to_keep=1)


def median_seconds(models: dict, args, measure) -> dict[str, float]:
    """The median of ``measure(name, model)`` over ``args.repeats`` rounds after ``args.warmup``; the models take
    turns round by round, so machine noise falls on every model alike."""
    times = {name: [] for name in models}
    for step in range(args.warmup + args.repeats):
        for name, model in models.items():
            seconds = measure(name, model)
            if step >= args.warmup:
                times[name].append(seconds)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    positions = max(args.contexts) + 8
    variants = {"original": None} | {f"collab D~={rank}": rank for rank in args.ranks}
    models = {name: build(rank, positions, args.device, dtype) for name, rank in variants.items()}
    one_context = prefill_rows if args.prefill else decode_rows
    return [row for context in args.contexts for row in one_context(models, variants, args, context)]


def prefill_rows(models: dict, variants: dict, args, context: int) -> list[dict]:
    ids = torch.randint(0, 50257, (args.batch, context), device=args.device)
    times = median_seconds(models, args, lambda name, model: prefill(model, ids))
    rows = []
    for name in models:
        row = {"context": context, "model": name, "rank": variants[name], "prefill_ms": 1e3 * times[name]}
        base = rows[0] if rows else row  # the first model is the original
        row["time_vs_original"] = row["prefill_ms"] / base["prefill_ms"]
        rows.append(row)
        print(f"context {context:5d}  {name:16s} {row['prefill_ms']:9.1f} ms prefill "
              f"({row['time_vs_original']:.2f}x)", flush=True)
    return rows


def decode_rows(models: dict, variants: dict, args, context: int) -> list[dict]:
    caches = {name: filled_cache(model, args.batch, context) for name, model in models.items()}
    ids = torch.randint(0, 50257, (args.batch, 1), device=args.device)
    mask = torch.ones(args.batch, context + 1, dtype=torch.long, device=args.device)
    times = median_seconds(models, args, lambda name, model: decode_step(model, caches[name], ids, mask))
    rows = []
    for name in models:
        row = {"context": context, "model": name, "rank": variants[name],
               "ms_per_token": 1e3 * times[name], "cache_mib": cache_bytes(caches[name]) / 2**20}
        base = rows[0] if rows else row  # the first model is the original
        row["time_vs_original"] = row["ms_per_token"] / base["ms_per_token"]
        row["cache_vs_original"] = row["cache_mib"] / base["cache_mib"]
        rows.append(row)
        print(f"context {context:5d}  {name:16s} {row['ms_per_token']:8.2f} ms/token "
              f"({row['time_vs_original']:.2f}x)  cache {row['cache_mib']:8.1f} MiB "
              f"({row['cache_vs_original']:.2f}x)", flush=True)
    return rows  # the caches go when this returns, before the next context's are filled


def markdown(rows: list[dict], args, environment: dict) -> str:
    if args.prefill:
        return prefill_markdown(rows, args, environment)
    lines = [
        f"# Decoding: GPT-2 small (random weights) against collaborative attention, {args.device}, {args.dtype}",
        "",
        f"Batch {args.batch}, one new token per step against a cache of `context` positions; median of "
        f"{args.repeats} steps after {args.warmup} warm-up steps. {environment['device_name']}, torch "
        f"{environment['torch']}, transformers {environment['transformers']}, {environment['threads']} threads.",
        "",
        "```bash",
        f"python benchmarks/decode.py {' '.join(sys.argv[1:])}".rstrip(),
        "```",
        "",
        "| context | model | ms / token | vs original | cache MiB | vs original |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['context']} | {r['model']} | {r['ms_per_token']:.2f} | {r['time_vs_original']:.2f}x | "
        f"{r['cache_mib']:.1f} | {r['cache_vs_original']:.2f}x |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def prefill_markdown(rows: list[dict], args, environment: dict) -> str:
    lines = [
        f"# Prefill: GPT-2 small (random weights) against collaborative attention, {args.device}, {args.dtype}",
        "",
        f"Batch {args.batch}, a prompt of `context` tokens into an empty cache (causal mask, logits of the last "
        f"position); median of {args.repeats} passes after {args.warmup} warm-up passes. "
        f"{environment['device_name']}, torch {environment['torch']}, transformers {environment['transformers']}, "
        f"{environment['threads']} threads.",
        "",
        "```bash",
        f"python benchmarks/decode.py {' '.join(sys.argv[1:])}".rstrip(),
        "```",
        "",
        "| context | model | prefill ms | vs original |",
        "|---:|---|---:|---:|",
    ]
    lines += [f"| {r['context']} | {r['model']} | {r['prefill_ms']:.1f} | {r['time_vs_original']:.2f}x |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--ranks", type=int, nargs="+", default=[D_MODEL // 2, D_MODEL // 4, D_MODEL // 8])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None, help="CPU threads for torch (default: torch's)")
    parser.add_argument("--prefill", action="store_true", help="time the prompt pass instead of decoding steps")
    parser.add_argument("--out", type=Path, default=None, help="output path without suffix")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    environment = {
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU",
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
    }
    rows = run(args)
    kind = "prefill" if args.prefill else "decode"
    out = args.out or ROOT / "experiments" / "benchmarks" / f"{kind}_{args.device}_{args.dtype}"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.with_suffix(".json").write_text(json.dumps({"args": vars(args) | {"out": str(out)}, "environment": environment,
                                                    "rows": rows}, indent=2, default=str))
    tmp.with_suffix(".json").rename(out.with_suffix(".json"))
    tmp.with_suffix(".md").write_text(markdown(rows, args, environment))
    tmp.with_suffix(".md").rename(out.with_suffix(".md"))
    print(f"wrote {out}.md and .json")
    return rows


if __name__ == "__main__":
    main()
