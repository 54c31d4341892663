"""Training from scratch: is collaborative attention a drop-in replacement for concatenated heads?

A small pre-LN transformer encoder classifier (token + learned position embeddings, mean or [CLS] pooling, a
linear head) whose self-attention is one of

- ``"concat"``: concatenated heads with a total query/key width ``key_size`` (``key_size / heads`` per head) while
  the values keep ``d_model / heads`` per head. At ``key_size = d_model`` this is ``MultiHeadAttention`` itself;
  below it, ``ConcatenatedAttention`` (``MultiHeadAttention`` has one ``head_dim`` for queries, keys *and*
  values, so it cannot shrink the keys alone);
- ``"collab"``: ``CollaborativeAttention`` with ``rank = key_size`` (shared query/key projections of that width and
  one mixing vector per head), mixing initialized at random by default, as the paper's translation code does.

``run_sweep`` trains every (attention, key size, seed) on a GLUE classification task (SST-2 by default) with the
same budget, writes one JSON per run (atomically; existing runs are skipped, so rerunning resumes), and
``write_summary`` turns them into ``results.md`` and ``curves.png``. The Hydra entry point is
``scripts/train_scratch.py`` (settings: ``configs/scratch.yaml``).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from collab_attn.files import replacing, write_text_atomic
from collab_attn.nn.attention import CollaborativeAttention, MultiHeadAttention, additive_mask, attend

ATTENTION_KINDS = ("concat", "collab")
POOLINGS = ("mean", "cls")
QUERY_KEY_COMPONENTS = ("query", "key", "mixing", "mixing_core", "content_bias")
RESULT_VERSION = 1  # bump when a run's result JSON changes meaning


# ---------------------------------------------------------------------------------------------------
# Model


class ConcatenatedAttention(MultiHeadAttention):
    """Concatenated heads whose queries and keys are ``key_size / num_heads`` wide, values ``head_dim`` wide.

    Head ``h`` scores ``(X Wq_h + bq_h)(Y Wk_h + bk_h)^T * scale`` with ``Wq_h, Wk_h`` of ``key_size / num_heads``
    columns; values and the output projection are those of ``MultiHeadAttention``. ``logit_scale`` defaults to
    ``1 / sqrt(key_size / num_heads)`` (Vaswani et al.'s ``1 / sqrt(d_k)``). At ``key_size = num_heads * head_dim``
    it computes exactly what ``MultiHeadAttention`` computes.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        key_size: int,
        *,
        dropout: float = 0.0,
        bias: bool = True,
        logit_scale: float | None = None,
    ):
        super().__init__(d_model, num_heads, dropout=dropout, bias=bias)
        if key_size <= 0 or key_size % num_heads:
            raise ValueError(f"concatenated heads need a key size that is a positive multiple of num_heads "
                             f"({num_heads}), got {key_size}")
        self.key_size = key_size
        self.key_head_dim = key_size // num_heads
        self.scale = logit_scale if logit_scale is not None else 1.0 / math.sqrt(self.key_head_dim)
        self.query = nn.Linear(d_model, key_size, bias=bias)
        self.key = nn.Linear(self.kv_dim, key_size, bias=bias)

    def forward(
        self,
        query_states: torch.Tensor,
        key_value_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        is_causal: bool = False,
        need_weights: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        keys_from = query_states if key_value_states is None else key_value_states
        bias = additive_mask(
            attention_mask, is_causal, query_states.shape[1], keys_from.shape[1], query_states.dtype,
            query_states.device,
        )

        def split(x: torch.Tensor, width: int) -> torch.Tensor:  # (B, T, H * width) -> (B, H, T, width)
            return x.unflatten(-1, (self.num_heads, width)).transpose(1, 2)

        queries = split(self.query(query_states), self.key_head_dim)
        keys = split(self.key(keys_from), self.key_head_dim)
        values = split(self.value(keys_from), self.head_dim)
        dropout = self.dropout if self.training else 0.0
        context, weights = attend(queries, keys, values, bias, self.scale, dropout, need_weights)
        return (context if self.output is None else self.output(context)), weights


@dataclass(frozen=True)
class ScratchConfig:
    """Sizes of the classifier. ``key_size=None`` means ``d_model``; ``ffn_dim=None`` means ``4 d_model``."""

    vocab_size: int
    num_labels: int = 2
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 8
    ffn_dim: int | None = None
    max_length: int = 64
    dropout: float = 0.1
    attention: str = "concat"
    key_size: int | None = None
    mixing_init: str = "random"
    pooling: str = "mean"
    pad_token_id: int = 0

    def __post_init__(self):
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {ATTENTION_KINDS}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"unknown pooling {self.pooling!r}; choose one of {POOLINGS}")
        if min(self.vocab_size, self.num_labels, self.d_model, self.num_layers, self.num_heads, self.max_length) <= 0:
            raise ValueError("vocab_size, num_labels, d_model, num_layers, num_heads and max_length must be positive")
        if self.d_model % self.num_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of num_heads ({self.num_heads})")
        key_size = self.resolved_key_size
        if key_size <= 0:
            raise ValueError(f"key_size must be positive, got {key_size}")
        if self.attention == "concat" and key_size % self.num_heads:
            raise ValueError(
                f"concatenated heads split key_size ({key_size}) into num_heads ({self.num_heads}) equal parts; "
                "choose a multiple of num_heads"
            )

    @property
    def resolved_key_size(self) -> int:
        return self.d_model if self.key_size is None else self.key_size


