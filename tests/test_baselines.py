"""Matched-budget baselines through ``reparametrize``: SVD-truncated concatenated heads (``method="svd"``) and head
pruning by importance (``method="prune"``, Michel et al.)."""

import copy
from pathlib import Path

import datasets
import pytest
import torch
import transformers
from conftest import SENTENCES, random_batch, small_model
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoModel, AutoModelForSequenceClassification

from collab_attn import reparametrize
from collab_attn.decomposition.rank_selection import query_key_params
from collab_attn.decomposition.truncation import truncate_head_products
from collab_attn.glue import pipeline
from collab_attn.glue.jobs import GlueJob
from collab_attn.kinds import ConcatenatedSelfAttention
from collab_attn.models.hf import attention_parameters
from collab_attn.models.importance import head_gates, head_importance
from collab_attn.models.methods import heads_to_keep


def truncate_heads(model, rank):
    return reparametrize(model, rank, method="svd", progress=False)


def prune_heads(model, rank, scores):
    return reparametrize(model, rank, method="prune", importance=scores, progress=False)

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
D, HEADS, HEAD_DIM, LAYERS = 384, 12, 32, 6
PER_HEAD = 2 * HEAD_DIM * (D + 1)  # query + key rows of one concatenated head, with biases


@pytest.fixture(scope="module")
def minilm(minilm_path):
    return AutoModel.from_pretrained(minilm_path).eval()


def hidden(model, batch, **kwargs):
    with torch.no_grad():
        return model(**batch, **kwargs).last_hidden_state


def on_tokens(a, b, batch):
    keep = batch["attention_mask"].bool()
    return (a[keep] - b[keep]).abs().max().item()


# --------------------------------------------------------------------------------------------------------------
# SVD-truncated heads


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_svd_at_full_head_size_reproduces_minilm(minilm_path, real_batch, implementation):
    original = AutoModel.from_pretrained(minilm_path, attn_implementation=implementation).eval()
    model = copy.deepcopy(original)
    report = truncate_heads(model, HEADS * HEAD_DIM)
    assert report.method == "svd" and report.mean_relative_error < 1e-6
    layers = [m for m in model.modules() if isinstance(m, ConcatenatedSelfAttention)]
    assert len(layers) == LAYERS and all(layer.query_key_head_dim == HEAD_DIM for layer in layers)
    expected = hidden(original, real_batch)
    assert on_tokens(hidden(model, real_batch), expected, real_batch) < 1e-4
    # the explicit-weights path gives the same outputs and proper attention maps
    with torch.no_grad():
        out = model(**real_batch, output_attentions=True)
    assert on_tokens(out.last_hidden_state, expected, real_batch) < 1e-4
    assert len(out.attentions) == LAYERS and out.attentions[0].shape[:2] == (len(SENTENCES), HEADS)
    assert torch.allclose(out.attentions[0].sum(-1), torch.ones(()), atol=1e-5)


def test_svd_truncation_error_and_parameter_count(minilm, real_batch):
    model = copy.deepcopy(minilm)
    rank, k = 96, 8
    report = truncate_heads(model, rank)
    # query/key parameters: heads x k per side, no biases, plus one content bias per head
    per_layer = 2 * D * rank + HEADS * D
    assert [layer.query_key_params_after for layer in report.layers] == [per_layer] * LAYERS
    assert attention_parameters(model)["query_key_params"] == LAYERS * per_layer
    assert per_layer == query_key_params(rank, D, HEADS) - HEADS * rank  # collaborative minus its mixing

    # the error is the analytic SVD truncation error of each head product
    layer = minilm.encoder.layer[0].attention.self
    w_query = layer.query.weight.detach().view(HEADS, HEAD_DIM, D)
    w_key = layer.key.weight.detach().view(HEADS, HEAD_DIM, D)
    products = w_query.transpose(1, 2).double() @ w_key.double()  # (heads, d_in, d_in)
    singular = torch.linalg.svdvals(products)
    analytic = (singular[:, k:].square().sum(-1) / singular.square().sum(-1)).sqrt()
    truncated = truncate_head_products(w_query, w_key, k)
    assert torch.allclose(truncated.head_errors.double(), analytic, atol=1e-5)
    total = (singular[:, k:].square().sum() / singular.square().sum()).sqrt().item()
    assert report.layers[0].relative_error == pytest.approx(total, abs=1e-5)
    approx = truncated.w_query.transpose(1, 2).double() @ truncated.w_key.double()
    assert torch.linalg.matrix_norm(products - approx).div(torch.linalg.matrix_norm(products)).allclose(
        analytic, atol=1e-5
    )
    # the new layer computes those heads: weights path and fused path agree
    assert on_tokens(hidden(model, real_batch), hidden(model, real_batch, output_attentions=True), real_batch) < 1e-5


