"""Bad input to the newest entry points, given as a new user gives it (issue 89): scripts/race_smollm2.py,
scripts/compare_runs.py, benchmarks/*.py and scripts/train_lm.py refuse it before any work (collab_attn/cli.py): exit
status 2, exactly one ``error:`` line on stderr that says what was wrong and what to pass, no traceback, and nothing
new on disk. One case of each class the issue found, and one per entry point, runs as a real process (two at a time,
each forked from an interpreter that imported torch and transformers once, tests/warm_python.py, and each with a
timeout so that a hang fails instead of blocking):

- work done, then a crash, files left behind: end-to-end check tokens beyond the fit's own, ``--out`` naming a file;
- a hang: windows of one token;
- mixed up: a race folder of another model (of the same architecture);
- accepted nonsense: a run compared with itself;
- unclear messages: a binary run file, ``--device gpu``, ``--warmup -1``, ``--out`` under a file.

The walk over every flag of every script runs each script's ``main`` in this process (the same path after the
interpreter starts). The race runs on a tiny random Llama with a character tokenizer, on small GLUE and Shakespeare
files shaped like the real ones. The API functions' refusals are in test_fitting.py, test_allocation.py and
test_answers.py.
"""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import transformers
from conftest import LM_TEXT, character_tokenizer

from collab_attn import cli
from collab_attn.pretrained import heldout

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TRANSFORMERS_VERBOSITY": "error",
       "TQDM_DISABLE": "1"}
RACE = ["--model", "model", "--glue-dir", "glue", "--shakespeare", "shakespeare.txt", "--methods", "cp", "--budgets",
        "0.5", "--windows", "2", "--length", "16", "--batch", "2"]
FITTED = ["--calibration-tokens", "64", "--fit-steps", "2", "--e2e-steps", "2"]
NO_GPU = not torch.cuda.is_available()

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(autouse=True)
def quiet():
    """No progress bars on stderr (loading weights), as HF_HUB_DISABLE_PROGRESS_BARS=1 and TRANSFORMERS_VERBOSITY=error
    do for a process: what remains there is the error alone."""
    from transformers.utils import logging as hf_logging

    bars, verbosity = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    yield
    hf_logging.set_verbosity(verbosity)
    if bars:
        hf_logging.enable_progress_bar()