def build_attention(cfg: ScratchConfig) -> nn.Module:
    """The self-attention of one layer: concatenated or collaborative heads at ``cfg.key_size``."""
    key_size = cfg.resolved_key_size
    if cfg.attention == "collab":
        return CollaborativeAttention(
            cfg.d_model, cfg.num_heads, key_size, dropout=cfg.dropout, mixing_init=cfg.mixing_init
        )
    if key_size == cfg.d_model:
        return MultiHeadAttention(cfg.d_model, cfg.num_heads, dropout=cfg.dropout)
    return ConcatenatedAttention(cfg.d_model, cfg.num_heads, key_size, dropout=cfg.dropout)


class EncoderLayer(nn.Module):
    """Pre-LN block: ``x + attention(LN(x))``, then ``x + FFN(LN(x))`` (GELU), dropout on both branches."""

    def __init__(self, cfg: ScratchConfig):
        super().__init__()
        ffn_dim = cfg.ffn_dim or 4 * cfg.d_model
        self.attention_norm = nn.LayerNorm(cfg.d_model)
        self.attention = build_attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.d_model)
        self.ffn = nn.Sequential(nn.Linear(cfg.d_model, ffn_dim), nn.GELU(), nn.Linear(ffn_dim, cfg.d_model))
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        attended, _ = self.attention(self.attention_norm(x), attention_mask=attention_mask)
        x = x + self.dropout(attended)
        return x + self.dropout(self.ffn(self.ffn_norm(x)))


class ScratchClassifier(nn.Module):
    """Token + learned position embeddings, ``num_layers`` pre-LN encoder layers, final LayerNorm, pooling, a linear
    head. ``forward(input_ids, attention_mask)`` returns logits (batch, num_labels); padding (mask 0) is masked in
    every attention layer and left out of mean pooling."""

    def __init__(self, cfg: ScratchConfig):
        super().__init__()
        self.config = cfg
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.position_embedding = nn.Embedding(cfg.max_length, cfg.d_model)
        self.embedding_dropout = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.d_model)
        self.classifier = nn.Linear(cfg.d_model, cfg.num_labels)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        # BERT's initialization for linear maps and embeddings. The collaborative mixing is a plain Parameter,
        # not a Linear, so it keeps the attention module's own ``mixing_init``.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, length = input_ids.shape
        if length > self.config.max_length:
            raise ValueError(f"sequence of {length} tokens is longer than max_length {self.config.max_length}")
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        positions = torch.arange(length, device=input_ids.device)
        x = self.embedding_dropout(self.token_embedding(input_ids) + self.position_embedding(positions)[None])
        for layer in self.layers:
            x = layer(x, attention_mask)
        x = self.final_norm(x)
        if self.config.pooling == "cls":
            pooled = x[:, 0]
        else:
            keep = attention_mask.to(x.dtype)[..., None]
            pooled = (x * keep).sum(1) / keep.sum(1).clamp_min(1.0)
        return self.classifier(pooled)


