"""Training-split against dev-split metrics of fine-tuned GLUE models, beside the majority class: tells a model
that cannot fit its task (a training score near the majority's: more steps or a larger learning rate may help)
from one that fits it and does not generalize (a training score far above its dev score: look at the data or the
pretrained model before the recipe).

    python scripts/fit_check.py rte=experiments/minilm_glue/finetuned/rte/minilm/seed0-924939b8 \\
        cola=experiments/minilm_glue/finetuned/cola/minilm/seed0-924939b8 --out experiments/minilm_glue/fit_check.md

Bad input (a checkpoint, the GLUE files, a size, the output path) exits with status 2 and one ``error: ...`` line.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from transformers import AutoModelForSequenceClassification, AutoTokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from collab_attn.cli import ArgumentParser, exit_on_bad_input, naming, output_file, positive_arg  # noqa: E402
from collab_attn.files import write_text_atomic  # noqa: E402
from collab_attn.glue import tasks as glue  # noqa: E402
from collab_attn.glue.jobs import DataSettings  # noqa: E402
from collab_attn.glue.pipeline import check_glue_files, evaluate, load_data  # noqa: E402
from collab_attn.models.checkpoints import resolve_model  # noqa: E402


def parse_pair(text: str) -> tuple[glue.GlueTask, Path]:
    task, sep, path = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected TASK=CHECKPOINT, got {text!r} (e.g. rte=path/to/finetuned/rte)")
    if not (Path(path) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{path} holds no config.json: not a saved model directory")
    try:
        return glue.get_task(task), Path(path)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def check(args: argparse.Namespace) -> None:
    """Each checkpoint (weights present), the GLUE files of its task and the output path, before any work."""
    for task, path in args.checkpoints:
        with naming(task.name, path):
            resolve_model(str(path))
        check_glue_files("--glue-dir", task, args.glue_dir, ("train", task.eval_splits[0]), hub=False)
    if args.out:
        output_file("--out", args.out)


def majority_metrics(task: glue.GlueTask, train_labels: np.ndarray, dev_labels: np.ndarray) -> dict | None:
    """Metrics of always predicting the training split's most frequent class (None for regression)."""
    if task.is_regression:
        return None
    majority = np.bincount(train_labels.astype(int), minlength=task.num_labels).argmax()
    return glue.glue_metrics(task, np.full(len(dev_labels), majority), dev_labels)


def fit_check(task: glue.GlueTask, checkpoint: Path, glue_dir: Path, max_samples: int | None, batch_size: int) -> dict:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint)
    limits = DataSettings(glue_dir=str(glue_dir), max_seq_length=128, max_train_samples=max_samples,
                          max_eval_samples=max_samples)
    data = load_data(task, limits, tokenizer)
    splits = {"train": "train", "dev": task.eval_splits[0]}
    row = {"task": task.name, "checkpoint": str(checkpoint), "metric": task.main_metric}
    with tempfile.TemporaryDirectory() as scratch:
        for name, split in splits.items():
            row[name] = evaluate(model, data, tokenizer, task, batch_size, Path(scratch), splits=[split])["main"]
    labels = {name: np.asarray(data[split]["labels"]) for name, split in splits.items()}
    majority = majority_metrics(task, labels["train"], labels["dev"])
    row["majority"] = None if majority is None else majority["main"]
    return row


def to_markdown(rows: list[dict]) -> str:
    lines = ["| task | metric | train | dev | dev, majority class | checkpoint |", "|---|---|---:|---:|---:|---|"]
    for row in rows:
        majority = "-" if row["majority"] is None else f"{100 * row['majority']:.1f}"
        scores = f"{100 * row['train']:.1f} | {100 * row['dev']:.1f} | {majority}"
        lines.append(f"| {row['task']} | {row['metric']} | {scores} | `{row['checkpoint']}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoints", nargs="+", type=parse_pair, metavar="TASK=CHECKPOINT")
    parser.add_argument("--glue-dir", type=Path, default=ROOT.parent / "shared" / "data" / "glue")
    parser.add_argument("--max-samples", type=positive_arg, default=None, help="truncate each split (quick checks)")
    parser.add_argument("--batch-size", type=positive_arg, default=128)
    parser.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = parser.parse_args(argv)
    exit_on_bad_input(lambda: check(args))
    rows = [fit_check(task, path, args.glue_dir, args.max_samples, args.batch_size) for task, path in args.checkpoints]
    table = to_markdown(rows)
    print(table)
    if args.out:
        command = " ".join(sys.argv[1:] if argv is None else argv)
        write_text_atomic(args.out, f"`python scripts/fit_check.py {command}`\n\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
