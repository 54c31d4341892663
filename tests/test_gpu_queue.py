"""experiments/gpu_queue.sh: what it would run on a GPU, and its CPU dry run (every job for one step, tiny sizes,
results under $OUT only) ending with every job's exit status 0 and its results in place."""

import os
import subprocess
import sys
from pathlib import Path

from conftest import GLUE_DIR

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "gpu_queue.sh"
LM_DATA = GLUE_DIR.parents[0] / "tinyshakespeare" / "input.txt"


def test_the_queue_lists_its_jobs_in_priority_order():
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    assert [line.split(":")[0] for line in listed.splitlines()] == ["decode", "glue", "lm", "race", "convert"]
    assert "--caches dynamic static" in listed and "refit=distill" in listed and "recipe=gpu" in listed


def test_dry_run_runs_every_job_for_one_step_on_the_cpu(tmp_path):
    env = {**os.environ, "GPU_QUEUE_DRY_RUN": "1", "OUT": str(tmp_path), "PYTHON": sys.executable,
           "GLUE_DIR": str(GLUE_DIR), "LM_DATA": str(LM_DATA)}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    report = done.stdout.splitlines()
    assert report[-1].startswith("queue finished after")
    assert "decode: exit 0" in done.stdout and "decode-kernels: exit 0" in done.stdout
    assert (tmp_path / "dry_run" / "benchmarks" / "decode_cuda_bfloat16_batches.md").is_file()
    assert (tmp_path / "dry_run" / "benchmarks" / "decode_kernels_cuda_bfloat16_batch1.md").is_file()
    if GLUE_DIR.is_dir():
        assert "glue: exit 0" in done.stdout
        assert list((tmp_path / "dry_run" / "minilm_glue" / "runs").glob("rte/minilm/cp-aware-r96/*/results.jsonl"))
    else:
        assert "glue: skipped" in done.stdout
    if LM_DATA.is_file():
        assert "lm: exit 0" in done.stdout
        assert (tmp_path / "dry_run" / "shakespeare_char" / "gpu" / "runs" / "collab-k8-seed0.json").is_file()
        assert "race: exit 0" in done.stdout
        race = tmp_path / "dry_run" / "shakespeare_char" / "kv_race_gpu" / "runs" / "collab-k6-v6-seed0.json"
        assert race.is_file()
        assert "convert-train-seed0: exit 0" in done.stdout and "convert-seed0: exit 0" in done.stdout
        converted = tmp_path / "dry_run" / "kv_cache" / "shakespeare_gpu" / "convert" / "seed0" / "runs"
        assert sorted(p.name for p in converted.glob("*.json")) == [
            "cp-k1-v1.json", "cp-k3-v3.json", "cp-k7-v7.json", "kv-svd-k16.json", "kv-svd-k4.json", "kv-svd-k8.json"]
    else:
        assert "lm: skipped" in done.stdout and "race: skipped" in done.stdout and "convert: skipped" in done.stdout