def parameter_counts(model: ScratchClassifier) -> dict[str, int]:
    """Total parameters, attention parameters per layer, and query/key parameters per layer.

    Query/key parameters are everything that forms the attention scores: query and key projections with their
    biases (concatenated), or shared projections, mixing and content bias (collaborative). Values and the output
    projection are the same in both kinds and not counted there.
    """
    layer_counts = model.layers[0].attention.parameter_counts()
    return {
        "total": sum(p.numel() for p in model.parameters()),
        "attention_per_layer": layer_counts["total"],
        "query_key_per_layer": sum(layer_counts.get(c, 0) for c in QUERY_KEY_COMPONENTS),
    }


# ---------------------------------------------------------------------------------------------------
# Data


@dataclass
class EncodedSplit:
    """Token ids of one split (unpadded, one list per example) and integer labels."""

    input_ids: list[list[int]]
    labels: torch.Tensor

    def __len__(self) -> int:
        return len(self.input_ids)

    def batch(self, indices: Sequence[int], pad_token_id: int) -> dict[str, torch.Tensor]:
        """Examples ``indices`` padded to their longest: input_ids, attention_mask (1 = token), labels."""
        rows = [self.input_ids[i] for i in indices]
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
            mask[i, : len(row)] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": self.labels[list(indices)]}


def encode(tokenizer: Any, dataset: Any, text_fields: Sequence[str], max_length: int) -> EncodedSplit:
    """Tokenize a datasets split (its ``text_fields`` and ``label``) without padding, truncating to ``max_length``."""
    texts = [list(dataset[f]) for f in text_fields]
    encoded = tokenizer(*texts, truncation=True, max_length=max_length)
    return EncodedSplit(list(encoded["input_ids"]), torch.tensor(list(dataset["label"]), dtype=torch.long))


def load_task(
    task: str,
    glue_dir: str | Path | None,
    tokenizer: Any,
    max_length: int,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
) -> tuple[EncodedSplit, EncodedSplit]:
    """Train and dev splits of a GLUE classification task, tokenized (first ``max_*_samples`` rows if given)."""
    from collab_attn.glue.tasks import get_task, load_glue

    info = get_task(task)
    if info.is_regression:
        raise ValueError(f"GLUE task {info.name!r} is a regression task; training from scratch supports "
                         "classification tasks only")
    dev_split = info.eval_splits[0]
    data = load_glue(info, glue_dir, splits=("train", dev_split))
    train, dev = data["train"], data[dev_split]
    if max_train_samples is not None:
        train = train.select(range(min(max_train_samples, len(train))))
    if max_eval_samples is not None:
        dev = dev.select(range(min(max_eval_samples, len(dev))))
    return encode(tokenizer, train, info.text_fields, max_length), encode(tokenizer, dev, info.text_fields, max_length)


# ---------------------------------------------------------------------------------------------------
# Training


@dataclass(frozen=True)
class TrainSettings:
    """One run's optimization: AdamW, linear warmup then linear decay to 0 over ``steps`` updates."""

    steps: int = 3000
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    grad_clip: float | None = 1.0
    eval_every: int = 250
    eval_batch_size: int = 256

    def __post_init__(self):
        if self.steps <= 0 or self.batch_size <= 0 or self.eval_every <= 0 or self.eval_batch_size <= 0:
            raise ValueError("steps, batch_size, eval_every and eval_batch_size must be positive")
        if self.lr <= 0 or not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"need lr > 0 and 0 <= warmup_ratio < 1, got {self.lr} and {self.warmup_ratio}")


