"""GLUE tasks: registry, loading (Hub or classic ``glue_data`` TSVs), tokenization and metrics.

Metrics follow the GLUE benchmark definitions and use scikit-learn / scipy only, so evaluation works
offline (the ``evaluate`` library fetches metric code from the Hub at run time).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import f1_score, matthews_corrcoef

from collab_attn.texts import CALIBRATION_SAMPLES, sample_texts

HUB_DATASET = "nyu-mll/glue"
_TSV_FORMAT_VERSION = 1  # bump when TSV parsing changes, to invalidate tokenization caches


@dataclass(frozen=True)
class GlueTask:
    """One GLUE task. ``name`` is the Hub config name, ``dir_name`` the classic ``glue_data`` folder."""

    name: str
    dir_name: str
    text_fields: tuple[str, ...]
    num_labels: int
    is_regression: bool
    main_metric: str
    eval_splits: tuple[str, ...]
    label_names: tuple[str, ...]  # Hub ClassLabel names, index = label id; () for regression

    @property
    def splits(self) -> tuple[str, ...]:
        return ("train", *self.eval_splits)


def _task(
    name: str,
    dir_name: str,
    text_fields: tuple[str, ...],
    main_metric: str,
    label_names: tuple[str, ...],
    eval_splits: tuple[str, ...] = ("validation",),
) -> GlueTask:
    return GlueTask(
        name=name,
        dir_name=dir_name,
        text_fields=text_fields,
        num_labels=max(len(label_names), 1),
        is_regression=not label_names,
        main_metric=main_metric,
        eval_splits=eval_splits,
        label_names=label_names,
    )


_BINARY_ENTAILMENT = ("entailment", "not_entailment")
TASKS: dict[str, GlueTask] = {
    t.name: t
    for t in (
        _task("cola", "CoLA", ("sentence",), "matthews_correlation", ("unacceptable", "acceptable")),
        _task("sst2", "SST-2", ("sentence",), "accuracy", ("negative", "positive")),
        _task("mrpc", "MRPC", ("sentence1", "sentence2"), "f1", ("not_equivalent", "equivalent")),
        _task("stsb", "STS-B", ("sentence1", "sentence2"), "pearson", ()),
        _task("qqp", "QQP", ("question1", "question2"), "f1", ("not_duplicate", "duplicate")),
        _task(
            "mnli",
            "MNLI",
            ("premise", "hypothesis"),
            "accuracy",
            ("entailment", "neutral", "contradiction"),
            eval_splits=("validation_matched", "validation_mismatched"),
        ),
        _task("qnli", "QNLI", ("question", "sentence"), "accuracy", _BINARY_ENTAILMENT),
        _task("rte", "RTE", ("sentence1", "sentence2"), "accuracy", _BINARY_ENTAILMENT),
        _task("wnli", "WNLI", ("sentence1", "sentence2"), "accuracy", ("not_entailment", "entailment")),
    )
}


def get_task(name: str | GlueTask) -> GlueTask:
    """Look up a task by Hub name or folder name, case-insensitively ("SST-2", "sts-b", "stsb", ...)."""
    if isinstance(name, GlueTask):
        return name
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    if key not in TASKS:
        raise ValueError(f"unknown GLUE task {name!r}; known tasks: {', '.join(TASKS)}")
    return TASKS[key]


# ---------------------------------------------------------------------------------------------------
# Loading


@dataclass(frozen=True)
class _TsvLayout:
    """Where a task's fields sit in the classic TSV files: header names, or 0-based indices if no header."""

    columns: tuple[str | int, ...]  # source of each text field, then of the label
    label_values: tuple[str, ...]  # label string for each label id; () means a float score
    header: bool = True
    num_fields: int | None = None  # expected fields per row when there is no header
    files: tuple[tuple[str, str], ...] = (("train", "train.tsv"), ("validation", "dev.tsv"))  # split, file


_BINARY = ("0", "1")
_TSV_LAYOUTS: dict[str, _TsvLayout] = {
    "cola": _TsvLayout((3, 1), _BINARY, header=False, num_fields=4),
    "sst2": _TsvLayout(("sentence", "label"), _BINARY),
    "mrpc": _TsvLayout(("#1 String", "#2 String", "Quality"), _BINARY),
    "stsb": _TsvLayout(("sentence1", "sentence2", "score"), ()),
    "qqp": _TsvLayout(("question1", "question2", "is_duplicate"), _BINARY),
    "mnli": _TsvLayout(
        ("sentence1", "sentence2", "gold_label"),
        ("entailment", "neutral", "contradiction"),
        files=(
            ("train", "train.tsv"),
            ("validation_matched", "dev_matched.tsv"),
            ("validation_mismatched", "dev_mismatched.tsv"),
        ),
    ),
    "qnli": _TsvLayout(("question", "sentence", "label"), _BINARY_ENTAILMENT),
    "rte": _TsvLayout(("sentence1", "sentence2", "label"), _BINARY_ENTAILMENT),
    "wnli": _TsvLayout(("sentence1", "sentence2", "label"), _BINARY),
}


