"""Re-fine-tuning with knowledge distillation (refit=distill): the loss on hand-made batches, the trainer, and a
tiny job end to end."""

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
import yaml
from conftest import small_config
from test_pipeline import settings, tiny

from collab_attn.distillation import (
    DistillationTrainer,
    DistillSettings,
    attention_map_loss,
    distillation_loss,
    hidden_state_loss,
)
from collab_attn.glue import pipeline
from collab_attn.glue.jobs import GlueJob
from collab_attn.models.conversion import reparametrize


def _softmax(row, temperature):
    exps = [math.exp(v / temperature) for v in row]
    return [e / sum(exps) for e in exps]


def test_classification_loss_is_alpha_ce_plus_scaled_kl_by_hand():
    student = [[2.0, 0.0, -1.0], [0.5, 0.5, 1.0]]
    teacher = [[1.0, 1.0, -2.0], [3.0, 0.0, 0.0]]
    labels = [0, 2]
    alpha, T = 0.3, 2.5
    ce = -sum(math.log(_softmax(s, 1.0)[y]) for s, y in zip(student, labels)) / 2
    kl = sum(
        sum(p * math.log(p / q) for p, q in zip(_softmax(t, T), _softmax(s, T)))
        for s, t in zip(student, teacher)
    ) / 2
    terms = distillation_loss(
        SimpleNamespace(logits=torch.tensor(student)), SimpleNamespace(logits=torch.tensor(teacher)),
        torch.tensor(labels), DistillSettings(alpha=alpha, temperature=T), regression=False,
    )
    assert terms["label_loss"].item() == pytest.approx(ce, rel=1e-5)
    assert terms["teacher_loss"].item() == pytest.approx(T * T * kl, rel=1e-5)
    assert terms["loss"].item() == pytest.approx(alpha * ce + (1 - alpha) * T * T * kl, rel=1e-5)
    assert set(terms) == {"loss", "label_loss", "teacher_loss"}  # per-layer terms off by default


def test_regression_loss_is_mse_to_labels_and_to_the_teacher():
    student, teacher, labels = [[1.0], [3.0]], [[2.0], [2.5]], [0.0, 4.0]
    terms = distillation_loss(
        SimpleNamespace(logits=torch.tensor(student)), SimpleNamespace(logits=torch.tensor(teacher)),
        torch.tensor(labels), DistillSettings(alpha=0.25, temperature=7.0), regression=True,
    )
    to_labels, to_teacher = (1 + 1) / 2, (1 + 0.25) / 2  # the temperature plays no part
    assert terms["label_loss"].item() == pytest.approx(to_labels)
    assert terms["teacher_loss"].item() == pytest.approx(to_teacher)
    assert terms["loss"].item() == pytest.approx(0.25 * to_labels + 0.75 * to_teacher)


def test_teacher_only_loss_vanishes_when_the_student_copies_the_teacher():
    logits = torch.randn(4, 2)
    terms = distillation_loss(SimpleNamespace(logits=logits), SimpleNamespace(logits=logits.clone()),
                              torch.tensor([0, 1, 1, 0]), DistillSettings(alpha=0.0, temperature=3.0), False)
    assert terms["loss"].item() == pytest.approx(0.0, abs=1e-6)


def test_hidden_state_loss_counts_real_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    teacher = (torch.zeros(2, 3, 4),) * 3  # embeddings + two layers
    student = [torch.zeros(2, 3, 4), torch.full((2, 3, 4), 2.0), torch.full((2, 3, 4), 1.0)]
    student[1][0, 2] = 100.0  # padding: ignored
    student[1][1, 1:] = -50.0
    assert hidden_state_loss(student, teacher, mask).item() == pytest.approx((4.0 + 1.0) / 2)
    student[0][0, 0] = 9.0  # the embeddings are left out
    assert hidden_state_loss(student, teacher, mask).item() == pytest.approx(2.5)
    unpadded = [torch.full((2, 3, 4), float(layer)) for layer in range(3)]
    assert hidden_state_loss(unpadded, teacher).item() == pytest.approx((1.0 + 4.0) / 2)  # no mask: every token