def linear_schedule(step: int, steps: int, warmup_ratio: float) -> float:
    """Learning-rate multiplier: 0 -> 1 over the warmup steps, then 1 -> 0 at ``steps``."""
    warmup = int(round(warmup_ratio * steps))
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (steps - step) / max(1, steps - warmup))


def make_optimizer(model: nn.Module, settings: TrainSettings) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices (weights, embeddings, mixing) and none on biases and LayerNorm gains.

    The fused implementation where torch has it (4x faster on CPU here: the 30k-token embedding dominates)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    try:
        return torch.optim.AdamW(groups, lr=settings.lr, fused=True)
    except (RuntimeError, TypeError):  # no fused kernel for this device / torch version
        return torch.optim.AdamW(groups, lr=settings.lr)


def _shuffled_batches(
    lengths: Sequence[int], batch_size: int, generator: torch.Generator, pool_batches: int = 50
) -> Iterator[list[int]]:
    """Endless random batches of similar lengths: each epoch is a new permutation, cut into pools of
    ``pool_batches`` batches; each pool is sorted by length and cut into batches, and the batches of the epoch are
    shuffled. Padding (and so the cost of a step) falls several times; the batches stay random. The last partial
    batch of a pool is kept, so an epoch visits every example once."""
    size = len(lengths)
    while True:
        order = torch.randperm(size, generator=generator).tolist()
        epoch: list[list[int]] = []
        pool = batch_size * pool_batches
        for start in range(0, size, pool):
            chunk = sorted(order[start : start + pool], key=lambda i: lengths[i])
            epoch.extend(chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size))
        for b in torch.randperm(len(epoch), generator=generator).tolist():
            yield epoch[b]


@torch.no_grad()
def evaluate(model: ScratchClassifier, split: EncodedSplit, batch_size: int = 256) -> dict[str, float]:
    """Accuracy and mean cross-entropy on ``split`` (model put in eval mode, then back to its previous mode)."""
    was_training = model.training
    model.eval()
    pad = model.config.pad_token_id
    correct, loss_sum = 0, 0.0
    order = sorted(range(len(split)), key=lambda i: len(split.input_ids[i]))  # similar lengths: less padding
    for start in range(0, len(split), batch_size):
        batch = split.batch(order[start : start + batch_size], pad)
        logits = model(batch["input_ids"], batch["attention_mask"])
        loss_sum += F.cross_entropy(logits, batch["labels"], reduction="sum").item()
        correct += (logits.argmax(-1) == batch["labels"]).sum().item()
    model.train(was_training)
    return {"accuracy": correct / len(split), "loss": loss_sum / len(split)}


