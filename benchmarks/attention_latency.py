"""Latency of collaborative versus concatenated attention layers on CPU or GPU, measured side by side.

    python benchmarks/attention_latency.py                      # d_model 768, 12 heads, batch 16/32, seq 128/512
    python benchmarks/attention_latency.py --batch 16 --seq 128 --repeats 5
    python benchmarks/attention_latency.py --device cuda --repeats 20

Variants, all with the same d_model, heads, value and output projections:

- ``concat``: ``MultiHeadAttention`` (heads of d_model / heads; fused ``scaled_dot_product_attention``);
- ``collab-R``: ``CollaborativeAttention`` at rank R (d_model/4 and d_model/2 by default), this package's layer
  as it runs by default: all heads' logits in one ``bmm`` against the shared keys, at inference on the CPU one
  batch element and a block of query rows at a time (``CollaborativeAttention._in_cpu_blocks``);
- ``paper-R``: the same parameters computed the way the paper's code does it: mixed queries materialized
  (batch, heads, seq, R), one ``matmul`` with the shared keys, content bias, explicit softmax and dropout, a
  second ``matmul`` with the values.

(The option ``--forced-paths`` added ``explicit-R`` and ``fused-R``, the library's layer forced onto each of its
paths. The fused path, slower in every case measured, was removed from ``CollaborativeAttention``; ``explicit-R``
would now time ``collab-R``'s own code, so the option went with it.)

For each (batch, seq) the variants run in turn, ``--repeats`` rounds after a warm-up (``train``: forward + backward
of a scalar loss in train mode with attention dropout; ``infer``: forward under ``torch.inference_mode`` in eval
mode), and each cell of the table gives a variant's median, in brackets the range of its repeats (the run-to-run
spread) and, beside every variant but ``concat``, its ratio to ``concat`` with the verdict: ``faster`` or ``slower``
only where the two ranges do not overlap (``collab_attn.stats.timing_verdict``), ``tie`` otherwise (and always with
a single repeat). The JSON keeps every repeat's time, the medians, ranges, ratios and verdicts. ``--clock cpu``
times each step by this process's CPU time instead of elapsed time, which other processes on a busy machine disturb
less. On ``--device cuda`` each step is timed from a synchronized start to a synchronized end, in float32 (TF32
off) unless ``--dtype`` says otherwise. Results go to ``experiments/benchmarks/attention_latency_<UTC time>.{md,json}``
(CPU, float32) or ``attention_latency_cuda_<dtype>_<UTC time>.{md,json}`` (GPU; on the CPU another dtype gives
``attention_latency_<dtype>_<UTC time>``), or to ``--out``, a new path: results are never overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
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
from collab_attn.kinds.collaborative.collaborative_attention import CollaborativeAttention  # noqa: E402
from collab_attn.kinds.concatenated.concatenated_attention import MultiHeadAttention  # noqa: E402
from collab_attn.nn.attention import additive_mask  # noqa: E402
from collab_attn.stats import timing, timing_verdict  # noqa: E402


class PaperCollaborativeAttention(CollaborativeAttention):
    """``CollaborativeAttention``'s parameters, computed as in the paper's reference code (epfml/collaborative-
    attention, ``CollaborativeAttention.forward``): materialized mixed queries, matmul, softmax, matmul."""

    def forward(self, query_states, key_value_states=None, attention_mask=None, is_causal=False, need_weights=False):
        keys_from = query_states
        shared_queries = self.query(query_states)
        mixed_query = shared_queries[..., None, :, :] * self.mixing[..., :, None, :]  # (B, H, T, R)
        mixed_key = self.key(keys_from)[..., None, :, :]  # (B, 1, S, R)
        scores = torch.matmul(mixed_query, mixed_key.transpose(-1, -2))
        scores = scores + self.content_bias(keys_from).transpose(-1, -2).unsqueeze(-2)
        scores = scores * self.scale
        mask = additive_mask(attention_mask, is_causal, query_states.shape[1], keys_from.shape[1], scores.dtype,
                             scores.device)
        if mask is not None:
            scores = scores + mask
        probs = F.dropout(scores.softmax(dim=-1), p=self._dropout())
        values = self.value(keys_from).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        context = torch.matmul(probs, values).transpose(1, 2).flatten(2)
        return self._finish(context), (probs if need_weights else None)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build(d_model: int, heads: int, ranks: list[int], dropout: float):
    torch.manual_seed(0)
    layers: dict[str, torch.nn.Module] = {"concat": MultiHeadAttention(d_model, heads, dropout=dropout)}
    for rank in ranks:
        ours = CollaborativeAttention(d_model, heads, rank, dropout=dropout, mixing_init="random")
        layers[f"collab-{rank}"] = ours
        paper = PaperCollaborativeAttention(d_model, heads, rank, dropout=dropout, mixing_init="random")
        paper.load_state_dict(ours.state_dict())
        layers[f"paper-{rank}"] = paper
    return layers


def one_step(layer, x, mask, mode: str) -> None:
    if mode == "train":
        layer.train()
        layer.zero_grad(set_to_none=True)
        out, _ = layer(x, attention_mask=mask)
        out.float().pow(2).mean().backward()
    else:
        layer.eval()
        with torch.inference_mode():
            layer(x, attention_mask=mask)


def measure(layers, batch: int, seq: int, d_model: int, mode: str, repeats: int, warmup: int,
            clock=time.perf_counter, device: str = "cpu", dtype: torch.dtype = torch.float32) -> dict[str, list]:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, d_model, generator=g).to(device, dtype).requires_grad_(mode == "train")
    mask = torch.ones(batch, seq, dtype=torch.long, device=device)
    mask[: batch // 2, seq - seq // 8 :] = 0  # some padding, as in real batches
    times: dict[str, list] = {name: [] for name in layers}
    for _ in range(warmup):
        for layer in layers.values():
            one_step(layer, x, mask, mode)
    for _ in range(repeats):  # round robin: a load change hits every variant alike
        for name, layer in layers.items():
            synchronize(device)
            start = clock()
            one_step(layer, x, mask, mode)
            synchronize(device)
            times[name].append(clock() - start)
    return times


def synchronize(device: str) -> None:
    """Wait for the GPU's queued kernels, so that a wall-clock interval covers them."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def check_same_outputs(layers, d_model: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Every variant computes the same function as ours at its rank (eval): max |difference|."""
    x = torch.randn(2, 16, d_model).to(device, dtype)
    mask = torch.ones(2, 16, dtype=torch.long, device=device)
    mask[1, 12:] = 0
    worst = 0.0
    for name, layer in layers.items():
        if name != "concat" and not name.startswith("collab-"):
            ours = layers["collab-" + name.split("-")[1]]
            with torch.inference_mode():
                a, b = layer.eval()(x, attention_mask=mask)[0], ours.eval()(x, attention_mask=mask)[0]
            worst = max(worst, float((a - b)[mask.bool()].abs().max()))
    return worst


