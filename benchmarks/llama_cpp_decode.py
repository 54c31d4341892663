"""Decoding in llama.cpp: SmolLM2-135M's architecture against its exported conversions, side by side in one process.

    python benchmarks/llama_cpp_decode.py                          # 1/2 and 1/4 of the cache, batch 1 and 8
    python benchmarks/llama_cpp_decode.py --contexts 8192 --batches 1 --cache-fractions --ranks 48 64 96 128

Models: the original (random weights, SmolLM2-135M's config: 30 layers, 9 query heads and 3 key/value heads of 64)
and its ``key-svd`` conversions with one band split for all layers (``bands="shared"``), at the size that caches at
most each of ``--cache-fractions`` (96/96 at 1/2, 48/48 at 1/4: ``collab_attn.pretrained.race.entries_at``) and at
each of ``--ranks`` (key and value width R, any size: to see how the time depends on the head size). Each conversion
is written as the standard Llama file it exports to (``collab_attn.export(..., format="gguf")``: one key/value head of
head size R), the original the same way (float32, ``collab_attn.serving.checkpoint.source_as_standard``), and all of
them are loaded by llama-cpp-python at once. Decoding time does not depend on the weights' values.

For each cache type (``--cache-types``: ``f16``, llama.cpp's default, or ``f32``), flash-attention setting
(``--flash-attn``: ``auto``, llama.cpp's default, which turns it on for this CPU, or ``off``) and context: every model
gets a context with one cache stream per sequence of the largest batch (``kv_unified=false``, so a sequence attends
to its own positions only); sequence 0 is filled by a prompt of ``context`` random tokens (the prefill, timed once per
model: one run, no verdict) and copied to the other sequences. For each batch, a step decodes one new token for each
of the batch's sequences at position ``context`` and removes it again; the models take turns step by
step, so machine noise falls on all alike. The table gives the median of ``--repeats`` steps after ``--warmup`` and
their range, milliseconds per token, the ratio to the original with ``collab_attn.stats.timing_verdict``'s verdict
(``faster``/``slower`` only where the ranges do not overlap), and the cache's bytes (all layers, keys and values, at
``context`` positions for every sequence). Results: ``--out`` (``.md`` and ``.json``), by default
``experiments/serving/llama_cpp_decode_<UTC time>``; an existing result is never overwritten.

llama-cpp-python is not a dependency of the project (it builds llama.cpp from source): ``scripts/check_llama_cpp.sh``
installs it.
"""

from __future__ import annotations

import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import collab_attn  # noqa: E402
from collab_attn import cli  # noqa: E402
from collab_attn.cli import ArgumentParser  # noqa: E402
from collab_attn.files import write_result_pair  # noqa: E402
from collab_attn.models.checkpoints import resolve_model, smollm2_gguf  # noqa: E402
from collab_attn.pretrained.race import entries_at  # noqa: E402
from collab_attn.serving import standard_model  # noqa: E402
from collab_attn.serving.checkpoint import source_as_standard  # noqa: E402
from collab_attn.serving.gguf_file import write_gguf  # noqa: E402
from collab_attn.serving.llama_cpp_engine import load_llama_cpp  # noqa: E402
from collab_attn.stats import timing_verdict  # noqa: E402

CACHE_TYPES = {"f32": (0, 4), "f16": (1, 2)}  # --cache-types -> (GGML type, bytes per number)
FLASH = {"auto": -1, "off": 0, "on": 1}  # --flash-attn -> llama_flash_attn_type
CHUNK = 512  # prompt tokens per llama_decode call


def gguf_files(args, folder: Path) -> tuple[dict[str, tuple[Path, int, int, int]], int]:
    """The original and its conversions written as GGUF files in ``folder`` (name -> (file, layers, key/value heads,
    head size)), and the vocabulary's size."""
    config = transformers.AutoConfig.from_pretrained(resolve_model("smollm2"))
    torch.manual_seed(0)
    original = transformers.AutoModelForCausalLM.from_config(config).eval()
    vocabulary = smollm2_gguf()
    sizes = [entry.rank for fraction in args.cache_fractions
             for entry in entries_at("key-svd", fraction, rope_pairs=4, kv_heads=config.num_key_value_heads,
                                     head_dim=config.head_dim)]
    layers = config.num_hidden_layers
    files = {"original": (folder / "original.gguf", layers, config.num_key_value_heads, config.head_dim)}
    write_gguf(source_as_standard(original), files["original"][0], vocabulary)
    for rank in dict.fromkeys(sizes + args.ranks):
        model = copy.deepcopy(original)
        collab_attn.reparametrize(model, rank, method="key-svd", value_rank=rank, bands="shared", progress=False)
        name = f"key-svd k{rank} v{rank} exported"
        files[name] = (folder / f"key-svd-{rank}.gguf", layers, 1, rank)
        write_gguf(standard_model(model), files[name][0], vocabulary)
        del model
    return files, config.vocab_size


