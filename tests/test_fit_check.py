"""scripts/fit_check.py: training against dev metrics of fine-tuned models, beside the majority class."""

import argparse
import csv
import importlib.util
from pathlib import Path

import numpy as np
import pytest

from collab_attn.glue import tasks as glue

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "fit_check.py"
spec = importlib.util.spec_from_file_location("fit_check", SCRIPT)
fit_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_check)


@pytest.mark.glue
@pytest.mark.parametrize("task, majority", [("mrpc", 0.8122), ("rte", 0.5271), ("cola", 0.0)])
def test_majority_class_matches_published_dev_baselines(glue_dir, task, majority):
    data = glue.load_glue(task, glue_dir)
    labels = {split: np.asarray(data[split]["label"]) for split in data}
    metrics = fit_check.majority_metrics(glue.get_task(task), labels["train"], labels["validation"])
    assert metrics["main"] == pytest.approx(majority, abs=1e-4)
    assert fit_check.majority_metrics(glue.get_task("stsb"), labels["train"], labels["validation"]) is None


def _mrpc_rows(glue_dir: Path, split: str, count: int) -> tuple[list[str], list[str], list[int]]:
    """The first ``count`` examples of MRPC's ``split`` file read as plain tab-separated text (quoting off, header and
    byte-order mark skipped): first sentences, second sentences, labels."""
    with open(glue_dir / "MRPC" / f"{split}.tsv", encoding="utf-8-sig", newline="") as file:
        rows = list(csv.reader(file, delimiter="\t", quoting=csv.QUOTE_NONE))[1:count + 1]
    assert len(rows) == count and all(len(row) == 5 for row in rows)
    return [row[3] for row in rows], [row[4] for row in rows], [int(row[0]) for row in rows]


@pytest.mark.glue
def test_writes_train_and_dev_scores(tmp_path, glue_dir, minilm_path):
    """The table's train and dev F1 are those of the checkpoint's own predictions on the first examples of each split
    (recomputed here from the TSV files, the tokenizer and the model), its majority column the F1 of always
    predicting the training examples' most frequent label (ties: the lower label) on the dev examples."""
    import torch
    from sklearn.metrics import f1_score
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    checkpoint = tmp_path / "mrpc-model"
    torch.manual_seed(1)  # a fresh head whose predictions are mixed on both splits
    AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=2).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(checkpoint)
    out = tmp_path / "fit.md"
    samples = 24
    args = [f"mrpc={checkpoint}", "--glue-dir", str(glue_dir), "--max-samples", str(samples), "--out", str(out)]
    assert fit_check.main(args) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| mrpc"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForSequenceClassification.from_pretrained(checkpoint).eval()
    scores, labels = {}, {}
    for name in ("train", "dev"):
        first, second, labels[name] = _mrpc_rows(glue_dir, name, samples)
        inputs = tokenizer(first, second, truncation=True, max_length=128, padding=True, return_tensors="pt")
        with torch.no_grad():
            predicted = model(**inputs).logits.argmax(-1).tolist()
        assert 0 < sum(predicted) < samples, (name, predicted)  # both classes predicted: an informative F1
        scores[name] = f1_score(labels[name], predicted)
    majority = max(set(labels["train"]), key=lambda label: (labels["train"].count(label), -label))
    scores["majority"] = f1_score(labels["dev"], [majority] * samples, zero_division=0.0)
    expected = [f"{100 * scores[name]:.1f}" for name in ("train", "dev", "majority")]
    assert cells == ["mrpc", "f1", *expected, f"`{checkpoint}`"]
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_pairs_say_what_to_pass(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="TASK=CHECKPOINT"):
        fit_check.parse_pair("rte")
    with pytest.raises(argparse.ArgumentTypeError, match="no config.json"):
        fit_check.parse_pair(f"rte={tmp_path}")
