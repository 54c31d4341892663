"""The GLUE pipeline: configs, validation before training, resumable jobs, W&B offline runs, summaries."""

import json
import os
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch
import transformers
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from transformers import AutoModel

from collab_attn.glue import calibrate as calibrate_module
from collab_attn.glue import pipeline
from collab_attn.glue.jobs import GlueJob
from collab_attn.glue.summary import before_after, before_after_markdown, load_results, summarize, table, to_markdown
from collab_attn.models.checkpoints import resolve_model
from collab_attn.models.settings import MethodSettings
from collab_attn.tracking import wandb_mode

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
CONTRACT_FIELDS = {
    "stage", "task", "model", "method", "rank", "seed", "main", "main_metric", "model_params", "attention_params",
    "query_key_params", "decomposition_seconds", "mean_relative_error",
}


def settings(*overrides: str, hydra_config: bool = False) -> dict:
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        cfg = compose(config_name="train_glue", overrides=list(overrides), return_hydra_config=hydra_config)
    return cfg if hydra_config else OmegaConf.to_container(cfg, resolve=True)


def tiny(tmp_path, *overrides: str) -> dict:
    """A job that trains for two steps on a few examples of at most 32 tokens."""
    return settings(
        "trainer=smoke", "trainer.max_steps=2", "refit.max_steps=2", "data.max_train_samples=16",
        "data.max_seq_length=32", "data.max_eval_samples=24", "collab.n_iter_max=2", "collab.init=random",
        f"output_root={tmp_path / 'out'}", *overrides,
    )


def tiny_job(tmp_path, *overrides: str) -> GlueJob:
    return GlueJob.of(tiny(tmp_path, *overrides))


# Every config group and experiment composing, and its values reaching the library: tests/test_configs.py


def test_slurm_launcher_composes():
    cfg = settings("hydra/launcher=slurm", "hydra.launcher.partition=gpu", hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher") and launcher.partition == "gpu"


def test_experiment_overrides_only_what_differs():
    smoke = settings("+experiment=smoke")
    assert smoke["trainer"]["max_steps"] == 3 and smoke["data"]["max_train_samples"] == 64
    assert smoke["trainer"]["learning_rate"] == settings()["trainer"]["learning_rate"]


def test_unknown_task_and_unknown_key_stop_in_hydra():
    with pytest.raises(MissingConfigException, match="task"):
        settings("task=mrcp")
    with pytest.raises(ConfigCompositionException, match="learning_rat"):
        settings("trainer.learning_rat=1e-4")


def test_job_dirs_separate_what_matters(tmp_path):
    def folder(*overrides: str) -> Path:
        return tiny_job(tmp_path, *overrides).folder

    base = folder()
    assert base.parts[-4:-1] == ("mrpc", "minilm", "cp-r192") and base.name.startswith("seed0-")
    assert folder("collab.rank=128") != base
    assert folder("seed=1") != base
    assert folder("refit.learning_rate=1e-4") != base
    assert folder("data.glue_dir=/elsewhere") == base  # same data, another copy
    assert folder("trainer.logging_steps=7") == base  # logging only
    assert tiny_job(tmp_path, "collab.rank=128").finetuned_dir == tiny_job(tmp_path).finetuned_dir
    aware = folder("collab.budget=mean:128", "collab.calibration=task")
    assert aware.parts[-2] == "cp-aware-rmean128"
    assert folder("collab.solver=tensorly").parts[-2] == "cp-tensorly-r192"
    assert folder("weights=pretrained") == base
    random_init = tiny_job(tmp_path, "weights=random")
    assert random_init.folder.parts[-3] == "minilm-random-init"
    assert random_init.finetuned_dir.parent.name == "minilm-random-init"


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["collab.rank=999"], ValueError, r"rank 999 for layer 0 is invalid.*\[1, 384\]"),
        (["model=/no/such/checkpoint"], FileNotFoundError, "no checkpoint at"),
        (["data.glue_dir=/no/such/glue"], FileNotFoundError, "data.glue_dir=/no/such/glue does not exist"),
        (["+trainer.learning_rat=1e-4"], ValueError, "trainer.learning_rat is not a transformers.TrainingArguments"),
        (["collab.budget=mean:-3"], ValueError, "budget"),
        (["collab.calibration=/no/texts.txt"], FileNotFoundError, "collab.calibration=/no/texts.txt: no such file"),
        (["weights=scratch"], ValueError, "weights='scratch': choose 'pretrained'"),
        (["weights=random", "finetune=false"], ValueError, "weights=random needs finetune=true"),
        (["+collab.importance_samples=8"], ValueError, "collab.importance_samples does not apply to collab.method=cp"),
        (["collab.method=svd"], ValueError, r"collab.solver does not apply to collab.method=svd; .*\(collab=svd\)"),
    ],
)
def test_bad_input_stops_before_training(tmp_path, overrides, error, message):
    with pytest.raises(error, match=message):
        pipeline.run_job(tiny_job(tmp_path, *overrides))
    assert not (tmp_path / "out").exists()


