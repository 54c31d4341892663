"""A converted model is a first-class transformers model: save/load, Auto classes, Trainer, pipeline."""

import copy
import subprocess

import datasets
import pytest
import torch
import transformers
from conftest import random_batch, small_config
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

import collab_attn  # noqa: F401  (registers the Auto classes)
from collab_attn import reparametrize
from collab_attn.kinds import CollaborativeSelfAttention


@pytest.fixture(scope="module")
def converted_dir(tmp_path_factory, minilm_path, minilm_tokenizer):
    """MiniLM with a fresh classification head, converted at rank 96, saved with its tokenizer."""
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=2).eval()
    reparametrize(model, rank=96, init="random", n_iter_max=3, progress=False)
    path = tmp_path_factory.mktemp("converted")
    model.save_pretrained(path)
    minilm_tokenizer.save_pretrained(path)
    return path, model


def test_save_then_load_gives_identical_outputs(converted_dir, real_batch):
    path, model = converted_dir
    loaded = AutoModelForSequenceClassification.from_pretrained(path).eval()
    assert type(loaded).__name__ == "CollabBertForSequenceClassification"
    assert loaded.config.collab_ranks == [96] * 6
    with torch.no_grad():
        assert torch.equal(loaded(**real_batch).logits, model(**real_batch).logits)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


@pytest.mark.parametrize("auto_class", [AutoModel, AutoModelForMaskedLM])
def test_other_auto_classes_load_the_collaborative_body(converted_dir, real_batch, auto_class):
    path, model = converted_dir
    loaded = auto_class.from_pretrained(path).eval()
    assert type(loaded).__name__.startswith("Collab")
    layers = [m for m in loaded.modules() if isinstance(m, CollaborativeSelfAttention)]
    assert len(layers) == 6 and layers[0].rank == 96
    with torch.no_grad():
        body = loaded.base_model(**real_batch).last_hidden_state
        expected = model.base_model(**real_batch).last_hidden_state
    assert torch.equal(body, expected)


def test_loading_without_collab_attn_fails_clearly(converted_dir, warm_python):
    path, _ = converted_dir
    code = f"from transformers import AutoModel; AutoModel.from_pretrained({str(path)!r})"
    result = subprocess.run([warm_python(), "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert "collab_attn_bert" in result.stderr and "does not recognize this architecture" in result.stderr


def test_output_attentions_after_loading(converted_dir, real_batch):
    path, _ = converted_dir
    loaded = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        attentions = loaded(**real_batch, output_attentions=True).attentions
    assert len(attentions) == 6 and attentions[0].shape[1] == 12
    padded = real_batch["attention_mask"] == 0
    assert torch.all(attentions[0].permute(0, 3, 1, 2)[padded] == 0)


def test_pipeline_runs_on_a_converted_checkpoint(converted_dir):
    """The pipeline loads the saved checkpoint and its tokenizer and gives, for every text and label, the converted
    model's own logits on that text (``function_to_apply="none"``) and by default their softmax."""
    path, model = converted_dir
    texts = ["A fine movie.", "Dull and far too long, though the second half picks up."]
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        logits = [model(**tokenizer(text, return_tensors="pt")).logits[0] for text in texts]
    classify = transformers.pipeline("text-classification", model=str(path), device="cpu")
    for apply, expected in (("none", logits), (None, [row.softmax(-1) for row in logits])):
        options = {"top_k": None} if apply is None else {"top_k": None, "function_to_apply": apply}
        for text, scores, want in zip(texts, classify(texts, **options), expected, strict=True):
            assert sorted(p["label"] for p in scores) == ["LABEL_0", "LABEL_1"]
            for p in scores:  # the logits are small (a fresh head): relative to them
                want_score = float(want[model.config.label2id[p["label"]]])
                assert p["score"] == pytest.approx(want_score, rel=1e-5, abs=1e-8), (text, apply)
            assert scores[0]["label"] == model.config.id2label[int(want.argmax())]


def test_trainer_fine_tunes_a_converted_model(converted_dir, minilm_tokenizer, tmp_path):
    path, _ = converted_dir
    model = AutoModelForSequenceClassification.from_pretrained(path)
    mixing_before = copy.deepcopy(next(m for m in model.modules() if isinstance(m, CollaborativeSelfAttention)).mixing)
    texts = ["great film", "terrible film", "I loved it", "I hated it"] * 4
    data = datasets.Dataset.from_dict({"text": texts, "label": [1, 0, 1, 0] * 4})
    data = data.map(lambda batch: minilm_tokenizer(batch["text"]), batched=True, remove_columns=["text"])
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=8, learning_rate=1e-3,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=data,
        data_collator=transformers.DataCollatorWithPadding(minilm_tokenizer),
    )
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    mixing_after = next(m for m in model.modules() if isinstance(m, CollaborativeSelfAttention)).mixing
    assert not torch.allclose(mixing_before, mixing_after)
    trainer.save_model(str(tmp_path / "refit"))
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "refit")
    assert torch.equal(next(m for m in reloaded.modules() if isinstance(m, CollaborativeSelfAttention)).mixing,
                       mixing_after.detach())


