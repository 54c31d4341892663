"""Every entry point in scripts/ checks before it writes (collab_attn/cli.py): each class of mistake gives exit
status 2, exactly one ``error:`` line on stderr naming the argument, and leaves the folder it ran in as it was. One
case per script runs as a real process (all at once, two at a time, each forked from an interpreter that imported
torch and transformers once: tests/warm_python.py); the rest call the script's ``main`` in this process, the same
path after the interpreter starts."""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from collab_attn import cli
from collab_attn.char_lm import data, models

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")

ROOT = Path(__file__).resolve().parents[1]
TEXT = "".join(f"{w} to be, or not to be: that is the question {i % 7}.\n" for i, w in enumerate(["To", "Or"] * 40))
LM = ["model.n_layer=1", "model.n_head=2", "model.n_embd=16", "block_size=16", "eval_iters=2", "trainer.max_steps=4",
      "trainer.eval_steps=2", "trainer.per_device_train_batch_size=4", "trainer.warmup_steps=1"]
CONVERT = ["data.path=text.txt", "train_dir=lm", "model_dir=lm/model", *LM]


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """The inputs every case may name: text, a binary file, a plain file, an empty folder, a GLUE folder whose train
    split is binary, a tiny trained character model, a GLUE sweep with one result, a folder of GLUE-scratch results."""
    root = tmp_path_factory.mktemp("template")
    (root / "text.txt").write_text(TEXT)
    (root / "binary.txt").write_bytes(b"\x80\x00\xff" * 50)
    (root / "afile").write_text("x")
    (root / "empty").mkdir()
    (root / "glue" / "SST-2").mkdir(parents=True)
    (root / "glue" / "SST-2" / "train.tsv").write_bytes(b"sentence\tlabel\n\x80\x81\t1\n")
    (root / "glue" / "SST-2" / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    corpus = data.corpus_from_text(TEXT)
    models.build_model(models.gpt_config(corpus.vocab_size, 16, 1, 2, 16), 0).save_pretrained(root / "lm" / "model")
    (root / "lm" / "model" / "vocab.json").write_text(json.dumps(corpus.chars))
    row = {"stage": "finetuned", "task": "mrpc", "model": "minilm", "method": "none", "seed": 0, "main": 0.8,
           "query_key_params": 10}
    (root / "sweep" / "job").mkdir(parents=True)
    (root / "sweep" / "job" / "results.jsonl").write_text(json.dumps(row) + "\n")
    (root / "scratch" / "sst2" / "runs").mkdir(parents=True)
    (root / "scratch" / "sst2" / "runs" / "collab-k8-seed0.json").write_text('{"attention": "collab", "rank": 8}')
    return root


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def workspace(template: Path, where: Path) -> Path:
    shutil.copytree(template, where)
    return where


def assert_refused(code, err: str, name: str, before: dict, after: dict) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert name in lines[0], lines[0]
    assert after == before, sorted(set(after) ^ set(before))


# ---------------------------------------------------------------------------------------------------
# As real processes: one case per script (the examples among them, the rest of them in this process below)
# and one grid per sweep script

PROCESSES = {
    "key size zero": ("train_lm", ["rank=0", "data.path=text.txt"], "rank"),
    "output_dir is a file (scratch)": ("train_scratch", ["output_dir=afile", "glue_dir=null"], "output_dir"),
    "grid: a key size one method cannot take": ("convert_lm", [*CONVERT, "methods=[none,cp,svd]", "ranks=[5]"],
                                                "ranks"),
    "grid: a rank one job cannot take": ("train_glue", ["-m", "task=mrpc,rte", "collab.rank=384,999",
                                                        "data.glue_dir=null"], "collab.rank"),
    "zero heads": ("accounting", ["--heads", "0", "--d-model", "12"], "--heads"),
    "summary into a file": ("summarize", ["glue", "sweep", "--out", "afile"], "--out"),
    "visualize into a file": ("visualize", ["output_dir=afile"], "output_dir"),
}


@pytest.fixture(scope="module")
def processes(template, tmp_path_factory, warm_python) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    python = warm_python(env)

    def run(item):
        case, (name, args, _) = item
        cwd = workspace(template, tmp_path_factory.mktemp("process") / "work")
        before = snapshot(cwd)
        done = subprocess.run([python, str(ROOT / "scripts" / f"{name}.py"), *args], cwd=cwd, env=env,
                              capture_output=True, text=True, timeout=300)
        return case, (done.returncode, done.stderr, before, snapshot(cwd))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, PROCESSES.items()))