def main(argv=None) -> dict:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=cli.positive_arg, default=768)
    parser.add_argument("--heads", type=cli.positive_arg, default=12)
    parser.add_argument("--ranks", type=cli.positive_arg, nargs="+", default=None,
                        help="default: d_model/4 and d_model/2")
    parser.add_argument("--batch", type=cli.positive_arg, nargs="+", default=[16, 32])
    parser.add_argument("--seq", type=cli.positive_arg, nargs="+", default=[128, 512])
    parser.add_argument("--modes", nargs="+", default=["train", "infer"], choices=["train", "infer"])
    parser.add_argument("--dropout", type=float, default=0.1, help="attention dropout in train mode (BERT: 0.1)")
    parser.add_argument("--repeats", type=cli.positive_arg, default=5)
    parser.add_argument("--warmup", type=cli.count_arg, default=1)
    parser.add_argument("--threads", type=cli.positive_arg, default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall: elapsed time; cpu: this process's CPU time (less sensitive to other load)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--out", type=Path, default=None,
                        help="a new output path without suffix (default: experiments/benchmarks/attention_latency"
                             "_<UTC time> on the CPU in float32, attention_latency_cuda_<dtype>_<UTC time> on a GPU); "
                             "results are never overwritten")
    args = parser.parse_args(argv)
    try:
        args.device = cli.device("--device", args.device)
        cli.number("--dropout", args.dropout, 0, 1, below=True)
    except cli.BadInput as error:
        parser.error(str(error))
    if args.d_model % args.heads:
        parser.error(f"--d-model {args.d_model} must be a multiple of --heads {args.heads} (heads of equal size)")
    if not args.ranks and args.d_model < 4:
        parser.error(f"--d-model {args.d_model}: its default ranks d_model/4 and d_model/2 are 0; give --ranks")
    if args.ranks and max(args.ranks) > args.d_model:
        parser.error(f"--ranks {max(args.ranks)}: a collaborative key width is at most --d-model ({args.d_model}), the "
                     "concatenated heads' own")
    on_gpu = args.device.startswith("cuda")
    if on_gpu and args.clock == "cpu":
        parser.error("--clock cpu measures this process's CPU time, not the GPU's: use --clock wall with --device cuda")
    stem = f"attention_latency_cuda_{args.dtype}" if on_gpu else "attention_latency"
    if not on_gpu and args.dtype != "float32":
        stem += f"_{args.dtype}"
    try:
        args.out = cli.result_stem("--out", args.out, ROOT / "experiments" / "benchmarks" / stem)
    except cli.BadInput as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 on both devices
    dtype = DTYPES[args.dtype]
    ranks = args.ranks or [args.d_model // 4, args.d_model // 2]
    layers = build(args.d_model, args.heads, ranks, args.dropout)
    for layer in layers.values():
        layer.to(args.device, dtype)
    params = {name: sum(p.numel() for p in layer.parameters()) for name, layer in layers.items()}
    same = check_same_outputs(layers, args.d_model, args.device, dtype)
    hardware = torch.cuda.get_device_name(args.device) if on_gpu else platform.processor() or platform.machine()
    print(f"d_model {args.d_model}, {args.heads} heads, ranks {ranks}, torch {torch.__version__}, {hardware}, "
          f"{args.dtype}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}; "
          f"variants vs ours max |diff| {same:.1e}")

    rows, records = [], []
    header = "| mode | batch | seq | " + " | ".join(
        f"{name} ms [range]" + ("" if name == "concat" else " (vs concat, verdict)") for name in layers) + " |"
    rows += [header, "|---|---:|---:|" + "---:|" * len(layers)]
    for mode in args.modes:
        for seq in args.seq:
            for batch in args.batch:
                load = os.getloadavg()[0]
                clock = time.perf_counter if args.clock == "wall" else time.process_time
                times = measure(layers, batch, seq, args.d_model, mode, args.repeats, args.warmup, clock,
                                args.device, dtype)
                spread = {name: timing(t) for name, t in times.items()}
                versus = {name: timing_verdict(t, times["concat"]) for name, t in times.items()}
                verdicts = {name: "-" if name == "concat" else versus[name].verdict for name in layers}
                digits = 0 if spread["concat"].median >= 0.01 else 2  # GPU steps take well under 10 ms
                cells = [
                    f"{spread[name].median * 1e3:.{digits}f} ms [{spread[name].low * 1e3:.{digits}f}-"
                    f"{spread[name].high * 1e3:.{digits}f}]"
                    + ("" if name == "concat" else f" ({versus[name].ratio:.2f}x, {verdicts[name]})")
                    for name in layers
                ]
                rows.append(f"| {mode} | {batch} | {seq} | " + " | ".join(cells) + " |")
                print(rows[-1], f"(load {load:.2f})", flush=True)
                records.append({"mode": mode, "batch": batch, "seq": seq, "load_before": load,
                                "seconds": times, "median_seconds": {n: t.median for n, t in spread.items()},
                                "range_seconds": {n: [t.low, t.high] for n, t in spread.items()},
                                "ratio_to_concat": {n: v.ratio for n, v in versus.items()}, "verdict": verdicts})
    table = "\n".join(rows)
    loads = [record["load_before"] for record in records]
    command = "python benchmarks/attention_latency.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {
        "command": command.strip(), "d_model": args.d_model, "heads": args.heads, "ranks": ranks,
        "dropout": args.dropout, "repeats": args.repeats, "clock": args.clock, "threads": torch.get_num_threads(),
        "torch": torch.__version__, "device": args.device, "dtype": args.dtype, "machine": hardware,
        "cpus": os.cpu_count(),
        "parameters": params, "variants_vs_ours_max_abs_diff": same, "results": records, "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    write_text_atomic(
        args.out.with_suffix(".md"),
        f"# Attention layer latency ({'GPU' if on_gpu else 'CPU'}: {hardware})\n\n`{result['command']}`\n\n"
        f"d_model {args.d_model}, {args.heads} heads, collaborative ranks {ranks}, {args.dtype}; "
        f"median of {args.repeats} round-robin repeats ({args.clock} clock) and, in brackets, their range (the "
        f"run-to-run spread), {result['threads']} torch threads, torch {torch.__version__}; ratios are to `concat` "
        "measured in the same rounds, and the verdict says faster or slower only where the two ranges do not overlap "
        "(`collab_attn.stats.timing_verdict`), tie otherwise. Parameters per layer: "
        + ", ".join(f"{k} {v:,}" for k, v in params.items())
        + f". Load average before the rows: {min(loads):.2f} to {max(loads):.2f} on {os.cpu_count()} CPUs.\n\n"
        + table + "\n",
    )
    return result


if __name__ == "__main__":
    main()
