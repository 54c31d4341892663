"""Tables, learning curves and samples of the Tiny Shakespeare runs, from their result JSONs.

Layout read (``experiments/shakespeare_char/``): ``<recipe>/runs/*.json`` (from scratch, ``collab_attn.char_lm.runs``)
and ``<recipe>/convert/runs/*.json`` (conversions, ``collab_attn.char_lm.convert``) for each recipe folder found.
``write_summary`` writes ``curves_<recipe>.png`` per recipe and replaces the part of ``results.md`` between
``RESULTS_BEGIN`` and ``RESULTS_END`` (appended when missing) with the tables and samples; the rest of that file is
left as written. The folder's ``README.md`` is written by hand (the current answer) and links ``results.md``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from collab_attn import cli
from collab_attn.char_lm.kinds import KINDS
from collab_attn.char_lm.race_summary import LOSS_RESOLUTION
from collab_attn.files import replacing, write_section
from collab_attn.models.settings import NO_CONVERSION, labels
from collab_attn.run_store import mean_curve, mean_std, read_results
from collab_attn.stats import compare_on_shared_seeds, rank

NANOGPT = {"gpu": 1.4697, "cpu": 1.88}  # nanoGPT's README: best val loss of its two shakespeare_char configs
RESULTS_BEGIN = "<!-- results: written by scripts/summarize.py lm -->"
EARLIER_BEGINS = ("<!-- results: written by scripts/summarize_lm.py -->",
                  "<!-- results: written by scripts/summarize_runs.py lm -->")  # before issue 90's one script
RESULTS_END = "<!-- end of results -->"
RESULTS_FILE = "results.md"  # the generated page: every table, verdict and sample; README.md links it
RESULTS_HEADER = ("# Tiny Shakespeare, character level: every run\n\n"
                  "Written by `python scripts/summarize.py lm experiments/shakespeare_char` from the runs' JSON "
                  "files (do not edit between the markers). The current answer is in [`README.md`](README.md).\n\n")
METHOD_ORDER = labels()
# Per results sub-folder: the keys the tables read, the key naming the variant and its values, the writing script.
RESULTS = {
    "runs": (("attention", "rank", "seed", "best_val_loss", "final_val_loss", "curve", "parameters",
              "cache_bytes_per_token_bf16", "sample"), "attention", KINDS, "train_lm"),
    "convert/runs": (("method", "rank", "original_val_loss", "original_parameters", "model_dir", "retrain_steps",
                      "parameters", "cache_bytes_per_token_bf16", "relative_error", "converted_val_loss",
                      "converted_sample"), "method", METHOD_ORDER, "convert_lm"),
}


def read_runs(recipe: Path, runs: str) -> list[dict]:
    """The records in the sub-folder ``runs`` (a key of ``RESULTS``) of a recipe folder, each checked to be a result
    of the script that writes them there (none when the folder is missing)."""
    keys, variant_key, variants, script = RESULTS[runs]
    found = read_results("root", recipe / runs, "*.json", keys, script, lambda record: record[variant_key] in variants)
    return [record for _, record in found]


def _rotary(record: dict) -> bool:
    return record.get("positions") == "rope"


def variant(record: dict) -> str:
    """``collab (values 30)``, ``mla (rotary key 16, rope)``, ``tpa (values 2, queries 6, rope)``: the attention
    and what shapes it besides its rank."""
    name = "collab (ones)" if record.get("mixing_init") == "ones" else record["attention"]
    details = [f"values {record['value_rank']}"] if record.get("value_rank") is not None else []
    if record.get("rope_dim") is not None:
        details.append(f"rotary key {record['rope_dim']}")
    if record.get("query_rank") is not None:
        details.append(f"queries {record['query_rank']}")
    details += ["rope"] if _rotary(record) else []
    return name if not details else f"{name} ({', '.join(details)})"


def family(record: dict) -> str:
    """One line of the cache plot: the attention, ``collab (values)`` where collaborative heads share their
    values, `` rope`` with rotary positions."""
    name = variant({**record, "value_rank": None, "rope_dim": None, "query_rank": None, "positions": None})
    if record["attention"] == "collab" and record.get("value_rank") is not None:
        name = f"{name} (values)"
    return f"{name} rope" if _rotary(record) else name


def _groups(records: Sequence[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for record in records:
        groups.setdefault((variant(record), record["rank"]), []).append(record)
    return dict(sorted(groups.items(), key=lambda item: (-item[0][1], item[0][0])))


def trained_tokens(record: dict | None, steps: int | None = None) -> str:
    """``2,000 x 12 x 64 = 1,536,000``: the tokens a run trained on, steps x batch x block, from its ``signature``
    (``steps``: another number of steps with the same batches, e.g. a re-training); ``-`` where it lacks them."""
    signature = (record or {}).get("signature") or {}
    trainer = signature.get("trainer") or {}
    steps = trainer.get("max_steps") if steps is None else steps
    batch, block = trainer.get("per_device_train_batch_size"), signature.get("block_size")
    if steps is None:
        return "-"
    if batch is None or block is None:
        return f"{steps:,} steps"
    return f"{steps:,} x {batch} x {block} = {steps * batch * block:,}"


def scratch_table(records: Sequence[dict]) -> str:
    """One row per (attention, rank): best validation loss mean ± std over seeds, the sizes, and what was trained
    (every weight, from scratch) on how many tokens per run."""
    lines = [
        "| attention | key size | q/k params | attention params | params | KV cache bytes/token (bf16) | best val loss "
        "| final val loss | seeds | tokens/s | best at the last evaluation | last 10% of steps: val loss change "
        "| long enough | trained: all weights from scratch, tokens per run (steps x batch x block) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---|---|",
    ]
    for (kind, key), runs in _groups(records).items():
        best, best_std = mean_std([r["best_val_loss"] for r in runs])
        final, final_std = mean_std([r["final_val_loss"] for r in runs])
        speed = [r["tokens_per_second"] for r in runs if r.get("tokens_per_second")]
        p, cache = runs[0]["parameters"], runs[0]["cache_bytes_per_token_bf16"]
        lines.append(
            f"| {kind} | {key} | {p['query_key_params']:,} | {p['attention_params']:,} | {p['total']:,} | {cache:,} "
            f"| {best:.4f} ± {best_std:.4f} | {final:.4f} ± {final_std:.4f} "
            f"| {','.join(str(r['seed']) for r in sorted(runs, key=lambda r: r['seed']))} "
            f"| {statistics.fmean(speed) if speed else float('nan'):,.0f} "
            f"| {sum(_still_improving(r) for r in runs)} of {len(runs)} "
            f"| {statistics.fmean(late_change(r) for r in runs):+.4f} | {long_enough(runs)} "
            f"| {trained_tokens(runs[0])} |"
        )
    return "\n".join(lines)


def long_enough(runs: Sequence[dict]) -> str:
    """``yes`` when the last 10% of training moved the validation loss (the mean over seeds of ``late_change``) by
    less than the spread of the best validation loss over the seeds (its standard deviation), ``no`` otherwise;
    ``one seed`` when there is no spread to compare with."""
    if len(runs) < 2:
        return "one seed"
    moved = abs(statistics.fmean(late_change(r) for r in runs))
    return "yes" if moved < mean_std([r["best_val_loss"] for r in runs])[1] else "no"


def late_change(record: dict) -> float:
    """How much the validation loss moved over the last 10% of training: the last evaluation's minus that of the
    last evaluation at or before 90% of the steps (negative: still falling)."""
    curve = record["curve"]
    cut = 0.9 * curve[-1]["step"]
    before = max((p for p in curve if p["step"] <= cut), key=lambda p: p["step"])
    return curve[-1]["val_loss"] - before["val_loss"]


def _still_improving(record: dict) -> bool:
    """Whether the run's best validation loss is at its last evaluation (it might have gone on improving)."""
    return record["best_step"] == record["curve"][-1]["step"]