def _features(task: GlueTask) -> datasets.Features:
    """Column types as on the Hub: text fields, ``label`` (ClassLabel or float32), ``idx`` (int32)."""
    feats: dict[str, Any] = {f: datasets.Value("string") for f in task.text_fields}
    feats["label"] = (
        datasets.Value("float32") if task.is_regression else datasets.ClassLabel(names=list(task.label_names))
    )
    feats["idx"] = datasets.Value("int32")
    return datasets.Features(feats)


def _read_tsv(path: Path, task: GlueTask) -> tuple[dict[str, list], str]:
    """Parse one GLUE TSV into columns; return them and the file's SHA-256."""
    layout = _TSV_LAYOUTS[task.name]
    raw = path.read_bytes()
    # utf-8-sig drops the BOM that starts the MRPC header; quoting is off because fields hold bare '"'.
    text = raw.decode("utf-8-sig")
    reader = csv.reader(io.StringIO(text, newline=""), delimiter="\t", quoting=csv.QUOTE_NONE)

    num_fields = layout.num_fields
    indices = layout.columns
    if layout.header:
        header = [h.strip() for h in next(reader, [])]
        missing = [c for c in layout.columns if c not in header]
        if missing:
            raise ValueError(
                f"{path}, line 1: header {header} lacks column(s) {missing} expected for GLUE task "
                f"{task.name!r}; is this the right file?"
            )
        num_fields = len(header)
        indices = tuple(header.index(c) for c in layout.columns)  # type: ignore[arg-type]

    label_ids = {v: i for i, v in enumerate(layout.label_values)}
    cols: dict[str, list] = {f: [] for f in (*task.text_fields, "label", "idx")}
    for row in reader:
        if not row:  # blank line
            continue
        where = f"{path}, line {reader.line_num}"
        if len(row) != num_fields:
            raise ValueError(f"{where}: expected {num_fields} tab-separated fields, found {len(row)}")
        *text_idx, label_idx = indices
        raw_label = row[label_idx].strip()
        if task.is_regression:
            try:
                label: float | int = float(raw_label)
            except ValueError:
                raise ValueError(f"{where}: cannot parse score {raw_label!r} as a float") from None
        elif raw_label in label_ids:
            label = label_ids[raw_label]
        else:
            raise ValueError(f"{where}: unknown label {raw_label!r}; expected one of {list(label_ids)}")
        for field, i in zip(task.text_fields, text_idx, strict=True):
            cols[field].append(row[i])
        cols["label"].append(label)
        cols["idx"].append(len(cols["idx"]))
    return cols, hashlib.sha256(raw).hexdigest()


def _check_splits(task: GlueTask, splits: Iterable[str] | None) -> list[str]:
    if splits is None:
        return list(task.splits)
    splits = [splits] if isinstance(splits, str) else list(splits)
    unknown = [s for s in splits if s not in task.splits]
    if unknown:
        raise ValueError(
            f"unknown split(s) {unknown} for GLUE task {task.name!r}; available: {list(task.splits)}"
        )
    return splits


def split_file(task: GlueTask, split: str) -> str:
    """The file name of ``split`` in the task's glue_data folder (``train.tsv``, ``dev_matched.tsv``, ...)."""
    return dict(_TSV_LAYOUTS[task.name].files)[split]


def check_tsv(task: GlueTask, path: str | Path) -> None:
    """Parse the GLUE file ``path`` of ``task`` as ``load_glue`` will, before any work: a malformed row raises the
    ValueError that names the file and the line."""
    _read_tsv(Path(path), task)


