"""Convert a pretrained BERT-family checkpoint to collaborative attention, check it, and save it.

    python scripts/reparametrize.py                                   # MiniLM, CP, rank 192
    python scripts/reparametrize.py collab=tucker collab.rank=128 output_dir=outputs/tucker128 overwrite=true
    python scripts/reparametrize.py model=path/to/checkpoint 'collab.rank=[384,256,256,192,192,128]'
    python scripts/reparametrize.py collab.budget=mean:128                   # per-layer ranks, same size as 128
    python scripts/reparametrize.py collab.calibration=../shared/data/glue/SST-2/train.tsv   # activation-aware

Everything is validated before anything is written. The converted model (task head kept), its tokenizer and
``reparam_report.json`` (the per-layer report, the comparison with the original model, the settings) are
written to a temporary sibling of ``output_dir`` and renamed into place at the end. Bad input (ValueError,
FileNotFoundError) exits with status 2 and one ``error: ...`` line on stderr.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from collab_attn import reparametrize
from collab_attn.decomposition.decompose import METHODS
from collab_attn.decomposition.rank_selection import RankBudget
from collab_attn.glue.tasks import load_texts
from collab_attn.models.calibration import calibration_from_texts
from collab_attn.models.checkpoints import (
    finalize_output_dir,
    load_model_and_tokenizer,
    prepare_output_dir,
    resolve_model,
)

log = logging.getLogger("reparametrize")


def _rank(value):
    """The configured rank as an int or a list of ints (reparametrize checks the values)."""
    ok = lambda x: isinstance(x, int) and not isinstance(x, bool)  # noqa: E731
    if ok(value) or (isinstance(value, list) and value and all(ok(x) for x in value)):
        return value
    raise ValueError(f"collab.rank must be an integer or a list of integers (one per layer), got {value!r}")


@torch.no_grad()
def compare(original, converted, tokenizer, sentences) -> dict:
    """Max and mean |difference| of the last hidden states over non-padding tokens of one padded batch."""
    encoded = [tokenizer(*([s] if isinstance(s, str) else s)) for s in sentences]
    batch = tokenizer.pad(encoded, padding=True, return_tensors="pt")
    outputs = [m.eval()(**batch, output_hidden_states=True) for m in (original, converted)]
    keep = batch["attention_mask"].bool()
    diff = (outputs[0].hidden_states[-1] - outputs[1].hidden_states[-1]).abs()[keep]
    result = {
        "sentences": len(sentences),
        "tokens": int(keep.sum()),
        "padding_tokens": int((~keep).sum()),
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
    }
    if getattr(outputs[0], "logits", None) is not None:  # a task head: compare its outputs too
        result["logits_max_abs_diff"] = (outputs[0].logits - outputs[1].logits).abs().max().item()
    return result


def run(cfg: DictConfig) -> dict:
    """Convert ``cfg.model``, compare it with the original, save it to ``cfg.output_dir``; return the report."""
    settings = OmegaConf.to_container(cfg, resolve=True)  # resolve once: the default output_dir has a timestamp
    collab = settings["collab"]
    if collab["method"] not in METHODS:
        hint = " (collab=none means 'no reparametrization' and is only for the GLUE pipeline)"
        raise ValueError(
            f"collab.method={collab['method']!r} cannot be reparametrized; choose collab=cp or collab=tucker"
            + (hint if collab["method"] == "none" else "")
        )
    budget = collab.get("budget")
    rank = str(RankBudget.parse(budget)) if budget is not None else _rank(collab["rank"])
    source = collab.get("calibration")
    texts = None
    if source is not None:
        if source == "task":
            raise ValueError("collab.calibration=task means the task's training texts and is only for the GLUE "
                             "pipeline; pass a text file (one text per line) or a GLUE train.tsv/dev.tsv")
        texts = load_texts(source, limit=collab.get("calibration_samples", 512), seed=settings["seed"])
    path = resolve_model(settings["model"])
    tmp = prepare_output_dir(settings["output_dir"], settings["overwrite"])
    torch.manual_seed(settings["seed"])

    log.info("loading %s (%s)", settings["model"], path)
    model, tokenizer = load_model_and_tokenizer(path, model_class=None)
    original = copy.deepcopy(model)
    calibration = None
    if texts is not None:
        log.info("calibrating on %d texts from %s", len(texts), source)
        calibration = calibration_from_texts(
            model, tokenizer, texts, max_length=collab.get("calibration_max_length", 128)
        )
    report = reparametrize(
        model, rank, collab["method"], settings["seed"], solver=collab.get("solver", "implicit"),
        init=collab["init"], n_iter_max=collab["n_iter_max"], tol=collab["tol"],
        tucker_core_size=collab["tucker_core_size"], calibration=calibration, progress=True,
    )
    print(report.table())

    comparison = compare(original, model, tokenizer, settings["compare_sentences"])
    comparison.update(
        model_params_before=report.model_params_before, model_params_after=report.model_params_after,
        attention_params_before=report.attention_params_before,
        attention_params_after=report.attention_params_after,
    )
    logits = comparison.get("logits_max_abs_diff")
    print(
        f"\nconverted vs original on {comparison['sentences']} sentences ({comparison['tokens']} tokens, "
        f"{comparison['padding_tokens']} padding): last hidden state |diff| "
        f"max {comparison['max_abs_diff']:.3e}, mean {comparison['mean_abs_diff']:.3e}"
        + ("" if logits is None else f"; logits |diff| max {logits:.3e}")
    )
    print(
        f"parameters: model {comparison['model_params_before']:,} -> {comparison['model_params_after']:,}, "
        f"attention {comparison['attention_params_before']:,} -> {comparison['attention_params_after']:,}"
    )
    result = {
        **report.to_dict(), "comparison": comparison, "model": settings["model"], "model_path": path,
        "rank": rank, "seed": settings["seed"], "config": settings,
    }

    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "reparam_report.json").write_text(json.dumps(result, indent=2) + "\n")
        out = finalize_output_dir(tmp, settings["output_dir"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("saved the converted model to %s", out)
    print(f"saved to {out}")
    return result


@hydra.main(version_base="1.3", config_path="../configs", config_name="reparametrize")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
