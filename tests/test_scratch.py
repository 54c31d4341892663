"""Training from scratch: the classifier (collab_attn.models.scratch_classifier) and its sweep through the Trainer
(collab_attn.glue.scratch)."""

import json

import pytest
import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from matplotlib.figure import Figure

import collab_attn.glue.scratch as scratch
from collab_attn import CollaborativeAttention, MultiHeadAttention
from collab_attn.glue.scratch import accuracy, learning_curve, run_sweep, trainer_fields
from collab_attn.models.scratch_classifier import ScratchConfig, ScratchForSequenceClassification
from collab_attn.training import train


def _model(kind="concat", rank=8, seed=0, **sizes) -> ScratchForSequenceClassification:
    torch.manual_seed(seed)
    sizes = {"vocab_size": 50, "d_model": 32, "num_heads": 4, "ffn_dim": 64, **sizes}
    return ScratchForSequenceClassification(ScratchConfig(attention=kind, rank=rank, **sizes))


def test_concatenated_heads_are_multi_head_attention_and_equal_it_at_full_rank():
    full, small = _model("concat", 32).eval().layers[0].attention, _model("concat", 8).layers[0].attention
    assert type(full) is MultiHeadAttention and type(small) is MultiHeadAttention
    assert type(_model("collab", 8).layers[0].attention) is CollaborativeAttention
    assert not hasattr(scratch, "ConcatenatedAttention")
    reference = MultiHeadAttention(32, 4)
    reference.load_state_dict(full.state_dict())
    x = torch.randn(2, 6, 32)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    assert torch.equal(full(x, attention_mask=mask)[0], reference(x, attention_mask=mask)[0])
    # below d_model only the queries and keys narrow: 2 dimensions per head, logits scaled by 1 / sqrt(2)
    assert small.query.out_features == small.key.out_features == 8 and small.value.out_features == 32
    assert small.scale == pytest.approx(2**-0.5)


def test_small_keys_shrink_only_query_key_parameters():
    """Hand-computed for d_model 128, 8 heads: concatenated q/k = 2 (128 k + k), collaborative
    q/k = 2 * 128 k (shared projections) + 8 k (mixing) + 128 * 8 (content bias)."""
    counts = {}
    for kind in ("concat", "collab"):
        for key in (128, 16):
            model = _model(kind, key, vocab_size=100, d_model=128, num_heads=8, ffn_dim=None)
            counts[kind, key] = model.parameter_counts()
    assert counts["concat", 128]["query_key_per_layer"] == 2 * (128 * 128 + 128)
    assert counts["concat", 16]["query_key_per_layer"] == 2 * (128 * 16 + 16)
    assert counts["collab", 16]["query_key_per_layer"] == 2 * 128 * 16 + 8 * 16 + 128 * 8
    saved = counts["concat", 128]["total"] - counts["concat", 16]["total"]
    assert saved == 2 * 2 * (128 * 112 + 112)  # two layers, query and key
    value_output = counts["concat", 128]["attention_per_layer"] - counts["concat", 128]["query_key_per_layer"]
    assert counts["collab", 16]["attention_per_layer"] - counts["collab", 16]["query_key_per_layer"] == value_output


@pytest.mark.parametrize("kind", ["concat", "collab"])
@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_forward_and_backward_with_padding(kind, pooling):
    model = _model(kind, pooling=pooling).eval()
    ids = torch.tensor([[5, 7, 9, 11]])
    padded = torch.tensor([[5, 7, 9, 11, 0, 0, 0], [6, 8, 0, 0, 0, 0, 0]])
    mask = (padded != 0).long()
    out = model(padded, mask, labels=torch.tensor([1, 0]))
    assert isinstance(out, transformers.modeling_outputs.SequenceClassifierOutput) and out.logits.shape == (2, 2)
    torch.testing.assert_close(out.logits[:1], model(ids).logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(out.logits, torch.tensor([1, 0])))
    out.loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())
    assert grads["token_embedding.weight"][0].abs().max() == 0  # the padding never reaches the loss
    assert grads["token_embedding.weight"][5].abs().max() > 0


