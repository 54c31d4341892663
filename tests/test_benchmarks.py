"""The benchmark scripts still run: a tiny case of each that the README's latency claims rest on."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("padded", [False, True])
def test_end_to_end_times_the_original_and_a_conversion(tmp_path, padded):
    end_to_end = load("end_to_end")
    argv = ["--threads", "1", "--ranks", "64", "--cases", "2x48", "--modes", "infer", "train", "--repeats", "1",
            "--warmup", "0", "--one-piece", "--out", str(tmp_path / "e2e")] + (["--padded"] if padded else [])
    result = end_to_end.main(argv)
    assert result["max_abs_difference_to_explicit_path"] < 1e-4  # the blocked path against all logits at once
    assert [(r["mode"], r["batch"], r["seq"]) for r in result["records"]] == [("infer", 2, 48), ("train", 2, 48)]
    for record in result["records"]:
        assert set(record["median"]) == {"original", "collab-64", "collab-64 (one piece)"}
        assert all(t > 0 for t in record["median"].values())
    assert json.loads((tmp_path / "e2e.json").read_text())["padded"] is padded
    table = (tmp_path / "e2e.md").read_text()
    assert ("padded to three quarters" in table) is padded and "| infer | 2 | 48 |" in table


def test_attention_latency_compares_every_variant(tmp_path):
    """Batch 2, 600 positions: more logits than one CPU block, so ``collab`` times the blocked path beside the
    forced one-piece (``explicit``) and fused ones; the script's own check finds the variants computing alike."""
    attention_latency = load("attention_latency")
    argv = ["--d-model", "48", "--heads", "4", "--ranks", "16", "--batch", "2", "--seq", "600", "--modes", "infer",
            "--forced-paths", "--threads", "1", "--repeats", "1", "--warmup", "0", "--out", str(tmp_path / "lat")]
    result = attention_latency.main(argv)
    assert result["variants_vs_ours_max_abs_diff"] < 1e-4
    (record,) = result["results"]
    assert set(record["median_seconds"]) == {"concat", "collab-16", "paper-16", "explicit-16", "fused-16"}
    assert "| infer | 2 | 600 |" in (tmp_path / "lat.md").read_text()


@pytest.mark.parametrize("prefill", [False, True])
def test_decode_times_the_original_and_a_collaborative_gpt2(tmp_path, prefill):
    """GPT-2 small against collaborative heads at D~ = 96: one decoding step against a cache of 16 positions, or
    the prompt pass of 16 tokens; the shared-key cache is the smaller one."""
    decode = load("decode")
    argv = ["--threads", "1", "--ranks", "96", "--contexts", "16", "--repeats", "1", "--warmup", "0",
            "--out", str(tmp_path / "dec")] + (["--prefill"] if prefill else [])
    rows = decode.main(argv)
    assert [(r["batch"], r["context"], r["model"]) for r in rows] == [(1, 16, "original"), (1, 16, "collab D~=96")]
    assert rows[0]["time_vs_original"] == 1.0
    if prefill:
        assert rows[1]["time_vs_original"] == pytest.approx(rows[1]["prefill_ms"] / rows[0]["prefill_ms"])
        assert "cache_mib" not in rows[1]
    else:
        assert rows[1]["time_vs_original"] == pytest.approx(rows[1]["ms_per_step"] / rows[0]["ms_per_step"])
        assert rows[1]["cache_vs_original"] == pytest.approx((96 + 12 + 768) / (2 * 768), rel=0.01)
    table = (tmp_path / "dec.md").read_text()
    assert table.startswith("# Prefill" if prefill else "# Decoding")
    assert ("| 1 | 16 | collab D~=96 |" if prefill else "| 1 | 16 | dynamic | collab D~=96 |") in table


def test_decode_in_batches_with_static_compiled_caches(tmp_path):
    """Batches 1 and 2, dynamic and static (compiled) caches: one row per model and setting, per-token time the
    step's divided by the batch, and a static cache that holds one slot more than the context."""
    decode = load("decode")
    argv = ["--threads", "1", "--ranks", "96", "--contexts", "16", "--batches", "1", "2", "--caches", "dynamic",
            "static", "--repeats", "1", "--warmup", "0", "--memory-gib", "1", "--out", str(tmp_path / "dec")]
    rows = decode.main(argv)
    assert [(r["batch"], r["cache"], r["model"]) for r in rows] == [
        (batch, cache, model) for batch in (1, 2) for cache in ("dynamic", "static")
        for model in ("original", "collab D~=96")]
    for row in rows:
        assert row["ms_per_token"] == pytest.approx(row["ms_per_step"] / row["batch"])
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 1e3 / row["ms_per_step"])
    by = {(r["batch"], r["cache"], r["model"]): r for r in rows}
    for batch in (1, 2):
        dynamic, static = by[batch, "dynamic", "original"], by[batch, "static", "original"]
        assert static["cache_mib"] == pytest.approx(dynamic["cache_mib"] * 17 / 16)  # context + 1 slots
        assert by[batch, "static", "collab D~=96"]["cache_vs_original"] == pytest.approx((96 + 12 + 768) / 1536)
        # a smaller cache per sequence fits more sequences in the same memory
        assert by[batch, "dynamic", "collab D~=96"]["max_batch"] > dynamic["max_batch"] > 0
    assert "| 2 | 16 | static | collab D~=96 |" in (tmp_path / "dec.md").read_text()


def test_decode_kernels_agree_and_report_ratios_of_their_timings(tmp_path):
    """One collaborative decoding step five ways: the collaborative variants compute the same attention, and each
    row's ratio is its time over the original's."""
    kernels = load("decode_kernels")
    result = kernels.main(["--batch", "2", "--context", "64", "--rank", "48", "--repeats", "1", "--warmup", "0",
                           "--threads", "1", "--out", str(tmp_path / "k")])
    rows = {row["variant"]: row for row in result["rows"]}
    assert list(rows) == ["original sdpa", "collab explicit", "collab compiled", "collab sdpa", "collab flex"]
    for name, row in rows.items():
        assert row["vs_original"] == pytest.approx(row["ms"] / rows["original sdpa"]["ms"])
        if name.startswith("collab"):
            assert row["max_abs_difference"] < 1e-4
    assert "| collab flex |" in (tmp_path / "k.md").read_text()
