"""One decoding step of tensor product attention (``collab_attn.kinds.rotary_tpa``),
scored against the cached factors (the
layer's decoding path) and through per-head keys and values expanded from them (its prompt path, one query row),
beside the rotary original's step (multi-head attention on per-head keys and values, ``scaled_dot_product_attention``).

    python benchmarks/tpa_decode.py                             # CPU, float32, batch 1, contexts 1024 and 8192
    python benchmarks/tpa_decode.py --batch 8 --contexts 4096

The step: one new query per sequence, 6 heads of 64 (d = 384, nanoGPT's gpu recipe, at which the GPU queue's job
``rope`` is to rerun the rotary race; the race that ran, ``experiments/shakespeare_char/rope_race.md``, has 4 heads of
32, d = 128), a cache of ``context`` positions of random factors (decoding time does not depend on their values),
TPA's ranks ``--ranks`` (keys, values; default 2 and 2, the race's ``k2-v2``). The three take turns step by step,
``--repeats`` steps after ``--warmup``; each row gives the median step, the range (the step-to-step spread), the
ratio to the original's step and the verdict of ``collab_attn.stats.timing_verdict`` (faster or slower only where
the ranges do not overlap, tie otherwise); the factored step's row also its ratio and verdict against the expanded
heads. The two TPA paths are checked to agree. Results:
``experiments/benchmarks/tpa_decode_<device>_<dtype>_<UTC time>.{md,json}`` (``--out``: a new path; never
overwritten).
"""

from __future__ import annotations

import json
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.kinds.rotary_tpa.rotary_tpa_attention import TensorProductAttention  # noqa: E402
from collab_attn.nn.attention import grouped_attend  # noqa: E402
from collab_attn.stats import timing, timing_verdict  # noqa: E402

HEADS, HEAD_DIM = 6, 64
ORIGINAL = "original (per-head keys and values)"
FACTORED, EXPANDED = "TPA factored (the layer's step)", "TPA expanded heads"


def steps(layer: TensorProductAttention, batch: int, context: int, dtype, device):
    """The three ways of one step on the same inputs: ``name -> zero-argument function``."""
    g = torch.Generator(device="cpu").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    keys = randn(batch, 1, context, layer.key_rank * (HEADS + HEAD_DIM))
    values = randn(batch, 1, context, layer.value_rank * (HEADS + HEAD_DIM))
    queries = randn(batch, HEADS, 1, HEAD_DIM)
    full_keys, full_values = randn(batch, HEADS, context, HEAD_DIM), randn(batch, HEADS, context, HEAD_DIM)
    return {
        ORIGINAL: lambda: F.scaled_dot_product_attention(queries, full_keys, full_values),
        FACTORED: lambda: layer._factored_step(queries, keys, values, None, False)[0],
        EXPANDED: lambda: grouped_attend(queries, layer._expand(keys, layer.key_rank),
                                                     layer._expand(values, layer.value_rank), None, layer.scale, 0.0,
                                                     False)[0],
    }


def timed(fn, device) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.inference_mode():
        fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = cli.ArgumentParser(description=__doc__.split("\n\n")[0])  # its errors: one error: line
    parser.add_argument("--batch", type=cli.positive_arg, default=1)
    parser.add_argument("--contexts", type=cli.positive_arg, nargs="+", default=[1024, 8192])
    parser.add_argument("--ranks", type=cli.positive_arg, nargs=2, default=[2, 2], metavar=("KEY", "VALUE"))
    parser.add_argument("--repeats", type=cli.positive_arg, default=20)
    parser.add_argument("--warmup", type=cli.count_arg, default=3)
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=cli.positive_arg, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/benchmarks/tpa_decode_<device>_"
                             "<dtype>_<UTC time>); results are never overwritten")
    args = parser.parse_args(argv)
    try:
        args.device = cli.device("--device", args.device)
        out = cli.result_stem("--out", args.out,
                              ROOT / "experiments" / "benchmarks" / f"tpa_decode_{args.device}_{args.dtype}")
    except cli.BadInput as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layer = TensorProductAttention(HEADS * HEAD_DIM, HEADS, args.ranks[0], value_rank=args.ranks[1],
                                   head_dim=HEAD_DIM).to(args.device, dtype).eval()
    rows = []
    for context in args.contexts:
        ways = steps(layer, args.batch, context, dtype, args.device)
        with torch.inference_mode():
            factored, expanded = ways[FACTORED](), ways[EXPANDED]()
        difference = float((factored.float() - expanded.float()).abs().max())
        seconds = {name: [] for name in ways}
        for step in range(args.warmup + args.repeats):
            for name, fn in ways.items():
                took = timed(fn, args.device)
                if step >= args.warmup:
                    seconds[name].append(took)
        for name, runs in seconds.items():
            versus, spread = timing_verdict(runs, seconds[ORIGINAL]), timing([1e3 * t for t in runs])
            rows.append({"context": context, "variant": name, "ms": spread.median, "ms_low": spread.low,
                         "ms_high": spread.high, "ms_runs": [1e3 * t for t in runs], "vs_original": versus.ratio,
                         "verdict": "-" if name == ORIGINAL else versus.verdict,
                         "max_abs_difference": None if name == ORIGINAL else difference})
            print(f"{context:6d} {name:36s} {spread.median:8.3f} ms [{spread.low:.3f}-{spread.high:.3f}] "
                  f"({versus.ratio:.2f}x, {rows[-1]['verdict']})", flush=True)
        factored = timing_verdict(seconds[FACTORED], seconds[EXPANDED])
        rows[-2].update(vs_expanded=factored.ratio, verdict_vs_expanded=factored.verdict)
        print(f"{context:6d} factored against expanded heads: {factored.ratio:.2f}x, {factored.verdict}", flush=True)
    on_gpu = args.device.startswith("cuda")
    environment = {"device": torch.cuda.get_device_name(args.device) if on_gpu else platform.processor() or "CPU",
                   "torch": torch.__version__, "threads": torch.get_num_threads()}
    lines = [
        f"# One decoding step of tensor product attention ({args.device}, {args.dtype})",
        "",
        f"Batch {args.batch}, {HEADS} heads of {HEAD_DIM}, TPA ranks {args.ranks[0]} (keys) and {args.ranks[1]} "
        f"(values); median of {args.repeats} steps after {args.warmup}, taking turns, and their range; the verdict "
        "says faster or slower than the original's step only where the ranges do not overlap "
        f"(`collab_attn.stats.timing_verdict`). {environment['device']}, torch {environment['torch']}, "
        f"{environment['threads']} threads.",
        "",
        "```bash",
        f"python benchmarks/tpa_decode.py {' '.join(sys.argv[1:] if argv is None else argv)}".rstrip(),
        "```",
        "",
        "| context | variant | ms / step | range | vs original | verdict | vs expanded heads | max abs difference "
        "factored - expanded |",
        "|---:|---|---:|---:|---:|---|---|---:|",
    ] + [f"| {row['context']} | {row['variant']} | {row['ms']:.3f} | {row['ms_low']:.3f}-{row['ms_high']:.3f} | "
         f"{row['vs_original']:.2f}x | {row['verdict']} | "
         f"{format(row['vs_expanded'], '.2f') + 'x, ' + row['verdict_vs_expanded'] if 'vs_expanded' in row else ''} | "
         f"{'' if row['max_abs_difference'] is None else format(row['max_abs_difference'], '.1e')} |" for row in rows]
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "environment": environment, "rows": rows}
    write_text_atomic(out.with_suffix(".json"), json.dumps(result, indent=2))
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.md')}")
    return result


if __name__ == "__main__":
    main()