def train(
    model: ScratchClassifier,
    train_split: EncodedSplit,
    dev_split: EncodedSplit,
    settings: TrainSettings,
    seed: int = 0,
    progress: bool = True,
    description: str = "train",
) -> dict[str, Any]:
    """Train for ``settings.steps`` updates, evaluating on ``dev_split`` at step 0, every ``eval_every`` steps and
    at the end. Returns the learning curve (step, dev accuracy, dev loss, mean train loss since the last
    evaluation, learning rate), the final dev metrics and the training seconds (evaluations excluded)."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = make_optimizer(model, settings)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: linear_schedule(step, settings.steps, settings.warmup_ratio)
    )
    pad = model.config.pad_token_id
    batches = _shuffled_batches([len(ids) for ids in train_split.input_ids], settings.batch_size, generator)
    curve: list[dict[str, float]] = []
    train_losses: list[float] = []
    train_seconds = 0.0

    def record(step: int) -> dict[str, float]:
        dev = evaluate(model, dev_split, settings.eval_batch_size)
        point = {
            "step": step,
            "dev_accuracy": dev["accuracy"],
            "dev_loss": dev["loss"],
            "train_loss": statistics.fmean(train_losses) if train_losses else float("nan"),
            "lr": optimizer.param_groups[0]["lr"],
            "train_seconds": train_seconds,
        }
        train_losses.clear()
        curve.append(point)
        return point

    model.train()
    record(0)
    bar = tqdm(total=settings.steps, desc=description, disable=not progress, mininterval=5.0, dynamic_ncols=True)
    for step in range(1, settings.steps + 1):
        started = time.perf_counter()
        batch = train_split.batch(next(batches), pad)
        loss = F.cross_entropy(model(batch["input_ids"], batch["attention_mask"]), batch["labels"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if settings.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        scheduler.step()
        train_seconds += time.perf_counter() - started
        train_losses.append(loss.item())
        bar.update(1)
        if step % settings.eval_every == 0 or step == settings.steps:
            point = record(step)
            bar.set_postfix(loss=f"{point['train_loss']:.3f}", dev_acc=f"{point['dev_accuracy']:.3f}")
    bar.close()
    final = curve[-1]
    return {
        "curve": curve,
        "dev_accuracy": final["dev_accuracy"],
        "dev_loss": final["dev_loss"],
        "train_seconds": train_seconds,
    }


# ---------------------------------------------------------------------------------------------------
# Sweep: every (attention, key size, seed), one result JSON each, then results.md and curves.png


def key_sizes_for(d_model: int, key_sizes: Sequence[int] | None) -> list[int]:
    """The key sizes to sweep: as given, or ``d_model``, ``/2``, ``/4``, ``/8``."""
    if key_sizes is None:
        return [d_model // div for div in (1, 2, 4, 8)]
    return [int(k) for k in key_sizes]


def run_name(kind: str, key_size: int, seed: int) -> str:
    return f"{kind}-k{key_size}-seed{seed}"


def _model_config(settings: dict, vocab_size: int, num_labels: int, kind: str, key_size: int) -> ScratchConfig:
    model = settings["model"]
    return ScratchConfig(
        vocab_size=vocab_size,
        num_labels=num_labels,
        d_model=model["d_model"],
        num_layers=model["num_layers"],
        num_heads=model["num_heads"],
        ffn_dim=model.get("ffn_dim"),
        max_length=settings["max_length"],
        dropout=model.get("dropout", 0.1),
        attention=kind,
        key_size=key_size,
        mixing_init=model.get("mixing_init", "random"),
        pooling=model.get("pooling", "mean"),
    )


def run_signature(settings: dict) -> dict:
    """What must agree for a stored run to be reused: everything that changes a run except its kind, key size
    and seed (not the output folder, thread count or progress bar)."""
    return {
        "version": RESULT_VERSION,
        "task": settings["task"],
        "tokenizer": settings["tokenizer"],
        "max_length": settings["max_length"],
        "max_train_samples": settings.get("max_train_samples"),
        "max_eval_samples": settings.get("max_eval_samples"),
        "model": dict(settings["model"]),
        "train": dict(settings["train"]),
    }


def run_sweep(settings: dict, progress: bool = True) -> list[dict]:
    """Train every configuration in ``settings`` (the resolved ``configs/scratch.yaml``) that has no result yet.

    Runs go seed by seed (all configurations of seed 0 first), each into ``<output_dir>/runs/<name>.json``
    written atomically; a run whose file exists is skipped after checking it was made with the same settings.
    Writes ``results.md`` and ``curves.png`` at the end and returns every run's record.
    """
    from transformers import AutoTokenizer

    from collab_attn.glue.tasks import get_task
    from collab_attn.models.checkpoints import resolve_model

    model_settings = settings["model"]
    keys = key_sizes_for(model_settings["d_model"], settings.get("key_sizes"))
    kinds = list(settings["kinds"])
    seeds = [int(s) for s in settings["seeds"]]
    train_settings = TrainSettings(**settings["train"])
    task = get_task(settings["task"])
    if task.is_regression:
        raise ValueError(f"GLUE task {task.name!r} is a regression task; training from scratch supports "
                         "classification tasks only")
    # Validate every configuration before any training (a bad key size fails now, not an hour in).
    for kind in kinds:
        for key in keys:
            _model_config(settings, 1, max(task.num_labels, 1), kind, key)
    if not seeds:
        raise ValueError("seeds is empty")
    if settings.get("threads"):
        torch.set_num_threads(int(settings["threads"]))
        os.environ.setdefault("RAYON_NUM_THREADS", str(settings["threads"]))  # the Rust tokenizer's thread pool

    out = Path(settings["output_dir"])
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    signature = run_signature(settings)
    plan = [(kind, key, seed) for seed in seeds for key in keys for kind in kinds]
    records: dict[str, dict] = {}
    for kind, key, seed in plan:
        path = runs_dir / f"{run_name(kind, key, seed)}.json"
        if path.exists():
            record = json.loads(path.read_text())
            if record.get("signature") != signature:
                raise ValueError(
                    f"{path} was made with different settings; use another output_dir or delete {runs_dir}"
                )
            records[path.stem] = record
    pending = [p for p in plan if run_name(*p) not in records]
    print(f"{len(plan) - len(pending)} of {len(plan)} runs already done in {runs_dir}; {len(pending)} to go")

    if pending:
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(settings["tokenizer"]))
        train_split, dev_split = load_task(
            task.name, settings.get("glue_dir"), tokenizer, settings["max_length"],
            settings.get("max_train_samples"), settings.get("max_eval_samples"),
        )
        majority = float(torch.bincount(dev_split.labels).max().item() / len(dev_split))
        for number, (kind, key, seed) in enumerate(pending, 1):
            name = run_name(kind, key, seed)
            cfg = _model_config(settings, len(tokenizer), task.num_labels, kind, key)
            cfg = ScratchConfig(**{**asdict(cfg), "pad_token_id": tokenizer.pad_token_id or 0})
            torch.manual_seed(seed)
            model = ScratchClassifier(cfg)
            result = train(
                model, train_split, dev_split, train_settings, seed=seed, progress=progress,
                description=f"[{number}/{len(pending)}] {name}",
            )
            record = {
                "name": name,
                "attention": kind,
                "key_size": key,
                "seed": seed,
                "task": task.name,
                "signature": signature,
                "parameters": parameter_counts(model),
                "majority_baseline": majority,
                "threads": torch.get_num_threads(),
                **result,
            }
            write_text_atomic(runs_dir / f"{name}.json", json.dumps(record, indent=1) + "\n")
            records[name] = record
            print(f"{name}: dev accuracy {result['dev_accuracy']:.4f}, {result['train_seconds']:.0f} s", flush=True)

    ordered = [records[run_name(*p)] for p in plan]
    write_summary(ordered, out)
    return ordered


def _mean_std(values: Sequence[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def summary_rows(records: Sequence[dict]) -> list[dict]:
    """One row per (attention, key size): parameter counts and final dev metrics, mean and std over seeds."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["attention"], record["key_size"]), []).append(record)
    rows = []
    for (kind, key), runs in sorted(groups.items(), key=lambda item: (-item[0][1], ATTENTION_KINDS.index(item[0][0]))):
        accuracy, accuracy_std = _mean_std([r["dev_accuracy"] for r in runs])
        loss, loss_std = _mean_std([r["dev_loss"] for r in runs])
        rows.append({
            "attention": kind,
            "key_size": key,
            "query_key_params": runs[0]["parameters"]["query_key_per_layer"],
            "total_params": runs[0]["parameters"]["total"],
            "dev_accuracy": accuracy,
            "dev_accuracy_std": accuracy_std,
            "dev_loss": loss,
            "dev_loss_std": loss_std,
            "seeds": sorted(r["seed"] for r in runs),
            "train_seconds": statistics.fmean(r["train_seconds"] for r in runs),
        })
    return rows


