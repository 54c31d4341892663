"""The claims of docs/design.md (issue 88: every number on a covered page sits in a claim or a cited fact)."""

from __future__ import annotations

from result_pages.engine import cited, claim, formula, strict

SMOLLM2 = 134_515_008  # SmolLM2-135M's parameters (as smollm2.py counts them)
TEN_MINUTES = ("experiments/transfer/runs/key-svd-k96-v96-calibrated16384-fitted150-e2e32on32768held4096-"
               "textall.json")


def claims_design() -> None:
    """docs/design.md: its few numbers, from the run files and the code they describe."""
    P = "docs/design.md"
    strict(P)
    claim(P, "(on SmolLM2 at half the cache {:.1f}M parameters, {:.0f}% of the\nmodel)",
          formula(lambda r: [r["end_to_end"]["parameters"] / 1e6, 100 * r["end_to_end"]["parameters"] / SMOLLM2],
                  TEN_MINUTES))
    cited(P, "the first 90% of Tiny\n  Shakespeare", "the fitting split (collab_attn/pretrained/heldout.py)")
    cited(P, "the last 10% of Tiny Shakespeare", "the held-out split (collab_attn/pretrained/heldout.py)")
    cited(P, "at\ntemperature 1", "collab_attn.own_text.OWN_TEXTS['own'] (experiments/transfer/README.md, section 3)")
    cited(P, "six Python files of torch 2.13.0", "the torch version pyproject.toml pins (CODE_FILES in heldout.py)")