def test_attention_loss_by_hand_and_for_pruned_heads():
    student_row = torch.tensor([0.25, 0.75, 0.0])  # against the teacher's (0.5, 0.5, 0)
    kl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    teacher = torch.zeros(1, 3, 3, 3)  # batch 1, heads 3, query 3, key 3; the third token is padding
    teacher[..., :2] = 0.5
    student = teacher[:, [2, 0]].clone()  # a pruned student kept heads 2 and 0
    student[0, 1, 0] = student_row  # query 0 of the head that was teacher head 0
    student[0, 1, 2] = torch.tensor([1.0, 0.0, 0.0])  # the padded query: ignored
    mask = torch.tensor([[1, 1, 0]])
    loss = attention_map_loss([student], [teacher], mask, teacher_heads=[[2, 0]])
    assert loss.item() == pytest.approx(kl / (2 * 2), rel=1e-5)  # one of 2 real queries x 2 heads differs
    with pytest.raises(ValueError, match="needs teacher_heads"):
        attention_map_loss([student], [teacher], mask)
    with pytest.raises(ValueError, match="eager attention"):  # a teacher loaded with SDPA returns no maps
        attention_map_loss([student], (), mask)
    same = torch.full((2, 3, 4, 4), 0.25)
    assert attention_map_loss([same], [same.clone()]).item() == pytest.approx(0.0, abs=1e-7)  # no mask: every query


@pytest.mark.parametrize("block, message", [
    ({"alpha": 1.5}, "must lie in"),
    ({"temperature": 0}, "must be positive"),
    ({"hidden_weight": -1}, "must be 0"),
    ({"beta": 0.1}, "not a distillation setting"),
    ({"alpha": "high"}, "must be a number"),
])
def test_bad_settings_are_refused_by_name(block, message):
    with pytest.raises(ValueError, match=message):
        DistillSettings.from_config(block)


def _pruned_pair(seed=0):
    """A small BERT classifier (teacher) and a copy with heads pruned to half the query/key size (student)."""
    torch.manual_seed(seed)
    config = small_config("bert", num_labels=2)
    config._attn_implementation = "eager"  # the attention maps are returned by eager attention only
    teacher = transformers.BertForSequenceClassification(config).eval()
    student = transformers.BertForSequenceClassification(config)
    student.load_state_dict(teacher.state_dict())
    importance = [torch.tensor([0.1, 0.9, 0.5, 0.2]), torch.tensor([0.3, 0.2, 0.8, 0.9])]
    report = reparametrize(student, 24, method="prune", importance=importance)
    return teacher, student, report.pruning.kept_heads


def test_trainer_trains_on_the_distillation_loss_and_logs_its_terms(tmp_path):
    teacher, student, kept = _pruned_pair()
    assert kept == [[1, 2], [2, 3]]
    torch.manual_seed(1)
    data = [{"input_ids": torch.randint(5, 120, (10,)), "attention_mask": torch.ones(10, dtype=torch.long),
             "labels": torch.tensor(i % 2)} for i in range(8)]
    settings = DistillSettings(alpha=0.5, temperature=2.0, hidden_weight=0.1, attention_weight=0.2)
    args = transformers.TrainingArguments(str(tmp_path), per_device_train_batch_size=4, max_steps=2, logging_steps=1,
                                          report_to=[], use_cpu=True, learning_rate=1e-3)
    trainer = DistillationTrainer(model=student, args=args, train_dataset=data, teacher=teacher, distill=settings,
                                  regression=False, teacher_heads=kept)
    batch = {k: torch.stack([d[k] for d in data[:4]]) for k in data[0]}
    student.eval()
    with torch.no_grad():
        expected = distillation_loss(
            student(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True,
                    output_attentions=True),
            teacher(**{k: v for k, v in batch.items() if k != "labels"}, output_hidden_states=True,
                    output_attentions=True),
            batch["labels"], settings, False, batch["attention_mask"], kept,
        )
        assert trainer.compute_loss(student, batch).item() == pytest.approx(expected["loss"].item(), rel=1e-5)
    before = {k: v.clone() for k, v in teacher.state_dict().items()}
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 2
    for entry in logs:
        terms = {"label_loss", "teacher_loss", "hidden_loss", "attention_loss"}
        assert {f"distill_{term}" for term in terms} <= set(entry)
        assert entry["distill_hidden_loss"] >= 0 and entry["distill_attention_loss"] >= 0
    assert all(torch.equal(before[k], v) for k, v in teacher.state_dict().items())  # the teacher does not learn


