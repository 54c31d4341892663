"""The one run store (collab_attn/run_store.py): single-record and staged runs, refusing runs made with other
settings, and the summaries' reader that checks every result file it reads."""

import json

import pytest

from collab_attn import cli
from collab_attn.run_store import STAGES_FILE, RunStore, read_results


def test_a_run_is_stored_once_under_its_name_and_read_back(tmp_path):
    store = RunStore(tmp_path, signature={"lr": 0.1})
    assert store.finished("collab-k4-seed0") is None
    record = {"name": "collab-k4-seed0", "signature": {"lr": 0.1}, "loss": 1.5}
    path = store.save("collab-k4-seed0", record)
    assert path == tmp_path / "runs" / "collab-k4-seed0.json" and json.loads(path.read_text()) == record
    assert store.finished("collab-k4-seed0") == record
    assert [p.name for p in (tmp_path / "runs").iterdir()] == ["collab-k4-seed0.json"]  # no temporary left
    assert store.checkpoints("collab-k4-seed0") == tmp_path / ".checkpoints" / "collab-k4-seed0"


def test_a_run_made_with_other_settings_is_refused_naming_what_differs(tmp_path):
    RunStore(tmp_path, signature={"lr": 0.1}).save("a", {"signature": {"lr": 0.1}, "method": "cp", "rank": 4})
    with pytest.raises(cli.BadInput, match=r"runs/a.json was made with different settings \(signature\)"):
        RunStore(tmp_path, signature={"lr": 0.2}).finished("a")
    unsigned = RunStore(tmp_path)
    assert unsigned.finished("a", {"method": "cp", "rank": 4})["rank"] == 4
    with pytest.raises(cli.BadInput, match=r"different settings \(method, rank\)"):
        unsigned.finished("a", {"method": "svd", "rank": 8})


def test_a_staged_run_keeps_one_line_per_stage_in_its_folder(tmp_path):
    store = RunStore(tmp_path, staged=True)
    name = "mrpc/minilm/cp-r96/seed0-1234abcd"
    stages = [{"stage": "finetuned", "main": 0.8}, {"stage": "reparam", "main": 0.7}]
    path = store.save(name, stages)
    assert path == tmp_path / "runs" / name / STAGES_FILE
    assert [json.loads(line) for line in path.read_text().splitlines()] == stages
    assert store.finished(name) == stages
    assert store.checkpoints(name) == tmp_path / "runs" / name / ".checkpoints"  # beside its W&B run
    with pytest.raises(cli.BadInput, match="different settings"):
        store.finished(name, {"stage": "finetuned"})  # every stage must match


def test_the_summaries_read_every_result_and_refuse_a_file_of_another_script(tmp_path):
    store = RunStore(tmp_path / "seed0")
    store.save("b", {"method": "cp", "loss": 2.0})
    store.save("a", {"method": "svd", "loss": 1.0})
    found = read_results("root", tmp_path, "seed*/runs/*.json", ["method", "loss"], "convert_lm")
    assert [(path.name, record["loss"]) for path, record in found] == [("a.json", 1.0), ("b.json", 2.0)]
    with pytest.raises(cli.BadInput, match=r"b.json is not a result of scripts/convert_lm.py \(holds a value"):
        read_results("root", tmp_path, "seed*/runs/*.json", ["method"], "convert_lm", lambda r: r["method"] == "svd")
    with pytest.raises(cli.BadInput, match=r"a.json is not a result of scripts/train_lm.py \(lacks curve\); move it "
                                           r"out of root="):
        read_results("root", tmp_path, "seed*/runs/*.json", ["method", "curve"], "train_lm")

    staged = RunStore(tmp_path / "glue", staged=True)
    staged.save("job", [{"stage": "finetuned"}, {"main": 0.5}])
    with pytest.raises(cli.BadInput, match=rf"{STAGES_FILE}, result 2, is not a result of scripts/train_glue.py "
                                           r"\(lacks stage\)"):
        read_results("sweep_dir", tmp_path / "glue", f"**/{STAGES_FILE}", ["stage"], "train_glue")
    (tmp_path / "glue" / "runs" / "job" / STAGES_FILE).write_text("[1, 2]\n")
    with pytest.raises(cli.BadInput, match=r"result 1, is not a result .*\(not a JSON object\)"):
        read_results("sweep_dir", tmp_path / "glue", f"**/{STAGES_FILE}", ["stage"], "train_glue")
