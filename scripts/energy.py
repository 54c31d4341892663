"""Energy spectra of a checkpoint's key/query projections and head products (the paper's Figure 1).

Writes energy.png (cumulative energy against the number of principal components, one panel per layer) and
energy.md / energy.csv (components needed for each energy threshold) into ``output_dir``. Bad input exits with status
2 and one ``error: ...`` line on stderr, writing nothing (collab_attn/cli.py).
"""

from __future__ import annotations

import csv

import matplotlib
from omegaconf import DictConfig

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from collab_attn import cli  # noqa: E402
from collab_attn.analysis.energy import KINDS, model_spectra, rank_for_energy  # noqa: E402
from collab_attn.cli import hydra_main, settings_of  # noqa: E402
from collab_attn.files import atomic_directory  # noqa: E402
from collab_attn.models.checkpoints import (
    checked_model,  # noqa: E402
    load_model_and_tokenizer,  # noqa: E402
)

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


def check(settings: dict) -> None:
    """The model (its config: a supported family), the thresholds and the output folder, before any work."""
    checked_model(settings["model"])
    for threshold in cli.nonempty_list("thresholds", settings["thresholds"]):
        cli.number("thresholds", threshold, 0, 1, above=True)
    cli.output_dir("output_dir", settings["output_dir"], overwrite=cli.boolean("overwrite", settings["overwrite"]))


def run(cfg: DictConfig) -> list[dict]:
    settings = settings_of(cfg)
    check(settings)
    model, _ = load_model_and_tokenizer(settings["model"])
    spectra = model_spectra(model)
    rows = [
        {"layer": name, "kind": kind, "dimension": len(curves[kind]),
         **{f"k@{t:g}": rank_for_energy(curves[kind], t) for t in settings["thresholds"]}}
        for name, curves in spectra for kind in KINDS
    ]
    header = list(rows[0])
    lines = ["| " + " | ".join(header) + " |", "|---|---|" + "---:|" * (len(header) - 2)]
    lines += ["| " + " | ".join(str(row[h]) for h in header) + " |" for row in rows]
    with atomic_directory(settings["output_dir"], settings["overwrite"]) as folder:
        plot(spectra, folder / "energy.png", f"{settings['model']}: energy captured by the top-k components")
        with open(folder / "energy.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=header)
            writer.writeheader()
            writer.writerows(rows)
        (folder / "energy.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows


@hydra_main("energy", check)
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