def tiny_llama(folder: Path, seed: int) -> None:
    """A random 2-layer Llama (4 heads, 2 key/value groups of 12) with a character tokenizer and a chat template."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                                      num_hidden_layers=2, intermediate_size=64, vocab_size=32,
                                      max_position_embeddings=256, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer = character_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tokenizer.save_pretrained(folder)


def entry(path: str):
    """``scripts/<name>.py`` or ``benchmarks/<name>.py`` as a module (each loaded once)."""
    if path not in _modules:
        spec = importlib.util.spec_from_file_location(f"entry_{Path(path).stem}", ROOT / path)
        _modules[path] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_modules[path])
    return _modules[path]


_modules = {}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    """What the cases name: two tiny Llamas of one config (model, other), GLUE's QNLI dev, RTE and MRPC train with
    more sentences than the validation split takes, a Shakespeare text with a blank line after its validation part,
    a character text, a binary file, a plain file, an empty folder, and a finished race of ``model`` (race/)."""
    root = tmp_path_factory.mktemp("template")
    tiny_llama(root / "model", 0)
    tiny_llama(root / "other", 1)
    for task, columns in (("QNLI", ["sentence"]), ("RTE", ["sentence1", "sentence2"]),
                          ("MRPC", ["#1 String", "#2 String"])):
        (root / "glue" / task).mkdir(parents=True)
        rows = ["\t".join(columns)] + ["\t".join(f"a sentence of {task.lower()} number {i} part {c}"
                                                 for c in range(len(columns))) for i in range(600)]
        for split in ("train", "dev"):
            (root / "glue" / task / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    text = "".join(f"the quick brown fox number {i} jumps over the lazy dog\n" + "\n" * (i % 10 == 9)
                   for i in range(12_000))
    for task in ("SST-2", "MRPC"):  # what benchmarks/activation_aware.py reads, for the cases past its --glue-dir
        (root / "sst_glue" / task).mkdir(parents=True)
        for split in ("train", "dev"):
            (root / "sst_glue" / task / f"{split}.tsv").write_text("sentence\tlabel\na sentence\t1\n")
    (root / "shakespeare.txt").write_text(text)
    (root / "shakespeare2.txt").write_text(text.replace("lazy", "idle", 1))  # other texts
    (root / "text.txt").write_text(LM_TEXT)
    (root / "binary.bin").write_bytes(b"\x80\x00\xff" * 50)
    (root / "afile").write_text("x")
    (root / "empty").mkdir()
    cwd = os.getcwd()
    os.chdir(root)
    try:
        entry("scripts/race_smollm2.py").main([*RACE, "--out", "race"])
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in (root / "race" / "runs").iterdir()) == ["cp-k12-v12.json", "original.json"]
    assert (root / "race" / "identity.json").is_file()
    return root


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


def assert_refused(code, out: str, err: str, message: str, before: dict, after: dict) -> None:
    lines = err.strip().splitlines()
    assert code == 2, err[-3000:]
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    assert message in lines[0], lines[0]
    assert "Traceback" not in out + err
    assert after == before, sorted(set(after) ^ set(before))  # nothing new, nothing changed


# ---------------------------------------------------------------------------------------------------
# As real processes: each class of the issue, and each entry point


PROCESSES = {
    "crash after work: check tokens beyond the fit's own": (
        "scripts/race_smollm2.py", [*RACE, "--out", "new", *FITTED, "--e2e-tokens", "64", "--e2e-check-tokens",
                                    "100000"],
        "--e2e-check-tokens 100000 is more than the end-to-end fit's own tokens hold (--e2e-tokens 64: 6 windows of "
        "16, 3 batches of 2): pass at most 96"),
    "crash after work: --out names a file": (
        "scripts/race_smollm2.py", [*RACE, "--out", "afile"], "--out=afile is a file; pass a folder path"),
    "hang: windows of one token": (
        "scripts/race_smollm2.py", [*RACE, "--out", "new", *FITTED, "--e2e-tokens", "64", "--e2e-length", "1"],
        "--e2e-length must be 0 (--length) or at least 2"),
    "mixed up: a race folder of another model": (
        "scripts/race_smollm2.py", [*RACE, "--model", "other", "--out", "race"],
        "--out=race holds results of the model 'model' (weights "),
    "accepted nonsense: a run compared with itself": (
        "scripts/compare_runs.py", ["race/runs/cp-k12-v12.json", "race/runs/cp-k12-v12.json"],
        "race/runs/cp-k12-v12.json and race/runs/cp-k12-v12.json are the same file"),
    "unclear: a binary run file": (
        "scripts/compare_runs.py", ["binary.bin", "race/runs/original.json"],
        "binary.bin is binary or not UTF-8 text"),
    "unclear: --device gpu": (
        "benchmarks/tpa_decode.py", ["--device", "gpu", "--out", "result"], "--device 'gpu' is not a device; pass "
                                                                           "one of: cpu"),
    "unclear: --warmup -1": (
        "benchmarks/tpa_decode.py", ["--warmup", "-1", "--out", "result"],
        "argument --warmup: must be an integer >= 0, got -1"),
    "unclear: --out under a file": (
        "benchmarks/decode.py", ["--size", "tiny", "--out", "afile/x"], "--out=afile/x.md is under"),
    "train_lm: save_models as one string": (
        "scripts/train_lm.py", ["data.path=text.txt", "save_models=concat-k128-seed0", "output_dir=out",
                                "hydra.run.dir=out"], "save_models must be a list of run names or glob patterns"),
    "activation_aware: a rank wider than MiniLM's": (
        "benchmarks/activation_aware.py", ["--ranks", "500", "--out", "result"],
        "--ranks 500: MiniLM's query/key width is 384"),
    "attention_latency: heads that do not divide d_model": (
        "benchmarks/attention_latency.py", ["--d-model", "10", "--heads", "3", "--out", "result"],
        "--d-model 10 must be a multiple of --heads 3"),
    "decode_kernels: no such compile backend": (
        "benchmarks/decode_kernels.py", ["--compile-backend", "inductr", "--out", "result"],
        "--compile-backend 'inductr' is not a torch.compile backend here; choose one of"),
    "decomposition: a tolerance that is not a number": (
        "benchmarks/decomposition.py", ["--bert-tols", "nan", "--out", "result"],
        "argument --bert-tols: must be a finite number > 0, got nan"),
    "end_to_end: a case that is not BxS": (
        "benchmarks/end_to_end.py", ["--cases", "32by128", "--out", "result"],
        "'32by128': give batch x sequence length as BxS"),
    "llama_cpp_half_cache: a run that is not there": (
        "scripts/llama_cpp_half_cache.py", ["--folder", "race", "--runs", "cp-k99", "--out", "result"],
        "--runs ['cp-k99']: no such run file in race/runs"),
    "race_decode: no runs": (
        "benchmarks/race_decode.py", ["--runs", "0", "--out", "result.md"],
        "argument --runs: must be a positive integer, got 0"),
}


@pytest.fixture(scope="module")
def processes(template, tmp_path_factory, warm_python) -> dict:
    python = warm_python(ENV)

    def run(item):
        case, (path, args, _) = item
        cwd = tmp_path_factory.mktemp("process") / "work"
        shutil.copytree(template, cwd)
        before = snapshot(cwd)
        try:
            done = subprocess.run([python, str(ROOT / path), *args], cwd=cwd, env=ENV, capture_output=True,
                                  text=True, timeout=240)
        except subprocess.TimeoutExpired:  # a hang fails its test, not the session
            return case, (None, "", "timed out", before, snapshot(cwd))
        return case, (done.returncode, done.stdout, done.stderr, before, snapshot(cwd))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, PROCESSES.items()))


@pytest.mark.parametrize("case", PROCESSES)
def test_a_process_refuses_in_one_line_before_any_work(processes, case):
    assert_refused(*processes[case][:3], PROCESSES[case][2], *processes[case][3:])


def test_windows_of_one_token_are_refused_not_looped_on():
    """The hang's cause: ``heldout.windows`` tokenized a growing prefix of nothing forever."""
    class Characters:
        bos_token_id = 1

        def __call__(self, text, add_special_tokens=False):
            return type("Encoded", (), {"input_ids": [3 + ord(c) % 90 for c in text]})()

    for length, count in ((1, 4), (0, 4), (8, 0), (8, -1), ("8", 2)):
        with pytest.raises(ValueError, match="a window holds the beginning-of-text token and at least one more"):
            heldout.windows(Characters(), "some text " * 50, length, count)