def load_glue(
    task: str | GlueTask,
    glue_dir: str | Path | None = None,
    splits: Iterable[str] | None = None,
) -> datasets.DatasetDict:
    """Load a GLUE task as a DatasetDict with splits "train" and the task's ``eval_splits``.

    Columns: the task's ``text_fields``, ``label`` (int class id; float for STS-B) and ``idx`` (row
    number). With ``glue_dir=None`` the data comes from the Hub (``nyu-mll/glue``, test split dropped);
    otherwise from ``<glue_dir>/<dir_name>/{train,dev}.tsv``. ``splits`` restricts what is read.
    """
    task = get_task(task)
    wanted = _check_splits(task, splits)

    if glue_dir is None:
        hub = datasets.load_dataset(HUB_DATASET, task.name)
        return datasets.DatasetDict({s: hub[s] for s in wanted})

    glue_dir = Path(glue_dir)
    if not glue_dir.is_dir():
        raise FileNotFoundError(
            f"GLUE directory {glue_dir} does not exist; pass the folder that holds the task folders "
            f"(CoLA/, SST-2/, ...) of a glue_data download, or glue_dir=None to load {HUB_DATASET} "
            "from the Hub"
        )
    task_dir = glue_dir / task.dir_name
    if not task_dir.is_dir():
        raise FileNotFoundError(
            f"no {task.dir_name}/ folder in {glue_dir} for GLUE task {task.name!r}; add it from a glue_data "
            f"download, or use glue_dir=None to load {HUB_DATASET} from the Hub"
        )

    files = dict(_TSV_LAYOUTS[task.name].files)
    features = _features(task)
    out = {}
    for split in wanted:
        path = task_dir / files[split]
        if not path.is_file():
            raise FileNotFoundError(
                f"missing {path} (split {split!r} of GLUE task {task.name!r}); add it from a glue_data "
                f"download, load the Hub copy with glue_dir=None ({HUB_DATASET}), or pass splits= to read "
                f"only the splits that are present"
            )
        cols, sha = _read_tsv(path, task)
        ds = datasets.Dataset.from_dict(cols, features=features, split=datasets.NamedSplit(split))
        # A fingerprint derived from the file content makes downstream map() caches hit across runs.
        fingerprint = _digest("glue-tsv", _TSV_FORMAT_VERSION, task.name, split, sha)
        out[split] = datasets.Dataset(ds.data, info=ds.info, split=ds.split, fingerprint=fingerprint)
    return datasets.DatasetDict(out)


# ---------------------------------------------------------------------------------------------------
# Tokenization


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:32]


def tokenize_glue(
    dataset_dict: datasets.DatasetDict,
    tokenizer: Any,
    task: str | GlueTask,
    max_seq_length: int = 128,
    cache_dir: str | Path | None = None,
) -> datasets.DatasetDict:
    """Tokenize every split (single sentences or pairs), truncating to ``max_seq_length``, without padding.

    Pad at batch time with ``transformers.DataCollatorWithPadding``. Output columns: the tokenizer's
    (``input_ids``, ``attention_mask``, ``token_type_ids`` for BERT-style tokenizers) and ``labels``.
    Results are cached by the datasets library under a fingerprint of the input data, the tokenizer
    (class, name/path, vocabulary size) and ``max_seq_length``. Data read from TSV lives in memory, so
    its cache goes to ``cache_dir`` (default: the datasets cache, ``collab_attn_glue/`` subfolder).
    """
    task = get_task(task)
    if max_seq_length < 1:
        raise ValueError(f"max_seq_length must be positive, got {max_seq_length}")
    tok_key = (type(tokenizer).__name__, str(getattr(tokenizer, "name_or_path", "")), len(tokenizer))
    fields = task.text_fields

    def encode(batch: dict[str, list]) -> dict[str, list]:
        return tokenizer(*(batch[f] for f in fields), truncation=True, max_length=max_seq_length)

    out = {}
    for split, ds in dataset_dict.items():
        missing = [c for c in (*fields, "label") if c not in ds.column_names]
        if missing:
            raise ValueError(
                f"split {split!r} lacks column(s) {missing} needed for GLUE task {task.name!r} "
                f"(has {ds.column_names}); was it loaded with load_glue for this task?"
            )
        fingerprint = _digest("glue-tok", ds._fingerprint, task.name, tok_key, max_seq_length)
        cache_file = None
        if not ds.cache_files and datasets.is_caching_enabled():
            folder = Path(cache_dir or Path(datasets.config.HF_DATASETS_CACHE) / "collab_attn_glue")
            folder.mkdir(parents=True, exist_ok=True)
            cache_file = str(folder / f"tokenized-{fingerprint}.arrow")
        mapped = ds.map(
            encode,
            batched=True,
            remove_columns=[c for c in ds.column_names if c != "label"],
            new_fingerprint=fingerprint,
            cache_file_name=cache_file,
            desc=f"Tokenizing {task.name}/{split}",
        )
        out[split] = mapped.rename_column("label", "labels")
    return datasets.DatasetDict(out)


