"""scripts/fit_check.py: training against dev metrics of fine-tuned models, beside the majority class."""

import argparse
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


@pytest.mark.glue
def test_writes_train_and_dev_scores(tmp_path, glue_dir, minilm_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    checkpoint = tmp_path / "mrpc-model"
    AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=2).save_pretrained(checkpoint)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(checkpoint)
    out = tmp_path / "fit.md"
    args = [f"mrpc={checkpoint}", "--glue-dir", str(glue_dir), "--max-samples", "24", "--out", str(out)]
    assert fit_check.main(args) == 0
    row = next(line for line in out.read_text().splitlines() if line.startswith("| mrpc"))
    cells = [cell.strip() for cell in row.strip("|").split("|")]
    assert cells[:2] == ["mrpc", "f1"] and all(0 <= float(cell) <= 100 for cell in cells[2:5])
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_pairs_say_what_to_pass(tmp_path):
    with pytest.raises(argparse.ArgumentTypeError, match="TASK=CHECKPOINT"):
        fit_check.parse_pair("rte")
    with pytest.raises(argparse.ArgumentTypeError, match="no config.json"):
        fit_check.parse_pair(f"rte={tmp_path}")
