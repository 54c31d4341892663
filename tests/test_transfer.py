"""The transfer matrix (collab_attn/pretrained/transfer.py, scripts/summarize.py transfer): each fit text's
perplexity over the original's per domain with the window bootstrap, and the in-domain fit against the general
ones."""

from __future__ import annotations

import math

import pytest

from collab_attn.pretrained.transfer import against_original, transfer_markdown


def run(name, fit_text, ratios, budget=0.5, windows=8):
    """A run file whose windows each predict 10 tokens at the original's nll 10 x 2 and this run's ``ratio`` times
    the original's perplexity (a little noise per window so that intervals have width)."""
    domains = {}
    for domain, ratio in ratios.items():
        domains[domain] = {"windows": [
            {"tokens": 10, "original_nll": 20.0, "nll": 20.0 + 10 * math.log(ratio) + 0.01 * (i % 3 - 1),
             "fingerprint": f"{domain}{i}"} for i in range(windows)]}
    return {"name": name + ("" if fit_text == "mixed" else f"-text{fit_text}"), "split": "test", "domains": domains,
            "entry": {"budget": budget, "fit_text": fit_text}}


def test_each_fit_text_is_a_row_with_its_intervals_and_the_in_domain_gain():
    recipe = "key-svd-k96-v96-calibrated16384-fitted150"
    runs = [run(recipe, "own", {"wikipedia": 1.2, "code": 1.3}), run(recipe, "code", {"wikipedia": 1.9, "code": 1.1}),
            run(recipe, "mixed", {"wikipedia": 1.15, "code": 3.0}),
            {"name": "original", "split": "test", "domains": {}, "entry": {}}]
    assert against_original(runs[0], "code").mean_difference == pytest.approx(0.3, abs=1e-3)
    text = transfer_markdown(runs)
    assert "(test split)" in text and f"### budget 0.5: `{recipe}`" in text
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert rows[1].startswith("| own | 1.200x [") and rows[1].endswith("| 1.300x |")  # general fits first
    assert rows[2].startswith("| mixed | 1.150x [") and rows[2].endswith("| 3.000x |")
    assert rows[3].startswith("| code | 1.900x [")
    gain = [line for line in text.splitlines() if line.startswith("| code | own |")]
    assert gain and "0.846x [" in gain[0] and "| ahead | +15.4% |" in gain[0]  # 1.1 / 1.3


def test_a_folder_of_one_split_with_converted_runs_only():
    with pytest.raises(ValueError, match="no converted runs"):
        transfer_markdown([{"name": "original", "split": "test", "domains": {}, "entry": {}}])
    with pytest.raises(ValueError):
        transfer_markdown([run("a", "own", {"code": 1.2}), {**run("b", "code", {"code": 1.1}), "split": "validation"}])
