"""Activation-aware fitting: input statistics, whitening round trips, and lower logit error on held-out text."""

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch
from conftest import small_model
from transformers import AutoModel

from collab_attn import decompose_heads, reparametrize
from collab_attn.decomposition.whitening import whitening_matrices
from collab_attn.fitting.calibration import (
    Calibration,
    attention_inputs,
    calibration_from_texts,
    collect_calibration,
    logit_errors,
)
from collab_attn.glue.calibrate import load_texts

CALIBRATION_TEXTS = [
    "The film was a delight from start to finish.",
    "I would not recommend this restaurant to anyone.",
    "Stock markets fell sharply on Monday after the announcement.",
    "She opened the window and let the cold air in.",
    "The committee will meet again next week to discuss the budget.",
    "A stunning performance by the lead actor saves an otherwise dull story.",
    "Researchers found that the new drug reduced symptoms in most patients.",
    "He forgot his keys at the office and had to wait outside.",
    "The recipe calls for two cups of flour and a pinch of salt.",
    "Our flight was delayed for three hours because of the storm.",
    "The children played in the park until it got dark.",
    "This is the worst customer service I have ever experienced.",
    "The museum's new exhibition features paintings from the eighteenth century.",
    "Engineers are still trying to understand why the bridge collapsed.",
    "The novel's ending felt rushed and unconvincing.",
    "Thousands of fans gathered outside the stadium before the final.",
    "The company reported record profits for the third quarter.",
    "My grandmother grows tomatoes and beans in her small garden.",
    "The talks ended without an agreement on trade tariffs.",
    "A gentle, funny and surprisingly moving little picture.",
    "The train to the airport leaves every fifteen minutes.",
    "Police arrested two men in connection with the robbery.",
    "The soundtrack is loud, repetitive and completely forgettable.",
    "Scientists observed the comet through a powerful telescope.",
    "He apologized for the mistake and promised to fix it quickly.",
    "The hotel room was clean, quiet and reasonably priced.",
    "Heavy rain caused flooding in several villages along the river.",
    "The teacher asked the students to read the first chapter.",
    "The sequel is even better than the original.",
    "The government plans to raise taxes on tobacco next year.",
    "We walked along the beach and collected shells.",
    "The battery lasts all day, but the screen scratches easily.",
]
HELD_OUT = [
    "The director's latest movie is bold, strange and beautiful.",
    "Officials said the road would remain closed until Friday.",
    "I waited forty minutes and the food arrived cold.",
    "The orchestra played the symphony with great energy.",
    "Prices of fresh vegetables rose again this month.",
    "An intelligent thriller that keeps you guessing until the last scene.",
    "The new library opens to the public on Saturday morning.",
    "Nobody in the audience laughed at a single joke.",
]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny problems


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return AutoModel.from_pretrained(minilm_path).eval()


@pytest.fixture(scope="module")
def calibration(minilm, minilm_tokenizer):
    return calibration_from_texts(minilm, minilm_tokenizer, CALIBRATION_TEXTS, batch_size=8)


def heads_of(module):
    view = (12, 32, 384)
    return (
        module.query.weight.detach().view(view), module.key.weight.detach().view(view),
        module.query.bias.detach().view(12, 32),
    )


def test_statistics_shapes_and_padding_is_ignored(minilm, minilm_tokenizer, calibration):
    assert len(calibration) == 6 and calibration.names[0] == "encoder.layer.0.attention.self"
    assert calibration.second_moments[0].shape == (384, 384) and calibration.second_moments[0].dtype == torch.float64
    lengths = [len(minilm_tokenizer(t)["input_ids"]) for t in CALIBRATION_TEXTS]
    assert calibration.tokens == sum(lengths) and calibration.sequences == len(CALIBRATION_TEXTS)
    for moment in calibration.second_moments + calibration.centered_moments:
        torch.testing.assert_close(moment, moment.T)
        assert torch.linalg.eigvalsh(moment).min() > -1e-8
    # one sentence per batch (no padding) gives the same statistics as padded batches
    texts = CALIBRATION_TEXTS[:6]
    padded = calibration_from_texts(minilm, minilm_tokenizer, texts, batch_size=6)
    alone = calibration_from_texts(minilm, minilm_tokenizer, texts, batch_size=1)
    assert padded.tokens == alone.tokens
    for a, b in zip(padded.second_moments + padded.centered_moments, alone.second_moments + alone.centered_moments):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_collect_from_batches_ignores_labels_and_restores_train_mode(minilm_tokenizer, minilm_path):
    model = AutoModel.from_pretrained(minilm_path).train()
    batch = dict(minilm_tokenizer(HELD_OUT[:3], padding=True, return_tensors="pt"))
    batch["labels"] = torch.tensor([0, 1, 0])
    result = collect_calibration(model, [batch])
    assert model.training and result.tokens == int(batch["attention_mask"].sum())