# ---------------------------------------------------------------------------------------------------
# In this process: every flag of every script, as a new user gets them wrong


def refused_in_process(template, tmp_path, monkeypatch, capsys, path: str, args: list[str], message: str,
                       prepare=None) -> None:
    cwd = tmp_path / "work"
    shutil.copytree(template, cwd)
    if prepare is not None:
        prepare(cwd)
    monkeypatch.chdir(cwd)
    before = snapshot(cwd)
    with pytest.raises(SystemExit) as stop:
        entry(path).main(args)
    out, err = capsys.readouterr()
    assert_refused(stop.value.code, out, err, message, before, snapshot(cwd))


def legacy(cwd: Path) -> None:
    (cwd / "race" / "identity.json").unlink()  # a folder of runs made before identities were recorded


RACE_CASES = [
    # paths: a file where a folder goes, and the reverse; binary, missing
    (["--out", "race/runs/original.json"], "--out=race/runs/original.json is a file; pass a folder path", None),
    (["--out", "afile/race"], "--out=afile/race is under", None),
    (["--out", "race"], "holds a file runs where the folder runs/ goes",
     lambda cwd: (shutil.rmtree(cwd / "race" / "runs"), (cwd / "race" / "runs").write_text("x"))),
    (["--out", "race"], "holds a folder summary.md/ where the file summary.md goes",
     lambda cwd: ((cwd / "race" / "summary.md").unlink(), (cwd / "race" / "summary.md").mkdir())),
    (["--out", "race"], "race/runs/broken.json is binary or not UTF-8 text",
     lambda cwd: (cwd / "race" / "runs" / "broken.json").write_bytes(b"\x00\x01")),
    (["--out", "race"], "race/runs/list.json is not a run file of scripts/race_smollm2.py",
     lambda cwd: (cwd / "race" / "runs" / "list.json").write_text("[1, 2]")),
    (["--glue-dir", "afile"], "--glue-dir=afile is a file; pass a folder", None),
    (["--glue-dir", "empty"], "--glue-dir=empty/QNLI/dev.tsv: no such file", None),
    (["--shakespeare", "binary.bin"], "--shakespeare=binary.bin is binary or not UTF-8 text", None),
    (["--shakespeare", "empty"], "--shakespeare=empty is a folder; pass a text file", None),
    (["--model", "afile"], "--model=afile: afile is a file, not a checkpoint directory", None),
    (["--model", "empty"], "--model=empty: checkpoint directory empty has no config.json", None),
    # devices, numbers, combinations
    (["--device", "gpu"], "--device 'gpu' is not a device; pass one of: cpu", None),
    pytest.param(["--device", "cuda"], "sees no CUDA GPU here; pass one of: cpu", None,
                 marks=pytest.mark.skipif(not NO_GPU, reason="a GPU is here")),
    (["--threads", "0"], "--threads must be a positive integer, got 0", None),
    (["--rope-pairs", "-1"], "--rope-pairs must be an integer >= 0, got -1", None),
    (["--extra", "cp:0"], "--extra cp:0: RANK and VALUE_RANK must be positive", None),
    (["--extra", "key-svd:1000"], "--extra key-svd:1000: rank 1000 for layer 0 is invalid: it must be an integer in "
                                  "[1, 48]", None),
    (["--extra", "cp:7:3"], "--extra cp:7:3: rank 7 is odd", None),
    (["--budgets", "0.01"], "--budgets 0.01: none of --methods cp fits within them on this model (48 numbers per "
                            "token and layer): nothing to race", None),
    (["--allocate", "--calibration-tokens", "64", "--budgets", "0.05"],
     "--allocate --budgets 0.05: 2.4 numbers per token and layer, fewer than the 4 an allocation needs", None),
    ([*FITTED, "--e2e-learning-rate", "inf"], "--e2e-learning-rate must be a finite number > 0, got inf", None),
    (["--calibration-tokens", "100000000"], "--calibration-tokens: 100,000,000 fitting tokens in windows of 16", None),
    (["--calibration-tokens", "8", "--calibration-sample", "3"],
     "--calibration-sample 3: --calibration-tokens 8 make 3 windows of 16 for 4 samples, less than one each", None),
    (["--distill-tokens", "100000000"], "--distill-tokens: 100,000,000 fitting tokens", None),
    ([*FITTED, "--e2e-tokens", "100000000"], "--e2e-tokens: 100,000,000 fitting tokens", None),
    ([*FITTED, "--e2e-check-tokens", "100000"],
     "--e2e-check-tokens 100000 is more than the end-to-end fit's own tokens hold (the calibration tokens", None),
    ([*FITTED, "--e2e-tokens", "60", "--e2e-held-out-tokens", "4"],
     "--e2e-held-out-tokens 4 adds no window after the end-to-end fit's own 6 windows of 16 (the fitting text is cut "
     "into windows, one from each domain at a time): pass at least 37", None),
    ([*FITTED, "--e2e-tokens", "60", "--e2e-held-out-tokens", "100000000", "--e2e-held-out-text", "code",
      "--fit-text", "wikipedia"],
     "--e2e-held-out-tokens 100000000 of --e2e-held-out-text code in windows of 16: more than its fit split", None),
    # mixed up: another model, other texts, a folder made before identities were recorded
    (["--model", "other", "--out", "race"], "not of this command's model 'other' (weights ", None),
    (["--shakespeare", "shakespeare2.txt", "--out", "race"],
     "--out=race was made from other texts: its shakespeare was ", None),
    (["--model", "other", "--out", "race"], "--out=race holds runs of another model: its original's first wikipedia "
                                            "window has log-likelihood", legacy),
]