def _short_label(record: dict) -> str:
    """``mqa 32``, ``collab 30/30`` (rank and value rank), ``collab (ones) 16``; rotary runs ``... rope`` (latent
    attention with its rotary key ``mla 48+16 rope``, tensor product attention ``tpa 2/2 q6 rope``)."""
    name = "collab (ones)" if record.get("mixing_init") == "ones" else record["attention"]
    label = f"{name} {record['rank']}" + ("" if record.get("value_rank") is None else f"/{record['value_rank']}")
    if record.get("rope_dim") is not None:
        label += f"+{record['rope_dim']}"
    if record.get("query_rank") is not None:
        label += f" q{record['query_rank']}"
    return f"{label} rope" if _rotary(record) else label


def is_race(records: Sequence[dict]) -> bool:
    return bool({r["attention"] for r in records} - {"concat", "collab"})


def verdicts_table(records: Sequence[dict]) -> str:
    """Per budget (a race: cache bytes per token; a grid: rank), the best variant by the mean best validation loss,
    the paired rule (``collab_attn.stats``) against the runner-up and against the original (the concatenated runs at
    the folder's largest rank, rotary ones where the folder has rotary runs, on the seeds both have), and the
    variants it cannot tell from the best."""
    budget = "cache_bytes_per_token_bf16" if is_race(records) else "rank"
    rotary = any(_rotary(r) for r in records)  # a rotary race: its original is the rotary one
    concat = [r for r in records if r["attention"] == "concat" and _rotary(r) == rotary]
    full = max((r["rank"] for r in concat), default=None)
    original = {r["seed"]: r["best_val_loss"] for r in concat if r["rank"] == full}
    lines = [f"| {'cache B/token' if budget != 'rank' else 'key size'} | best (mean) | runner-up (mean) "
             "| best - runner-up [95% interval], verdict | tied with the best | best - original, verdict "
             "| best - the best one size down, verdict |",
             "|---:|---|---|---|---|---|---|"]
    sizes = sorted({r[budget] for r in records}, reverse=True)
    bests = {}
    for value in sizes:
        values: dict[str, dict[int, float]] = {}
        for runs in _groups([r for r in records if r[budget] == value]).values():
            values[_short_label(runs[0])] = {r["seed"]: r["best_val_loss"] for r in runs}
        ranking = rank(values, resolution=LOSS_RESOLUTION)
        bests[value] = (ranking, values)
    for value, smaller in zip(sizes, [*sizes[1:], None]):
        ranking, values = bests[value]
        best = ranking.order[0]
        second = "-" if ranking.runner_up is None else f"{ranking.order[1]} ({ranking.means[ranking.order[1]]:.4f})"
        versus = "-" if ranking.runner_up is None else ranking.runner_up.describe()
        tied = "-" if ranking.runner_up is None else ", ".join(ranking.tied) or "none (ahead of all)"
        against = "-"
        if original and values[best] != original:
            against = compare_on_shared_seeds(values[best], original, resolution=LOSS_RESOLUTION).describe()
        down = "-"
        if smaller is not None:  # what the larger cache buys: its best against the best of the next size down
            lower, lower_values = bests[smaller]
            down = (f"vs {lower.order[0]}: " + compare_on_shared_seeds(
                values[best], lower_values[lower.order[0]], resolution=LOSS_RESOLUTION).describe())
        lines.append(f"| {value:,} | {best} ({ranking.means[best]:.4f}) | {second} | {versus} | {tied} | {against} "
                     f"| {down} |")
    return "\n".join(lines)


