"""Multi-process training: every process trains, rank 0 alone writes, the others wait in collectives."""

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from collab_attn import distributed
from collab_attn.glue import pipeline
from collab_attn.glue import tasks as glue
from collab_attn.glue.jobs import GlueJob

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 900  # two processes of a few steps each take about two minutes on 2 busy cores
# Every launch: 32-token sequences and a re-fine-tuning batch of 8 (4 per process; the recipe's 32 would be 16), so
# that the steps cost little beside the processes' start; what is checked is how the two processes share the work.
SMALL = ["data.max_seq_length=32", "refit.per_device_train_batch_size=8"]


def test_batch_of_a_step_splits_over_processes(monkeypatch):
    recipe = {"per_device_train_batch_size": 32, "learning_rate": 1e-4}
    assert distributed.split_batch(recipe) == recipe
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert distributed.split_batch(recipe) == {**recipe, "per_device_train_batch_size": 8}
    assert distributed.split_batch({"per_device_eval_batch_size": 7}) == {"per_device_eval_batch_size": 7}
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match="per_device_train_batch_size=32 .* does not split evenly over 3 processes"):
        distributed.split_batch(recipe)


def test_one_process_needs_no_process_group(tmp_path):
    distributed.setup()
    assert distributed.is_main() and distributed.from_main(5) == 5
    with distributed.main_lock(tmp_path / "x.lock"):
        distributed.barrier()


def _launch(arguments: list[str], cwd: Path, warm_python) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=2 scripts/train_glue.py <arguments>``, the launcher and its two workers warm
    python processes (``--no-python``: torchrun starts the warm python where it would start ``python``); on timeout
    the whole process group is killed (a hang fails the test instead of leaving processes behind)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    python = warm_python(env)
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python", python,
               str(ROOT / "scripts" / "train_glue.py"), *arguments]
    process = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.communicate()
        pytest.fail(f"two processes did not finish within {TIMEOUT} s (a deadlock?)")
    return subprocess.CompletedProcess(command, process.returncode, out, err)


@pytest.mark.glue
def test_two_processes_train_together_and_rank0_writes_once(tmp_path, glue_dir, warm_python):
    """Two CPU processes (gloo) fine-tune (the fine-tuned-model lock is rank 0's alone), convert, re-fine-tune and
    evaluate; one results file, one W&B run, one Hydra folder, the loss one process would see; a dev set of 25
    examples (odd: the distributed sampler pads it) is scored once, as one process scores it; the rerun skips the
    finished job."""
    overrides = [
        "task=rte", f"data.glue_dir={glue_dir}", "trainer=smoke", "trainer.max_steps=2", "data.max_train_samples=16",
        "data.max_eval_samples=25", "collab.rank=96", "collab.n_iter_max=2", f"output_root={tmp_path / 'out'}", *SMALL,
    ]
    first = _launch(overrides, tmp_path, warm_python)
    assert first.returncode == 0, first.stderr[-3000:]
    out = tmp_path / "out"
    (results,) = out.glob("runs/*/*/*/*/results.jsonl")
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["stage"] for r in records] == ["finetuned", "reparam", "refit"]
    assert first.stdout.count("] finetuned:") == 1 and first.stdout.count("refit:") == 1
    # the loss of a fresh two-class head is about ln 2, not the process count times it (the Trainer's token
    # averaging across processes, which sequence-classification losses ignore, would double it)
    losses = [float(x) for x in re.findall(r"'loss': '([\d.]+)'", first.stdout + first.stderr)]
    assert losses and 0.5 < losses[0] < 0.9, losses
    (run_file,) = results.parent.glob("wandb/offline-run-*/run-*.wandb")
    assert b"refit/train_loss" in run_file.read_bytes() and b"query_key_compression" in run_file.read_bytes()
    assert len(list((out / "hydra").iterdir())) == 1
    leftovers = [p for p in out.rglob("*") if ".tmp-" in p.name or p.name.startswith((".scratch", ".checkpoints"))]
    assert leftovers == [] and not list((out / "finetuned").glob("*/*/*.checkpoints"))

    # the fine-tuned model's metrics, scored again here in one process
    settings = _settings(overrides)
    (finetuned,) = [p for p in (out / "finetuned").glob("*/*/seed0-*") if p.is_dir()]
    model = AutoModelForSequenceClassification.from_pretrained(finetuned)
    tokenizer = AutoTokenizer.from_pretrained(finetuned)
    task = glue.get_task("rte")
    data = pipeline.load_data(task, GlueJob.of(settings).data, tokenizer)
    single = pipeline.evaluate(model, data, tokenizer, task, 8, tmp_path / "scratch")
    assert single["accuracy"] == pytest.approx(records[0]["accuracy"], abs=1e-9)

    second = _launch(overrides, tmp_path, warm_python)
    assert second.returncode == 0 and second.stdout.count("skipping") == 1, second.stderr[-3000:]


def _settings(overrides: list[str]) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="train_glue", overrides=overrides), resolve=True)


@pytest.mark.glue
def test_two_processes_distill_a_pruned_model(tmp_path, glue_dir, warm_python):
    """refit=distill under two processes: each process runs the teacher on its share of the batch beside the
    student (a pruned one, so the attention term maps each kept head to its teacher head); one job, every loss term
    logged, and the distilled job's settings recorded."""
    overrides = [
        "task=mrpc", f"data.glue_dir={glue_dir}", "trainer=smoke", "trainer.max_steps=2", "data.max_train_samples=16",
        "data.max_eval_samples=25", "collab=prune", "collab.rank=128", "collab.importance_samples=16",
        "refit=distill", "refit.distill.hidden_weight=0.1", "refit.distill.attention_weight=0.1",
        "trainer.logging_steps=1", f"output_root={tmp_path / 'out'}", *SMALL,
    ]
    run = _launch(overrides, tmp_path, warm_python)
    assert run.returncode == 0, run.stderr[-3000:]
    (results,) = (tmp_path / "out").glob("runs/*/*/*/*/results.jsonl")
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [r["stage"] for r in records] == ["finetuned", "reparam", "refit"]
    assert records[-1]["distill"]["attention_weight"] == 0.1
    logged = run.stdout + run.stderr
    for term in ("label_loss", "teacher_loss", "hidden_loss", "attention_loss"):
        assert f"'distill_{term}'" in logged