def test_wandb_mode_is_offline_without_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    assert wandb_mode(None) == "offline"
    assert wandb_mode("disabled") == "disabled"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode(None) == "online"


@pytest.mark.glue
def test_job_runs_end_to_end_and_resumes(tmp_path, glue_dir, capsys, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    job = tiny_job(tmp_path, "task=mrpc", f"data.glue_dir={glue_dir}", "collab.rank=96")
    records = pipeline.run_job(job)
    assert [r["stage"] for r in records] == ["finetuned", "reparam", "refit"]
    for record in records:
        assert CONTRACT_FIELDS <= set(record) and {"f1", "accuracy"} <= set(record)
        assert record["main"] == record["f1"] and record["main_metric"] == "f1"
    assert records[0]["query_key_params"] == 6 * 2 * (384 * 384 + 384)
    assert records[1]["query_key_params"] == 6 * (2 * 384 * 96 + 12 * 96 + 12 * 384)
    assert 0 < records[1]["mean_relative_error"] < 1 and records[1]["decomposition_seconds"] > 0
    out = job.folder
    assert [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()] == records
    run_file = next(out.glob("wandb/offline-run-*/run-*.wandb")).read_bytes()
    assert b"refit/main" in run_file and b"query_key_compression" in run_file
    assert not list(out.glob(".scratch-*"))

    capsys.readouterr()
    assert pipeline.run_job(job) == records
    assert "skipping" in capsys.readouterr().out

    finetuned = job.finetuned_dir
    stamp = (finetuned / "config.json").stat().st_mtime_ns
    other = pipeline.run_job(tiny_job(tmp_path, "task=mrpc", f"data.glue_dir={glue_dir}", "collab.rank=384",
                                      "logger=none", "refit.enabled=false"))
    assert [r["stage"] for r in other] == ["finetuned", "reparam"]
    assert other[0]["main"] == records[0]["main"]  # the same cached fine-tuned model
    assert (finetuned / "config.json").stat().st_mtime_ns == stamp
    # its evaluation is cached too: a planted value comes back instead of a new evaluation
    (cache,) = finetuned.glob("eval-*.json")
    assert json.loads(cache.read_text())["f1"] == records[0]["f1"]
    cache.write_text(json.dumps({**json.loads(cache.read_text()), "f1": 0.123, "main": 0.123}))
    third = pipeline.run_job(tiny_job(tmp_path, "task=mrpc", f"data.glue_dir={glue_dir}", "collab.rank=192",
                                      "logger=none", "refit.enabled=false"))
    assert third[0]["f1"] == 0.123 and third[0]["main"] == 0.123
    assert other[1]["main"] == pytest.approx(other[0]["main"], abs=1e-6)  # full rank is exact


@pytest.mark.glue
def test_random_weights_train_the_architecture_from_scratch(tmp_path, glue_dir):
    job = tiny_job(tmp_path, "task=rte", f"data.glue_dir={glue_dir}", "logger=none", "collab.method=none",
                   "weights=random")
    (record,) = pipeline.run_job(job)
    assert record["model"] == "minilm-random-init" and record["stage"] == "finetuned"
    trained = AutoModel.from_pretrained(job.finetuned_dir)
    pretrained = AutoModel.from_pretrained(resolve_model("minilm"))
    assert trained.config.hidden_size == pretrained.config.hidden_size == 384
    for name, weight in pretrained.state_dict().items():  # two training steps move no weight this far
        if name.endswith("word_embeddings.weight") or name.endswith("query.weight"):
            assert not torch.allclose(trained.state_dict()[name], weight, atol=1e-2), name


@pytest.mark.glue
def test_budget_and_activation_aware_fit_on_task_texts(tmp_path, glue_dir):
    job = tiny_job(
        tmp_path, "task=rte", f"data.glue_dir={glue_dir}", "logger=none", "refit.enabled=false",
        "collab.budget=mean:128", "collab.calibration=task", "collab.calibration_samples=8",
        "collab.calibration_max_length=32",
    )
    finetuned, reparam = pipeline.run_job(job)
    assert reparam["method"] == "cp-aware" and reparam["budget"] == "mean:128"
    assert len(reparam["rank"]) == 6 and all(1 <= r <= 384 for r in reparam["rank"])
    # the budget spends what rank 128 everywhere would, up to one rank step per layer
    assert reparam["query_key_params"] <= 6 * (2 * 384 * 128 + 12 * 128 + 12 * 384)
    assert reparam["query_key_params"] < finetuned["query_key_params"] / 2


def test_calibration_is_measured_only_where_a_layer_is_approximated(tmp_path, monkeypatch):
    texts = tmp_path / "texts.txt"
    texts.write_text("a sentence\nanother one\n")
    calls = []
    monkeypatch.setattr(calibrate_module, "calibration_from_texts",
                        lambda model, tokenizer, texts, **kw: calls.append(texts))
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=384))

    def settings(**collab):
        return MethodSettings.from_config(dict(method="cp", **collab))

    for rank in (384, [384] * 6):
        assert pipeline.calibrate(model, None, settings(rank=rank, calibration=str(texts)), seed=0) is None
    assert calls == []
    for collab in ({"rank": 128}, {"rank": [384] * 5 + [128]}, {"rank": 384, "budget": "mean:128"}):
        pipeline.calibrate(model, None, settings(calibration=str(texts), **collab), seed=0)
    assert calls == [["a sentence", "another one"]] * 3
    with pytest.raises(ValueError, match="collab.calibration=task means the task's training texts"):
        pipeline.calibrate(model, None, settings(rank=128, calibration="task"), seed=0)


