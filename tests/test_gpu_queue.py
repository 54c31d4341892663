"""experiments/gpu_queue.sh: what it would run on a GPU, and its CPU dry run (every job for one step, tiny sizes,
results under $OUT only) ending with every job's exit status 0 and its results in place. A job whose data is not here
is skipped by pytest, with the reason, never passed unchecked."""

import os
import re
import subprocess
from pathlib import Path

import pytest
from conftest import GLUE_DIR

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_queue.sh"
LM_DATA = GLUE_DIR.parents[0] / "tinyshakespeare" / "input.txt"
JOBS = ["triton", "tests", "smollm2", "decode", "glue", "lm", "race", "rope", "convert"]
# The dry run in two parts: the jobs that need no data always run; the others need GLUE and Tiny Shakespeare
GROUPS = {"no data": ["triton", "tests", "decode"],
          "glue and lm data": ["smollm2", "glue", "lm", "race", "rope", "convert"]}
NEEDS = {"no data": [], "glue and lm data": [GLUE_DIR, LM_DATA]}


def test_the_queue_lists_its_jobs_in_priority_order():
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[0] for line in listed.splitlines()] == JOBS
    assert "--caches dynamic static" in listed and "refit=distill" in listed and "recipe=gpu" in listed
    assert "pytest -q tests/test_cuda.py" in listed
    assert "pytest -q tests/test_triton_kernels.py" in listed and "--triton" in listed  # first: issue 67
    assert "benchmarks/decode.py --prefill --device cuda" in listed
    assert sorted(job for group in GROUPS.values() for job in group) == sorted(JOBS)  # the dry run covers them all


def dry_run(out: Path, jobs: list[str], warm_python) -> subprocess.CompletedProcess:
    # the queue's python is a warm one for the environment the queue gives its jobs
    queue_env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    env = {**os.environ, "GPU_QUEUE_DRY_RUN": "1", "OUT": str(out), "PYTHON": warm_python(queue_env),
           "GLUE_DIR": str(GLUE_DIR), "LM_DATA": str(LM_DATA), "GPU_QUEUE_JOBS": " ".join(jobs)}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1].startswith("queue finished after"), done.stdout
    return done


@pytest.mark.parametrize("group", GROUPS)
def test_dry_run_runs_every_job_for_one_step_on_the_cpu(tmp_path, group, warm_python):
    missing = [str(path) for path in NEEDS[group] if not path.exists()]
    if missing:
        pytest.skip(f"the {', '.join(GROUPS[group])} jobs need {' and '.join(missing)}, which is not here")
    done = dry_run(tmp_path, GROUPS[group], warm_python)
    ran = dict(re.findall(r"^([\w-]+): (exit \d+|skipped.*|done before.*)", done.stdout, flags=re.M))
    dry = tmp_path / "dry_run"
    if group == "no data":
        assert ran == {"triton-tests": "exit 0", "triton-kernels": "exit 0", "triton-decode": "exit 0",
                       "triton-prefill": "exit 0", "tests": "exit 0", "decode": "exit 0", "decode-kernels": "exit 0"
                       }, done.stdout
        assert "| cp k" in (dry / "benchmarks" / "prefill_causal_kv_cuda_bfloat16.md").read_text()  # a causal prompt
        # the Triton kernels under the interpreter: one layer's step beside the copy, a model beside its twin
        assert (dry / "benchmarks" / "decode_kernels_triton_cuda_bfloat16_batch1.md").is_file()
        assert "| collab D~=24, present path |" in (dry / "benchmarks" / "decode_cuda_bfloat16_triton_batch1.md"
                                                     ).read_text()
        assert (dry / "benchmarks" / "decode_cuda_bfloat16_batches.md").is_file()
        assert (dry / "benchmarks" / "decode_kernels_kv184_cuda_bfloat16_batch1.md").is_file()
        report = (dry / "gpu_tests" / "test_cuda.txt").read_text().splitlines()
        assert re.fullmatch(r"sources [0-9a-f]{12}", report[0]) and report[1] == "exit 0", report[:2]
        # without a GPU every test skips; with one they pass: either way each was collected and none failed
        summary = report[-1]
        assert re.fullmatch(r"(\d+ \w+, )*\d+ \w+ in [\d.]+s", summary) and re.search(r"\d+ (passed|skipped)", summary)
        assert not re.search("failed|error", summary), summary
        again = dry_run(tmp_path, ["tests"], warm_python)  # resumable: the same sources were tested already
        assert f"tests: done before ({dry / 'gpu_tests' / 'test_cuda.txt'})" in again.stdout
    else:
        assert ran == {"smollm2": "exit 0", "glue": "exit 0", "lm": "exit 0", "race": "exit 0", "rope": "exit 0",
                       "convert-train-seed0": "exit 0", "convert-seed0": "exit 0"}, done.stdout
        race = dry / "smollm2" / "gpu"
        assert sorted(p.name for p in (race / "runs").glob("*.json")) == [
            "cp-k12-v12-calibrated32-distilled64.json", "cp-k12-v12-calibrated32.json", "cp-k12-v12.json",
            "merge-kv-k12-distilled64.json", "merge-kv-k12.json", "original.json"]  # distilled from the calibrated
        assert (race / "summary.md").is_file() and (race / "perplexity.png").is_file()
        assert list((dry / "minilm_glue" / "runs").glob("rte/minilm/cp-aware-r96/*/results.jsonl"))
        assert (dry / "shakespeare_char" / "gpu" / "runs" / "collab-k8-seed0.json").is_file()
        assert (dry / "shakespeare_char" / "kv_race_gpu" / "runs" / "collab-k6-v6-seed0.json").is_file()
        assert (dry / "shakespeare_char" / "rope_race_gpu" / "runs" / "rope-tpa-k1-v1-q6-seed0.json").is_file()
        converted = dry / "kv_cache" / "shakespeare_gpu" / "convert" / "seed0" / "runs"
        assert sorted(p.name for p in converted.glob("*.json")) == [
            "cp-k1-v1.json", "cp-k3-v3.json", "cp-k7-v7.json", "kv-svd-k16.json", "kv-svd-k4.json", "kv-svd-k8.json"]
