"""GLUE dev accuracy of a fine-tuned model converted without retraining: plain CP against activation-aware CP.

    python benchmarks/no_retraining_accuracy.py --checkpoint path/to/finetuned/mrpc --task mrpc
    python benchmarks/no_retraining_accuracy.py --checkpoint path/to/finetuned/sst2 --task sst2 --ranks 192 128 96

For each rank: ``reparametrize`` with the implicit solver defaults, once on the raw weights (``plain``) and once
with a calibration on ``--calibration-texts`` texts of the task's training split (``aware``), then the task's
GLUE metrics on its dev split. The fine-tuned model itself is the first row. Writes
``experiments/benchmarks/no_retraining_<task>.{md,json}``.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn import reparametrize  # noqa: E402
from collab_attn.calibration import calibration_from_texts  # noqa: E402
from collab_attn.glue import get_task, glue_metrics, load_glue  # noqa: E402


@torch.no_grad()
def predict(model, tokenizer, texts, batch_size=64, max_length=128) -> np.ndarray:
    model.eval()
    outputs = []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start:start + batch_size]
        columns = [list(c) for c in zip(*chunk)] if isinstance(chunk[0], tuple) else [chunk]
        batch = tokenizer(*columns, padding=True, truncation=True, max_length=max_length, return_tensors="pt")
        outputs.append(model(**batch).logits.float().numpy())
    return np.concatenate(outputs)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--task", required=True)
    parser.add_argument("--ranks", type=int, nargs="+", default=[192, 128, 96])
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--calibration-texts", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    task = get_task(args.task)
    data = load_glue(task, args.glue_dir, splits=["train", task.eval_splits[0]])

    def texts(split):
        columns = [data[split][f] for f in task.text_fields]
        return list(columns[0]) if len(columns) == 1 else list(zip(*columns))

    dev_texts, dev_labels = texts(task.eval_splits[0]), np.asarray(data[task.eval_splits[0]]["label"])
    train_texts = texts("train")
    pick = np.sort(np.random.RandomState(args.seed).choice(len(train_texts), min(args.calibration_texts,
                                                                                   len(train_texts)), replace=False))
    calibration_texts = [train_texts[i] for i in pick]
    model = AutoModelForSequenceClassification.from_pretrained(args.checkpoint).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.checkpoint)
    start = time.perf_counter()
    calibration = calibration_from_texts(model, tokenizer, calibration_texts)
    calibration_seconds = time.perf_counter() - start

    metric = task.main_metric
    rows = [f"| rank | variant | {metric} | all metrics | mean rel. error | seconds |", "|---:|---|---:|---|---:|---:|"]
    records = []
    base = glue_metrics(task, predict(model, tokenizer, dev_texts), dev_labels)
    rows.append(f"| full | fine-tuned | {base[metric]:.4f} | {json.dumps(base)} | 0 | - |")
    print(rows[-1], flush=True)
    records.append({"rank": None, "variant": "fine-tuned", "metrics": base})
    for rank in args.ranks:
        for variant, cal in (("plain", None), ("aware", calibration)):
            converted = copy.deepcopy(model)
            start = time.perf_counter()
            report = reparametrize(converted, rank, calibration=cal, progress=False)
            seconds = time.perf_counter() - start
            metrics = glue_metrics(task, predict(converted, tokenizer, dev_texts), dev_labels)
            rows.append(f"| {rank} | {variant} | {metrics[metric]:.4f} | {json.dumps(metrics)} | "
                        f"{report.mean_relative_error:.4f} | {seconds:.1f} |")
            print(rows[-1], flush=True)
            records.append({"rank": rank, "variant": variant, "metrics": metrics, "seconds": seconds,
                            "mean_relative_error": report.mean_relative_error,
                            "mean_whitened_error": None if cal is None else float(np.mean(
                                [layer.weighted_error for layer in report.layers]))})
    command = "python benchmarks/no_retraining_accuracy.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table = "\n".join(rows)
    result = {"command": command.strip(), "checkpoint": str(args.checkpoint), "task": task.name,
              "calibration": calibration.summary(), "calibration_seconds": calibration_seconds,
              "dev_examples": len(dev_texts), "results": records, "table": table}
    out = args.out or ROOT / "experiments" / "benchmarks" / f"no_retraining_{task.name}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(
        f"# {task.name}: dev metrics after conversion without retraining\n\n`{result['command']}`\n\n"
        f"Checkpoint `{args.checkpoint}`; calibration on {len(calibration_texts)} training texts "
        f"({calibration.tokens} tokens); {len(dev_texts)} dev examples.\n\n" + table + "\n"
    )
    return result


if __name__ == "__main__":
    main()
