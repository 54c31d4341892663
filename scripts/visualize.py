"""Look inside: attention of a model (BERT family, GPT-2, OPT) and of its collaborative conversion, side by side.

    python scripts/visualize.py                                   # MiniLM, CP, rank 128, the default sentence
    python scripts/visualize.py collab.rank=384 output_dir=outputs/views-exact
    python scripts/visualize.py collab=tucker collab.rank=64
    python scripts/visualize.py 'sentence="Is the museum open?"' 'sentence_pair="It opens at ten."' causal=true
    python scripts/visualize.py model=path/to/gpt2-checkpoint collab.rank=192        # decoders: causal views

Writes into ``output_dir``: ``head_view.html`` and ``model_view.html`` (BertViz, original and collaborative side
by side over the same tokens), ``mixing.png`` (heads x rank mixing per layer), ``head_statistics.png``
(effective rank, conversion error and energy of each head's ``Wq_h^T Wk_h``), ``attention_difference.png`` and
``attention_worst_head.png`` (|original - collaborative| attention), ``summary.json`` and an ``index.html`` that
links them. The conversion is the ``collab`` group (cp or tucker, one rank), read once into ``MethodSettings``;
``collab.calibration=<text file>`` fits the attention logits on those texts. Bad input exits with status 2 and
one ``error: ...`` line on stderr, writing nothing.
"""

from __future__ import annotations

import html
import json
import logging
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from collab_attn import cli
from collab_attn.analysis import plots
from collab_attn.analysis.views import (
    check_causal,
    collaborative_copy,
    comparison_page,
    is_causal,
    load_for_viewing,
    sentence_attention,
)
from collab_attn.cli import hydra_main
from collab_attn.files import atomic_directory
from collab_attn.glue.calibrate import calibrate, check_calibration
from collab_attn.models.checkpoints import checked_model, resolve_model
from collab_attn.models.methods import METHODS
from collab_attn.models.settings import MethodSettings

log = logging.getLogger("visualize")

FILES = {
    "head_view.html": "BertViz head view: original and collaborative side by side",
    "model_view.html": "BertViz model view: every layer and head, original and collaborative",
    "mixing.png": "mixing matrix of each layer (heads x rank)",
    "head_statistics.png": "per head: effective rank, conversion error, energy share",
    "attention_difference.png": "|original - collaborative| attention, every layer and head",
    "attention_worst_head.png": "the head whose attention changed most, with tokens",
    "summary.json": "settings, tokens, per-layer decomposition report and attention differences",
}


def _check(settings: dict) -> MethodSettings:
    """The settings this script can show, as ``MethodSettings``: collaborative heads (cp, tucker) at one rank; with
    the model's config, the calibration texts and the output folder checked before anything is loaded or written."""
    method = MethodSettings.from_config(settings["collab"])
    method.refuse_fit("scripts/visualize.py")
    if not method.converts or not method.conversion.collaborative:
        shown = [name for name, m in METHODS.items() if m.collaborative]
        raise ValueError(f"collab.method={method.method} has no collaborative heads to show; choose one of "
                         f"collab={', collab='.join(shown)}")
    if method.budget is not None or type(method.rank) is not int:
        raise ValueError(f"collab.rank must be one integer (and collab.budget null), got "
                         f"{method.budget or method.rank!r}")
    check_calibration(method, task_allowed=False)
    config = checked_model(settings["model"])[1]
    method.check_model(config)
    cli.output_dir("output_dir", settings["output_dir"], overwrite=cli.boolean("overwrite", settings["overwrite"]))
    cli.integer("seed", settings["seed"], 0)
    if settings["causal"] is not None:
        cli.boolean("causal", settings["causal"])
    check_causal(config, settings["causal"])
    for key in ("sentence", "sentence_pair"):
        value = settings[key]
        if not (isinstance(value, str) and value.strip()) and not (key == "sentence_pair" and value is None):
            raise ValueError(f"{key} must be a non-empty string (quote it: '{key}=\"...\"'), got {value!r}")
    return method