@pytest.mark.parametrize("args, message, prepare", RACE_CASES, ids=[
    c.values[1][:40] if hasattr(c, "values") else c[1][:40] for c in RACE_CASES])
def test_the_race_refuses_in_one_line_and_writes_nothing(template, tmp_path, monkeypatch, capsys, args, message,
                                                         prepare):
    given = [*RACE, *args] if "--out" in args else [*RACE, "--out", "new", *args]
    refused_in_process(template, tmp_path, monkeypatch, capsys, "scripts/race_smollm2.py", given, message, prepare)


def test_a_folder_made_before_identities_is_adopted_by_its_own_model(template, tmp_path, monkeypatch, capsys):
    """The same model and texts: the runs are read back as done and the folder gets its identity, the one its first
    run wrote (the same weights and texts, read from this copy)."""
    cwd = tmp_path / "work"
    shutil.copytree(template, cwd)
    recorded = json.loads((cwd / "race" / "identity.json").read_text())
    legacy(cwd)
    monkeypatch.chdir(cwd)
    entry("scripts/race_smollm2.py").main([*RACE, "--out", "race"])
    assert "cp-k12-v12: done before" in capsys.readouterr().out
    adopted = json.loads((cwd / "race" / "identity.json").read_text())
    assert adopted["weights"] == recorded["weights"] and adopted["model"] == "model"
    assert {k: v["sha256"] for k, v in adopted["texts"].items()} == {k: v["sha256"] for k, v in
                                                                     recorded["texts"].items()}