def test_svd_rejects_a_rank_that_heads_do_not_divide(minilm):
    model = copy.deepcopy(minilm)
    with pytest.raises(ValueError, match=r"rank 100 for layer 0 is not a multiple of the 12 heads.*96 or 108"):
        truncate_heads(model, 100)
    with pytest.raises(ValueError, match=r"\[1, 384\]"):
        truncate_heads(model, 396)
    assert not any(isinstance(m, ConcatenatedSelfAttention) for m in model.modules())


@pytest.mark.parametrize("family", ["bert", "distilbert", "albert"])
def test_baselines_on_every_family(family):
    original = small_model(family)
    batch = random_batch(lengths=(9, 6, 2))
    model = copy.deepcopy(original)
    truncate_heads(model, 48)
    assert on_tokens(hidden(model, batch), hidden(original, batch), batch) < 1e-4

    model = copy.deepcopy(original)
    scores = [torch.tensor([0.1, 0.9, 0.5, 0.3])] * (1 if family == "albert" else 2)  # ALBERT shares its layer
    report = prune_heads(model, 12, scores)
    gates = [torch.zeros(4).index_fill_(0, torch.tensor(kept), 1.0) for kept in report.pruning.kept_heads]
    with head_gates(original, gates):
        expected = hidden(original, batch)
    assert on_tokens(hidden(model, batch), expected, batch) < 1e-5


# --------------------------------------------------------------------------------------------------------------
# Head pruning


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_pruned_model_matches_the_gated_model(minilm_path, real_batch, implementation):
    original = AutoModel.from_pretrained(minilm_path, attn_implementation=implementation).eval()
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(HEADS, generator=g) for _ in range(LAYERS)]
    model = copy.deepcopy(original)
    report = prune_heads(model, 96, scores)

    budget = LAYERS * query_key_params(96, D, HEADS)
    kept = sum(len(heads) for heads in report.pruning.kept_heads)
    assert kept == budget // PER_HEAD == 19 and all(report.pruning.kept_heads)
    assert attention_parameters(model)["query_key_params"] == kept * PER_HEAD <= budget
    assert [layer.rank for layer in report.layers] == [len(h) * HEAD_DIM for h in report.pruning.kept_heads]
    for layer, kept, module in zip(report.layers, report.pruning.kept_heads, original.encoder.layer):
        # the error of the stacked head products with the removed heads zeroed, recomputed from MiniLM's weights
        w_query, w_key = (getattr(module.attention.self, part).weight.double().reshape(HEADS, HEAD_DIM, D)
                          for part in ("query", "key"))
        energy = torch.einsum("hai,haj->hij", w_query, w_key).square().sum((1, 2)).detach()
        removed = [h for h in range(HEADS) if h not in kept]
        assert layer.relative_error == pytest.approx(float((energy[removed].sum() / energy.sum()).sqrt()), rel=1e-6)
        assert layer.products_error == pytest.approx(layer.relative_error, abs=1e-6)

    gates = [torch.zeros(HEADS).index_fill_(0, torch.tensor(heads), 1.0) for heads in report.pruning.kept_heads]
    with head_gates(original, gates):
        expected = hidden(original, real_batch)
    assert on_tokens(hidden(model, real_batch), expected, real_batch) < 1e-5
    assert on_tokens(hidden(original, real_batch), expected, real_batch) > 1e-2  # the gates did switch heads off


def test_heads_to_keep_is_global_with_one_head_per_layer():
    scores = [torch.tensor([0.9, 0.8, 0.7]), torch.tensor([0.1, 0.2, 0.05])]
    assert heads_to_keep(scores, 3) == [[0, 1], [1]]
    assert heads_to_keep(scores, 1) == [[0], [1]]  # at least one per layer, even over the budget
    assert heads_to_keep(scores, 99) == [[0, 1, 2], [0, 1, 2]]


