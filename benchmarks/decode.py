"""Decoding cost of a GPT-2-small-sized model against its collaborative versions: time per generated token and
key/value cache memory at long contexts, in batches, with dynamic and static (compiled) caches, measured side by
side in one process.

    python benchmarks/decode.py                                   # CPU, float32, batch 1, contexts 512 to 8192
    python benchmarks/decode.py --contexts 1024 4096 8192 --batches 1 8 --caches dynamic static
    python benchmarks/decode.py --device cuda --dtype bfloat16 --batches 1 8 32 64 --caches dynamic static
    python benchmarks/decode.py --contexts 2048 8192 --ranks 384 --cache-fractions 0.25    # the cache race's layouts
    python benchmarks/decode.py --contexts 2048 8192 --ranks 384 --cache-fractions 0.25 --race-methods cp tucker
    python benchmarks/decode.py --contexts 8192 --batches 8 --ranks 192 --cache-fractions 0.25 --race-methods cp \
        --caches static --kernels-against-reference   # the CPU kernels against the reference path, taking turns
    python benchmarks/decode.py --device cuda --dtype bfloat16 --contexts 8192 --batches 1 32 --ranks 192 \
        --cache-fractions 0.25 --race-methods cp --caches static --triton   # the Triton kernels against the rest

Models: a randomly initialized GPT-2 small (12 layers, d_model 768, 12 heads of 64, 50,257-token vocabulary,
positions up to the longest context) and the same architecture with collaborative attention at D~ = d/2, d/4, d/8
(384, 192, 96), built from the library's ``CollabGPT2LMHeadModel`` config; with ``--cache-fractions`` also the
conversions of the cache race at the size that caches at most each fraction (shared keys and values, per-head SVD
with narrow values, the MLA latent of ``kv-svd``, pruned heads). ``--size tiny`` (2 layers, d_model 192, 12 heads of
16, 512 tokens) is for the tests: it checks that the script runs, it measures nothing. Decoding time does not depend
on the weights' values, so no decomposition is run and the cache is filled with random keys and values of the right
shapes (as ``model.generate`` would leave it after a prompt of ``context`` tokens) instead of running a prefill. Each
measurement is one forward pass of one new token per sequence against that cache, the cache set back to ``context``
positions after each step; the models take turns step by step, so machine noise falls on all of them alike.

Caches (``--caches``): ``dynamic`` is the default ``DynamicCache`` in eager mode; ``static`` is a ``StaticCache`` of
``context + 1`` positions with ``torch.compile(model.forward, fullgraph=True)`` (``mode="reduce-overhead"``, CUDA
graphs, on a GPU), the way transformers decodes with a static cache. Every (batch, context) pair gets its own caches,
freed before the next. The table gives the median step over ``--repeats`` steps after ``--warmup`` and the range of
those steps (the step-to-step spread), milliseconds per token (the step divided by the batch), tokens per second,
the ratio to the original and its verdict (``faster`` or ``slower`` only where the two models' ranges do not overlap,
``collab_attn.stats.timing_verdict``; ``tie`` otherwise), the cache bytes (the cache's own tensors, all layers), on a
GPU the peak memory of the step, and the largest batch whose cache and weights fit ``--memory-gib`` at that context
(from the measured bytes per sequence). The JSON keeps every step's time. Results go to ``--out`` (``.md`` and
``.json``), by default ``experiments/benchmarks/decode_<device>_<dtype>_<UTC time>``; an existing result is never
overwritten.

``--kernels-against-reference`` (CPU, float32) adds a twin of every collaborative model that decodes through the
reference path (``collab_attn.nn.cpu_kernels.reference_path()``, switched at call time; a compiled twin gets a graph of
its own) instead of the CPU kernels, with the same weights and a cache of its own, taking turns with the others step
by step in the same process; each model's row gives its ratio to its twin and ``timing_verdict``'s verdict, and one
profiled step per model checks that it runs the kernels and its twin does not (``kernel_calls``).

``--triton`` does the same for the Triton decoding kernels (``collab_attn.nn.triton_kernels``): every collaborative
model beside a twin on its present path (``triton_kernels.present_path()``: what the layers run without the kernels),
each row with its ratio to its twin and the verdict; the check runs one eager step per model (a CUDA graph's replay
shows no operator calls to a profiler). It needs the kernels to run on ``--device``: a GPU with triton, or the CPU
under ``COLLAB_ATTN_TRITON=1 TRITON_INTERPRET=1`` (the interpreter: a check that it runs, its timings measure
nothing).

``--prefill`` times the prompt pass instead: ``context`` tokens through an empty cache with the causal mask, logits
for the last position only (``logits_to_keep=1``, as ``generate`` asks), the models again taking turns. Results:
``experiments/benchmarks/prefill_<device>_<dtype>_<UTC time>.{md,json}``.
"""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, StaticCache

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import collab_attn  # noqa: E402,F401  (registers the collaborative model classes)
from collab_attn import cli  # noqa: E402
from collab_attn.cli import ArgumentParser  # noqa: E402
from collab_attn.files import write_result_pair  # noqa: E402
from collab_attn.kinds import cache_keyword  # noqa: E402
from collab_attn.models.hf import Layout, collab_config_class  # noqa: E402
from collab_attn.models.methods import METHODS, LayerSizes  # noqa: E402
from collab_attn.models.sizing import conversion_at, conversion_sizes, converted_layout, original_size  # noqa: E402
from collab_attn.nn import cpu_kernels, triton_kernels  # noqa: E402
from collab_attn.stats import timing_verdict  # noqa: E402

