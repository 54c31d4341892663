"""One name per size (collab_attn/deprecation.py): the query/key width is ``rank`` everywhere, the value width
``value_rank``; ``key_size`` and ``value_size``, their old names, still work as keywords (``key_size`` in a saved
config.json too) with a ``FutureWarning``, are refused beside a new name that disagrees, and run records stored under
them (the committed ones are never rewritten) read as holding ``rank`` and ``value_rank``. The settings of the
scripts: tests/test_entry_points.py (``test_a_deprecated_setting_*``)."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from collab_attn import cli
from collab_attn.char_lm import race_summary, runs_summary
from collab_attn.char_lm.convert import Conversion
from collab_attn.char_lm.models import gpt_config
from collab_attn.char_lm.runs import run_name
from collab_attn.kinds.shared_key import SharedKeyAttention
from collab_attn.models.scratch_classifier import ScratchConfig, ScratchForSequenceClassification
from collab_attn.run_store import RunStore, current_names, read_results

ROOT = Path(__file__).resolve().parents[1]
# a committed record of scripts/convert_lm.py written before the rename: it holds key_size and value_size
OLD_RECORD = ROOT / "experiments/kv_cache/shakespeare_cpu/convert_distill/seed1/runs/cp-k30-v30.json"
# a committed record of scripts/train_lm.py written before the rename: key_size and value_size
OLD_TRAINED = ROOT / "experiments/shakespeare_char/rope_race_8000/runs/rope-collab-k16-v16-seed2.json"


def test_shared_key_attention_takes_key_size_as_rank_with_a_warning():
    torch.manual_seed(0)
    new = SharedKeyAttention(24, 3, 8, head_dim=8).eval()
    with pytest.warns(FutureWarning, match="key_size is deprecated .*use rank"):
        old = SharedKeyAttention(24, 3, key_size=8, head_dim=8).eval()
    old.load_state_dict(new.state_dict())
    x = torch.randn(2, 5, 24)
    assert old.rank == 8 and old.cache_width() == new.cache_width() == 8 + 3 * 8
    torch.testing.assert_close(old(x)[0], new(x)[0])
    with pytest.warns(FutureWarning, match="key_size is deprecated"):
        assert new.key_size == 8  # the attribute: a deprecated read of rank
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SharedKeyAttention(24, 3, rank=8).rank == 8  # the new name: no warning
    with pytest.raises(TypeError, match="key_size=8 and rank=6 are both set"):
        SharedKeyAttention(24, 3, 6, key_size=8)
    with pytest.raises(TypeError, match="needs rank"):
        SharedKeyAttention(24, 3)


def test_the_scratch_config_takes_key_size_as_rank_and_old_config_files_load(tmp_path):
    with pytest.warns(FutureWarning, match="key_size is deprecated .*use rank"):
        config = ScratchConfig(attention="collab", key_size=16, d_model=32, num_heads=4, vocab_size=50)
    assert config.rank == config.resolved_rank == 16 and "key_size" not in config.to_dict()
    with pytest.raises(ValueError, match="key_size=16 and rank=32 are both set"):
        ScratchConfig(key_size=16, rank=32)
    torch.manual_seed(0)
    model = ScratchForSequenceClassification(ScratchConfig(attention="collab", rank=16, d_model=32, num_heads=4,
                                                           vocab_size=50)).eval()
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["rank"] == 16 and "key_size" not in saved
    saved["key_size"] = saved.pop("rank")  # a config.json written before the rename
    (tmp_path / "config.json").write_text(json.dumps(saved))
    with pytest.warns(FutureWarning, match="key_size is deprecated"):
        loaded = ScratchForSequenceClassification.from_pretrained(tmp_path).eval()
    assert loaded.config.rank == 16
    ids = torch.randint(0, 50, (2, 7))
    torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


def test_a_record_stored_under_key_size_reads_as_holding_rank(tmp_path):
    assert current_names({"method": "cp", "key_size": 4, "seed": 0}) == {"method": "cp", "rank": 4, "seed": 0}
    assert list(current_names({"a": 1, "key_size": 4, "b": 2})) == ["a", "rank", "b"]  # in its place
    assert current_names({"rank": 4, "key_size": 5}) == {"rank": 4, "key_size": 5}  # a rank there already stays
    assert current_names([1]) == [1]
    store = RunStore(tmp_path)
    store.folder.mkdir(parents=True)
    (store.folder / "cp-k4.json").write_text(json.dumps({"method": "cp", "key_size": 4}))
    assert store.finished("cp-k4", {"method": "cp", "rank": 4}) == {"method": "cp", "rank": 4}
    with pytest.raises(cli.BadInput, match=r"different settings \(rank\)"):
        store.finished("cp-k4", {"method": "cp", "rank": 8})
    ((_, record),) = read_results("root", tmp_path, "runs/*.json", ("method", "rank"), "convert_lm")
    assert record == {"method": "cp", "rank": 4}


def test_a_committed_record_written_before_the_rename_still_reads():
    stored = json.loads(OLD_RECORD.read_text())
    assert "key_size" in stored and "rank" not in stored  # committed results are not rewritten
    folder = OLD_RECORD.parents[2]
    ours = [r for r in race_summary.read_variant(folder) if r["name"] == "cp-k30-v30" and r["seed"] == 1]
    assert len(ours) == 1 and ours[0]["rank"] == stored["key_size"] == 30 and "key_size" not in ours[0]


def test_the_character_models_take_value_size_as_value_rank_with_a_warning():
    with pytest.warns(FutureWarning, match="value_size is deprecated .*gpt_config.*use value_rank"):
        old = gpt_config(65, 16, 2, 4, 16, kind="collab", rank=8, value_size=6)
    assert old.to_dict() == gpt_config(65, 16, 2, 4, 16, kind="collab", rank=8, value_rank=6).to_dict()
    assert old.collab_value_ranks == [6, 6]
    with pytest.warns(FutureWarning, match="value_size is deprecated .*run_name"):
        assert run_name("collab", 8, 0, value_size=6) == run_name("collab", 8, 0, value_rank=6) == "collab-k8-v6-seed0"
    with pytest.warns(FutureWarning, match="value_size is deprecated .*Conversion"):
        conversion = Conversion("cp", 8, value_size=6)
    assert conversion == Conversion("cp", 8, 6) and conversion.value_rank == 6 and conversion.name == "cp-k8-v6"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name, or the old one given as None: no warning
        assert Conversion("cp", 8, value_rank=6, value_size=None).value_rank == 6
        gpt_config(65, 16, 2, 4, 16, kind="collab", rank=8, value_rank=6, value_size=None)
    for refused in (lambda: gpt_config(65, 16, 2, 4, 16, kind="collab", rank=8, value_rank=4, value_size=6),
                    lambda: run_name("collab", 8, 0, value_rank=4, value_size=6),
                    lambda: Conversion("cp", 8, 4, value_size=6)):
        with pytest.raises(TypeError, match="value_size=6 and value_rank=4 are both set"):
            refused()


def test_a_record_stored_under_key_size_and_value_size_reads_as_holding_rank_and_value_rank(tmp_path):
    old = {"method": "cp", "key_size": 4, "value_size": 3, "seed": 0}
    assert current_names(old) == {"method": "cp", "rank": 4, "value_rank": 3, "seed": 0}
    assert list(current_names(old)) == ["method", "rank", "value_rank", "seed"]  # each in its place
    assert current_names({"value_rank": 3, "value_size": 5}) == {"value_rank": 3, "value_size": 5}
    store = RunStore(tmp_path)
    store.folder.mkdir(parents=True)
    (store.folder / "cp-k4-v3.json").write_text(json.dumps(old))
    identity = {"method": "cp", "rank": 4, "value_rank": 3}
    assert store.finished("cp-k4-v3", identity) == current_names(old)
    with pytest.raises(cli.BadInput, match=r"different settings \(value_rank\)"):
        store.finished("cp-k4-v3", {**identity, "value_rank": 4})
    ((_, record),) = read_results("root", tmp_path, "runs/*.json", ("method", "rank", "value_rank"), "convert_lm")
    assert record == current_names(old)


def test_committed_records_holding_value_size_still_read_as_holding_value_rank():
    converted, trained = json.loads(OLD_RECORD.read_text()), json.loads(OLD_TRAINED.read_text())
    for stored in (converted, trained):  # committed results are not rewritten
        assert {"key_size", "value_size"} <= set(stored) and not {"rank", "value_rank"} & set(stored)
    (ours,) = [r for r in race_summary.read_variant(OLD_RECORD.parents[2])
               if r["name"] == "cp-k30-v30" and r["seed"] == 1]
    assert ours["value_rank"] == converted["value_size"] == 30 and "value_size" not in ours
    assert race_summary._size(ours) == "30/30"
    (run,) = [r for r in runs_summary.read_runs(OLD_TRAINED.parents[1], "runs") if r["name"] == trained["name"]]
    assert (run["rank"], run["value_rank"]) == (trained["key_size"], trained["value_size"]) == (16, 16)
    assert not {"key_size", "value_size"} & set(run)
    assert runs_summary.family(run) == "collab (values) rope"
    assert runs_summary._short_label(run).startswith("collab 16/16")
