"""Training from scratch (collab_attn.glue.scratch): the classifier, its attention variants, training and the sweep."""

import json

import pytest
import torch

from collab_attn import MultiHeadAttention
from collab_attn.glue.scratch import (
    ConcatenatedAttention,
    EncodedSplit,
    ScratchClassifier,
    ScratchConfig,
    TrainSettings,
    evaluate,
    parameter_counts,
    run_sweep,
    train,
)


def test_concatenated_attention_at_full_key_size_is_multi_head_attention():
    torch.manual_seed(0)
    reference = MultiHeadAttention(32, 4)
    layer = ConcatenatedAttention(32, 4, key_size=32)
    layer.load_state_dict(reference.state_dict())
    x = torch.randn(2, 6, 32)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    torch.testing.assert_close(layer(x, attention_mask=mask)[0], reference(x, attention_mask=mask)[0])


def test_small_keys_shrink_only_query_key_parameters():
    """Hand-computed for d_model 128, 8 heads: concatenated q/k = 2 (128 k + k), collaborative
    q/k = 2 * 128 k (shared projections) + 8 k (mixing) + 128 * 8 (content bias)."""
    counts = {}
    for kind in ("concat", "collab"):
        for key in (128, 16):
            model = ScratchClassifier(ScratchConfig(vocab_size=100, attention=kind, key_size=key))
            counts[kind, key] = parameter_counts(model)
    assert counts["concat", 128]["query_key_per_layer"] == 2 * (128 * 128 + 128)
    assert counts["concat", 16]["query_key_per_layer"] == 2 * (128 * 16 + 16)
    assert counts["collab", 16]["query_key_per_layer"] == 2 * 128 * 16 + 8 * 16 + 128 * 8
    saved = counts["concat", 128]["total"] - counts["concat", 16]["total"]
    assert saved == 2 * 2 * (128 * 112 + 112)  # two layers, query and key
    # values and output projection are the same for every kind and key size
    value_output = counts["concat", 128]["attention_per_layer"] - counts["concat", 128]["query_key_per_layer"]
    assert counts["collab", 16]["attention_per_layer"] - counts["collab", 16]["query_key_per_layer"] == value_output


@pytest.mark.parametrize("kind", ["concat", "collab"])
def test_padding_does_not_change_the_logits(kind):
    torch.manual_seed(0)
    model = ScratchClassifier(ScratchConfig(vocab_size=50, d_model=32, num_heads=4, attention=kind, key_size=8))
    model.eval()
    ids = torch.tensor([[5, 7, 9, 11]])
    padded = torch.tensor([[5, 7, 9, 11, 0, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0]])
    torch.testing.assert_close(model(padded, mask), model(ids), atol=1e-5, rtol=0)


def test_bad_settings_name_the_problem():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        ScratchConfig(vocab_size=10, attention="concat", key_size=12)
    with pytest.raises(ValueError, match="unknown attention"):
        ScratchConfig(vocab_size=10, attention="sparse")
    with pytest.raises(ValueError, match="warmup_ratio"):
        TrainSettings(warmup_ratio=1.5)


def _keyword_task(size: int, seed: int) -> EncodedSplit:
    """Label 1 when token 3 occurs in the sentence: learnable by attention-pooled features in a few steps."""
    g = torch.Generator().manual_seed(seed)
    rows, labels = [], []
    for _ in range(size):
        length = int(torch.randint(3, 12, (1,), generator=g))
        row = torch.randint(4, 40, (length,), generator=g)
        label = int(torch.rand(1, generator=g) < 0.5)
        if label:
            row[int(torch.randint(0, length, (1,), generator=g))] = 3
        rows.append(row.tolist())
        labels.append(label)
    return EncodedSplit(rows, torch.tensor(labels))


@pytest.mark.parametrize("kind", ["concat", "collab"])
def test_both_attentions_learn_a_real_signal(kind):
    torch.manual_seed(0)
    model = ScratchClassifier(ScratchConfig(vocab_size=40, d_model=32, num_heads=4, num_layers=1, attention=kind,
                                            key_size=8, max_length=16, dropout=0.0))
    train_split, dev_split = _keyword_task(512, 0), _keyword_task(256, 1)
    before = evaluate(model, dev_split)["accuracy"]
    result = train(model, train_split, dev_split, TrainSettings(steps=150, batch_size=32, lr=3e-3, eval_every=50),
                   progress=False)
    assert result["dev_accuracy"] >= 0.9 > before + 0.2
    assert [p["step"] for p in result["curve"]] == [0, 50, 100, 150]


def _settings(glue_dir, out, **train):
    return {
        "task": "sst2", "glue_dir": str(glue_dir), "max_train_samples": 128, "max_eval_samples": 64,
        "tokenizer": "minilm", "max_length": 32,
        "model": {"d_model": 32, "num_layers": 1, "num_heads": 4, "ffn_dim": 64, "dropout": 0.1, "pooling": "mean",
                  "mixing_init": "random"},
        "kinds": ["concat", "collab"], "key_sizes": [32, 8], "seeds": [0],
        "train": {"steps": 4, "batch_size": 16, "lr": 1e-3, "weight_decay": 0.01, "warmup_ratio": 0.1,
                  "grad_clip": 1.0, "eval_every": 2, "eval_batch_size": 64, **train},
        "threads": None, "output_dir": str(out),
    }


def test_sweep_writes_every_run_resumes_and_refuses_other_settings(glue_dir, tmp_path, capsys):
    settings = _settings(glue_dir, tmp_path / "sweep")
    records = run_sweep(settings, progress=False)
    assert [r["name"] for r in records] == ["concat-k32-seed0", "collab-k32-seed0", "concat-k8-seed0",
                                            "collab-k8-seed0"]
    runs = tmp_path / "sweep" / "runs"
    saved = json.loads((runs / "collab-k8-seed0.json").read_text())
    assert saved["parameters"]["query_key_per_layer"] == 2 * 32 * 8 + 4 * 8 + 32 * 4
    assert [p["step"] for p in saved["curve"]] == [0, 2, 4]
    table = (tmp_path / "sweep" / "results.md").read_text()
    assert "| collab | 8 |" in table and "| concat | 32 |" in table
    assert (tmp_path / "sweep" / "curves.png").stat().st_size > 0

    stamps = {p.name: p.stat().st_mtime_ns for p in runs.iterdir()}
    capsys.readouterr()
    again = run_sweep(settings, progress=False)
    assert "4 of 4 runs already done" in capsys.readouterr().out
    assert {p.name: p.stat().st_mtime_ns for p in runs.iterdir()} == stamps
    assert [r["dev_accuracy"] for r in again] == [r["dev_accuracy"] for r in records]

    with pytest.raises(ValueError, match="different settings"):
        run_sweep(_settings(glue_dir, tmp_path / "sweep", lr=5e-4), progress=False)


def test_sweep_rejects_a_regression_task_before_training(glue_dir, tmp_path):
    settings = _settings(glue_dir, tmp_path / "sweep")
    settings["task"] = "stsb"
    with pytest.raises(ValueError, match="regression"):
        run_sweep(settings, progress=False)
    assert not (tmp_path / "sweep").exists()