@pytest.mark.parametrize("family", ["bert", "albert"])  # ALBERT calls its one shared layer three times a pass
def test_passes_after_the_first_end_at_the_last_attention_call_with_the_same_statistics(family):
    """The statistics of every layer are those of the inputs a full pass gives it, batch after batch; only the first
    pass reaches the layers' outputs and the pooler after the last attention call."""
    model = small_model(family)
    torch.manual_seed(0)
    batches = [{"input_ids": torch.randint(5, 90, (2, 7))} for _ in range(3)]
    expected = {}  # layer index -> x x^T over every call and batch
    for batch in batches:
        with torch.no_grad():
            captured = attention_inputs(model, batch)
        for k, hidden in enumerate(captured):
            flat = hidden.reshape(-1, hidden.shape[-1]).double()
            index = 0 if family == "albert" else k
            expected[index] = expected.get(index, 0) + flat.T @ flat
    pooled = []
    handle = model.pooler.register_forward_hook(lambda *args: pooled.append(1))
    try:
        result = collect_calibration(model, batches)
    finally:
        handle.remove()
    assert len(pooled) == 1  # the first pass only
    assert len(result) == len(expected)
    calls = 3 if family == "albert" else 1  # inputs per layer per sequence position
    assert result.tokens == 3 * 2 * 7
    for index, moment in expected.items():
        torch.testing.assert_close(result.second_moments[index], moment / (result.tokens * calls))


def test_whitening_round_trips():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 20, generator=g, dtype=torch.float64) * torch.linspace(0.1, 5, 20, dtype=torch.float64)
    cov = x.T @ x / 200
    root, inverse = whitening_matrices(cov, eps=0.01)
    torch.testing.assert_close(root @ inverse, torch.eye(20, dtype=torch.float64))
    torch.testing.assert_close(root @ root, cov + 0.01 * torch.linalg.eigvalsh(cov).mean() * torch.eye(20))
    # planted CP structure survives whitening and mapping back: still exact
    heads, head_dim, rank = 6, 8, 5
    query, key, mixing = (torch.randn(s, rank, generator=g) for s in (20, 20, heads))
    w_query, w_key = torch.zeros(heads, head_dim, 20), torch.zeros(heads, head_dim, 20)
    for h in range(heads):
        w_query[h, :rank], w_key[h, :rank] = (query * mixing[h]).T, key.T
    fit = decompose_heads(w_query, w_key, rank, covariance=(cov, cov * 2), n_iter_max=1000, tol=1e-12)
    assert fit.relative_error < 1e-4 and fit.weighted_error < 1e-4
    # Tucker at full size is exact whatever the whitening
    w_query, w_key = torch.randn(4, 5, 20, generator=g), torch.randn(4, 5, 20, generator=g)
    full = decompose_heads(w_query, w_key, 20, method="tucker", covariance=cov)
    assert full.relative_error < 1e-5


def test_full_rank_stays_exact_with_a_calibration(minilm, calibration, real_batch):
    model = copy.deepcopy(minilm)
    with torch.no_grad():
        expected = minilm(**real_batch).last_hidden_state
    report = reparametrize(model, 384, calibration=calibration, progress=False)
    with torch.no_grad():
        got = model(**real_batch).last_hidden_state
    assert (got - expected).abs().max() < 1e-4
    assert all(layer.weighted_error == 0.0 for layer in report.layers)


