"""Decoding time per token of the attention variants of the cache race (experiments/shakespeare_char/kv_race.md)
at a long context on the CPU, side by side in one process: the cpu recipe's model (4 layers, 4 heads, d 128, a
65-character vocabulary) with positions up to the context, randomly initialized, its cache filled with random keys
and values (``benchmarks/decode.py``'s machinery: one new token per step against ``context`` cached positions, the
models taking turns step by step).

    OMP_NUM_THREADS=1 python benchmarks/race_decode.py --out experiments/benchmarks/race_decode_cpu_1thread_runs5.md
    python benchmarks/race_decode.py --contexts 2048 8192 --batch 8 --out <new file>.md

Each of ``--runs`` runs takes the median over ``--repeats`` steps; rows: the median of the runs in milliseconds per
token and their range (the run-to-run spread), the ratio of medians to the concatenated model, ``faster`` or
``slower`` only where the two ranges do not overlap (``collab_attn.stats.timing_verdict``), and the cache bytes
measured from the cache's tensors (float32 here; the race tables give bf16). The table goes to ``--out`` and every
run's numbers to the JSON beside it; an existing result is never overwritten.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from decode import cache_bytes, decode_step, filled_cache, repeated_seconds  # noqa: E402

from collab_attn import cli  # noqa: E402
from collab_attn.char_lm.models import build_model, gpt_config  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.stats import timing_verdict  # noqa: E402

MODEL = {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0}
# (name, attention, rank, value_rank): the race's variants at 1/1, 1/2, 1/4 and 1/8 of the cache
VARIANTS = [
    ("concat", "concat", 128, None), ("gqa kv2", "gqa", 64, None), ("mqa", "mqa", 32, None),
    ("mla 128", "mla", 128, None), ("mla 64", "mla", 64, None), ("mla 32", "mla", 32, None),
    ("collab k62 v62", "collab", 62, 62), ("collab k30 v30", "collab", 30, 30), ("collab k14 v14", "collab", 14, 14),
]


def rows_for(context: int, batch: int, args) -> list[dict]:
    models = {name: build_model(gpt_config(65, context + 1, **MODEL, kind=kind, rank=key, value_rank=values),
                                seed=0).eval() for name, kind, key, values in VARIANTS}
    caches = {name: filled_cache(model, "dynamic", batch, context) for name, model in models.items()}
    ids = torch.randint(0, 65, (batch, 1))
    mask = torch.ones(batch, context + 1, dtype=torch.long)
    times = repeated_seconds(models, args, lambda name, model: decode_step(model, None, caches[name], ids, mask,
                                                                           context))
    medians = {name: statistics.median(seconds) for name, seconds in times.items()}
    base = medians["concat"]
    return [{"variant": name, "context": context, "batch": batch, "ms_per_token": 1e3 * seconds / batch,
             "ratio": seconds / base, "cache_bytes_per_token": cache_bytes(caches[name]) // (batch * context)}
            for name, seconds in medians.items()]


def over_runs(runs: list[list[dict]]) -> list[dict]:
    """Rows of several runs (the same variants and contexts in each) as one row per variant and context: the median
    of the runs, their range and every run's time, the ratio of medians to concat and the timing verdict."""
    rows = [{**same[0], "ms_per_token_runs": [r["ms_per_token"] for r in same]} for same in zip(*runs)]
    for row in rows:
        concat = next(r for r in rows if r["variant"] == "concat" and r["context"] == row["context"])
        verdict = timing_verdict(row["ms_per_token_runs"], concat["ms_per_token_runs"])
        row.update(ms_per_token=verdict.candidate.median, ms_low=verdict.candidate.low,
                   ms_high=verdict.candidate.high, ratio=verdict.ratio, verdict=verdict.verdict)
    return rows


def markdown(rows: list[dict], args, command: str) -> str:
    lines = [f"Decoding on the CPU ({torch.get_num_threads()} threads), float32, {args.runs} runs, each the median "
             f"of {args.repeats} steps after {args.warmup} (the models taking turns); faster or slower than concat "
             f"only where the ranges of runs do not overlap; `{command}`",
             "", "| variant | context | batch | ms / token (median of runs) | range of runs | vs concat | verdict "
             "| cache B / token (float32, measured) |", "|---|---:|---:|---:|---:|---:|---|---:|"]
    lines += [f"| {r['variant']} | {r['context']} | {r['batch']} | {r['ms_per_token']:.3f} "
              f"| {r['ms_low']:.3f}-{r['ms_high']:.3f} | {r['ratio']:.2f}x | {r['verdict']} "
              f"| {r['cache_bytes_per_token']:,} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    parser = cli.ArgumentParser(description=__doc__.splitlines()[0])  # its errors: one error: line
    parser.add_argument("--contexts", type=cli.positive_arg, nargs="+", default=[2048])
    parser.add_argument("--batch", type=cli.positive_arg, default=1)
    parser.add_argument("--warmup", type=cli.count_arg, default=5)
    parser.add_argument("--repeats", type=cli.positive_arg, default=30)
    parser.add_argument("--runs", type=cli.positive_arg, default=5)
    parser.add_argument("--out", type=Path, required=True, help="a new .md file; the JSON of every run goes beside it")
    args = parser.parse_args(argv)
    try:  # a result already there is never overwritten; a folder or a file under a file is refused before the work
        stem = cli.result_stem("--out", args.out, None)
    except cli.BadInput as error:
        parser.error(str(error))
    outputs = [stem.with_suffix(".md"), stem.with_suffix(".json")]
    load = [os.getloadavg()[0]]
    runs = [[row for context in args.contexts for row in rows_for(context, args.batch, args)] for _ in range(args.runs)]
    load.append(os.getloadavg()[0])
    rows = over_runs(runs)
    command = " ".join(["python benchmarks/race_decode.py", *(sys.argv[1:] if argv is None else argv)])
    text = markdown(rows, args, command) + f"\nLoad average (1 minute) before and after: {load[0]:.1f}, {load[1]:.1f}\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(outputs[1], json.dumps({"command": command, "threads": torch.get_num_threads(),
                                              "load_average": load, "rows": rows}, indent=1) + "\n")
    write_text_atomic(outputs[0], text)
    return rows


if __name__ == "__main__":
    main()