@pytest.mark.parametrize("case", PROCESSES)
def test_a_process_refuses_in_one_line_and_writes_nothing(processes, case):
    code, err, before, after = processes[case]
    assert_refused(code, err, PROCESSES[case][2], before, after)


# ---------------------------------------------------------------------------------------------------
# In this process: the script's main with its command line

_modules = {}


def script(name: str):
    if name not in _modules:
        spec = importlib.util.spec_from_file_location(f"entry_{name}", ROOT / "scripts" / f"{name}.py")
        _modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_modules[name])
    return _modules[name]


CASES = [
    ("train_lm", ["output_dir=afile", "data.path=text.txt"], "output_dir"),  # a file where a folder goes
    ("train_lm", ["data.path=binary.txt"], "data.path"),  # binary data
    ("train_scratch", ["glue_dir=no/glue", "output_dir=out"], "glue_dir"),  # a missing GLUE folder
    ("train_lm", ["key_sise=3"], "key_sise"),  # a typo
    ("train_lm", ["recipe=tpu"], "recipe/tpu"),  # an unknown choice of a group
    ("train_lm", ["attention=sparse", "data.path=text.txt"], "attention"),
    ("train_lm", ["trainer.max_steps=many", "data.path=text.txt"], "trainer.max_steps"),  # not an integer
    ("train_lm", ["threads=0", "data.path=text.txt"], "threads"),
    ("train_lm", ["mode=sweep", "seeds=[]", "data.path=text.txt"], "seeds"),  # an empty list
    ("train_lm", ["data.path=empty"], "data.path"),  # a folder where a file goes
    ("train_lm", ["data.path=no/such.txt"], "data.path"),
    ("train_lm", ["block_size=500", "data.path=text.txt"], "block_size"),  # a text too short for the blocks
    ("train_lm", ["-m", "seed=0,1", "eval_iters=2,-2", "data.path=text.txt"], "eval_iters"),  # one job of a grid
    ("convert_lm", [*CONVERT, "retrain_fraction=2"], "retrain_fraction"),
    ("convert_lm", [*CONVERT, "model_dir=empty"], "model_dir"),
    ("train_scratch", ["ranks=[32,0]", "glue_dir=null"], "ranks"),
    ("train_scratch", ["glue_dir=glue", "output_dir=out"], "glue_dir"),  # a binary GLUE split
    ("train_glue", ["trainer.per_device_train_batch_size=0", "data.glue_dir=null"], "per_device_train_batch_size"),
    ("train_glue", ["output_root=afile", "data.glue_dir=null"], "output_root"),
    ("train_glue", ["collab.calibration=binary.txt", "data.glue_dir=null"], "collab.calibration"),
    ("reparametrize", ["collab.calibration=empty"], "collab.calibration"),
    ("reparametrize", ["compare_prompts=[]"], "compare_prompts"),
    ("reparametrize", ["model=afile"], "model"),
    ("energy", ["thresholds=[0]"], "thresholds"),
    ("accounting", ["--output", "empty"], "--output"),  # a folder where a file goes
    ("summarize", ["glue", "empty"], "sweep_dir"),  # a folder without results
    ("summarize", ["glue", "sweep", "--seeds", "one"], "--seeds"),
    ("summarize", ["lm", "scratch"], "root="),  # results of another script
    ("summarize", ["race", "scratch"], "root="),
    ("summarize", ["transfer", "scratch"], "runs/"),  # not a race folder
    ("summarize", ["sweeps", "scratch"], "mode"),  # no such pipeline
    ("fit_check", ["mrpc=lm/model", "--batch-size", "0"], "--batch-size"),
]