class Engine:
    """One GGUF file in llama.cpp with a context of ``sequences`` cache streams of ``context + 1`` positions each."""

    def __init__(self, llama_cpp, path: Path, sequences: int, context: int, cache_type: str, flash: str,
                 threads: int):
        self.lib, self.sequences, self.context = llama_cpp, sequences, context
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), llama_cpp.llama_model_default_params())
        params = llama_cpp.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = sequences * (context + 1), sequences, False
        params.n_batch = params.n_ubatch = CHUNK
        params.n_threads = params.n_threads_batch = threads
        params.type_k = params.type_v = CACHE_TYPES[cache_type][0]
        params.flash_attn_type = FLASH[flash]
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp made no context for {path.name} ({sequences} sequences of {context})")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        self.step_batch = llama_cpp.llama_batch_init(sequences, 0, 1)

    def _decode(self, batch) -> None:
        if self.lib.llama_decode(self.ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        self.lib.llama_synchronize(self.ctx)

    def prefill(self, tokens: np.ndarray) -> float:
        """Sequence 0 through ``tokens`` (its cache filled), copied to the other sequences; the seconds of the
        prompt pass alone."""
        chunk = self.lib.llama_batch_init(CHUNK, 0, 1)
        seconds = 0.0
        for start in range(0, len(tokens), CHUNK):
            count = min(CHUNK, len(tokens) - start)
            chunk.n_tokens = count
            for i in range(count):
                chunk.token[i], chunk.pos[i], chunk.n_seq_id[i] = int(tokens[start + i]), start + i, 1
                chunk.seq_id[i][0], chunk.logits[i] = 0, i == count - 1
            begin = time.perf_counter()
            self._decode(chunk)
            seconds += time.perf_counter() - begin
        self.lib.llama_batch_free(chunk)
        for sequence in range(1, self.sequences):
            self.lib.llama_memory_seq_cp(self.memory, 0, sequence, -1, -1)
        ends = {self.lib.llama_memory_seq_pos_max(self.memory, s) for s in range(self.sequences)}
        if ends != {self.context - 1}:
            raise RuntimeError(f"the sequences' caches end at {sorted(ends)}, not {self.context - 1}")
        return seconds

    def step(self, batch: int) -> float:
        """One new token for each of the first ``batch`` sequences at position ``context``, timed, then removed
        from their caches."""
        tokens = self.step_batch
        tokens.n_tokens = batch
        for sequence in range(batch):
            tokens.token[sequence], tokens.pos[sequence], tokens.n_seq_id[sequence] = 1 + sequence, self.context, 1
            tokens.seq_id[sequence][0], tokens.logits[sequence] = sequence, True
        begin = time.perf_counter()
        self._decode(tokens)
        seconds = time.perf_counter() - begin
        for sequence in range(batch):
            self.lib.llama_memory_seq_rm(self.memory, sequence, self.context, -1)
        return seconds

    def close(self) -> None:
        self.lib.llama_batch_free(self.step_batch)
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)


def rows_for(llama_cpp, files: dict, args, cache_type: str, flash: str, tokens: np.ndarray) -> list[dict]:
    """Every model decoding after the prompt ``tokens`` at each of ``args.batches``, taking turns step by step
    (module doc)."""
    context = len(tokens)
    engines, prefill, rows = {}, {}, []
    try:
        for name, (path, *_) in files.items():
            engines[name] = Engine(llama_cpp, path, max(args.batches), context, cache_type, flash, args.threads)
            prefill[name] = engines[name].prefill(tokens)
        for batch in args.batches:
            times = {name: [] for name in engines}
            for round_ in range(args.warmup + args.repeats):
                for name, engine in engines.items():
                    seconds = engine.step(batch)
                    if round_ >= args.warmup:
                        times[name].append(1e3 * seconds)
            rows += timed_rows(times, files, prefill, cache_type, flash, batch, context)
    finally:
        for engine in engines.values():
            engine.close()
    return rows


def timed_rows(times: dict, files: dict, prefill: dict, cache_type: str, flash: str, batch: int,
               context: int) -> list[dict]:
    rows, base = [], times["original"]
    for name, (_, layers, kv_heads, head_dim) in files.items():
        runs = times[name]
        cache = layers * 2 * kv_heads * head_dim * CACHE_TYPES[cache_type][1] * batch * context
        verdict = timing_verdict(runs, base)
        rows.append({"cache_type": cache_type, "flash_attn": flash, "batch": batch, "context": context,
                     "model": name, "head_dim": head_dim, "kv_heads": kv_heads,
                     "ms_per_step": statistics.median(runs), "ms_low": min(runs), "ms_high": max(runs),
                     "runs": runs, "ms_per_token": statistics.median(runs) / batch,
                     "time_vs_original": verdict.ratio, "verdict": "-" if name == "original" else verdict.verdict,
                     "cache_mib": cache / 2**20, "prefill_s": prefill[name],
                     "prefill_vs_original": prefill[name] / prefill["original"]})
        print(f"{cache_type} flash {flash} batch {batch} context {context} {name}: {rows[-1]['ms_per_step']:.1f} ms "
              f"({rows[-1]['time_vs_original']:.2f}x, {rows[-1]['verdict']})", flush=True)
    return rows