def test_a_collaborative_model_can_be_built_from_a_config():
    """Training from scratch: a collaborative config builds a randomly initialized collaborative model."""
    config = collab_attn.models.hf.CollabBertConfig(
        vocab_size=100, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
        collab_ranks=[8, 16],
    )
    model = AutoModel.from_config(config)
    layers = [m for m in model.modules() if isinstance(m, CollaborativeSelfAttention)]
    assert [layer.rank for layer in layers] == [8, 16]
    assert torch.equal(layers[0].mixing, torch.eye(4).repeat_interleave(2, dim=1))
    assert 0.01 < layers[0].query.weight.std() < 0.03  # the transformers initializer_range, not torch's default
    out = model(input_ids=torch.randint(0, 100, (2, 5))).last_hidden_state
    assert torch.isfinite(out).all()
    with pytest.raises(ValueError, match="needs config.collab_ranks"):
        AutoModel.from_config(collab_attn.models.hf.CollabBertConfig(hidden_size=32, num_attention_heads=4))


METHOD_OPTIONS = {
    "cp": {"rank": 16, "n_iter_max": 3},
    "tucker": {"rank": 16, "n_iter_max": 3},
    "svd": {"rank": 16},
    "prune": {"rank": 12},
}


@pytest.mark.parametrize("family", ["bert", "roberta", "distilbert", "albert"])
@pytest.mark.parametrize("method", list(METHOD_OPTIONS))
def test_every_method_saves_and_loads_with_identical_outputs(tmp_path, family, method):
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(small_config(family, num_labels=3)).eval()
    options = dict(METHOD_OPTIONS[method])
    if method == "prune":  # one score per head and layer (ALBERT shares one layer)
        options["importance"] = [torch.tensor([0.1, 0.9, 0.5, 0.3])] * (1 if family == "albert" else 2)
    report = reparametrize(model, method=method, progress=False, **options)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()

    assert type(loaded).__name__.startswith("Collab") and loaded.config.collab_method == method
    assert loaded.config.collab_ranks == [layer.rank for layer in report.layers]
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    batch = random_batch()
    with torch.no_grad():
        expected, got = model(**batch, output_attentions=True), loaded(**batch, output_attentions=True)
    assert torch.equal(got.logits, expected.logits)
    heads = loaded.config.collab_heads or [4] * len(report.layers)
    assert [a.shape[1] for a in got.attentions][: len(heads)] == heads[: len(got.attentions)]
    if method == "prune":
        assert report.model_params_after < report.model_params_before
        assert loaded.config.collab_heads == [len(kept) for kept in report.pruning.kept_heads]


@pytest.mark.parametrize("mixing_init, check", [
    ("ones", lambda m: torch.equal(m, torch.ones_like(m))),
    ("random", lambda m: 0.5 < m.std() < 1.5),
])
def test_a_collaborative_decoder_built_from_a_config_takes_its_mixing_init(tmp_path, mixing_init, check):
    """Training a decoder from scratch: the mixing starts as the config says, and saves and loads with it."""
    config = collab_attn.models.hf.collab_config_class("gpt2")(
        n_embd=32, n_head=4, n_layer=2, vocab_size=65, n_positions=16, collab_ranks=[16, 8],
        collab_mixing_init=mixing_init, bos_token_id=0, eos_token_id=0,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    layers = [m for m in model.modules() if isinstance(m, CollaborativeSelfAttention)]
    assert [layer.rank for layer in layers] == [16, 8] and all(check(layer.mixing.detach()) for layer in layers)
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.collab_mixing_init == mixing_init
    assert torch.equal(loaded.transformer.h[0].attn.mixing, layers[0].mixing)