def test_initialization_and_weight_decay_groups():
    """BERT's N(0, 0.02) for linear maps and embeddings, random N(0, 1) mixing; the Trainer decays every weight
    matrix, embeddings and mixing included, but not biases, LayerNorms or the collaborative content bias (its name
    holds "bias")."""
    model = _model("collab", 8, d_model=128, num_heads=8)
    attention = model.layers[0].attention
    assert attention.query.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.token_embedding.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert attention.mixing.std().item() == pytest.approx(1.0, rel=0.3)
    args = transformers.TrainingArguments(output_dir="unused", report_to=[])
    decayed = set(transformers.Trainer(model=model, args=args).get_decay_parameter_names(model))
    assert {"token_embedding.weight", "position_embedding.weight", "layers.0.attention.mixing",
            "layers.0.attention.query.weight", "layers.0.ffn.0.weight", "classifier.weight"} <= decayed
    assert not {"layers.0.attention.content_bias.weight", "layers.0.attention_norm.weight", "final_norm.weight",
                "layers.0.attention.value.bias", "classifier.bias"} & decayed


@pytest.mark.parametrize("kind", ["concat", "collab"])
def test_save_and_load_with_the_auto_classes_gives_identical_logits(kind, tmp_path):
    model = _model(kind, 8, num_labels=3).eval()
    model.save_pretrained(tmp_path)
    assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path), ScratchConfig)
    loaded = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    assert type(loaded) is ScratchForSequenceClassification and loaded.config.attention == kind
    ids = torch.tensor([[5, 7, 9, 11, 0], [3, 4, 0, 0, 0]])
    assert torch.equal(model(ids, (ids != 0).long()).logits, loaded(ids, (ids != 0).long()).logits)