# ---------------------------------------------------------------------------------------------------
# Metrics


def _as_labels(predictions: Any, task: GlueTask) -> np.ndarray:
    preds = np.asarray(predictions)
    if preds.ndim == 2:
        if preds.shape[1] != task.num_labels:
            raise ValueError(
                f"{task.name}: expected logits with {task.num_labels} columns, got {preds.shape}"
            )
        return preds.argmax(axis=-1)
    if preds.ndim != 1:
        raise ValueError(f"{task.name}: predictions must be logits (N, C) or labels (N,), got {preds.shape}")
    if not np.issubdtype(preds.dtype, np.integer) and not np.all(preds == np.round(preds)):
        raise ValueError(f"{task.name}: 1-D predictions must be class ids, got non-integer values")
    return preds.astype(np.int64)


def glue_metrics(task: str | GlueTask, predictions: Any, references: Any) -> dict[str, float]:
    """GLUE metrics for one task, plus ``"main"`` (the task's main metric).

    ``predictions``: logits (N, num_labels) or class ids (N,) for classification; scores (N,) or (N, 1)
    for STS-B. cola: matthews_correlation; mrpc/qqp: f1 (positive class 1) and accuracy; stsb: pearson
    and spearmanr; the others: accuracy.
    """
    task = get_task(task)
    refs = np.asarray(references)
    if task.is_regression:
        preds = np.asarray(predictions, dtype=np.float64)
        if preds.ndim == 2 and preds.shape[1] == 1:
            preds = preds[:, 0]
        if preds.ndim != 1:
            raise ValueError(f"{task.name}: expected scores of shape (N,) or (N, 1), got {preds.shape}")
    else:
        preds = _as_labels(predictions, task)
    if refs.shape != preds.shape:
        raise ValueError(f"{task.name}: {len(preds)} predictions but references of shape {refs.shape}")

    if task.is_regression:
        refs = refs.astype(np.float64)
        result = {
            "pearson": float(pearsonr(preds, refs)[0]),
            "spearmanr": float(spearmanr(preds, refs)[0]),
        }
    else:
        refs = refs.astype(np.int64)
        if task.name == "cola":
            result = {"matthews_correlation": float(matthews_corrcoef(refs, preds))}
        else:
            result = {"accuracy": float(np.mean(preds == refs))}
        if task.name in ("mrpc", "qqp"):
            result = {"f1": float(f1_score(refs, preds, zero_division=0.0)), **result}
    result["main"] = result[task.main_metric]
    return result


def glue_average(main_metric_by_task: Mapping[str, float]) -> float:
    """Plain mean of per-task main metrics (same units as given, e.g. all in %)."""
    if not main_metric_by_task:
        raise ValueError("glue_average needs at least one task score")
    return float(np.mean([float(v) for v in main_metric_by_task.values()]))


def compute_metrics_fn(task: str | GlueTask) -> Callable[[Any], dict[str, float]]:
    """A ``compute_metrics`` callable for ``transformers.Trainer`` (takes an ``EvalPrediction``)."""
    task = get_task(task)

    def compute_metrics(eval_pred: Any) -> dict[str, float]:
        predictions, label_ids = eval_pred[0], eval_pred[1]
        if isinstance(predictions, tuple):  # models that also return hidden states etc.
            predictions = predictions[0]
        return glue_metrics(task, predictions, label_ids)

    return compute_metrics


__all__ = [
    "GlueTask",
    "TASKS",
    "HUB_DATASET",
    "get_task",
    "load_glue",
    "tokenize_glue",
    "glue_metrics",
    "glue_average",
    "compute_metrics_fn",
]


# Texts for activation-aware calibration (``collab_attn.glue.calibrate.load_texts`` reads a GLUE .tsv through
# ``task_texts``)


def task_texts(
    task, glue_dir: str | Path | None, split: str = "train", *, limit: int | None = CALIBRATION_SAMPLES, seed: int = 0
) -> list[str | tuple[str, str]]:
    """A GLUE task's texts (one text or sentence pair per example) from ``glue_dir`` (None: the Hub), sampled as
    in ``collab_attn.texts.sample_texts``."""
    task = get_task(task)
    data = load_glue(task, glue_dir, splits=[split])[split]
    columns = [data[f] for f in task.text_fields]
    texts = list(columns[0]) if len(columns) == 1 else list(zip(*columns))
    if not texts:
        raise ValueError(f"the {task.name} {split} split holds no texts")
    return sample_texts(texts, limit, seed)