def conversion_table(records: Sequence[dict], scratch: Sequence[dict] = ()) -> str:
    """One row per (method, rank): validation loss converted and re-trained, next to the original's; the tokens of
    the re-training from the batches of the original's run among ``scratch`` (the folder's runs from scratch)."""
    if not records:
        return ""
    first = records[0]
    p = first["original_parameters"]
    original = next((r for r in scratch if r.get("name") == Path(first["model_dir"]).name), None)
    lines = [
        f"Original model (`{Path(first['model_dir']).name}`): val loss {first['original_val_loss']:.4f}, q/k params "
        f"{p['query_key_params']:,}, KV cache {first['original_cache_bytes_per_token_bf16']:,} bytes/token. "
        f"Re-training: {first['retrain_steps']} iterations. Converted: no weight trained (each method is fitted to "
        "the trained weights; `cp-aware` and `prune` also read training blocks for statistics). Re-trained: every "
        "weight, on the tokens of the last column.",
        "",
        "| method | key size | q/k params | KV cache bytes/token | rel. error | val loss converted "
        "| val loss re-trained (final / best) | re-trained: all weights, tokens (steps x batch x block) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    order = sorted(records, key=lambda r: (METHOD_ORDER.index(r["method"]), -r["rank"]))
    for r in order:
        retrained = (f"{r['retrained_val_loss']:.4f} / {r['retrained_best_val_loss']:.4f}"
                     if "retrained_val_loss" in r else "-")
        method = f"{NO_CONVERSION} (re-training only)" if r["method"] == NO_CONVERSION else r["method"]
        tokens = trained_tokens(original, r["retrain_steps"]) if "retrained_val_loss" in r else "-"
        lines.append(
            f"| {method} | {r['rank']} | {r['parameters']['query_key_params']:,} "
            f"| {r['cache_bytes_per_token_bf16']:,} | {r['relative_error']:.3f} | {r['converted_val_loss']:.4f} "
            f"| {retrained} | {tokens} |"
        )
    return "\n".join(lines)


def _sample_block(title: str, text: str) -> list[str]:
    return [f"**{title}**", "", "```text", text.strip("\n"), "```", ""]


def samples_markdown(scratch: Sequence[dict], converted: Sequence[dict]) -> str:
    lines = []
    for (kind, key), runs in _groups(scratch).items():
        run = min(runs, key=lambda r: r["seed"])
        lines += _sample_block(f"{kind}, key size {key}, seed {run['seed']} (from scratch)", run["sample"])
    for r in sorted(converted, key=lambda r: (METHOD_ORDER.index(r["method"]), -r["rank"])):
        lines += _sample_block(f"{r['method']} at {r['rank']}, converted", r["converted_sample"])
        if "retrained_sample" in r:
            lines += _sample_block(f"{r['method']} at {r['rank']}, re-trained", r["retrained_sample"])
    return "\n".join(lines)


# Line style per variant: solid concatenated, dashed collaborative (dotted: ones mixing), dash-dot the race variants.
STYLES = {"concat": "-", "collab": "--", "collab (ones)": ":"}


def line_style(variant_name: str) -> str:
    if variant_name in STYLES:
        return STYLES[variant_name]
    return "--" if variant_name.startswith("collab") else "-."


def plot_curves(records: Sequence[dict], recipe: str, path: Path) -> Path:
    """Left: validation loss against iteration, mean over seeds; colour = rank, solid = concatenated,
    dashed = collaborative (dotted: ones mixing). Right: best validation loss against rank, mean ± std."""
    from matplotlib.figure import Figure

    groups = _groups(records)
    keys = sorted({k for _, k in groups}, reverse=True)
    colours = {k: f"C{i}" for i, k in enumerate(keys)}
    fig = Figure(figsize=(12, 4.5))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1.6, 1]})
    for (kind, key), runs in groups.items():
        steps, mean, _ = mean_curve(runs, "val_loss", skip_steps=frozenset({0}))
        left.plot(steps, mean, line_style(kind), color=colours[key], label=f"{kind} {key}")
    reference = NANOGPT.get(recipe)
    order = list(STYLES)  # the grid's variants first, in their order, then the others by name
    for kind in sorted({kind for kind, _ in groups}, key=lambda kind: (order.index(kind) if kind in STYLES else
                                                                        len(order), kind)):
        rows = [(key, mean_std([r["best_val_loss"] for r in runs])) for (k, key), runs in groups.items()
                if k == kind]
        if rows:
            right.errorbar([k for k, _ in rows], [m for _, (m, _) in rows], yerr=[s for _, (_, s) in rows],
                           fmt="o" + line_style(kind), capsize=3, label=kind)
    for ax in (left, right):
        if reference:
            ax.axhline(reference, color="grey", lw=0.8, ls=":", label=f"nanoGPT {reference}")
        ax.grid(alpha=0.3)
    left.set_xlabel("iteration")
    left.set_ylabel("validation loss")
    left.set_title(f"{recipe} recipe: validation loss, mean over seeds")
    left.legend(fontsize=7, ncol=2)
    right.set_xscale("log", base=2)
    right.set_xticks(keys, [str(k) for k in keys])
    right.set_xlabel("query/key size")
    right.set_ylabel("best validation loss")
    right.set_title("best validation loss, mean ± std")
    right.legend(fontsize=8)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    return path


