"""One name per size (collab_attn/deprecation.py): the query/key width is ``rank`` everywhere; ``key_size``, its old
name, still works as a keyword and in a saved config.json with a ``FutureWarning``, is refused beside a ``rank`` that
disagrees, and run records stored under it (the committed ones are never rewritten) read as holding ``rank``. The
settings of the scripts: tests/test_entry_points.py (``test_a_deprecated_setting_*``)."""

import json
import warnings
from pathlib import Path

import pytest
import torch

from collab_attn import cli
from collab_attn.char_lm import race_summary
from collab_attn.kinds.shared_key import SharedKeyAttention
from collab_attn.models.scratch_classifier import ScratchConfig, ScratchForSequenceClassification
from collab_attn.run_store import RunStore, current_names, read_results

ROOT = Path(__file__).resolve().parents[1]
# a committed record of scripts/convert_lm.py written before the rename: it holds key_size
OLD_RECORD = ROOT / "experiments/kv_cache/shakespeare_cpu/convert_distill/seed1/runs/cp-k30-v30.json"


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