def test_refit_settings_reach_the_trainer_and_stay_out_of_training_arguments(tmp_path):
    job = GlueJob.of(tiny(tmp_path, "refit=distill", "refit.distill.alpha=0.2", "refit.distill.temperature=4"))
    assert "distill" not in job.refit_recipe and job.distill == DistillSettings(alpha=0.2, temperature=4)
    plain = GlueJob.of(tiny(tmp_path))
    assert job.folder != plain.folder
    other = GlueJob.of(tiny(tmp_path, "refit=distill", "refit.distill.alpha=0.3", "refit.distill.temperature=4"))
    assert other.folder != job.folder  # the settings enter the recipe hash
    with pytest.raises(ValueError, match="refit.distill.gamma"):
        pipeline.validate(tiny(tmp_path, "refit=distill", "+refit.distill.gamma=1"))


@pytest.mark.glue
@pytest.mark.parametrize("task, method", [("mrpc", "cp"), ("stsb", "prune")])
def test_distilled_job_runs_end_to_end(tmp_path, glue_dir, monkeypatch, task, method):
    monkeypatch.setenv("WANDB_MODE", "offline")
    common = [f"task={task}", f"data.glue_dir={glue_dir}", "refit=distill", "refit.distill.hidden_weight=0.5",
              "refit.distill.attention_weight=0.5", "trainer.logging_steps=1"]
    if method == "cp":
        job = tiny(tmp_path, "collab.rank=64", *common)
    else:  # tiny() sets CP solver fields that prune does not take
        job = settings("trainer=smoke", "trainer.max_steps=2", "refit.max_steps=2", "data.max_train_samples=16",
                       "data.max_eval_samples=24", f"output_root={tmp_path / 'out'}", "collab=prune",
                       "collab.rank=128", "collab.importance_samples=16", *common)
    job = GlueJob.of(job)
    records = pipeline.run_job(job)
    assert [r["stage"] for r in records] == ["finetuned", "reparam", "refit"]
    assert all(r["distill"] == {"alpha": 0.5, "temperature": 4, "hidden_weight": 0.5, "attention_weight": 0.5}
               for r in records)
    out = job.folder
    run_file = next(out.glob("wandb/offline-run-*/run-*.wandb")).read_bytes()
    for term in ("label_loss", "teacher_loss", "hidden_loss", "attention_loss"):
        assert f"refit/distill_{term}".encode() in run_file
    assert json.loads((out / "results.jsonl").read_text().splitlines()[-1]) == records[-1]


def test_summaries_keep_distilled_jobs_apart_from_plain_ones(tmp_path):
    from collab_attn.glue.summary import before_after, before_after_markdown, load_results

    def write(name, refit, distill=None):
        folder = tmp_path / "runs" / name
        folder.mkdir(parents=True)
        stages = [("finetuned", 0.80), ("reparam", 0.40), ("refit", refit)]
        rows = [{"task": "mrpc", "stage": s, "model": "m", "method": "prune", "rank": 64, "seed": 0, "main": v,
                 "query_key_params": 10, **({"distill": distill} if distill else {})} for s, v in stages]
        (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    write("plain", 0.70)
    write("kd", 0.76, {"alpha": 0.5, "temperature": 2.0, "hidden_weight": 0.0, "attention_weight": 0.0})
    write("kd-layers", 0.78, {"alpha": 0.0, "temperature": 1.0, "hidden_weight": 0.1, "attention_weight": 0.0})
    markdown = before_after_markdown(before_after(load_results(tmp_path)))
    assert "| m | prune | 64 | 40.0 → 70.0 | 70.0 | -10.0 | 1 |" in markdown
    assert "| m | prune + KD a0.5 T2 | 64 | 40.0 → 76.0 | 76.0 | -4.0 | 1 |" in markdown
    assert "| m | prune + KD a0 T1 h0.1 | 64 | 40.0 → 78.0 | 78.0 | -2.0 | 1 |" in markdown


def test_the_dataclass_defaults_are_the_configs_chosen_ones():
    block = yaml.safe_load((Path(__file__).parents[1] / "configs/refit/distill.yaml").read_text())["distill"]
    assert DistillSettings() == DistillSettings.from_config(block)