D_MODEL, HEADS, LAYERS = 768, 12, 12
# --size: the model's (layers, d_model, heads, vocabulary). gpt2-small is the benchmark; tiny (2 layers, 12 heads of
# 16, 512 tokens) is for checking that the script runs (its timings measure nothing).
SIZES = {"gpt2-small": (LAYERS, D_MODEL, HEADS, 50257), "tiny": (2, 192, HEADS, 512)}
TITLES = {"gpt2-small": "GPT-2 small", "tiny": "a tiny GPT-2 (2 layers, d_model 192, 12 heads)",
          "smollm2": "SmolLM2-135M's architecture (Llama: 30 layers, 9 heads and 3 key/value heads of 64, rotary)"}
# --size smollm2: a rotary Llama with SmolLM2-135M's config, converted by the rotary methods of its cache race at each
# --cache-fractions (collab_attn.pretrained.race.entries_at: the sizes scripts/race_smollm2.py uses)
LLM_SIZES = {"smollm2": "smollm2"}
LLM_METHODS = ("cp", "key-svd", "kv-svd", "merge-kv", "drop-kv")
# The conversions of the cache race (experiments/kv_cache): keys and values shared (cp; tucker: mixed by a matrix per
# head) or cut per head (svd), a latent (kv-svd, MLA), whole heads removed (prune). key-svd never caches less than
# half. The default set; --race-methods picks others.
RACE_METHODS = ("cp", "svd", "kv-svd", "prune")
EXPORTED = "exported"  # a conversion's standard checkpoint (--export: collab_attn.serving.standard_model)
REFERENCE = ", reference path"  # the name of a model's twin on the reference path (--kernels-against-reference)
PRESENT = ", present path"  # the name of a model's twin without the Triton kernels (--triton)
# a twin's suffix -> its row's keys: the ratio to the twin and its verdict
TWIN_KEYS = {REFERENCE: ("vs_reference", "reference_verdict"), PRESENT: ("vs_present", "present_verdict")}


def twin_suffix(args) -> str | None:
    """The suffix of every collaborative model's twin: ``REFERENCE`` (--kernels-against-reference), ``PRESENT``
    (--triton), or None (no twins)."""
    if getattr(args, "kernels_against_reference", False):
        return REFERENCE
    return PRESENT if getattr(args, "triton", False) else None


def gpt2_sizes(size: str) -> dict:
    """The GPT-2 config fields of ``--size`` (the last token is the bos and eos token, as 50256 is GPT-2's)."""
    layers, d_model, heads, vocab = SIZES[size]
    return {"n_layer": layers, "n_embd": d_model, "n_head": heads, "vocab_size": vocab, "bos_token_id": vocab - 1,
            "eos_token_id": vocab - 1}