@pytest.fixture(scope="module")
def classifier(minilm_path):
    torch.manual_seed(0)
    return AutoModelForSequenceClassification.from_pretrained(minilm_path, num_labels=2).eval()


@pytest.fixture(scope="module")
def labelled(minilm_tokenizer):
    texts = SENTENCES * 2
    encoded = minilm_tokenizer(texts, truncation=True, max_length=32)
    return datasets.Dataset.from_dict({**encoded, "labels": [i % 2 for i in range(len(texts))]})


def test_importance_is_per_example_deterministic_and_normalized(classifier, labelled, minilm_tokenizer):
    collator = transformers.DataCollatorWithPadding(minilm_tokenizer)
    first = head_importance(classifier, labelled, collator, samples=6, batch_size=4, seed=3)
    again = head_importance(classifier, labelled, collator, samples=6, batch_size=4, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(first.scores, again.scores))
    assert first.samples == 6 and len(first.scores) == LAYERS and first.scores[0].shape == (HEADS,)
    assert all(score.norm().item() == pytest.approx(1.0, abs=1e-6) for score in first.scores)
    # each example has its own gates: one example per batch gives the same mean |dL/d xi_h|
    single = head_importance(classifier, labelled, collator, samples=6, batch_size=1, seed=3)
    assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-8) for a, b in zip(first.raw, single.raw))
    other = head_importance(classifier, labelled, collator, samples=6, batch_size=4, seed=4)
    assert not all(torch.equal(a, b) for a, b in zip(first.raw, other.raw))  # another sample of examples
    assert not classifier.training


# --------------------------------------------------------------------------------------------------------------
# Pipeline


def settings(tmp_path, *overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train_glue", overrides=[
            "trainer=smoke", "trainer.max_steps=1", "data.max_train_samples=16", "data.max_eval_samples=16",
            "refit.enabled=false", "logger=none", f"output_root={tmp_path / 'out'}", *overrides,
        ])
    return OmegaConf.to_container(cfg, resolve=True)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["collab=svd", "collab.rank=100"], "not a multiple of the 12 heads"),
        (["collab=svd", "collab.rank=0"], r"rank 0 for layer 0 is invalid"),
        (["collab=prune", "collab.rank=999"], r"rank 999 for layer 0 is invalid"),
        (["collab=prune", "collab.importance_samples=0"], "importance_samples must be a positive integer"),
        (["collab=svd", "collab.method=svdd"], "unknown collab.method 'svdd'"),
    ],
)
def test_bad_baseline_input_stops_before_training(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        pipeline.run_job(GlueJob.of(settings(tmp_path, *overrides)))
    assert not (tmp_path / "out").exists()


@pytest.mark.glue
def test_pipeline_runs_both_baselines(tmp_path, glue_dir):
    svd_job = GlueJob.of(settings(tmp_path, "collab=svd", "collab.rank=96", f"data.glue_dir={glue_dir}"))
    assert svd_job.folder.parts[-2] == "svd-r96"
    finetuned, svd = pipeline.run_job(svd_job)
    assert svd["method"] == "svd" and svd["rank"] == 96
    assert svd["query_key_params"] == LAYERS * (2 * D * 96 + HEADS * D)
    assert 0 < svd["mean_relative_error"] < 1 and svd["decomposition_seconds"] > 0

    prune_job = GlueJob.of(settings(tmp_path, "collab=prune", "collab.rank=96", "collab.importance_samples=8",
                                    "collab.importance_batch_size=4", f"data.glue_dir={glue_dir}"))
    same_finetuned, pruned = pipeline.run_job(prune_job)  # reuses the cached fine-tuned model
    assert same_finetuned["main"] == finetuned["main"]
    assert pruned["method"] == "prune" and pruned["rank"] == 96
    assert pruned["query_key_params"] == 19 * PER_HEAD <= LAYERS * query_key_params(96, D, HEADS)
    assert pruned["model_params"] < finetuned["model_params"] and 0 < pruned["mean_relative_error"] < 1