def plot_cache_race(records: Sequence[dict], path: Path, reference: Sequence[dict] = ()) -> Path:
    """Best validation loss (mean ± std over seeds) against key/value-cache bytes per token, one line per attention
    variant; ``reference``: runs of another folder drawn beside them (the concatenated and collaborative grid), but
    the variants and sizes the race ran itself."""
    from matplotlib.figure import Figure

    lines: dict[str, list[tuple[int, float, float]]] = {}
    own = _groups(records)
    reference = [r for r in reference if (variant(r), r["rank"]) not in own]  # the race's own runs come first
    for runs in _groups([*records, *reference]).values():
        best, spread = mean_std([r["best_val_loss"] for r in runs])
        lines.setdefault(family(runs[0]), []).append((runs[0]["cache_bytes_per_token_bf16"], best, spread))
    fig = Figure(figsize=(7, 4.5))
    axes = fig.subplots()
    for name, points in sorted(lines.items()):
        points.sort()
        axes.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points],
                      fmt="o" + line_style(name), capsize=3, label=name)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("key/value cache, bytes per token (bf16, all layers)")
    axes.set_ylabel("best validation loss")
    axes.set_title("validation loss against cache, mean ± std over seeds")
    axes.grid(alpha=0.3)
    axes.legend(fontsize=8)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    return path