def build(layout: Layout | None, positions: int, device: str, dtype: torch.dtype,
          size: str = "gpt2-small") -> transformers.PreTrainedModel:
    """GPT-2 of ``size`` (default: small) with concatenated heads (``layout=None``) or converted layers of
    ``layout``."""
    sizes = {**gpt2_sizes(size), "n_positions": positions}
    if layout is None:
        config = transformers.GPT2Config(**sizes)
    else:
        config = collab_config_class("gpt2")(**sizes, **layout.config_fields())
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype).eval()


def variants_of(args) -> dict[str, Layout | None]:
    """The original, keys-only collaborative heads at ``--ranks`` and, per ``--cache-fractions``, each cache-race
    method (``--race-methods``) at the size that caches at most that fraction (``collab_attn.models.sizing``)."""
    config = transformers.GPT2Config(**gpt2_sizes(args.size))
    variants = {"original": None} | {
        f"collab D~={rank}": Layout.uniform("cp", "collaborative", config.n_layer, rank=rank) for rank in args.ranks}
    original = original_size(config)
    for method in args.race_methods:
        sizes = conversion_sizes(config, METHODS[method])
        for fraction in args.cache_fractions:
            size = conversion_at(sizes, original, fraction)
            if size is not None:
                name = f"{method} k{size.rank}" + ("" if size.value_rank is None else f" v{size.value_rank}")
                variants[f"{name} ({fraction:g})"] = converted_layout(config, METHODS[method],
                                                                      LayerSizes(size.rank, size.value_rank))
    suffix = twin_suffix(args)
    if suffix:  # each converted model, then its twin
        variants = {key: value for name, layout in variants.items()
                    for key, value in [(name, layout)] + ([(name + suffix, layout)] if layout else [])}
    return variants


def on_path(name: str):
    """The context a model's steps run in: its twin's on the reference path (``REFERENCE``) or the present path
    (``PRESENT``), the others as built."""
    if name.endswith(REFERENCE):
        return cpu_kernels.reference_path()
    return triton_kernels.present_path() if name.endswith(PRESENT) else contextlib.nullcontext()


