"""The claims of docs/converting.md (converting a pretrained model), section by section: the numbers it quotes from
experiments/benchmarks/, experiments/minilm_glue/ and experiments/smollm2/, recomputed from their result files.
(Its sentence on the distillations at a quarter of SmolLM2's cache is claimed with the SmolLM2 page, in
smollm2.py.)"""

from __future__ import annotations

from result_pages.engine import claim, formula, stage, strict, struck

P = "docs/converting.md"
B = "experiments/benchmarks/"
GLUE = "experiments/minilm_glue/runs/"

# sections with no measured number: strict, so that none is added without its run files
PLAIN = ("Sharing the values too", "Ways to shrink the cache", "Matched-budget baselines",
         "Adding a conversion method or a layer kind", "What the conversion does",
         "The converted layer is the evidence", "Loading, `Trainer`, `pipeline` and attention maps",
         "Supported classes", "The script", "Bad input, in every script")


def options() -> None:
    """## Options: the implicit solver's speed-up (benchmarks, section 1) and calibration on MRPC (section 2)."""
    strict(P, section="Options")

    def speed_up(r):  # MiniLM at rank 128: the paper's settings' time over the implicit solver's, at a lower error
        m = next(x for x in r["minilm"] if x["rank"] == 128)["variants"]
        if not m["implicit"]["mean_error"] < m["paper"]["mean_error"]:
            raise ValueError("the implicit solver's error is not lower than the paper's settings'")
        return [m["paper"]["total_seconds"] / m["implicit"]["total_seconds"]]
    claim(P, "tensor ({:.0f}x faster than tensorly's dense `parafac` with the paper's settings, at a lower error:",
          formula(speed_up, B + "decomposition.json"))

    aware, plain = GLUE + "mrpc/minilm/cp-aware-r128/seed0-46922a08/", GLUE + "mrpc/minilm/cp-r128/seed0-6c28b6c2/"
    struck(P, "F1 0.819 at rank 128 where plain CP falls to 0.435 (the checkpoint fine-tuned at lr 2e-5 in "
              "`experiments/benchmarks/LOG.md`, section 2, with its commands)",
           "the lr 2e-5 checkpoint's results were never kept (the LOG says so); the sweep's jobs beside it")
    claim(P, "F1 {:.3f} at rank 128 where plain CP falls to {:.3f} (the MiniLM sweep's checkpoint, lr 1e-4:",
          stage(aware + "results.jsonl", "reparam", "f1"), stage(plain + "results.jsonl", "reparam", "f1"))


def claims_docs_converting() -> None:
    """docs/converting.md: the sections strict so far, and their claims."""
    options()
    for section in PLAIN:
        strict(P, section=section)