def test_a_run_that_fails_leaves_nothing_a_later_run_reads_as_done(template, tmp_path, monkeypatch, capsys):
    """A failure in a run's work (here its answers, after its evaluation): no run file, summary or identity of that
    run; the runs finished before it stay, whole, and a later command resumes from them."""
    from collab_attn.pretrained import race

    cwd = tmp_path / "work"
    shutil.copytree(template, cwd)
    monkeypatch.chdir(cwd)
    answers, calls = race.answers, []

    def fails_for_cp(model, tokenizer):  # the original's answers, then the conversion's
        calls.append(model)
        if len(calls) == 2:
            raise RuntimeError("out of memory")
        return answers(model, tokenizer)

    monkeypatch.setattr(race, "answers", fails_for_cp)
    with pytest.raises(RuntimeError, match="out of memory"):
        entry("scripts/race_smollm2.py").main([*RACE, "--out", "new"])
    assert sorted(str(p.relative_to(cwd / "new")) for p in (cwd / "new").rglob("*")) == [
        "identity.json", "runs", "runs/original.json"]
    json.loads((cwd / "new" / "runs" / "original.json").read_text())  # whole
    monkeypatch.setattr(race, "answers", answers)
    entry("scripts/race_smollm2.py").main([*RACE, "--out", "new"])
    assert "original: done before" in capsys.readouterr().out
    assert (cwd / "new" / "summary.md").is_file() and (cwd / "new" / "runs" / "cp-k12-v12.json").is_file()