def kernel_calls(step, prefix: str = "collab_attn::") -> int:
    """Calls of the ``collab_attn`` operators whose names start with ``prefix`` (default: every one, the CPU kernels;
    ``collab_attn::triton_``: the Triton kernels) in one ``step()`` (a profiled decoding step)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        step()
    return sum(event.name.startswith(prefix) for event in profile.events())


def filled_cache(model, kind: str, batch: int, context: int):
    """A cache of ``kind`` (dynamic or static) holding ``context`` random positions in the layout the model's
    attention layers write; a static cache has room for one more (the step's token)."""
    ids = torch.randint(0, model.config.vocab_size, (batch, 1), device=model.device)
    cache = DynamicCache() if kind == "dynamic" else StaticCache(config=model.config, max_cache_len=context + 1)
    with torch.inference_mode():  # the buffers are inference tensors: fill them in that mode too
        # one real step gives each layer its key and value shapes
        model(ids, use_cache=True, **{cache_keyword(model): cache})
        _fill(cache, kind, context)
    return cache


def _fill(cache, kind: str, context: int) -> None:
    for layer in cache.layers:
        if kind == "dynamic":
            keys, values = layer.keys, layer.values
            layer.keys = torch.randn(*keys.shape[:2], context, keys.shape[-1], device=keys.device, dtype=keys.dtype)
            layer.values = torch.randn(*values.shape[:2], context, values.shape[-1], device=keys.device,
                                       dtype=values.dtype)
        else:  # in place: the buffers keep the addresses a compiled step reads
            layer.keys.normal_()
            layer.values.normal_()
            layer.cumulative_length.fill_(context)


def rewind(cache, context: int) -> None:
    """Drop the step's token: every step sees ``context`` cached positions."""
    with torch.inference_mode():
        if isinstance(cache, StaticCache):
            for layer in cache.layers:
                layer.cumulative_length.fill_(context)
        else:
            cache.crop(-1)


def cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def timed(model, forward=None, **inputs) -> float:
    """Seconds for one forward pass of ``model`` (or of ``forward``, its compiled form) on ``inputs`` (the GPU
    synchronized on both sides)."""
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        (forward or model)(**inputs)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def decode_step(model, forward, cache, ids: torch.Tensor, mask: torch.Tensor, context: int) -> float:
    """Seconds for one new token per sequence against ``cache``, which is set back to ``context`` afterwards."""
    seconds = timed(model, forward, input_ids=ids, attention_mask=mask, use_cache=True,
                    **{cache_keyword(model): cache})
    rewind(cache, context)
    return seconds


def prefill(model, ids: torch.Tensor) -> float:
    """Seconds for the prompt pass of ``ids`` into an empty cache, logits of the last position only."""
    return timed(model, input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
                 **{cache_keyword(model): DynamicCache()})


def repeated_seconds(models: dict, args, measure) -> dict[str, list[float]]:
    """``measure(name, model)`` for ``args.repeats`` rounds after ``args.warmup``; the models take turns round by
    round, so machine noise falls on every model alike."""
    times = {name: [] for name in models}
    for step in range(args.warmup + args.repeats):
        for name, model in models.items():
            seconds = measure(name, model)
            if step >= args.warmup:
                times[name].append(seconds)
    return times


def timed_row(row: dict, key: str, seconds: list[float], base: dict | None) -> dict:
    """``row`` with the median of ``seconds`` (as ``key``, milliseconds), every run and their range, and the ratio
    to ``base`` (the original's row; ``None``: this is the original) with its verdict."""
    runs = [1e3 * s for s in seconds]
    row |= {key: statistics.median(runs), f"{key}_low": min(runs), f"{key}_high": max(runs), f"{key}_runs": runs}
    if base is None:
        return row | {"time_vs_original": 1.0, "verdict": "-"}
    versus = timing_verdict(runs, base[f"{key}_runs"])
    return row | {"time_vs_original": row[key] / base[key], "verdict": versus.verdict}


def llm_models(args, dtype: torch.dtype) -> dict[str, transformers.PreTrainedModel]:
    """The original (random weights, the checkpoint's config) and its rotary conversions at ``--cache-fractions``,
    each converted by ``reparametrize`` (the fits of random weights: decoding time does not depend on them)."""
    import copy

    from collab_attn.models.checkpoints import resolve_model
    from collab_attn.pretrained.race import entries_at

    config = transformers.AutoConfig.from_pretrained(resolve_model(LLM_SIZES[args.size]))
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    models = {"original": original}
    shared = {"bands": "shared"} if args.export else {}
    for method in args.race_methods:
        for fraction in args.cache_fractions:
            for entry in entries_at(method, fraction, rope_pairs=4, kv_heads=kv_heads, head_dim=head_dim):
                model = copy.deepcopy(original)
                sizes = {} if entry.value_rank is None else {"value_rank": entry.value_rank}
                collab_attn.reparametrize(model, entry.rank, method=method, progress=False, **sizes, **entry.options,
                                          **shared)
                name = f"{method} k{entry.rank}" + ("" if entry.value_rank is None else f" v{entry.value_rank}")
                if args.export:  # in its place the standard checkpoint it exports to: a plain Llama, one kv head
                    from collab_attn.serving import standard_model

                    models[f"{name} ({fraction:g}) {EXPORTED}"] = standard_model(model).model
                else:
                    models[f"{name} ({fraction:g})"] = model
    return {name: model.to(device=args.device, dtype=dtype).eval() for name, model in models.items()}


def run(args) -> list[dict]:
    dtype = getattr(torch, args.dtype)
    positions = max(args.contexts) + 8
    if args.size in LLM_SIZES:
        models = llm_models(args, dtype)
        suffix = twin_suffix(args)
        if suffix:  # each converted model, then its twin: the same model object (weights), a cache of its own
            models = {key: value for name, model in models.items()
                      for key, value in [(name, model)] + ([(name + suffix, model)] if name != "original" else [])}
        variants = dict.fromkeys(models)
    else:
        variants = variants_of(args)
        models = {name: build(layout, positions, args.device, dtype, args.size) for name, layout in variants.items()}
    if args.prefill:
        return [row for batch in args.batches for context in args.contexts
                for row in prefill_rows(models, variants, args, batch, context)]
    return [row for batch in args.batches for context in args.contexts for kind in args.caches
            for row in decode_rows(models, variants, args, kind, batch, context)]


def prefill_rows(models: dict, variants: dict, args, batch: int, context: int) -> list[dict]:
    ids = torch.randint(0, next(iter(models.values())).config.vocab_size, (batch, context), device=args.device)
    times = repeated_seconds(models, args, lambda name, model: prefill(model, ids))
    rows = []
    for name in models:
        base = rows[0] if rows else None  # the first model is the original
        row = timed_row({"batch": batch, "context": context, "model": name}, "prefill_ms", times[name], base)
        rows.append(row)
        print(f"batch {batch:3d} context {context:5d}  {name:16s} {row['prefill_ms']:9.1f} ms prefill "
              f"({row['time_vs_original']:.2f}x, {row['verdict']})", flush=True)
    return rows


def compiled(model, backend: str = "inductor"):
    """``model.forward`` compiled for a static cache: one graph for the whole decoding step (inductor with CUDA
    graphs on a GPU); each (batch, context) pair compiles afresh (``torch._dynamo.reset`` between them). Another
    ``backend`` (the tests' ``aot_eager``) captures the same whole graph without generating kernels."""
    mode = "reduce-overhead" if model.device.type == "cuda" and backend == "inductor" else None
    return torch.compile(model.forward, fullgraph=True, dynamic=False, mode=mode, backend=backend)


def weight_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def decode_rows(models: dict, variants: dict, args, kind: str, batch: int, context: int) -> list[dict]:
    torch._dynamo.reset()
    caches = {name: filled_cache(model, kind, batch, context) for name, model in models.items()}
    forwards = {name: compiled(model, args.compile_backend) if kind == "static" else None
                for name, model in models.items()}
    ids = torch.randint(0, next(iter(models.values())).config.vocab_size, (batch, 1), device=args.device)
    mask = torch.ones(batch, context + 1, dtype=torch.long, device=args.device)

    def step(name, model, eager: bool = False):
        with on_path(name):
            return decode_step(model, None if eager else forwards[name], caches[name], ids, mask, context)

    step_extra = {}  # bytes a step allocates beyond the weights and caches (GPU only: the CPU has no counter)
    for name, model in models.items():
        if args.device == "cuda":
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        step(name, model)  # compiles a static step
        if args.device == "cuda":
            step_extra[name] = torch.cuda.max_memory_allocated() - before
    calls, suffix = {}, twin_suffix(args)
    if suffix == REFERENCE:
        calls = {name: kernel_calls(lambda: step(name, model)) for name, model in models.items()}  # noqa: B023
    elif suffix == PRESENT:  # an eager step: a CUDA graph's replay shows no operator calls to the profiler
        calls = {name: kernel_calls(lambda: step(name, model, eager=True), "collab_attn::triton_")  # noqa: B023
                 for name, model in models.items()}
    if suffix:
        wrong = [name for name in models if name + suffix in models and not calls[name]]
        wrong += [name for name in models if name.endswith(suffix) and calls[name]]
        if wrong:
            raise RuntimeError(f"{', '.join(wrong)}: not on the path named (kernel calls per step: {calls})")
    times = repeated_seconds(models, args, step)
    budget = args.memory_gib * 2**30
    rows = []
    for name, model in models.items():
        per_sequence = (cache_bytes(caches[name]) + step_extra.get(name, 0)) / batch
        base = rows[0] if rows else None  # the first model is the original
        row = timed_row({"batch": batch, "context": context, "cache": kind, "model": name}, "ms_per_step",
                        times[name], base)
        row |= {"ms_per_token": row["ms_per_step"] / batch, "tokens_per_s": 1e3 * batch / row["ms_per_step"],
                "cache_mib": cache_bytes(caches[name]) / 2**20,
                "max_batch": int((budget - weight_bytes(model)) // per_sequence)}
        if name in step_extra:
            row["step_extra_mib"] = step_extra[name] / 2**20
        row["cache_vs_original"] = row["cache_mib"] / (base or row)["cache_mib"]
        twin = ""
        if name in calls:
            row["kernel_calls"] = calls[name]
        if suffix and name + suffix in times:  # the kernels against their twin on the other path
            versus = timing_verdict(times[name], times[name + suffix])
            ratio_key, verdict_key = TWIN_KEYS[suffix]
            row |= {ratio_key: versus.ratio, verdict_key: versus.verdict}
            twin = f"  vs {suffix[2:]} {versus.ratio:.2f}x: {versus.verdict}"
        rows.append(row)
        print(f"batch {batch:3d} context {context:5d} {kind:7s} {name:16s} {row['ms_per_token']:8.3f} ms/token "
              f"({row['time_vs_original']:.2f}x, {row['verdict']})  cache {row['cache_mib']:8.1f} MiB "
              f"({row['cache_vs_original']:.2f}x)  max batch {row['max_batch']}{twin}", flush=True)
    return rows  # the caches go when this returns, before the next ones are filled


def markdown(rows: list[dict], args, environment: dict) -> str:
    if args.prefill:
        return prefill_markdown(rows, args, environment)
    extra = args.device == "cuda"
    twins = twin_suffix(args)
    ratio_key, verdict_key = TWIN_KEYS.get(twins, (None, None))
    explained = {
        REFERENCE: f" `{REFERENCE[2:]}`: the same model and weights decoding through the reference path instead of "
                   "the CPU kernels (`cpu_kernels.reference_path()`), taking turns with the others in this process; "
                   "`vs reference path`: the ratio of the medians, and its verdict by the same rule.",
        PRESENT: f" `{PRESENT[2:]}`: the same model and weights decoding through the layers' present path instead of "
                 "the Triton kernels (`triton_kernels.present_path()`), taking turns with the others in this "
                 "process; `vs present path`: the ratio of the medians, and its verdict by the same rule.",
    }
    if args.compile_backend == "inductor":
        compiler = f"`torch.compile(fullgraph=True)`{' with CUDA graphs' if extra else ''}"
    else:
        compiler = f"`torch.compile(fullgraph=True, backend=\"{args.compile_backend}\")`"
    lines = [
        f"# Decoding: {TITLES[args.size]} (random weights) against collaborative attention, {args.device}, "
        f"{args.dtype}",
        "",
        f"One new token per sequence per step against a cache of `context` positions; median of {args.repeats} "
        f"steps after {args.warmup} warm-up steps, and their range (the step-to-step spread). `dynamic`: "
        f"DynamicCache, eager; `static`: StaticCache and {compiler}. Time ratios compare models with the same batch, "
        "context and cache; the verdict says faster or slower only where the two models' ranges do not overlap "
        "(`collab_attn.stats.timing_verdict`), tie otherwise. Max batch: the largest batch whose weights and cache"
        f"{' (and the step' + chr(39) + 's own memory)' if extra else ''} fit {args.memory_gib:g} GiB at that "
        f"context, from the measured bytes. {environment['device_name']}, torch {environment['torch']}, "
        f"transformers {environment['transformers']}, {environment['threads']} threads."
        + explained.get(twins, ""),
        "",
        "```bash",
        environment["command"],
        "```",
        "",
        "| batch | context | cache | model | ms / step | range | ms / token | tokens / s | vs original | verdict | "
        f"cache MiB | vs original | max batch |{' step extra MiB |' if extra else ''}"
        f"{f' vs {twins[2:]} | verdict |' if twins else ''}",
        f"|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|{'---:|' if extra else ''}"
        f"{'---:|---|' if twins else ''}",
    ]
    lines += [
        f"| {r['batch']} | {r['context']} | {r['cache']} | {r['model']} | {r['ms_per_step']:.2f} | "
        f"{r['ms_per_step_low']:.2f}-{r['ms_per_step_high']:.2f} | {r['ms_per_token']:.3f} | {r['tokens_per_s']:.1f} | "
        f"{r['time_vs_original']:.2f}x | {r['verdict']} | {r['cache_mib']:.1f} | {r['cache_vs_original']:.2f}x | "
        f"{r['max_batch']} |" + (f" {r['step_extra_mib']:.0f} |" if extra else "")
        + ((f" {r[ratio_key]:.2f}x | {r[verdict_key]} |" if ratio_key in r else " - | - |") if twins else "")
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def prefill_markdown(rows: list[dict], args, environment: dict) -> str:
    lines = [
        f"# Prefill: {TITLES[args.size]} (random weights) against collaborative attention, {args.device}, "
        f"{args.dtype}",
        "",
        "A prompt of `context` tokens per sequence into an empty cache (causal mask, logits of the last "
        f"position); median of {args.repeats} passes after {args.warmup} warm-up passes and their range; faster or "
        "slower only where the ranges do not overlap (`collab_attn.stats.timing_verdict`), tie otherwise. "
        f"{environment['device_name']}, torch {environment['torch']}, transformers {environment['transformers']}, "
        f"{environment['threads']} threads.",
        "",
        "```bash",
        environment["command"],
        "```",
        "",
        "| batch | context | model | prefill ms | range | vs original | verdict |",
        "|---:|---:|---|---:|---:|---:|---|",
    ]
    lines += [f"| {r['batch']} | {r['context']} | {r['model']} | {r['prefill_ms']:.1f} | "
              f"{r['prefill_ms_low']:.1f}-{r['prefill_ms_high']:.1f} | {r['time_vs_original']:.2f}x | {r['verdict']} |"
              for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])  # its errors: one error: line
    parser.add_argument("--contexts", type=cli.positive_arg, nargs="+", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--size", choices=[*SIZES, *LLM_SIZES], default="gpt2-small",
                        help="the model: gpt2-small (the benchmark), tiny (2 layers of 192: a check that it runs) or "
                             "smollm2 (SmolLM2-135M's rotary architecture and its race's conversions; no --ranks)")
    parser.add_argument("--ranks", type=cli.positive_arg, nargs="*", default=None,
                        help="collaborative key widths D~ (default: d_model/2, /4, /8: 384 192 96 for gpt2-small; "
                             "none given: no keys-only models)")
    parser.add_argument("--cache-fractions", type=float, nargs="+", default=[],
                        help="also each cache-race conversion (cp keys and values, svd with values, kv-svd, prune) "
                             "at the size caching at most this fraction of the original's bytes")
    parser.add_argument("--race-methods", nargs="+", default=None,
                        choices=list(METHODS), help="the conversions that --cache-fractions sizes (default: "
                        f"{' '.join(RACE_METHODS)}; --size smollm2: {' '.join(LLM_METHODS[:3])}; one that cannot reach "
                        "a fraction gives no row there)")
    parser.add_argument("--batches", "--batch", type=cli.positive_arg, nargs="+", default=[1],
                        help="sequences per step")
    parser.add_argument("--caches", nargs="+", choices=("dynamic", "static"), default=["dynamic"],
                        help="dynamic: DynamicCache, eager; static: StaticCache and torch.compile(fullgraph=True)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile's backend for static caches (default inductor, what transformers uses; "
                             "aot_eager: the same fullgraph capture without generating kernels, for checks)")
    parser.add_argument("--memory-gib", type=cli.positive_number_arg, default=None,
                        help="memory budget for the max-batch column (default: 80 on cuda, 24 on the CPU)")
    parser.add_argument("--repeats", type=cli.positive_arg, default=10)
    parser.add_argument("--warmup", type=cli.count_arg, default=2)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--threads", type=cli.positive_arg, default=None,
                        help="CPU threads for torch (default: torch's)")
    parser.add_argument("--prefill", action="store_true", help="time the prompt pass instead of decoding steps")
    parser.add_argument("--kernels-against-reference", action="store_true",
                        help="also every collaborative model on the reference path instead of the CPU kernels, "
                             "taking turns in this process (CPU, float32, decoding)")
    parser.add_argument("--triton", action="store_true",
                        help="also every collaborative model on its present path instead of the Triton kernels, "
                             "taking turns in this process (decoding, where the kernels run: a GPU with triton, or "
                             "the CPU under COLLAB_ATTN_TRITON=1 TRITON_INTERPRET=1)")
    parser.add_argument("--export", action="store_true",
                        help="--size smollm2: convert with bands='shared' and decode each conversion's standard "
                             "checkpoint instead (collab_attn.export: a plain LlamaForCausalLM with one key/value "
                             "head); --race-methods among cp, key-svd")
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/benchmarks/<decode or prefill>_"
                             "<device>_<dtype>_<UTC time>); an existing result is never overwritten")
    args = parser.parse_args(argv)
    try:
        args.device = cli.device("--device", args.device)
    except cli.BadInput as error:
        parser.error(str(error))
    if args.race_methods is None:
        args.race_methods = list(LLM_METHODS[:3] if args.size in LLM_SIZES else RACE_METHODS)
    if args.size in LLM_SIZES:
        if args.ranks:
            parser.error(f"--ranks: keys-only collaborative widths are GPT-2's; --size {args.size} converts by "
                         "--race-methods at --cache-fractions")
        if set(args.race_methods) - set(LLM_METHODS):
            parser.error(f"--race-methods {sorted(set(args.race_methods) - set(LLM_METHODS))} do not convert rotary "
                         f"models (these do: {' '.join(LLM_METHODS)})")
        args.ranks = []
        if args.export and set(args.race_methods) - {"cp", "tucker", "key-svd"}:
            parser.error(f"--export: {sorted(set(args.race_methods) - {'cp', 'tucker', 'key-svd'})} have no standard "
                         "form; give --race-methods among cp, tucker, key-svd")
    elif args.export:
        parser.error("--export writes rotary conversions as standard checkpoints: give --size smollm2")
    elif args.ranks is None:
        d_model = SIZES[args.size][1]
        args.ranks = [d_model // 2, d_model // 4, d_model // 8]
    elif max(args.ranks) > SIZES[args.size][1]:
        parser.error(f"--ranks {max(args.ranks)}: a collaborative key width is at most d_model "
                     f"({SIZES[args.size][1]} for --size {args.size}), the concatenated heads' own")
    if args.memory_gib is None:
        args.memory_gib = 80.0 if args.device == "cuda" else 24.0
    if any(not 0 < f <= 1 for f in args.cache_fractions):
        parser.error(f"--cache-fractions must lie in (0, 1], got {args.cache_fractions}")
    if args.kernels_against_reference:
        if args.device != "cpu" or args.dtype != "float32" or args.prefill or args.size in LLM_SIZES:
            parser.error("--kernels-against-reference: the CPU kernels decode GPT-2's collaborative layers on the CPU "
                         "in float32 (no --prefill, --size smollm2, --device cuda or --dtype other than float32)")
        if not cpu_kernels.available():
            parser.error(f"--kernels-against-reference: the CPU kernels do not run here (x86 with AVX2 and a "
                         f"compiler, {cpu_kernels.SWITCH} not 0)")
    if args.triton:
        if args.kernels_against_reference or args.prefill:
            parser.error("--triton: decoding steps, one kind of twin at a time (no --prefill or "
                         "--kernels-against-reference)")
        try:
            runs = triton_kernels.applies(torch.empty(0, device=args.device))
        except (RuntimeError, ValueError) as error:
            parser.error(f"--triton: {error}")
        if not runs:
            parser.error(f"--triton: the Triton kernels do not run on {args.device} here (a GPU with triton, or the "
                         f"CPU under {triton_kernels.SWITCH}=1 TRITON_INTERPRET=1; {triton_kernels.SWITCH} not 0)")
    kind = "prefill" if args.prefill else "decode"
    try:
        if "static" in args.caches:  # compiled
            cli.compile_backend("--compile-backend", args.compile_backend)
        out = cli.result_stem("--out", args.out, ROOT / "experiments" / "benchmarks" /
                              f"{kind}_{args.device}_{args.dtype}")
    except cli.BadInput as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    environment = {
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "CPU",
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "command": " ".join(["python benchmarks/decode.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    rows = run(args)
    write_result_pair(out, {"args": vars(args) | {"out": str(out)}, "environment": environment, "rows": rows},
                      markdown(rows, args, environment))
    return rows


if __name__ == "__main__":
    main()
