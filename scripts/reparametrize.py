"""Convert a pretrained BERT-family checkpoint to collaborative attention (or SVD-truncated heads), check it, save it.

    python scripts/reparametrize.py                                   # MiniLM, CP, rank 192
    python scripts/reparametrize.py collab=tucker collab.rank=128 output_dir=outputs/tucker128 overwrite=true
    python scripts/reparametrize.py collab=svd collab.rank=96                # the SVD-truncated heads baseline
    python scripts/reparametrize.py model=path/to/checkpoint 'collab.rank=[384,256,256,192,192,128]'
    python scripts/reparametrize.py collab.budget=mean:128                   # per-layer ranks, same size as 128
    python scripts/reparametrize.py collab.calibration=../shared/data/glue/SST-2/train.tsv   # activation-aware

The ``collab`` group becomes ``MethodSettings`` once (``collab_attn.models.settings``). ``collab=prune`` needs
labelled task examples to score the heads on, so it runs through the GLUE pipeline (``scripts/train_glue.py``);
``collab=none`` converts nothing.

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
from collab_attn.glue.pipeline import calibrate
from collab_attn.models.checkpoints import (
    finalize_output_dir,
    load_model_and_tokenizer,
    prepare_output_dir,
    resolve_model,
)
from collab_attn.models.settings import MethodSettings

log = logging.getLogger("reparametrize")


def method_settings(collab: dict) -> MethodSettings:
    """The ``collab`` group as settings this script can run: ``cp``, ``tucker`` or ``svd``."""
    method = MethodSettings.from_config(collab)
    if method.method == "none":
        raise ValueError("collab=none means 'no reparametrization' and is only for the GLUE pipeline; choose "
                         "collab=cp, collab=tucker or collab=svd")
    if method.method == "prune":
        raise ValueError(
            "collab=prune scores the heads on a task's labelled training examples with a model fine-tuned on that "
            "task, so it runs through the GLUE pipeline: python scripts/train_glue.py task=<task> collab=prune "
            "collab.rank=<rank> refit=none data.glue_dir=<glue folder> (refit=none stops after the pruning)"
        )
    method.check_calibration_source(task_allowed=False)
    return method


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
    method = method_settings(settings["collab"])
    path = resolve_model(settings["model"])
    tmp = prepare_output_dir(settings["output_dir"], settings["overwrite"])
    torch.manual_seed(settings["seed"])

    log.info("loading %s (%s)", settings["model"], path)
    model, tokenizer = load_model_and_tokenizer(path, model_class=None)
    method.check_model(model.config)
    original = copy.deepcopy(model)
    calibration = calibrate(model, tokenizer, method, settings["seed"])
    report = reparametrize(
        model, seed=settings["seed"], calibration=calibration, progress=True, **method.reparametrize_kwargs()
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
        "rank": method.rank_request, "seed": settings["seed"], "config": settings,
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
