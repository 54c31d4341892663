"""Matched key/value-cache and parameter budgets (collab_attn/char_lm/budgets.py, scripts/kv_budgets.py)."""

import importlib.util
from pathlib import Path

import pytest

from collab_attn.char_lm import budgets
from collab_attn.char_lm.models import build_model, cache_bytes, gpt_config, parameter_counts

CPU = {"n_layer": 4, "n_head": 4, "n_embd": 128, "dropout": 0.0}
ROOT = Path(__file__).resolve().parents[1]


def test_candidate_sizes_are_what_each_variant_takes():
    assert budgets.candidate_sizes("concat", 128, 4) == list(range(4, 129, 4))
    assert budgets.candidate_sizes("mqa", 128, 4) == [32]
    assert budgets.candidate_sizes("gqa", 128, 4) == [32, 64, 128]  # 1, 2, 4 key/value heads of 32
    assert budgets.candidate_sizes("mla", 128, 4) == list(range(1, 129))


@pytest.mark.parametrize("kind, rank", [("concat", 64), ("collab", 16), ("collab-kv", 30), ("gqa", 64), ("mqa", 32),
                                           ("mla", 48)])
def test_costs_on_the_meta_device_equal_a_real_model(kind, rank):
    values = {"value_rank": rank} if kind == "collab-kv" else {}
    real = build_model(gpt_config(2, 8, **CPU, kind=kind.removesuffix("-kv"), rank=rank, **values), seed=0)
    meta = budgets.sized(kind, rank, CPU)
    assert (meta.cache_bytes, meta.attention_params) == (cache_bytes(real), parameter_counts(real)["attention_params"])


def test_a_quarter_of_the_cache():
    rows = {row.kind: row for row in budgets.matched(budgets.all_sizes(CPU), [0.25], "cache_bytes")}
    original = budgets.sized("concat", 128, CPU).cache_bytes
    assert original == 4 * 2 * 128 * 2  # 4 layers, keys and values of 128, bf16
    for kind, size in (("gqa", 32), ("mqa", 32), ("mla", 64)):
        assert rows[kind].sized.rank == size and rows[kind].ratio == 0.25 and rows[kind].reached
    # keys-only collaboration keeps per-head values: half the cache at least, whatever its key size
    assert not rows["collab"].reached and rows["collab"].ratio > 0.5
    # sharing the values too: 30 + 4 content logits + 30 = 64 numbers per layer, exactly a quarter
    assert rows["collab-kv"].sized.rank == 30 and rows["collab-kv"].ratio == 0.25
    assert rows["collab"].ratio == rows["collab"].sized.cache_bytes / original


def test_matched_parameters_pick_the_closest_size():
    sizes = budgets.all_sizes(CPU, kinds=("concat", "mla"))
    (concat, mla) = budgets.matched(sizes, [0.75], "attention_params")
    full = budgets.sized("concat", 128, CPU).attention_params
    closest = min(abs(s.attention_params / full - 0.75) for s in sizes["mla"])
    assert mla.kind == "mla" and abs(mla.ratio - 0.75) == closest
    assert concat.ratio == concat.sized.attention_params / full


def test_script_prints_both_tables(capsys):
    spec = importlib.util.spec_from_file_location("kv_budgets", ROOT / "scripts" / "kv_budgets.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--fractions", "0.25", "--param-fractions", "0.625"]) == 0
    out = capsys.readouterr().out
    assert "| 0.25 | mqa | 32 | 512 | 165,120 | 0.250x |" in out
    assert "| 0.625 | mqa | 32 | 512 | 165,120 | 0.625x |" in out
    with pytest.raises(SystemExit):
        script.main(["--fractions", "0"])


def test_rotary_sizes_are_what_each_rotary_variant_takes():
    assert budgets.candidate_sizes("concat", 128, 4, "rope") == [128]  # no narrower rotary heads
    assert budgets.candidate_sizes("collab-kv", 128, 4, "rope") == list(range(2, 129, 2))  # query/key pairs
    assert budgets.candidate_sizes("tpa", 128, 4, "rope") == [1, 2, 3]  # rank 4 would cache more than the heads
    sizes = budgets.all_sizes(CPU, positions="rope")
    assert "tpa" in sizes and "tpa" not in budgets.all_sizes(CPU)
    rows = {row.kind: row for row in budgets.matched(sizes, [0.125], "cache_bytes")}
    assert rows["collab-kv"].sized.rank == 16 and rows["collab-kv"].ratio == 0.125  # no content logits
    assert rows["mla"].sized.rank == 16 and rows["mla"].ratio == 0.125  # 16 + the rotary key of 16
    assert not rows["tpa"].reached and rows["tpa"].ratio == 4 * 2 * (4 + 32) * 2 / 2048  # ranks 1 and 1


@pytest.mark.parametrize("kind, rank", [("concat", 128), ("collab-kv", 30), ("gqa", 64), ("mla", 48),
                                           ("tpa", 2)])
def test_rotary_costs_on_the_meta_device_equal_a_real_model(kind, rank):
    values = {"value_rank": rank} if kind == "collab-kv" else {}
    config = gpt_config(2, 8, **CPU, kind=kind.removesuffix("-kv"), rank=rank, positions="rope", **values)
    real = build_model(config, seed=0)
    meta = budgets.sized(kind, rank, CPU, "rope")
    assert (meta.cache_bytes, meta.attention_params) == (cache_bytes(real), parameter_counts(real)["attention_params"])