@pytest.mark.glue
def test_interrupted_job_leaves_no_results(tmp_path, glue_dir, monkeypatch):
    job = tiny_job(tmp_path, "task=rte", f"data.glue_dir={glue_dir}", "logger=none", "finetune=false")

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(pipeline, "reparametrize", crash)
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_job(job)
    out = job.folder
    assert not (out / "results.jsonl").exists() and not list(out.glob(".scratch-*"))


@pytest.mark.glue
@pytest.mark.parametrize(
    "stage, steps",
    [
        ("finetuned", ["trainer.max_steps=5", "collab.method=none"]),
        ("refit", ["trainer.max_steps=1", "refit.max_steps=5", "collab.rank=96"]),
        ("refit", ["trainer.max_steps=1", "refit=distill", "refit.max_steps=5", "collab.rank=96"]),
    ],
    ids=["finetuned", "refit", "refit-distill"],
)
def test_interrupted_training_continues_where_it_stopped(tmp_path, glue_dir, monkeypatch, stage, steps):
    """A job killed in its fifth training step, run again, takes the one step left after its step-4 checkpoint and
    ends with the weights and results of a job that was never interrupted; its training time counts the four steps
    of the interrupted run."""
    overrides = [  # 16 batches an epoch, so the checkpoint falls mid-epoch and resuming must skip seen batches
        "task=rte", f"data.glue_dir={glue_dir}", "logger=none", "checkpoint_every=2", "data.max_train_samples=64",
        "trainer.per_device_train_batch_size=4", "refit.per_device_train_batch_size=4", *steps,
    ]
    calls, trained, runs, crash_at = [], [], [], {"call": None}  # steps taken, weights and runs after training
    step_seconds = 0.3
    real_step, real_train = transformers.Trainer.training_step, pipeline.train

    def step(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == crash_at["call"]:
            raise KeyboardInterrupt
        time.sleep(step_seconds)
        return real_step(self, *args, **kwargs)

    def train(model, *args, **kwargs):
        result = real_train(model, *args, **kwargs)
        trained.append({k: v.clone() for k, v in model.state_dict().items()})
        runs.append(result)
        return result

    monkeypatch.setattr(transformers.Trainer, "training_step", step)
    monkeypatch.setattr(pipeline, "train", train)
    reference = pipeline.run_job(tiny_job(tmp_path / "reference", *overrides))
    expected_weights, expected_calls = trained[-1], len(calls)

    job = tiny_job(tmp_path, *overrides)
    calls.clear()
    crash_at["call"] = expected_calls
    with pytest.raises(KeyboardInterrupt):
        pipeline.run_job(job)
    checkpoints = pipeline.checkpoints_dir(job, stage)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["checkpoint-2", "checkpoint-4"]
    assert not (job.folder / "results.jsonl").exists()

    calls.clear()
    crash_at["call"] = None
    resumed = pipeline.run_job(job)
    assert len(calls) == 1
    assert not checkpoints.exists()
    assert trained[-1].keys() == expected_weights.keys()
    for name, weight in trained[-1].items():
        torch.testing.assert_close(weight, expected_weights[name], rtol=0, atol=1e-6, msg=name)
    assert [r["main"] for r in resumed] == [r["main"] for r in reference]
    assert runs[-1].resumed_seconds >= 4 * step_seconds and runs[-1].seconds >= 5 * step_seconds
    # the stage's time holds all of its training, the interrupted run's included
    assert resumed[-1 if stage == "refit" else 0]["seconds"] >= runs[-1].seconds


def test_checkpoint_every_must_be_a_positive_step_count(tmp_path):
    for value in ("0", "-5", "1.5", "often"):
        with pytest.raises(ValueError, match="checkpoint_every must be a positive number of training steps"):
            pipeline.validate(tiny(tmp_path, f"checkpoint_every={value}"))
    pipeline.validate(tiny(tmp_path, "checkpoint_every=null"))


@pytest.mark.glue
def test_sweep_resumes_and_summarizes(tmp_path, glue_dir, warm_python):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [
        warm_python(env), str(ROOT / "scripts" / "train_glue.py"), "-m", "+experiment=smoke", "logger=none",
        f"data.glue_dir={glue_dir}", f"output_root={tmp_path}", "data.max_train_samples=16",
        "data.max_eval_samples=16", "data.max_seq_length=32", "trainer.max_steps=1", "refit.max_steps=1",
        "collab.n_iter_max=2",
    ]
    first = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    results = sorted(tmp_path.glob("runs/*/*/*/*/results.jsonl"))
    assert len(results) == 4
    stamps = [p.stat().st_mtime_ns for p in results]
    second = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path)
    assert second.returncode == 0 and second.stdout.count("skipping") == 4
    assert [p.stat().st_mtime_ns for p in results] == stamps

    paths = summarize(tmp_path)
    markdown = paths["markdown"].read_text()
    for needle in ("mrpc (f1)", "rte (accuracy)", "| 384 | reparam", "| 96 | refit", "finetuned"):
        assert needle in markdown
    assert paths["plot"].stat().st_size > 10_000
    assert paths["csv"].read_text().count("\n") == 6  # header, original, 2 ranks x 2 stages