def results_markdown(root: Path) -> str:
    """The generated part of ``results.md``: per recipe folder, the from-scratch table, the conversion table and the
    samples."""
    parts = [RESULTS_BEGIN, ""]
    for folder in sorted(p for p in root.iterdir() if (p / "runs").is_dir()):
        scratch, converted = read_runs(folder, "runs"), read_runs(folder, "convert/runs")
        recipe = scratch[0].get("recipe") if scratch else folder.name
        parts += [f"### `{folder.name}`: {recipe} recipe", ""]
        if scratch:
            reference = NANOGPT.get(recipe)
            parts += [f"From scratch ({len(scratch)} runs; nanoGPT's reference for this recipe: {reference}; "
                      f"device {scratch[0].get('device')}).", "", scratch_table(scratch), ""]
            if len(_groups(scratch)) > 1:
                parts += [f"Per {'cache budget' if is_race(scratch) else 'key size'}, the best by the mean and the "
                          "paired rule (`collab_attn.stats.paired_comparison`: 95% t-interval over the per-seed "
                          "differences of the best validation loss; `tie` when it holds zero or with one seed):", "",
                          verdicts_table(scratch), ""]
            if (root / f"curves_{folder.name}.png").exists():
                parts += [f"![learning curves](curves_{folder.name}.png)", ""]
            if (root / f"cache_{folder.name}.png").exists():
                parts += [f"![loss against cache](cache_{folder.name}.png)", ""]
        if converted:
            parts += ["Conversion of the concatenated seed-0 model:", "", conversion_table(converted, scratch), ""]
        parts += ["<details><summary>samples</summary>", "", samples_markdown(scratch, converted), "</details>", ""]
    return "\n".join(parts + [RESULTS_END]) + "\n"


def check_results(root: str | Path) -> list[Path]:
    """The recipe folders under ``root``, every result JSON in them (readable, written by the script that owns the
    folder) and ``results.md`` to update, before anything is written; returns the folders."""
    root = cli.input_dir("root", root)
    folders = [p for p in sorted(root.iterdir()) if (p / "runs").is_dir()]
    if not folders:
        raise cli.Missing(f"root={root} holds no <recipe>/runs/*.json: not a results folder of scripts/train_lm.py; "
                          "pass the folder above its output_dir (e.g. experiments/shakespeare_char)")
    for folder in folders:
        for runs in RESULTS:
            read_runs(folder, runs)
    if (root / RESULTS_FILE).exists():
        cli.text_file("root", root / RESULTS_FILE)
    cli.summary_outputs("root", root, [RESULTS_FILE, *(f"curves_{folder.name}.png" for folder in folders)])
    return folders


def write_summary(root: str | Path) -> Path:
    """Plots per recipe folder and the results part of ``results.md``; returns that file's path."""
    folders = check_results(root)
    root = Path(root)
    for folder in folders:
        scratch = read_runs(folder, "runs")
        if scratch:
            plot_curves(scratch, scratch[0].get("recipe") or folder.name, root / f"curves_{folder.name}.png")
        if {r["attention"] for r in scratch} - {"concat", "collab"}:  # a cache race: beside the grid of its recipe
            grid = root / str(scratch[0].get("recipe"))
            # only runs trained with the same settings (not, e.g., for another number of steps)
            reference = [r for r in read_runs(grid, "runs") if r.get("signature") == scratch[0].get("signature")
                         and grid != folder]
            plot_cache_race(scratch, root / f"cache_{folder.name}.png", reference)
    return write_section(root / RESULTS_FILE, results_markdown(root), RESULTS_BEGIN, RESULTS_END, RESULTS_HEADER,
                         EARLIER_BEGINS)