def markdown(rows: list[dict], environment: dict, args) -> str:
    lines = [
        "# Decoding in llama.cpp: SmolLM2-135M's architecture (random weights) against its exported conversions",
        "",
        f"One new token per sequence per step against a cache of `context` positions per sequence (one cache stream "
        f"per sequence); median of {args.repeats} steps after {args.warmup} warm-up steps and their range; the "
        "models take turns step by step in one process; faster or slower only where the ranges do not overlap "
        "(`collab_attn.stats.timing_verdict`), tie otherwise. Prefill: sequence 0's prompt of `context` tokens, "
        f"one run. Weights float32. llama-cpp-python {environment['llama_cpp_python']}, "
        f"{environment['device_name']}, {args.threads} thread(s); llama.cpp's CPU features: "
        f"{environment['system_info']}.",
        "",
        "```bash",
        environment["command"],
        "```",
        "",
        "| cache | flash attn | batch | context | model | head size | ms / step | range | ms / token | vs original "
        "| verdict | cache MiB | prefill s | vs original |",
        "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|---:|---:|---:|",
    ]
    lines += [f"| {r['cache_type']} | {r['flash_attn']} | {r['batch']} | {r['context']} | {r['model']} | "
              f"{r['head_dim']} | {r['ms_per_step']:.1f} | {r['ms_low']:.1f}-{r['ms_high']:.1f} | "
              f"{r['ms_per_token']:.2f} | {r['time_vs_original']:.2f}x | {r['verdict']} | {r['cache_mib']:.1f} | "
              f"{r['prefill_s']:.2f} | {r['prefill_vs_original']:.2f}x |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-fractions", type=float, nargs="*", default=[0.5, 0.25],
                        help="the key-svd conversion that caches at most each fraction of the original's bytes")
    parser.add_argument("--ranks", type=cli.positive_arg, nargs="*", default=[],
                        help="also key-svd at these key and value widths (even numbers: R/2 rotary pairs)")
    parser.add_argument("--contexts", type=cli.positive_arg, nargs="+", default=[2048, 8192])
    parser.add_argument("--batches", type=cli.positive_arg, nargs="+", default=[1, 8])
    parser.add_argument("--cache-types", nargs="+", choices=list(CACHE_TYPES), default=["f16"],
                        help="the cache's number type (f16: llama.cpp's default)")
    parser.add_argument("--flash-attn", nargs="+", choices=list(FLASH), default=["auto", "off"],
                        help="llama.cpp's flash attention: auto (llama.cpp's default: it chooses), on, or off")
    parser.add_argument("--repeats", type=cli.positive_arg, default=9)
    parser.add_argument("--warmup", type=cli.count_arg, default=2)
    parser.add_argument("--threads", type=cli.positive_arg, default=1)
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/serving/llama_cpp_decode_<UTC "
                             "time>); an existing result is never overwritten")
    args = parser.parse_args(argv)
    if any(not 0 < f <= 1 for f in args.cache_fractions):
        parser.error(f"--cache-fractions must lie in (0, 1], got {args.cache_fractions}")
    if any(r % 2 for r in args.ranks):
        parser.error(f"--ranks {[r for r in args.ranks if r % 2]}: a rotary key width is even (pairs)")
    if not args.cache_fractions and not args.ranks:
        parser.error("nothing to compare the original with: give --cache-fractions or --ranks")
    try:
        out = cli.result_stem("--out", args.out, ROOT / "experiments" / "serving" / "llama_cpp_decode")
    except cli.BadInput as error:
        parser.error(str(error))
    try:
        llama_cpp = load_llama_cpp()
    except ImportError as error:
        parser.error(str(error))
    environment = {
        "device_name": platform.processor() or "CPU", "cpus": os.cpu_count(),
        "llama_cpp_python": llama_cpp.__version__, "torch": torch.__version__,
        "system_info": llama_cpp.llama_print_system_info().decode().strip(),
        "command": " ".join(["python benchmarks/llama_cpp_decode.py", *(sys.argv[1:] if argv is None else argv)]),
    }
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        files, vocabulary = gguf_files(args, Path(folder))
        prompt = np.random.default_rng(0).integers(0, vocabulary, max(args.contexts))
        for cache_type in args.cache_types:
            for flash in args.flash_attn:
                for context in args.contexts:
                    rows += rows_for(llama_cpp, files, args, cache_type, flash, prompt[:context])
    write_result_pair(out, {"args": vars(args) | {"out": str(out)}, "environment": environment, "rows": rows},
                      markdown(rows, environment, args))
    return rows


if __name__ == "__main__":
    main()