def test_forward_returns_what_it_is_asked_for_and_refuses_the_rest():
    model = _model("collab", 8).eval()
    ids = torch.tensor([[5, 7, 9, 0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    out = model(ids, mask, output_attentions=True, output_hidden_states=True)
    assert len(out.attentions) == 2 and out.attentions[0].shape == (1, 4, 4, 4)
    torch.testing.assert_close(out.attentions[0].sum(-1), torch.ones(1, 4, 4))
    assert out.attentions[0][..., 3].max() < 1e-6  # no weight on padding
    assert len(out.hidden_states) == 3
    assert isinstance(model(ids, return_dict=False), tuple)
    with pytest.raises(TypeError, match="token_type_ids"):
        model(ids, token_type_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="longer than max_length"):
        model(torch.ones(1, 65, dtype=torch.long))


def test_bad_settings_name_the_problem(tmp_path):
    with pytest.raises(StrictDataclassError, match="multiple of num_heads"):
        ScratchConfig(attention="concat", rank=12)
    with pytest.raises(StrictDataclassError, match="unknown attention"):
        ScratchConfig(attention="sparse")
    settings = _settings(None, tmp_path)
    with pytest.raises(ValueError, match="unknown pooling"):
        scratch.model_config({**settings, "model": {**settings["model"], "pooling": "max"}}, 10, 2, "concat", 8)
    with pytest.raises(ValueError, match="unknown model settings"):
        scratch.model_config({**settings, "model": {**settings["model"], "width": 3}}, 10, 2, "concat", 8)
    with pytest.raises(ValueError, match="max_steps"):
        trainer_fields({**settings, "train": {"eval_steps": 2}})
    with pytest.raises(ValueError, match="bad train settings.*steps"):
        trainer_fields({**settings, "train": {**settings["train"], "steps": 4}})


def _keyword_examples(size: int, seed: int) -> list[dict]:
    """Label 1 when token 3 occurs in the sentence: learnable by attention-pooled features in a few steps."""
    g = torch.Generator().manual_seed(seed)
    examples = []
    for _ in range(size):
        length = int(torch.randint(3, 12, (1,), generator=g))
        row = torch.randint(4, 40, (length,), generator=g)
        label = int(torch.rand(1, generator=g) < 0.5)
        if label:
            row[int(torch.randint(0, length, (1,), generator=g))] = 3
        examples.append({"input_ids": row.tolist(), "labels": label})
    return examples


@pytest.mark.parametrize("kind", ["concat", "collab"])
def test_both_attentions_learn_a_real_signal_through_the_trainer(kind, minilm_tokenizer, tmp_path):
    model = _model(kind, 8, vocab_size=40, num_layers=1, max_length=16, dropout=0.0)
    fields = trainer_fields({
        "output_dir": str(tmp_path),
        "train": {"max_steps": 150, "per_device_train_batch_size": 32, "learning_rate": 3e-3, "warmup_steps": 0.1,
                  "eval_steps": 50, "per_device_eval_batch_size": 256},
    }, progress=False)
    run = train(model, _keyword_examples(512, 0), transformers.DataCollatorWithPadding(minilm_tokenizer), fields,
                0, tmp_path / "checkpoints", eval_dataset=_keyword_examples(256, 1), compute_metrics=accuracy)
    curve = learning_curve(run.history)
    assert [p["step"] for p in curve] == [0, 50, 100, 150]
    assert curve[-1]["dev_accuracy"] >= 0.9 > curve[0]["dev_accuracy"] + 0.2
    assert curve[0]["train_loss"] is None and curve[-1]["train_loss"] < curve[1]["train_loss"]
    # warmup over 15 steps, then linear decay to 0 over 135; logged: the rate of the step's own update (step - 1)
    assert curve[1]["lr"] == pytest.approx(3e-3 * 101 / 135) and curve[-1]["lr"] == pytest.approx(3e-3 / 135)


def _settings(glue_dir, out, **train_fields):
    return {
        "task": "sst2", "glue_dir": str(glue_dir), "max_train_samples": 128, "max_eval_samples": 64,
        "tokenizer": "minilm", "max_length": 32,
        "model": {"d_model": 32, "num_layers": 1, "num_heads": 4, "ffn_dim": 64, "dropout": 0.1, "pooling": "mean",
                  "mixing_init": "random"},
        "kinds": ["concat", "collab"], "ranks": [32, 8], "seeds": [0],
        "train": {"max_steps": 4, "per_device_train_batch_size": 16, "learning_rate": 1e-3, "weight_decay": 0.01,
                  "warmup_steps": 0.1, "max_grad_norm": 1.0, "eval_steps": 2, "per_device_eval_batch_size": 64,
                  "train_sampling_strategy": "group_by_length", **train_fields},
        "checkpoint_every": None, "threads": None, "output_dir": str(out),
    }


def assert_curves_drawn(fig, records: list[dict]) -> None:
    """``curves.png`` of one-seed runs: each run's dev accuracy (%) at every evaluated step, coloured by key size
    and styled by attention, with its (zero-width) band over seeds; on the right the final accuracies against the
    key size; the majority-class baseline on both."""
    left, right = fig.axes
    keys = sorted({r["rank"] for r in records}, reverse=True)
    runs = sorted(records, key=lambda r: (-r["rank"], r["attention"]))
    majority = 100 * records[0]["majority_baseline"]
    drawn = [(line.get_label(), line.get_linestyle(), line.get_color(), list(line.get_xdata()),
              list(line.get_ydata())) for line in left.get_lines()]
    assert drawn == [(f"{r['attention']} D_k={r['rank']}", {"concat": "-", "collab": "--"}[r["attention"]],
                      f"C{keys.index(r['rank'])}", [p["step"] for p in r["curve"]],
                      [100 * p["dev_accuracy"] for p in r["curve"]]) for r in runs] + [
                         ("majority class", ":", "grey", [0, 1], [majority, majority])]
    assert len(left.collections) == len(runs)  # one band per curve
    assert [text.get_text() for text in left.get_legend().get_texts()] == [label for label, *_ in drawn]
    assert (left.get_xlabel(), left.get_ylabel(), left.get_title()) == (
        "training step", "dev accuracy (%)", f"{records[0]['task']}: dev accuracy, mean over seeds")
    for container, kind in zip(right.containers, ("concat", "collab"), strict=True):
        final = [r for r in records if r["attention"] == kind]
        final.sort(key=lambda r: -r["rank"])
        data = container.lines[0]
        assert container.get_label() == kind and list(data.get_xdata()) == [r["rank"] for r in final]
        assert list(data.get_ydata()) == pytest.approx([100 * r["dev_accuracy"] for r in final])
    assert [list(line.get_ydata()) for line in right.get_lines() if line.get_label() == "majority class"] == [
        [majority, majority]]
    assert (right.get_xlabel(), right.get_ylabel(), right.get_xscale()) == (
        "key/query size D_k", "final dev accuracy (%)", "log")
    assert [t.get_text() for t in right.get_xticklabels()] == [str(k) for k in keys]


def test_sweep_writes_every_run_resumes_and_refuses_other_settings(glue_dir, tmp_path, capsys, monkeypatch):
    settings = _settings(glue_dir, tmp_path / "sweep")
    figures, savefig = [], Figure.savefig

    def save(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save)
    records = run_sweep(settings, progress=False)
    assert [r["name"] for r in records] == ["concat-k32-seed0", "collab-k32-seed0", "concat-k8-seed0",
                                            "collab-k8-seed0"]
    runs = tmp_path / "sweep" / "runs"
    saved = json.loads((runs / "collab-k8-seed0.json").read_text())
    assert saved["parameters"]["query_key_per_layer"] == 2 * 32 * 8 + 4 * 8 + 32 * 4
    assert [p["step"] for p in saved["curve"]] == [0, 2, 4]
    assert saved["dev_accuracy"] == saved["curve"][-1]["dev_accuracy"] and saved["train_seconds"] > 0
    table = (tmp_path / "sweep" / "results.md").read_text()
    assert "| collab | 8 |" in table and "| concat | 32 |" in table
    assert (tmp_path / "sweep" / "curves.png").is_file()
    (figure,) = figures  # the figure written to curves.png
    assert_curves_drawn(figure, records)
    assert not (tmp_path / "sweep" / ".checkpoints").exists()

    stamps = {p.name: p.stat().st_mtime_ns for p in runs.iterdir()}
    capsys.readouterr()
    again = run_sweep(settings, progress=False)
    assert "4 of 4 runs already done" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in runs.iterdir()} == stamps
    assert [r["dev_accuracy"] for r in again] == [r["dev_accuracy"] for r in records]

    with pytest.raises(ValueError, match="different settings"):
        run_sweep(_settings(glue_dir, tmp_path / "sweep", learning_rate=5e-4), progress=False)


def test_an_interrupted_run_continues_from_its_checkpoint(glue_dir, tmp_path, monkeypatch):
    class Interrupt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 3:
                raise KeyboardInterrupt

    def settings(out):
        return {**_settings(glue_dir, out), "kinds": ["collab"], "ranks": [8], "checkpoint_every": 2}

    whole = run_sweep(settings(tmp_path / "whole"), progress=False)[0]
    monkeypatch.setattr(scratch, "train", lambda *args, **kwargs: train(*args, callbacks=[Interrupt()], **kwargs))
    with pytest.raises(KeyboardInterrupt):
        run_sweep(settings(tmp_path / "resumed"), progress=False)
    assert (tmp_path / "resumed" / ".checkpoints" / "collab-k8-seed0" / "checkpoint-2").is_dir()
    assert not list((tmp_path / "resumed" / "runs").iterdir())
    monkeypatch.undo()
    resumed = run_sweep(settings(tmp_path / "resumed"), progress=False)[0]
    assert resumed["resumed_seconds"] > 0 and whole["resumed_seconds"] == 0
    assert [p["step"] for p in resumed["curve"]] == [0, 2, 4]
    for point, reference in zip(resumed["curve"], whole["curve"]):
        assert point["dev_loss"] == pytest.approx(reference["dev_loss"], rel=1e-5)


def test_sweep_rejects_a_regression_task_before_training(glue_dir, tmp_path):
    settings = _settings(glue_dir, tmp_path / "sweep")
    settings["task"] = "stsb"
    with pytest.raises(ValueError, match="regression"):
        run_sweep(settings, progress=False)
    assert not (tmp_path / "sweep").exists()
