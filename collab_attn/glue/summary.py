"""Summaries of GLUE sweeps: a task x rank x stage table (Markdown and CSV) and a compression-vs-accuracy plot,
in the spirit of the paper's Table 2. Reads the stage records of every GLUE job under a sweep directory (its
``results.jsonl``, ``collab_attn.run_store``)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from collab_attn.files import replacing, write_text_atomic  # noqa: E402
from collab_attn.glue.tasks import get_task  # noqa: E402
from collab_attn.run_store import STAGES_FILE, read_results  # noqa: E402
from collab_attn.stats import paired_comparison  # noqa: E402

TASK_COLUMNS = ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")
STAGE_ORDER = {"finetuned": 0, "reparam": 1, "refit": 2}
OUTPUTS = ("summary.md", "summary.csv", "compression_vs_accuracy.png", "before_after.md")
RESULT_KEYS = ("stage", "task", "model", "method", "seed", "main", "query_key_params")  # what the tables read
STAGE_LABELS = {"finetuned": "original (fine-tuned)", "reparam": "reparametrized, no retraining",
                "refit": "reparametrized + re-fine-tuned"}


def load_results(
    sweep_dir: str | Path, tasks: list[str] | None = None, seeds: list[int] | None = None
) -> pd.DataFrame:
    """One row per (job, stage) from every results.jsonl below ``sweep_dir`` (``job``: the directory holding it);
    only ``tasks`` when given, so that the table's average is over those tasks, and only ``seeds`` when given (to
    compare rows on the same seeds). A job re-fine-tuned with
    distillation has its settings in its method (``cp-aware + KD a0.5 T4``): its rows are its own."""
    stored = read_results("sweep_dir", sweep_dir, f"**/{STAGES_FILE}", RESULT_KEYS, "train_glue")
    if not stored:
        raise FileNotFoundError(f"no {STAGES_FILE} under {sweep_dir}; run scripts/train_glue.py first")
    rows = [{**row, "job": str(path.parent)} for path, row in stored]
    if tasks is not None:
        wanted = {get_task(t).name for t in tasks}
        found = {row["task"] for row in rows}
        if not wanted <= found:
            missing = ", ".join(sorted(wanted - found))
            raise ValueError(f"no results for task(s) {missing} under {sweep_dir}; it has {', '.join(sorted(found))}")
        rows = [row for row in rows if row["task"] in wanted]
    if seeds is not None:
        rows = [row for row in rows if row["seed"] in seeds]
        if not rows:
            raise ValueError(f"no results for seed(s) {seeds} under {sweep_dir}")
    frame = pd.DataFrame(rows)
    frame["rank"] = [_rank_label(row.get("rank")) for row in rows]
    frame["method"] = [row["method"] + _distill_label(row.get("distill")) for row in rows]
    return frame


def _distill_label(distill: dict | None) -> str:
    """How a job re-fine-tuned with distillation is told apart from the same method re-fine-tuned plainly:
    ``" + KD a0.5 T4"`` (plus ``h<weight>`` and ``att<weight>`` for the per-layer terms that are on)."""
    if not distill:
        return ""
    label = f" + KD a{distill['alpha']:g} T{distill['temperature']:g}"
    for key, short in (("hidden_weight", "h"), ("attention_weight", "att")):
        if distill.get(key):
            label += f" {short}{distill[key]:g}"
    return label


def _task_order(task: str) -> int:
    """GLUE's usual column order; unknown tasks last."""
    return TASK_COLUMNS.index(task) if task in TASK_COLUMNS else len(TASK_COLUMNS)


def _rank_label(rank) -> str | None:
    """``"128"`` for a rank, ``"96-128-..."`` for per-layer ranks, None where a job has none (``collab=none``)."""
    if isinstance(rank, list):
        return "-".join(map(str, rank))
    return None if rank is None else str(rank)


def _rank_value(ranks: pd.Series) -> pd.Series:
    """A sort key for rank labels: the rank as a number; the original's ``-`` and per-layer ranks sort as largest."""
    return pd.to_numeric(ranks, errors="coerce").fillna(1e9)