@pytest.mark.parametrize("name, args, argument", CASES, ids=[f"{n} {' '.join(a[-2:])}" for n, a, _ in CASES])
def test_main_refuses_in_one_line_and_writes_nothing(template, tmp_path, monkeypatch, capsys, name, args, argument):
    cwd = workspace(template, tmp_path / "work")
    module = script(name)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [name, *args])
    before = snapshot(cwd)
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert_refused(stop.value.code, capsys.readouterr().err, argument, before, snapshot(cwd))


CHECKS = [  # script, its config, its check, a command line, the jobs it makes
    ("train_lm", "train_lm", "check", ["data.path=text.txt"], 1),
    ("train_lm", "train_lm", "check", ["-m", "data.path=text.txt", "attention=concat,collab", "rank=16,4"], 4),
    ("convert_lm", "convert_lm", "check", CONVERT, 1),
    ("train_scratch", "scratch", "check", ["glue_dir=null"], 1),
    ("train_glue", "train_glue", "validate", ["data.glue_dir=null"], 1),
    ("train_glue", "train_glue", "validate", ["-m", "+experiment=minilm_mrpc_rte", "data.glue_dir=null"], 4),
    ("reparametrize", "reparametrize", "check", [], 1),
    ("visualize", "visualize", "_check", [], 1),
    ("energy", "energy", "check", [], 1),
]


@pytest.mark.parametrize("name, config, check, args, jobs", CHECKS, ids=[f"{c[0]} {c[3][:1]}" for c in CHECKS])
def test_good_settings_pass_the_check_and_it_writes_nothing(template, tmp_path, monkeypatch, name, config, check,
                                                            args, jobs):
    cwd = workspace(template, tmp_path / "work")
    monkeypatch.chdir(cwd)
    before = snapshot(cwd)
    assert cli.check_command_line(ROOT / "configs", config, args, getattr(script(name), check)) == jobs
    assert snapshot(cwd) == before


# ---------------------------------------------------------------------------------------------------
# The checks themselves