def results_markdown(records: Sequence[dict]) -> str:
    rows = summary_rows(records)
    first = records[0]
    sig = first["signature"]
    lines = [
        f"# Training from scratch on {first['task']}: concatenated vs collaborative heads",
        "",
        f"Model: {sig['model']}; max length {sig['max_length']}; training: {sig['train']}.",
        f"Dev majority-class baseline: {100 * first['majority_baseline']:.1f}%.",
        "",
        "| attention | key size D_k | q/k params per layer | total params | final dev accuracy (%) | final dev loss "
        "| seeds | train s (mean) |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['attention']} | {row['key_size']} | {row['query_key_params']:,} | {row['total_params']:,} "
            f"| {100 * row['dev_accuracy']:.2f} ± {100 * row['dev_accuracy_std']:.2f} "
            f"| {row['dev_loss']:.3f} ± {row['dev_loss_std']:.3f} | {','.join(map(str, row['seeds']))} "
            f"| {row['train_seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _curves_by_config(records: Sequence[dict]) -> dict[tuple[str, int], tuple[list[int], list[float], list[float]]]:
    """Per (attention, key size): steps, mean and std over seeds of the dev accuracy (steps all runs share)."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((record["attention"], record["key_size"]), []).append(record)
    curves = {}
    for config, runs in groups.items():
        by_step = [{p["step"]: p["dev_accuracy"] for p in r["curve"]} for r in runs]
        steps = sorted(set.intersection(*(set(c) for c in by_step)))
        stats = [_mean_std([c[s] for c in by_step]) for s in steps]
        curves[config] = (steps, [m for m, _ in stats], [s for _, s in stats])
    return curves


def plot_curves(records: Sequence[dict], path: str | Path) -> Path:
    """Left: dev accuracy against step, mean over seeds (band: ± std), colour = key size, solid = concatenated,
    dashed = collaborative. Right: final dev accuracy against key size, mean ± std."""
    from matplotlib.figure import Figure

    curves = _curves_by_config(records)
    keys = sorted({k for _, k in curves}, reverse=True)
    colours = {k: f"C{i}" for i, k in enumerate(keys)}
    styles = {"concat": "-", "collab": "--"}
    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    for (kind, key), (steps, mean, std) in sorted(curves.items(), key=lambda item: (-item[0][1], item[0][0])):
        mean_pc = [100 * m for m in mean]
        left.plot(steps, mean_pc, styles[kind], color=colours[key], label=f"{kind} D_k={key}")
        left.fill_between(steps, [m - 100 * s for m, s in zip(mean_pc, std)],
                          [m + 100 * s for m, s in zip(mean_pc, std)], color=colours[key], alpha=0.08)
    majority = 100 * records[0]["majority_baseline"]
    for ax in (left, right):
        ax.axhline(majority, color="grey", lw=0.8, ls=":", label="majority class")
        ax.grid(alpha=0.3)
    left.set_xlabel("training step")
    left.set_ylabel("dev accuracy (%)")
    left.set_title(f"{records[0]['task']}: dev accuracy, mean over seeds")
    left.legend(fontsize=7, ncol=2)
    for kind in ATTENTION_KINDS:
        rows = [r for r in summary_rows(records) if r["attention"] == kind]
        if rows:
            right.errorbar([r["key_size"] for r in rows], [100 * r["dev_accuracy"] for r in rows],
                           yerr=[100 * r["dev_accuracy_std"] for r in rows], fmt="o" + styles[kind], capsize=3,
                           label=kind)
    right.set_xscale("log", base=2)
    right.set_xticks(keys, [str(k) for k in keys])
    right.set_xlabel("key/query size D_k")
    right.set_ylabel("final dev accuracy (%)")
    right.set_title("final dev accuracy, mean ± std over seeds")
    right.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    return path


def write_summary(records: Sequence[dict], out_dir: str | Path) -> dict[str, Path]:
    """``results.md`` and ``curves.png`` for the given runs, each written atomically into ``out_dir``."""
    out = Path(out_dir)
    md = write_text_atomic(out / "results.md", results_markdown(records))
    with replacing(out / "curves.png") as tmp:
        plot_curves(records, tmp)
    return {"results": md, "curves": out / "curves.png"}


__all__ = [
    "ConcatenatedAttention",
    "ScratchConfig",
    "ScratchClassifier",
    "EncodedSplit",
    "TrainSettings",
    "build_attention",
    "parameter_counts",
    "load_task",
    "evaluate",
    "train",
    "run_sweep",
    "summary_rows",
    "write_summary",
]