def test_activation_aware_fit_lowers_the_logit_error_on_held_out_sentences(minilm, minilm_tokenizer, calibration):
    batch = minilm_tokenizer(HELD_OUT, padding=True, return_tensors="pt")
    inputs = attention_inputs(minilm, batch)
    for index in (0, 3):
        w_query, w_key, b_query = heads_of(minilm.encoder.layer[index].attention.self)
        plain = decompose_heads(w_query, w_key, 64, n_iter_max=30)
        aware = decompose_heads(w_query, w_key, 64, n_iter_max=30, covariance=calibration.covariance(index))
        errors = [
            logit_errors(w_query, w_key, b_query, fit.head_products(), inputs[index], batch["attention_mask"])
            for fit in (plain, aware)
        ]
        assert errors[1]["centered_logits"] < 0.8 * errors[0]["centered_logits"]
        assert errors[1]["attention_tv"] < 0.8 * errors[0]["attention_tv"]
        assert aware.relative_error > plain.relative_error  # it fits the raw weights worse, on purpose
        assert aware.weighted_error < 1


def test_logit_errors_are_zero_for_the_exact_products(minilm, minilm_tokenizer):
    batch = minilm_tokenizer(HELD_OUT[:3], padding=True, return_tensors="pt")
    inputs = attention_inputs(minilm, batch)
    w_query, w_key, b_query = heads_of(minilm.encoder.layer[1].attention.self)
    exact = torch.einsum("hai,haj->hij", w_query, w_key)
    errors = logit_errors(w_query, w_key, b_query, exact, inputs[1], batch["attention_mask"])
    assert all(value < 1e-6 for value in errors.values())


def test_reparametrize_reports_the_calibration_and_refuses_a_mismatch(minilm, calibration):
    model = copy.deepcopy(minilm)
    report = reparametrize(model, 96, n_iter_max=5, calibration=calibration, progress=False)
    payload = report.to_dict()
    assert payload["calibration"]["tokens"] == calibration.tokens
    assert all(0 < layer["weighted_error"] < 1 for layer in payload["layers"])
    assert "whitened error" in report.table()
    other = copy.deepcopy(calibration)
    other.names = other.names[:3]
    with pytest.raises(ValueError, match="collect it on this model"):
        reparametrize(copy.deepcopy(minilm), 96, calibration=other, progress=False)
    with pytest.raises(ValueError, match="original"):
        collect_calibration(model, [])


def test_save_load_and_key_statistic(tmp_path, calibration):
    calibration.save(tmp_path / "calibration.pt")
    loaded = Calibration.load(tmp_path / "calibration.pt")
    assert loaded.names == calibration.names and loaded.tokens == calibration.tokens
    assert torch.equal(loaded.centered_moments[2], calibration.centered_moments[2])
    query, key = loaded.covariance(2)
    assert key is loaded.centered_moments[2]
    loaded.keys = "raw"
    assert loaded.covariance(2)[1] is loaded.second_moments[2]
    with pytest.raises(ValueError, match="unknown key statistic"):
        Calibration([], [], [], 0, 0, keys="mean")


def test_load_texts(tmp_path, glue_dir_or_none):
    path = tmp_path / "texts.txt"
    path.write_text("one\n\n two \nthree\nfour\n")
    assert load_texts(path) == ["one", "two", "three", "four"]
    sample = load_texts(path, limit=2, seed=1)
    assert len(sample) == 2 and sample == load_texts(path, limit=2, seed=1)
    with pytest.raises(FileNotFoundError):
        load_texts(tmp_path / "missing.txt")
    if glue_dir_or_none is not None:
        pairs = load_texts(glue_dir_or_none / "MRPC" / "dev.tsv", limit=5)
        assert len(pairs) == 5 and all(isinstance(p, tuple) and len(p) == 2 for p in pairs)


@pytest.fixture
def glue_dir_or_none():
    from conftest import GLUE_DIR

    return GLUE_DIR if GLUE_DIR.is_dir() else None


def test_script_calibrates_on_a_text_file(tmp_path):
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("reparametrize_script_cal", root / "scripts" / "reparametrize.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    from hydra import compose, initialize_config_dir

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(CALIBRATION_TEXTS[:16]))
    with initialize_config_dir(config_dir=str(root / "configs"), version_base="1.3"):
        cfg = compose(
            config_name="reparametrize",
            overrides=["collab.rank=96", "collab.n_iter_max=5", f"collab.calibration={texts}",
                       f"output_dir={tmp_path / 'out'}"],
        )
        bad = compose(config_name="reparametrize", overrides=["collab.calibration=task"])
    result = script.run(cfg)
    assert result["calibration"]["texts"] == 16
    assert json.loads((tmp_path / "out" / "reparam_report.json").read_text())["layers"][0]["weighted_error"] > 0
    with pytest.raises(ValueError, match="GLUE pipeline"):
        script.run(bad)