def _index(settings: dict, method: MethodSettings, summary: dict) -> str:
    rows = [("model", f"{settings['model']} ({summary['model_path']})"), ("method", method.label),
            ("rank", method.rank), ("causal", summary["causal"]), ("tokens", " ".join(summary["tokens"])),
            ("mean relative error of the decomposition", f"{summary['mean_relative_error']:.4f}"),
            ("attention parameters", f"{summary['attention_params_before']:,} -> "
                                     f"{summary['attention_params_after']:,}"),
            ("max |attention difference|", f"{summary['max_attention_difference']:.4f}")]
    table = "\n".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(str(v))}</td></tr>" for k, v in rows)
    links = "\n".join(
        f'<li><a href="{name}">{name}</a>: {html.escape(text)}</li>' for name, text in FILES.items()
    )
    images = "\n".join(f'<h2>{name}</h2><img src="{name}" style="max-width:100%">' for name in FILES
                       if name.endswith(".png"))
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>collab-attn: look inside</title></head>\n'
            f"<body style=\"font-family:sans-serif\">\n<h1>Original vs collaborative attention</h1>\n"
            f"<table>\n{table}\n</table>\n<ul>\n{links}\n</ul>\n{images}\n</body></html>\n")


def run(cfg: DictConfig) -> dict:
    """Convert ``cfg.model`` as ``cfg.collab`` says, render the views and plots into ``cfg.output_dir``; return the
    summary."""
    settings = OmegaConf.to_container(cfg, resolve=True)
    method = _check(settings)
    path = resolve_model(settings["model"])
    torch.manual_seed(settings["seed"])

    log.info("loading %s (%s)", settings["model"], path)
    original, tokenizer = load_for_viewing(path, causal=settings["causal"])
    method.check_model(original.config)
    with cli.as_bad_input():  # what only the loaded weights show (NaN or Inf): one error line, nothing written
        calibration = calibrate(original, tokenizer, method, settings["seed"])
        converted, report = collaborative_copy(original, method, settings["seed"], calibration=calibration)
    print(report.table())
    sentences = settings["sentence"], settings["sentence_pair"]
    maps = {"original": sentence_attention(original, tokenizer, *sentences),
            "collaborative": sentence_attention(converted, tokenizer, *sentences)}
    difference = plots.attention_difference(maps["original"], maps["collaborative"])
    stats = plots.head_statistics(original, converted)
    summary = {
        "model": settings["model"], "model_path": path, "tokens": maps["original"].tokens,
        "sentence_b_start": maps["original"].sentence_b_start, "causal": is_causal(original), **report.to_dict(),
        "max_attention_difference": float(difference.max()),
        "mean_attention_difference_per_layer": difference.mean(axis=(1, 2, 3)).tolist(),
        "head_statistics": {name: values.tolist() for name, values in stats.items()}, "config": settings,
    }

    what = f"{method.label.upper()} rank {method.rank}"
    panels = [("original (concatenated heads)", maps["original"]),
              (f"collaborative ({what})", maps["collaborative"])]
    intro = (f"{settings['model']}: {' '.join(maps['original'].tokens)}"
             f" | mean relative error of the decomposition {report.mean_relative_error:.4f}")
    with atomic_directory(settings["output_dir"], settings["overwrite"]) as tmp:
        for view in ("head", "model"):
            page = comparison_page(panels, view, f"{view} view: original vs collaborative ({what})", intro)
            (tmp / f"{view}_view.html").write_text(page)
        plots.plot_mixing(converted, tmp / "mixing.png")
        plots.plot_head_statistics(stats, tmp / "head_statistics.png", method.rank)
        plots.plot_attention_difference(maps["original"], maps["collaborative"], tmp / "attention_difference.png")
        plots.plot_worst_head(maps["original"], maps["collaborative"], tmp / "attention_worst_head.png")
        (tmp / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        (tmp / "index.html").write_text(_index(settings, method, summary))
    out = Path(settings["output_dir"]).expanduser().absolute()
    print(f"max |attention difference| {summary['max_attention_difference']:.4f}")
    print(f"wrote {', '.join(['index.html', *FILES])} to {out}")
    return summary


@hydra_main("visualize", _check)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
