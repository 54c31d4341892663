"""Energy spectra of a checkpoint's key/query projections and head products (the paper's Figure 1).

Writes energy.png (cumulative energy against the number of principal components, one panel per layer) and
energy.md / energy.csv (components needed for each energy threshold) into ``output_dir``.
"""

from __future__ import annotations

import csv
import shutil

import hydra
import matplotlib
from omegaconf import DictConfig, OmegaConf

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from collab_attn.analysis.energy import KINDS, model_spectra, rank_for_energy  # noqa: E402
from collab_attn.cli import run_or_exit  # noqa: E402
from collab_attn.models.checkpoints import finalize_output_dir, load_model_and_tokenizer, prepare_output_dir  # noqa: E402

LABELS = {"query": "stacked queries Wq", "key": "stacked keys Wk", "products": "head products Wq_h^T Wk_h"}


def plot(spectra, path, title):
    fig, axes = plt.subplots(1, len(spectra), figsize=(3.2 * len(spectra), 3.2), sharey=True, squeeze=False)
    for ax, (name, curves) in zip(axes[0], spectra):
        for kind in KINDS:
            ax.plot(range(1, len(curves[kind]) + 1), curves[kind].numpy(), label=LABELS[kind])
        ax.set_title(name.replace(".attention.self", "").replace("encoder.", ""), fontsize=9)
        ax.set_xlabel("principal components")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of energy")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(cfg: DictConfig) -> list[dict]:
    settings = OmegaConf.to_container(cfg, resolve=True)
    tmp = prepare_output_dir(settings["output_dir"], settings["overwrite"])
    model, _ = load_model_and_tokenizer(settings["model"])
    spectra = model_spectra(model)
    rows = [
        {"layer": name, "kind": kind, "dimension": len(curves[kind]),
         **{f"k@{t:g}": rank_for_energy(curves[kind], t) for t in settings["thresholds"]}}
        for name, curves in spectra for kind in KINDS
    ]
    try:
        tmp.mkdir(parents=True)
        plot(spectra, tmp / "energy.png", f"{settings['model']}: energy captured by the top-k components")
        with open(tmp / "energy.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
        header = list(rows[0])
        lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
        lines += ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows]
        (tmp / "energy.md").write_text("\n".join(lines) + "\n")
        finalize_output_dir(tmp, settings["output_dir"])
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    print("\n".join(lines))
    return rows


@hydra.main(version_base="1.3", config_path="../configs", config_name="energy")
def main(cfg: DictConfig) -> None:
    run_or_exit(run, cfg)


if __name__ == "__main__":
    main()