COMPARE_CASES = [
    (["empty", "race/runs/original.json"], "error: empty is a folder; pass a text file"),
    (["afile", "race/runs/original.json"], "afile: not a JSON run file"),
    (["race/runs/original.json", "copy.json"], "are two copies of the same run (original)"),
    (["race/runs/original.json", "race/../race/runs/original.json"], "are the same file (original)"),
    (["race/runs/original.json", "race/runs/cp-k12-v12.json", "race/runs/original.json"], "pass them in pairs"),
    (["nope.json", "race/runs/original.json"], "nope.json: no such run file"),
]


@pytest.mark.parametrize("args, message", COMPARE_CASES, ids=[c[1][:30] for c in COMPARE_CASES])
def test_compare_runs_refuses_in_one_line(template, tmp_path, monkeypatch, capsys, args, message):
    def copy(cwd):
        shutil.copy(cwd / "race" / "runs" / "original.json", cwd / "copy.json")

    refused_in_process(template, tmp_path, monkeypatch, capsys, "scripts/compare_runs.py", args, message, copy)


NOT_A_DEVICE = ["--device", "gpu"], "--device 'gpu' is not a device; pass one of: cpu"
UNDER_A_FILE = ["--out", "afile/x"], "is under"
BENCHMARK_CASES = {
    "tpa_decode": [(["--batch", "0"], "argument --batch: must be a positive integer, got 0"),
                   (["--contexts", "16", "-5"], "argument --contexts: must be a positive integer, got -5"),
                   (["--ranks", "2", "x"], "argument --ranks: expected a positive integer, got 'x'"),
                   (["--repeats", "0"], "argument --repeats: must be a positive integer"),
                   (["--threads", "0"], "argument --threads: must be a positive integer"),
                   (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'"),
                   NOT_A_DEVICE, UNDER_A_FILE],
    "race_decode": [(["--contexts", "0"], "argument --contexts: must be a positive integer"),
                    (["--batch", "-1"], "argument --batch: must be a positive integer"),
                    (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
                    (["--repeats", "0"], "argument --repeats: must be a positive integer"),
                    UNDER_A_FILE],
    "decode": [(["--contexts", "0"], "argument --contexts: must be a positive integer"),
               (["--batches", "0"], "argument --batches/--batch: must be a positive integer"),
               (["--ranks", "0"], "argument --ranks: must be a positive integer"),
               (["--size", "tiny", "--ranks", "500"], "--ranks 500: a collaborative key width is at most d_model (192"),
               (["--memory-gib", "-1"], "argument --memory-gib: must be a finite number > 0, got -1"),
               (["--cache-fractions", "2"], "--cache-fractions must lie in (0, 1]"),
               (["--repeats", "0"], "argument --repeats: must be a positive integer"),
               (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
               (["--threads", "0"], "argument --threads: must be a positive integer"),
               (["--caches", "static", "--compile-backend", "inductr"], "--compile-backend 'inductr' is not a "
                                                                        "torch.compile backend"),
               NOT_A_DEVICE, UNDER_A_FILE],
    "decode_kernels": [(["--batch", "0"], "argument --batch: must be a positive integer"),
                       (["--context", "0"], "argument --context: must be a positive integer"),
                       (["--rank", "0"], "argument --rank: must be a positive integer"),
                       (["--value-rank", "-2"], "argument --value-rank: must be a positive integer"),
                       (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
                       (["--triton-tiles", "3:1"], "keys per tile must be a power of two from 16"),
                       (["--compile-backend", "inductr"], "--compile-backend 'inductr' is not a torch.compile"),
                       NOT_A_DEVICE, UNDER_A_FILE],
    "attention_latency": [(["--d-model", "0"], "argument --d-model: must be a positive integer"),
                          (["--heads", "0"], "argument --heads: must be a positive integer"),
                          (["--ranks", "1000"], "--ranks 1000: a collaborative key width is at most --d-model (768)"),
                          (["--batch", "0"], "argument --batch: must be a positive integer"),
                          (["--seq", "-1"], "argument --seq: must be a positive integer"),
                          (["--dropout", "1"], "--dropout must be a number in [0, 1), got 1.0"),
                          (["--dropout", "nan"], "--dropout must be a number in [0, 1), got nan"),
                          (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
                          (["--modes", "eval"], "argument --modes: invalid choice: 'eval'"),
                          NOT_A_DEVICE, UNDER_A_FILE],
    "activation_aware": [(["--ranks", "0"], "argument --ranks: must be a positive integer"),
                         (["--calibration-texts", "0"], "argument --calibration-texts: must be a positive integer"),
                         (["--held-out", "1"], "--held-out must be at least 2"),
                         (["--glue-dir", "afile"], "--glue-dir=afile is a file; pass a folder"),
                         (["--glue-dir", "no/glue"], "--glue-dir=no/glue: no such folder"),
                         (["--glue-dir", "glue"], "--glue-dir=glue/SST-2/train.tsv: no such file"),
                         (["--threads", "0"], "argument --threads: must be a positive integer"),
                         # its own GLUE folder: the default (../shared/data/glue) is absent on some machines
                         (["--glue-dir", "sst_glue", *UNDER_A_FILE[0]], UNDER_A_FILE[1])],
    "decomposition": [(["--minilm-ranks", "0"], "argument --minilm-ranks: must be a positive integer"),
                      (["--minilm-ranks", "500"], "--minilm-ranks 500: the model's query/key width is 384"),
                      (["--bert-rank", "1000"], "--bert-rank 1000: the model's query/key width is 768"),
                      (["--bert-tensorly-iters", "0"], "argument --bert-tensorly-iters: must be a positive integer"),
                      (["--bert-tols", "0"], "argument --bert-tols: must be a finite number > 0, got 0"),
                      (["--tucker-ranks", "-1"], "argument --tucker-ranks: must be a positive integer"),
                      (["--skip-minilm", "--skip-bert", "--tucker-ranks"], "nothing to measure"),
                      NOT_A_DEVICE, UNDER_A_FILE],
    "llama_cpp_decode": [(["--ranks", "47"], "--ranks [47]: a rotary key width is even"),
                         (["--cache-fractions", "2"], "--cache-fractions must lie in (0, 1]"),
                         (["--cache-fractions"], "nothing to compare the original with: give --cache-fractions"),
                         (["--contexts", "0"], "argument --contexts: must be a positive integer"),
                         (["--flash-attn", "yes"], "argument --flash-attn: invalid choice: 'yes'"),
                         (["--cache-types", "q8_0"], "argument --cache-types: invalid choice: 'q8_0'"),
                         UNDER_A_FILE],
    "decode_attention": [(["--head-sizes", "0"], "argument --head-sizes: must be a positive integer"),
                         (["--clock", "gpu"], "argument --clock: invalid choice: 'gpu'"),
                         (["--context", "-8"], "argument --context: must be a positive integer"),
                         UNDER_A_FILE],
    "end_to_end": [(["--ranks", "500"], "--ranks 500: MiniLM's query/key width is 384"),
                   (["--cases", "0x128"], "'0x128': the batch must be positive and the length from 1 to 512"),
                   (["--cases", "1x1000"], "'1x1000': the batch must be positive and the length from 1 to 512"),
                   (["--max-train-tokens", "-1"], "argument --max-train-tokens: must be an integer >= 0"),
                   (["--repeats", "0"], "argument --repeats: must be a positive integer"),
                   (["--warmup", "-1"], "argument --warmup: must be an integer >= 0"),
                   NOT_A_DEVICE, UNDER_A_FILE],
}
BENCHMARKS = [(name, args, message) for name, cases in BENCHMARK_CASES.items() for args, message in cases]


@pytest.mark.parametrize("name, args, message", BENCHMARKS, ids=[f"{n} {' '.join(a)}" for n, a, _ in BENCHMARKS])
def test_a_benchmark_refuses_in_one_line_before_any_work(template, tmp_path, monkeypatch, capsys, name, args,
                                                         message):
    given = args if "--out" in args else [*args, "--out", "result"]
    refused_in_process(template, tmp_path, monkeypatch, capsys, f"benchmarks/{name}.py", given, message)


@pytest.mark.skipif(not NO_GPU, reason="a GPU is here")
@pytest.mark.parametrize("name", sorted(set(BENCHMARK_CASES) - {"race_decode", "activation_aware", "llama_cpp_decode",
                                                                 "decode_attention"}))
def test_a_benchmark_refuses_cuda_where_there_is_none(template, tmp_path, monkeypatch, capsys, name):
    refused_in_process(template, tmp_path, monkeypatch, capsys, f"benchmarks/{name}.py",
                       ["--device", "cuda", "--out", "result"], "--device cuda: torch ")


TRAIN_LM = ["data.path=text.txt", "output_dir=out", "model.n_layer=1", "model.n_head=2", "model.n_embd=16",
            "block_size=16", "eval_iters=2", "trainer.max_steps=4", "trainer.eval_steps=2",
            "trainer.per_device_train_batch_size=4", "trainer.warmup_steps=1"]
TRAIN_LM_CASES = [
    (["save_models=concat-k16-seed0"], "save_models must be a list of run names or glob patterns"),
    (["progress=maybe"], "progress must be true or false, got 'maybe'"),
    (["trainer.adam_beta1=2"], "trainer.adam_beta1 must be a number in [0, 1), got 2"),
    (["+trainer.adam_epsilon=0"], "trainer.adam_epsilon must be a number > 0, got 0"),
    (["trainer.lr_scheduler_kwargs.min_lr=-1"], "trainer.lr_scheduler_kwargs.min_lr must be a number >= 0, got -1"),
]


@pytest.mark.parametrize("args, message", TRAIN_LM_CASES, ids=[c[0][0] for c in TRAIN_LM_CASES])
def test_train_lm_refuses_in_one_line(template, tmp_path, monkeypatch, capsys, args, message):
    cwd = tmp_path / "work"
    shutil.copytree(template, cwd)
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", ["train_lm", *TRAIN_LM, *args, f"hydra.run.dir={tmp_path / 'hydra'}"])
    module = entry("scripts/train_lm.py")
    monkeypatch.setattr(module.main.__wrapped__, "__module__", "__main__")
    before = snapshot(cwd)
    with pytest.raises(SystemExit) as stop:
        module.main()
    out, err = capsys.readouterr()
    assert_refused(stop.value.code, out, err, message, before, snapshot(cwd))


def test_the_checks_name_what_to_pass():
    for call, message in [
        (lambda: cli.device("--device", "gpu"), "--device 'gpu' is not a device; pass one of: cpu"),
        (lambda: cli.device("--device", "mps"), "--device mps: the scripts run on the CPU or a CUDA GPU"),
        (lambda: cli.compile_backend("--compile-backend", "fast"), "choose one of .*inductor"),
        (lambda: cli.result_stem("--out", "", "x"), "--out is empty; pass a new file path without suffix"),
    ]:
        with pytest.raises(cli.BadInput, match=message):
            call()
    assert cli.device("--device", "cpu") == "cpu"
    for parse, text, message in [(cli.count_arg, "-1", "must be an integer >= 0"),
                                 (cli.count_arg, "1.5", "expected an integer >= 0"),
                                 (cli.positive_number_arg, "inf", "must be a finite number > 0"),
                                 (cli.positive_number_arg, "x", "expected a positive number")]:
        with pytest.raises(Exception, match=message):
            parse(text)
    assert cli.count_arg("0") == 0 and cli.positive_number_arg("1e-4") == 1e-4