def _record(task, stage, rank, seed, main, qk):
    """One results.jsonl record with just the fields summaries read."""
    return {"task": task, "stage": stage, "model": "m", "method": "cp", "rank": rank, "seed": seed, "main": main,
            "query_key_params": qk}


def _write_results(root, rows, job="a"):
    job = root / "runs" / job
    job.mkdir(parents=True)
    (job / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_table_averages_seeds_and_tasks(tmp_path):
    rows = []
    for seed, bump in ((0, 0.0), (1, 0.02)):
        for task in ("mrpc", "rte"):
            rows += [_record(task, "finetuned", 128, seed, 0.80 + bump, 100),
                     _record(task, "reparam", 128, seed, 0.60, 40), _record(task, "refit", 128, seed, 0.70 + bump, 40)]
    rows += [_record("mrpc", "finetuned", 64, 0, 0.80, 100), _record("mrpc", "reparam", 64, 0, 0.5, 20)]
    rows += [{**_record("mrpc", "finetuned", None, 0, 0.80, 100), "method": "none"}]  # a collab=none job: no rank
    rows += [_record("mrpc", "reparam", 128, 2, 0.60, 40)]  # a third seed for one task only
    rows += [_record("mrpc", "reparam", 64, 0, 0.5, 20)]  # the same stage from a second job: one seed, not two
    _write_results(tmp_path, rows)
    wide = table(load_results(tmp_path))
    original = wide[wide.stage == "finetuned"].iloc[0]
    assert original.mrpc == pytest.approx(81.0) and original.seeds == 2  # rank 64's copy is not counted twice
    assert set(wide["rank"]) == {"-", "128", "64"}  # labels, not floats: a rank-less job leaves them alone
    refit = wide[(wide.stage == "refit") & (wide["rank"] == "128")].iloc[0]
    assert refit.glue_avg == pytest.approx(71.0)
    rank64 = wide[(wide.stage == "reparam") & (wide["rank"] == "64")].iloc[0]
    assert rank64.mrpc == pytest.approx(50.0) and pd.isna(rank64.glue_avg)  # rte missing: no average
    assert original.mrpc_std == pytest.approx(2 ** 0.5) and pd.isna(rank64.mrpc_std)  # std over seeds
    markdown = to_markdown(wide).splitlines()
    assert "| m | - | - | finetuned | 81.0 ± 1.4 | 81.0 ± 1.4 | 81.0 | 100 | 2 |" in markdown
    assert "| m | cp | 128 | reparam | 60.0 ± 0.0 | 60.0 ± 0.0 | 60.0 | 40 | 2-3 |" in markdown
    assert "| m | cp | 64 | reparam | 50.0 |  |  | 20 | 1 |" in markdown


def test_summary_over_chosen_tasks(tmp_path):
    """A task that only some stages have leaves the average empty; ``tasks=`` averages over the others."""
    def line(task, stage, main):
        return _record(task, stage, 128, 0, main, 40)

    rows = [line(t, s, m) for t, m in (("mrpc", 0.8), ("rte", 0.6)) for s in ("finetuned", "reparam", "refit")]
    rows += [line("sst2", "finetuned", 0.9), line("sst2", "reparam", 0.85)]  # no re-fine-tuned SST-2
    _write_results(tmp_path, rows)

    def refit_average(wide):
        return wide[wide.stage == "refit"].iloc[0].glue_avg

    assert pd.isna(refit_average(table(load_results(tmp_path))))
    two = table(load_results(tmp_path, tasks=["MRPC", "rte"]))
    assert refit_average(two) == pytest.approx(70.0) and "sst2" not in two.columns
    paths = summarize(tmp_path, tmp_path / "two", tasks=["mrpc", "rte"])
    markdown = paths["markdown"].read_text()
    assert "sst2" not in markdown and "| avg (2 tasks) |" in markdown
    with pytest.raises(ValueError, match="no results for task.*cola"):
        load_results(tmp_path, tasks=["mrpc", "cola"])
    with pytest.raises(ValueError, match="unknown GLUE task"):
        load_results(tmp_path, tasks=["mrcp"])


def test_summary_over_chosen_seeds(tmp_path, warm_python):
    """``seeds=`` keeps those seeds' rows only, so rows with different seeds can be compared on the same ones."""
    rows = [_record("mrpc", s, 128, seed, m + seed / 10, 40)
            for seed in (0, 1) for s, m in (("finetuned", 0.8), ("reparam", 0.5), ("refit", 0.7))]
    _write_results(tmp_path, rows)
    both = before_after(load_results(tmp_path))
    assert both.iloc[1].mrpc_refit == pytest.approx(75.0) and both.iloc[1].seeds == 2
    first = before_after(load_results(tmp_path, seeds=[0]))
    assert first.iloc[1].mrpc_refit == pytest.approx(70.0) and first.iloc[1].seeds == 1
    with pytest.raises(ValueError, match=r"no results for seed\(s\) \[7\]"):
        load_results(tmp_path, seeds=[7])
    script = ROOT / "scripts" / "summarize.py"
    run = subprocess.run([warm_python(), str(script), "glue", str(tmp_path), "--seeds", "one"], capture_output=True,
                         text=True)
    assert run.returncode == 2 and run.stderr.startswith("error: --seeds='one'")


def test_summary_of_originals_only_has_no_compression_plot(tmp_path):
    """A control sweep (``collab.method=none``: fine-tuned models only) gets its table, and no plot of accuracy
    against a compression that no job made."""
    rows = [{**_record(task, "finetuned", None, seed, main, 100), "method": "none"}
            for task, main in (("cola", 0.1), ("rte", 0.54)) for seed in (0, 1)]
    _write_results(tmp_path, rows)
    paths = summarize(tmp_path)
    assert set(paths) == {"markdown", "csv"} and not (tmp_path / "compression_vs_accuracy.png").exists()
    assert "| m | - | - | finetuned | 10.0 ± 0.0 | 54.0 ± 0.0 | 32.0 | 100 | 2 |" in paths["markdown"].read_text()


def test_before_after_reads_each_refit_against_its_own_start(tmp_path):
    """Cells pair the conversion and the re-fine-tuning of the same jobs; a no-retraining job's score for the same
    size stays out, each seed's original counts once, a task without re-fine-tuning leaves the average empty, and
    the change is measured against the fine-tuned models of the row's own seeds."""
    def job(name, seed, stages, rank=128, task="mrpc"):
        _write_results(tmp_path, [_record(task, s, rank, seed, m, 40) for s, m in stages], job=name)

    job("refit-s0", 0, [("finetuned", 0.80), ("reparam", 0.10), ("refit", 0.70)])
    job("refit-s1", 1, [("finetuned", 0.84), ("reparam", 0.30), ("refit", 0.74)])
    job("refit-r64", 0, [("finetuned", 0.80), ("reparam", 0.05), ("refit", 0.60)], rank=64)
    job("none-s0", 0, [("finetuned", 0.80), ("reparam", 0.90)])  # refit=none: not a "before"
    job("rte-s0", 0, [("finetuned", 0.55), ("reparam", 0.50), ("refit", 0.52)], task="rte")
    job("rte-none", 0, [("finetuned", 0.55), ("reparam", 0.50)], rank=64, task="rte")
    job("mrpc-r96", 0, [("finetuned", 0.80), ("reparam", 0.20), ("refit", 0.76)], rank=96)  # seed 0 only
    job("rte-r96", 0, [("finetuned", 0.55), ("reparam", 0.50), ("refit", 0.55)], rank=96, task="rte")

    wide = before_after(load_results(tmp_path))
    assert list(wide.method) == ["-", "cp", "cp", "cp"] and list(wide["rank"]) == ["-", "128", "96", "64"]
    original, r128, r96, r64 = (row for _, row in wide.iterrows())
    assert original.mrpc_finetuned == pytest.approx(82.0) and original.seeds == 2  # seed 0's model once
    assert r128.mrpc_reparam == pytest.approx(20.0) and r128.mrpc_refit == pytest.approx(72.0)
    assert r128.refit_avg == pytest.approx((72.0 + 52.0) / 2)
    assert r128.change == pytest.approx(62.0 - (82.0 + 55.0) / 2)
    assert r96.change == pytest.approx((76.0 + 55.0) / 2 - (80.0 + 55.0) / 2)  # not against the two-seed original
    assert pd.isna(r64.rte_refit) and pd.isna(r64.refit_avg) and pd.isna(r64.change)
    markdown = before_after_markdown(wide).splitlines()
    assert markdown[0].endswith("| avg after (2 tasks) | change vs its original | seeds |")
    assert "| m | original (fine-tuned) | - | 82.0 ± 2.8 | 55.0 | 68.5 |  | 1-2 |" in markdown
    assert "| m | cp | 128 | 20.0 → 72.0 ± 2.8 | 50.0 → 52.0 | 62.0 | -6.5 | 1-2 |" in markdown
    assert "| m | cp | 96 | 20.0 → 76.0 | 50.0 → 55.0 | 65.5 | -2.0 | 1 |" in markdown
    assert "| m | cp | 64 | 5.0 → 60.0 |  |  |  | 1 |" in markdown
    assert summarize(tmp_path)["before_after"].read_text().splitlines() == markdown

    (tmp_path / "runs").rename(tmp_path / "old")
    job("none-s0", 0, [("finetuned", 0.80), ("reparam", 0.90)])
    assert "before_after" not in summarize(tmp_path / "runs")
    with pytest.raises(ValueError, match="no re-fine-tuned jobs"):
        before_after(load_results(tmp_path / "runs"))