def _over_seeds(rows: pd.DataFrame, keys: list[str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The main metric x100 as one value per ``keys`` and seed (a stage that two jobs share, such as the reparam
    stage of a job with and one without re-fine-tuning, counts once), then its mean, standard deviation and number
    of seeds per ``keys``; the mean query/key parameter count rides along."""
    per_seed = rows.assign(score=rows["main"] * 100).groupby([*keys, "seed"], sort=False).agg(
        score=("score", "mean"), query_key_params=("query_key_params", "mean")).reset_index()
    stats = per_seed.groupby(keys, sort=False).agg(
        score=("score", "mean"), std=("score", "std"), seeds=("seed", "nunique"),
        query_key_params=("query_key_params", "mean")).reset_index()
    return per_seed, stats


def _spread_by_task(stats: pd.DataFrame, index: list[str], tasks: list[str], suffix: str) -> pd.DataFrame:
    """Each task's standard deviation over seeds (from ``_over_seeds``) as a column ``<task><suffix>``, one row per
    ``index``, to join onto a table with that index."""
    spread = stats.pivot_table(index=index, columns="task", values="std", dropna=False)
    return spread.reindex(columns=tasks).add_suffix(suffix)


def _seed_range(stats: pd.DataFrame, index: list[str]) -> pd.DataFrame:
    """The fewest (``min_seeds``) and most (``seeds``) seeds of any task, one row per ``index``."""
    return stats.groupby(index).agg(min_seeds=("seeds", "min"), seeds=("seeds", "max"))


def table(frame: pd.DataFrame) -> pd.DataFrame:
    """Mean main metric (x100) per task over seeds, for the original model and each (method, rank, stage), with
    its standard deviation over seeds in ``<task>_std`` (NaN for one seed) and the fewest and most seeds of any task
    in ``min_seeds`` and ``seeds``.

    The fine-tuned model is the same for every rank of a sweep, so it appears once per task and seed.
    """
    original = frame[frame.stage == "finetuned"].drop_duplicates(["task", "model", "seed"]).assign(
        method="-", rank="-"
    )
    rows = ["model", "method", "rank", "stage"]
    _, stats = _over_seeds(pd.concat([original, frame[frame.stage != "finetuned"]]), [*rows, "task"])
    wide = stats.pivot_table(index=rows, columns="task", values="score")
    tasks = sorted(wide.columns, key=_task_order)
    wide = wide[tasks]
    wide["glue_avg"] = wide.mean(axis=1, skipna=False)
    wide = wide.join(_spread_by_task(stats, rows, tasks, "_std")).join(_seed_range(stats, rows))
    wide = wide.join(stats.groupby(rows).query_key_params.mean()).reset_index()
    wide = wide.assign(_stage=wide.stage.map(STAGE_ORDER), _rank=_rank_value(wide["rank"]))
    return wide.sort_values(["model", "_stage", "method", "_rank"], ascending=[True, True, True, False]).drop(
        columns=["_stage", "_rank"]).reset_index(drop=True)


def _cell(mean, std=None) -> str:
    """``85.6``, or ``85.6 ± 1.2`` (standard deviation over seeds) where there is more than one seed."""
    if pd.isna(mean):
        return ""
    return f"{mean:.1f}" if pd.isna(std) else f"{mean:.1f} ± {std:.1f}"


def _seeds(row) -> str:
    """``3``, or ``1-3`` where tasks have different numbers of seeds."""
    return str(int(row.seeds)) if row.min_seeds == row.seeds else f"{int(row.min_seeds)}-{int(row.seeds)}"


def to_markdown(wide: pd.DataFrame) -> str:
    tasks = [c for c in wide.columns if c in TASK_COLUMNS]
    header = ["model", "method", "rank", "stage", *[f"{t} ({get_task(t).main_metric})" for t in tasks],
              f"avg ({len(tasks)} tasks)", "q/k params", "seeds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 4 + "---:|" * (len(tasks) + 3)]
    for _, row in wide.iterrows():
        cells = [str(row.model), str(row.method), str(row["rank"]), str(row.stage)]
        cells += [_cell(row[t], row[f"{t}_std"]) for t in tasks]
        cells += ["" if pd.isna(row.glue_avg) else f"{row.glue_avg:.1f}", f"{row.query_key_params:,.0f}", _seeds(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def against_original_markdown(frame: pd.DataFrame) -> str:
    """Each converted row's main metric (x100) against its fine-tuned original, paired by seed
    (``collab_attn.stats.paired_comparison``, higher is better): per task the mean difference, its 95% t-interval and
    ``better``, ``worse`` or ``tie`` (always ``tie`` with one seed: a one-seed difference is not a verdict)."""
    rows = ["model", "method", "rank", "stage"]
    per_seed, _ = _over_seeds(frame, [*rows, "task"])
    original = per_seed[per_seed.stage == "finetuned"].drop_duplicates(["model", "task", "seed"])
    original = {(r.model, r.task, r.seed): r.score for r in original.itertuples()}
    converted = per_seed[per_seed.stage != "finetuned"]
    if converted.empty:
        return ""
    tasks = sorted(set(converted.task), key=_task_order)
    lines = ["Against the fine-tuned original, paired by seed (difference x100, 95% t-interval, verdict; one seed: "
             "no interval, a tie):", "",
             "| " + " | ".join([*rows, *[f"{t} ({get_task(t).main_metric})" for t in tasks]]) + " |",
             "|" + "---|" * (4 + len(tasks))]
    order = table(frame)[rows].drop_duplicates()
    for key in order[order.stage != "finetuned"].itertuples(index=False):
        mine = converted[(converted[rows] == pd.Series(key._asdict())).all(axis=1)]
        cells = []
        for task in tasks:
            scores = {r.seed: r.score for r in mine[mine.task == task].itertuples()
                      if (r.model, task, r.seed) in original}
            cells.append(paired_comparison(scores, {s: original[key.model, task, s] for s in scores},
                                           higher_is_better=True).describe(1) if scores else "")
        lines.append("| " + " | ".join([*map(str, key), *cells]) + " |")
    return "\n".join(lines) + "\n"


def before_after(frame: pd.DataFrame) -> pd.DataFrame:
    """The re-fine-tuned jobs only: per (model, method, rank) and task, the score of their fine-tuned original, straight
    after the conversion and after re-fine-tuning (x100, mean over their seeds), so each "after" is read against the
    "before" of the same jobs.

    Columns ``<task>_finetuned``, ``<task>_reparam``, ``<task>_refit``; ``<task>_refit_std`` and, in the original
    row, ``<task>_finetuned_std`` (standard deviation over seeds); ``refit_avg`` and ``finetuned_avg`` (over all
    tasks; NaN where one lacks a score); ``change`` (``refit_avg - finetuned_avg``: the loss against the very models
    these jobs started from, comparable across rows with different seeds); ``min_seeds``/``seeds`` (fewest and most
    seeds of any task). A first row per model (method and rank ``-``) holds the original, each seed's fine-tuned
    model counted once."""
    jobs = set(frame.job[frame.stage == "refit"])
    if not jobs:
        raise ValueError("no re-fine-tuned jobs (stage 'refit') in these results; run without refit=none")
    rows = ["model", "method", "rank"]
    per_seed, stats = _over_seeds(frame[frame.job.isin(jobs)], [*rows, "task", "stage"])
    wide = stats.pivot_table(index=rows, columns=["task", "stage"], values="score")
    tasks = sorted({t for t, _ in wide.columns}, key=_task_order)
    columns = [(t, stage) for t in tasks for stage in STAGE_ORDER]
    wide = wide.reindex(columns=columns)
    wide.columns = [f"{t}_{stage}" for t, stage in columns]
    wide = wide.join(_spread_by_task(stats[stats.stage == "refit"], rows, tasks, "_refit_std"))
    wide = wide.join(_seed_range(stats, rows)).reset_index()
    # the original row: each seed's fine-tuned model once, however many jobs started from it
    originals = per_seed[per_seed.stage == "finetuned"].drop_duplicates(["model", "task", "seed"])
    original = originals.pivot_table(index="model", columns="task", values="score").reindex(columns=tasks)
    original.columns = [f"{t}_finetuned" for t in tasks]
    spread = originals.pivot_table(index="model", columns="task", values="score", aggfunc="std", dropna=False)
    original = original.join(spread.reindex(columns=tasks).add_suffix("_finetuned_std"))
    seeds = originals.groupby(["model", "task"]).seed.nunique().groupby("model")
    original = original.assign(method="-", rank="-", min_seeds=seeds.min(), seeds=seeds.max()).reset_index()
    wide = pd.concat([original, wide], ignore_index=True)
    for stage in ("finetuned", "refit"):
        wide[f"{stage}_avg"] = wide[[f"{t}_{stage}" for t in tasks]].mean(axis=1, skipna=False)
    wide["change"] = wide.refit_avg - wide.finetuned_avg
    wide = wide.assign(_rank=_rank_value(wide["rank"]))
    return wide.sort_values(["model", "_rank", "method"], ascending=[True, False, True]).drop(
        columns="_rank").reset_index(drop=True)


def before_after_markdown(wide: pd.DataFrame) -> str:
    """The original, then one row per re-fine-tuned (model, method, rank) with each task's cell ``before → after``
    (``± standard deviation`` over seeds after re-fine-tuning where there are several),
    the average after re-fine-tuning and its change against the fine-tuned models those jobs started from."""
    tasks = [c.removesuffix("_refit") for c in wide.columns if c.endswith("_refit") and c != "refit_avg"]
    header = ["model", "method", "rank", *[f"{t} ({get_task(t).main_metric})" for t in tasks],
              f"avg after ({len(tasks)} tasks)", "change vs its original", "seeds"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * 3 + "---:|" * (len(tasks) + 3)]

    for _, row in wide.iterrows():
        if row.method == "-":
            cells = [_cell(row[f"{t}_finetuned"], row[f"{t}_finetuned_std"]) for t in tasks]
            average, change, method = _cell(row.finetuned_avg), "", "original (fine-tuned)"
        else:
            cells = ["" if pd.isna(row[f"{t}_refit"]) else
                     f"{_cell(row[f'{t}_reparam'])} → {_cell(row[f'{t}_refit'], row[f'{t}_refit_std'])}"
                     for t in tasks]
            average, method = _cell(row.refit_avg), row.method
            change = "" if pd.isna(row.change) else f"{row.change:+.1f}"
        lines.append(f"| {row.model} | {method} | {row['rank']} | " + " | ".join(cells)
                     + f" | {average} | {change} | {_seeds(row)} |")
    return "\n".join(lines) + "\n"


def plot(wide: pd.DataFrame, path: Path) -> None:
    """Main metric against query/key parameters, one panel per task plus the GLUE average: a colour per (model,
    method), solid without retraining, dashed re-fine-tuned; error bars: the standard deviation over seeds."""
    columns = [c for c in wide.columns if c in TASK_COLUMNS] + ["glue_avg"]
    curves = wide[wide.stage != "finetuned"][["model", "method"]].drop_duplicates().itertuples(index=False)
    colours = {tuple(curve): f"C{i % 10}" for i, curve in enumerate(curves)}
    fig, axes = plt.subplots(1, len(columns), figsize=(4 * len(columns), 3.6), squeeze=False)
    legend = {}
    for ax, column in zip(axes[0], columns):
        for (model, method, stage), group in wide.groupby(["model", "method", "stage"], sort=False):
            if stage == "finetuned":
                for value in group[column].dropna():
                    legend[f"{model} original"] = ax.axhline(value, color="black", linestyle=":", linewidth=1)
                continue
            group = group.dropna(subset=[column]).sort_values("query_key_params")
            if group.empty:
                continue
            legend[f"{model} {method}: {STAGE_LABELS[stage]}"] = ax.errorbar(
                group.query_key_params / 1e6, group[column], yerr=group[f"{column}_std"].fillna(0)
                if f"{column}_std" in group else None, marker="o", capsize=3, color=colours[model, method],
                linestyle="--" if stage == "refit" else "-",
            )
        ax.set_title(f"average of {len(columns) - 1} tasks" if column == "glue_avg"
                     else f"{column} ({get_task(column).main_metric})")
        ax.set_xlabel("key/query parameters (millions)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("score x 100")
    fig.legend(legend.values(), legend.keys(), loc="lower center", ncol=min(3, len(legend)), fontsize=8)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def summarize(
    sweep_dir: str | Path, out_dir: str | Path | None = None, tasks: list[str] | None = None,
    seeds: list[int] | None = None,
) -> dict[str, Path]:
    """Write summary.md, summary.csv, compression_vs_accuracy.png where some job compressed a model, and
    before_after.md where jobs were re-fine-tuned (over ``tasks`` and ``seeds`` only, when given); return their
    paths."""
    return write(load_results(sweep_dir, tasks, seeds), out_dir or sweep_dir)


def write(frame: pd.DataFrame, out_dir: str | Path) -> dict[str, Path]:
    """``summarize``'s files for the rows of ``load_results`` into ``out_dir`` (made if missing)."""
    wide = table(frame)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out / "summary.md", "csv": out / "summary.csv"}
    verdicts = against_original_markdown(frame)
    write_text_atomic(paths["markdown"], to_markdown(wide) + ("\n" + verdicts if verdicts else ""))
    with replacing(paths["csv"]) as tmp:
        wide.to_csv(tmp, index=False, float_format="%.4f")
    if (wide.stage != "finetuned").any():
        paths["plot"] = out / "compression_vs_accuracy.png"
        with replacing(paths["plot"]) as tmp:
            plot(wide, tmp)
    if (frame.stage == "refit").any():
        paths["before_after"] = write_text_atomic(out / "before_after.md", before_after_markdown(before_after(frame)))
    return paths