def test_checks_name_the_argument_and_the_fix(tmp_path):
    (tmp_path / "f").write_text("x")
    (tmp_path / "latin.txt").write_bytes("caf\xe9".encode("latin-1"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "a").write_text("x")
    for call, message in [
        (lambda: cli.positive_int("heads", 0), "heads must be a positive integer, got 0"),
        (lambda: cli.positive_int("heads", True), "heads must be a positive integer"),
        (lambda: cli.positive_int("heads", "3"), "got '3'"),
        (lambda: cli.number("dropout", 1.0, 0, 1, below=True), r"dropout must be a number in \[0, 1\)"),
        (lambda: cli.choice("mode", "fit", ("train", "sweep")), "unknown mode 'fit'; choose one of train, sweep"),
        (lambda: cli.trainer_fields("trainer", {"max_steps": 0}), "trainer.max_steps must be a positive number"),
        (lambda: cli.output_dir("out", tmp_path / "f" / "g"), "is under .*f, which is a file"),
        (lambda: cli.output_dir("out", tmp_path / "full", overwrite=False), "pass overwrite=true"),
        (lambda: cli.output_file("out", tmp_path), "is a folder; pass a file path"),
        (lambda: cli.text_file("texts", tmp_path / "latin.txt"), "texts=.* is binary or not UTF-8 text"),
        (lambda: cli.text_file("texts", tmp_path / "nope.txt"), "texts=.*: no such file"),
        (lambda: cli.json_file("out", tmp_path / "f"), "is not JSON"),
    ]:
        with pytest.raises(ValueError, match=message):
            call()
    assert cli.positive_int("x", None, nullable=True) is None and cli.output_dir("out", tmp_path / "new").name == "new"
    assert not (tmp_path / "new").exists()
    with pytest.raises(FileNotFoundError, match="model=x: no checkpoint"), cli.naming("model", "x"):
        raise FileNotFoundError("no checkpoint")
    with pytest.raises(argparse.ArgumentTypeError, match="positive"):
        cli.positive_arg("-1")


def test_anything_raised_while_checking_is_one_line(capsys):
    def check():
        raise KeyError("n_embd")

    with pytest.raises(SystemExit) as stop:
        cli.exit_on_bad_input(check)
    assert stop.value.code == 2 and capsys.readouterr().err == "error: KeyError: 'n_embd'\n"
    with pytest.raises(SystemExit):
        cli.exit_on_bad_input(lambda: int("x"), report=False)
    assert capsys.readouterr().err == ""
    assert cli.exit_on_bad_input(lambda: 3) == 3


# ---------------------------------------------------------------------------------------------------
# Deprecated setting names (collab_attn/deprecation.py): taken as the new one with a FutureWarning, refused beside a
# new one that disagrees, never ignored

RENAMED_SETTINGS = [  # script, its config, a command line under the old name, the same under the new name, new key
    ("train_lm", "train_lm", ["data.path=text.txt", "attention=collab", "key_size=8"],
     ["data.path=text.txt", "attention=collab", "rank=8"], "rank"),
    ("train_lm", "train_lm", ["data.path=text.txt", "mode=sweep", "key_sizes=[16,4]"],
     ["data.path=text.txt", "mode=sweep", "ranks=[16,4]"], "ranks"),
    ("train_lm", "train_lm", ["data.path=text.txt", "attention=collab", "rank=8", "value_size=6"],
     ["data.path=text.txt", "attention=collab", "rank=8", "value_rank=6"], "value_rank"),
    ("convert_lm", "convert_lm", [*CONVERT, "key_sizes=[4]"], [*CONVERT, "ranks=[4]"], "ranks"),
    ("train_scratch", "scratch", ["glue_dir=null", "key_sizes=[32,8]"], ["glue_dir=null", "ranks=[32,8]"], "ranks"),
]


def _checked(config: str, args: list[str], check) -> tuple[dict, object]:
    """The settings ``check`` was given (after it) and what it returned, for the one job of ``args``."""
    seen = []

    def spy(settings):
        seen.append((settings, check(settings)))

    assert cli.check_command_line(ROOT / "configs", config, args, spy) == 1
    return seen[0]


@pytest.mark.parametrize("name, config, old, new, key", RENAMED_SETTINGS,
                         ids=[f"{c[0]} {c[2][-1].split('=')[0]}" for c in RENAMED_SETTINGS])
def test_a_deprecated_setting_is_taken_as_its_new_name_with_a_warning(template, tmp_path, monkeypatch, name, config,
                                                                      old, new, key):
    monkeypatch.chdir(workspace(template, tmp_path / "work"))
    check = script(name).check
    deprecated = old[-1].split("=")[0]
    with pytest.warns(FutureWarning, match=rf"{deprecated} is deprecated .*use {key}; {deprecated} goes in"):
        settings, planned = _checked(config, old, check)
    expected_settings, expected = _checked(config, new, check)
    assert deprecated not in settings and settings[key] == expected_settings[key] is not None
    assert planned == expected  # the same runs as under the new name


REFUSED_SETTINGS = [
    ("train_lm", ["data.path=text.txt", "key_size=8", "rank=16"], "key_size=8 and rank=16 are both set"),
    ("train_lm", ["data.path=text.txt", "mode=sweep", "key_sizes=[8]", "ranks=[16]"], "key_sizes=[8] and ranks=[16]"),
    ("train_lm", ["data.path=text.txt", "attention=collab", "value_size=6", "value_rank=4"],
     "value_size=6 and value_rank=4 are both set"),
    ("convert_lm", [*CONVERT, "key_sizes=[4]", "ranks=[8]"], "key_sizes=[4] and ranks=[8] are both set"),
    ("train_scratch", ["glue_dir=null", "key_sizes=[32]", "ranks=[16]"], "key_sizes=[32] and ranks=[16]"),
]


@pytest.mark.parametrize("name, args, message", REFUSED_SETTINGS, ids=[f"{c[0]} {c[1][-2]}" for c in REFUSED_SETTINGS])
def test_a_deprecated_setting_beside_a_different_new_one_is_refused(template, tmp_path, monkeypatch, capsys, name,
                                                                     args, message):
    cwd = workspace(template, tmp_path / "work")
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", [name, *args])
    before = snapshot(cwd)
    with pytest.raises(SystemExit) as stop:
        script(name).main()
    err = capsys.readouterr().err
    assert_refused(stop.value.code, err, message, before, snapshot(cwd))
    assert "deprecated name of" in err
