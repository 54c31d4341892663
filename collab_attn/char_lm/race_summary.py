"""The conversion race at matched key/value-cache bytes: tables and a plot from ``scripts/convert_lm.py`` runs with
``cache_fractions`` (``collab_attn.char_lm.convert``), one folder per seed.

Layout read: ``<model folder>/<variant>/seed<N>/runs/*.json``, e.g. ``experiments/kv_cache/shakespeare_cpu/convert/
seed0/runs/cp-k30-v30.json``; a variant is one way of re-training (``convert``: the plain loss, ``convert_distill``:
distilled from the original). Per (method, cache budget) the validation loss converted and re-trained, mean ± std
over seeds, beside the original models' and the re-training-only control (``none``); per budget and seed the method
that wins; per budget and stage the best method by the mean and whether the paired rule
(``collab_attn.stats.paired_comparison``) puts it ahead of each other method or calls them tied; one plot per variant
(loss against cache bytes, one line per method). ``write_summary`` puts them in ``results.md`` (between its markers);
the folder's ``README.md`` is written by hand and links it.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from collab_attn import cli
from collab_attn.files import replacing, write_section
from collab_attn.models.settings import NO_CONVERSION, labels
from collab_attn.run_store import mean_std, read_results
from collab_attn.stats import compare_on_shared_seeds, rank

LOSS_RESOLUTION = 1e-5  # float32 losses: differences below this are evaluation noise (an exact conversion's 1e-7)

KEYS = ("method", "rank", "value_rank", "cache_fraction", "seed", "original_val_loss", "converted_val_loss",
        "cache_bytes_per_token_bf16", "original_cache_bytes_per_token_bf16")
STAGES = {"converted_val_loss": "converted", "retrained_val_loss": "re-trained"}


def read_variant(folder: Path) -> list[dict]:
    """Every run of every seed folder under ``folder`` (``seed*/runs/*.json``), checked to be a conversion result."""
    found = read_results("root", folder, "seed*/runs/*.json", KEYS, "convert_lm", lambda r: r["method"] in labels())
    return [record for _, record in found]


def variants(root: Path) -> dict[str, list[dict]]:
    """``<model>/<variant>`` -> its runs, for every folder under ``root`` that holds seed folders of runs."""
    found = {}
    for folder in sorted(p for p in root.glob("*/*") if p.is_dir() and any(p.glob("seed*/runs/*.json"))):
        found[f"{folder.parent.name}/{folder.name}"] = read_variant(folder)
    return found


def _size(record: dict) -> str:
    return f"{record['rank']}" + ("" if record.get("value_rank") is None else f"/{record['value_rank']}")


def _groups(records: Sequence[dict]) -> dict[tuple[str, float | None], list[dict]]:
    """Runs by (method, budget); the budget of runs sized by hand (``ranks``) is None."""
    order = {label: i for i, label in enumerate(labels())}
    groups: dict[tuple[str, float | None], list[dict]] = {}
    for record in records:
        groups.setdefault((record["method"], record.get("cache_fraction")), []).append(record)
    return dict(sorted(groups.items(), key=lambda item: (-(item[0][1] or 2), order[item[0][0]],
                                                         -item[1][0]["cache_bytes_per_token_bf16"])))


def _cell(runs: Sequence[dict], key: str) -> str:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return "-"
    mean, std = mean_std(values)
    return f"{mean:.4f} ± {std:.4f}"


def batches(model_folder: Path) -> tuple[int, int] | None:
    """(batch, block) of the original models' training runs (``<model folder>/runs/*.json``, ``scripts/train_lm.py``),
    which the re-training of their conversions keeps; None where no run says."""
    for path in sorted(model_folder.glob("runs/*.json")):
        signature = json.loads(path.read_text()).get("signature") or {}
        batch = (signature.get("trainer") or {}).get("per_device_train_batch_size")
        if batch is not None and signature.get("block_size") is not None:
            return batch, signature["block_size"]
    return None


def _retrained_tokens(runs: Sequence[dict], shape: tuple[int, int] | None) -> str:
    steps = runs[0].get("retrain_steps")
    if not steps or all(r.get("retrained_val_loss") is None for r in runs):
        return "-"
    if shape is None:
        return f"{steps:,} steps"
    return f"{steps:,} x {shape[0]} x {shape[1]} = {steps * shape[0] * shape[1]:,}"


def table(records: Sequence[dict], shape: tuple[int, int] | None = None) -> str:
    """One row per (method, budget): sizes, cache bytes measured from the converted model, validation loss converted
    and re-trained (mean ± std over seeds), and the tokens of the re-training (``shape``: its batch and block)."""
    originals = {r["seed"]: r["original_val_loss"] for r in records}
    mean, std = mean_std(list(originals.values()))
    original_bytes = records[0]["original_cache_bytes_per_token_bf16"]
    lines = [f"Original models (seeds {', '.join(map(str, sorted(originals)))}): val loss {mean:.4f} ± {std:.4f}, "
             f"{original_bytes:,} cache bytes per token (bf16). Converted: no weight trained (each method is fitted "
             "to the trained weights; `-aware` methods and `prune` also read training blocks for statistics). "
             "Re-trained: every weight, on the tokens of the last column per seed.", "",
             "| budget | method | rank / value rank | cache B/token | vs original | val loss converted "
             "| val loss re-trained | seeds | re-trained: all weights, tokens per seed (steps x batch x block) |",
             "|---:|---|---|---:|---:|---:|---:|---|---|"]
    for (method, fraction), runs in _groups(records).items():
        cache = runs[0]["cache_bytes_per_token_bf16"]
        budget = "-" if fraction is None else f"{fraction:g}"
        lines.append(f"| {budget} | {method} | {_size(runs[0])} | {cache:,} | {cache / original_bytes:.3f}x "
                     f"| {_cell(runs, 'converted_val_loss')} | {_cell(runs, 'retrained_val_loss')} "
                     f"| {','.join(str(r['seed']) for r in sorted(runs, key=lambda r: r['seed']))} "
                     f"| {_retrained_tokens(runs, shape)} |")
    return "\n".join(lines)


def winners(records: Sequence[dict]) -> str:
    """Per budget, stage and seed, the method with the lowest validation loss (and the runner-up's margin)."""
    lines = ["| budget | stage | seed | best | runner-up (+ loss) |", "|---:|---|---:|---|---|"]
    fractions = sorted({r["cache_fraction"] for r in records if r.get("cache_fraction")}, reverse=True)
    for fraction in fractions:
        for key, stage in STAGES.items():
            for seed in sorted({r["seed"] for r in records}):
                runs = sorted((r for r in records if r.get("cache_fraction") == fraction and r["seed"] == seed
                               and r.get(key) is not None), key=lambda r: r[key])
                if len(runs) < 2:
                    continue
                best, second = runs[0], runs[1]
                lines.append(f"| {fraction:g} | {stage} | {seed} | {best['method']} ({best[key]:.4f}) "
                             f"| {second['method']} (+{second[key] - best[key]:.4f}) |")
    return "\n".join(lines)


def _by_method(records: Sequence[dict], fraction: float, key: str) -> dict[str, dict[int, float]]:
    """Method -> (seed -> ``key``) for the runs at one budget."""
    values: dict[str, dict[int, float]] = {}
    for r in records:
        if r.get("cache_fraction") == fraction and r.get(key) is not None:
            values.setdefault(r["method"], {})[r["seed"]] = r[key]
    return values


def verdicts(records: Sequence[dict]) -> str:
    """Per budget and stage, the method with the lowest mean loss, the paired comparison (by seed) with the runner-up,
    and every method the rule cannot tell from the best (``tie``): "ahead" only where the interval excludes zero."""
    lines = ["| budget | stage | best (mean) | runner-up (mean) | best - runner-up [95% interval], verdict "
             "| tied with the best |", "|---:|---|---|---|---|---|"]
    fractions = sorted({r["cache_fraction"] for r in records if r.get("cache_fraction")}, reverse=True)
    for fraction in fractions:
        for key, stage in STAGES.items():
            by_method = _by_method(records, fraction, key)
            if len(by_method) < 2:
                continue
            ranking = rank(by_method, resolution=LOSS_RESOLUTION)
            best, second = ranking.order[:2]
            lines.append(f"| {fraction:g} | {stage} | {best} ({ranking.means[best]:.4f}) "
                         f"| {second} ({ranking.means[second]:.4f}) | {ranking.runner_up.describe()} "
                         f"| {', '.join(ranking.tied) or 'none (ahead of all)'} |")
    return "\n".join(lines)


# The race's question, collaborative keys and values against MLA, each fitted the same way (plain or activation-aware).
HEAD_TO_HEAD = (("cp", "kv-svd"), ("cp-aware", "kv-svd-aware"), ("tucker", "kv-svd"), ("tucker-aware", "kv-svd-aware"))


def head_to_head(records: Sequence[dict], pairs: Sequence[tuple[str, str]] = HEAD_TO_HEAD) -> str:
    """Per budget and stage, the paired rule for each pair of methods (``a - b``: negative is a lower loss for a)."""
    lines = ["| budget | stage | " + " | ".join(f"{a} - {b}" for a, b in pairs) + " |",
             "|---:|---|" + "---|" * len(pairs)]
    for fraction in sorted({r["cache_fraction"] for r in records if r.get("cache_fraction")}, reverse=True):
        for key, stage in STAGES.items():
            values = _by_method(records, fraction, key)
            cells = [compare_on_shared_seeds(values[a], values[b], resolution=LOSS_RESOLUTION).describe()
                     if a in values and b in values else "-" for a, b in pairs]
            lines.append(f"| {fraction:g} | {stage} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def against_references(records: Sequence[dict]) -> str:
    """Per (method, budget), the paired rule against the two references of the race: converted against the original
    models, re-trained against the re-training-only control (``none`` re-trained the same way)."""
    original = {r["seed"]: r["original_val_loss"] for r in records}
    control = {r["seed"]: r["retrained_val_loss"] for r in records
               if r["method"] == NO_CONVERSION and r.get("retrained_val_loss") is not None}
    lines = ["| budget | method | converted - original [95% interval], verdict "
             "| re-trained - control (none, re-trained) [95% interval], verdict |", "|---:|---|---|---|"]
    for (method, fraction), runs in _groups(records).items():
        if method == NO_CONVERSION:
            continue
        converted = {r["seed"]: r["converted_val_loss"] for r in runs}
        retrained = {r["seed"]: r["retrained_val_loss"] for r in runs if r.get("retrained_val_loss") is not None}
        versus_control = "-"
        if retrained and control:
            versus_control = compare_on_shared_seeds(retrained, control, resolution=LOSS_RESOLUTION).describe()
        lines.append(f"| {'-' if fraction is None else f'{fraction:g}'} | {method} "
                     f"| {compare_on_shared_seeds(converted, original, resolution=LOSS_RESOLUTION).describe()} "
                     f"| {versus_control} |")
    return "\n".join(lines)


def plot(records: Sequence[dict], path: Path, title: str) -> Path:
    """Validation loss against cache bytes per token, one line per method (mean ± std over seeds), converted on the
    left and re-trained on the right; the original models and the re-training-only control as horizontal lines."""
    fig = Figure(figsize=(11, 4.2))
    panels = fig.subplots(1, 2)
    original = statistics.fmean(r["original_val_loss"] for r in records)
    for axes, (key, stage) in zip(panels, STAGES.items()):
        lines: dict[str, list[tuple[int, float, float]]] = {}
        for (method, _), runs in _groups(records).items():
            values = [r[key] for r in runs if r.get(key) is not None]
            if values and method != NO_CONVERSION:
                mean, std = mean_std(values)
                lines.setdefault(method, []).append((runs[0]["cache_bytes_per_token_bf16"], mean, std))
        for method, points in lines.items():
            points.sort()
            axes.errorbar([p[0] for p in points], [p[1] for p in points], yerr=[p[2] for p in points], fmt="o-",
                          capsize=3, label=method)
        axes.axhline(original, color="black", linestyle=":", label=f"original {original:.4f}")
        control = [r[key] for r in records if r["method"] == NO_CONVERSION and r.get(key) is not None]
        if key == "retrained_val_loss" and control:
            axes.axhline(statistics.fmean(control), color="grey", linestyle="--",
                         label=f"none, re-trained {statistics.fmean(control):.4f}")
        axes.set_xscale("log", base=2)
        axes.set_xlabel("key/value cache, bytes per token (bf16, all layers)")
        axes.set_title(f"{stage}")
        axes.grid(alpha=0.3)
    panels[0].set_ylabel("validation loss")
    panels[1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    with replacing(path) as tmp:
        fig.savefig(tmp, dpi=110)
    return path


RESULTS_BEGIN = "<!-- race results: written by scripts/summarize.py race -->"
EARLIER_BEGINS = ("<!-- race results: written by scripts/summarize_race.py -->",
                  "<!-- race results: written by scripts/summarize_runs.py race -->")  # before issue 90's one script
RESULTS_END = "<!-- end of race results -->"
RESULTS_FILE = "results.md"  # the generated page; README.md links it
RESULTS_HEADER = ("# The cache race: every table\n\n"
                  "Written by `python scripts/summarize.py race experiments/kv_cache` from the runs' JSON files "
                  "(do not edit between the markers). The current answer is in [`README.md`](README.md).\n\n")


def check_root(root: str | Path) -> dict[str, list[dict]]:
    """Every run under ``root`` read and checked, and ``results.md`` writable, before anything is written."""
    root = cli.input_dir("root", root)
    found = variants(root)
    if not found:
        raise cli.Missing(f"root={root} holds no <model>/<variant>/seed*/runs/*.json: run scripts/convert_lm.py with "
                          "cache_fractions and output_dir=<root>/<model>/<variant>/seed<N> first")
    if (root / RESULTS_FILE).exists():
        cli.text_file("root", root / RESULTS_FILE)
    cli.summary_outputs("root", root, [RESULTS_FILE, *(f"{name.replace('/', '_')}.png" for name in found)])
    return found


def write_summary(root: str | Path) -> Path:
    """A plot per variant and the results part of ``results.md`` (between the markers; the rest is kept); returns
    that file's path."""
    found = check_root(root)
    root = Path(root)
    parts = [RESULTS_BEGIN, ""]
    for name, records in found.items():
        image = f"{name.replace('/', '_')}.png"
        plot(records, root / image, name)
        shape = batches(root / name.split("/")[0])
        parts += [f"### `{name}`", "", table(records, shape), "", f"![loss against cache]({image})", "",
                  "Per budget and stage, the best method by the mean over seeds and the paired rule "
                  "(`collab_attn.stats.paired_comparison`: 95% t-interval over the per-seed differences; `tie` when "
                  "it holds zero):", "", verdicts(records), "",
                  "Per method and budget, the paired rule against the original models and against the "
                  "re-training-only control (a negative difference: lower loss):", "", against_references(records), "",
                  "Collaborative keys and values against MLA, fitted the same way, paired by seed:", "",
                  head_to_head(records), "",
                  "Per budget and seed, the best method:", "", winners(records), ""]
    generated = "\n".join(parts + [RESULTS_END]) + "\n"
    return write_section(root / RESULTS_FILE, generated, RESULTS_BEGIN, RESULTS_END, RESULTS_HEADER, EARLIER_BEGINS)
