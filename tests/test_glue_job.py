"""A GLUE job is a frozen typed object (``collab_attn.glue.jobs.GlueJob``): read once from the resolved settings,
bad values refused then with the message that names the setting, and handed to every stage of the pipeline."""

import dataclasses
import inspect

import pytest
from test_pipeline import settings

from collab_attn.distillation import DistillSettings
from collab_attn.glue import jobs, pipeline
from collab_attn.glue.jobs import DataSettings, GlueJob
from collab_attn.glue.tasks import get_task
from collab_attn.models.settings import MethodSettings


def test_the_job_holds_the_typed_settings(tmp_path):
    composed = settings("task=rte", "seed=3", "refit=distill", "data.max_train_samples=16", f"output_root={tmp_path}")
    job = GlueJob.of(composed)
    assert job.task is get_task("rte") and job.seed == 3 and job.model == "minilm" and job.weights == "pretrained"
    assert job.method == MethodSettings.from_config(composed["collab"])
    assert job.distill == DistillSettings(**composed["refit"]["distill"]) and "distill" not in job.refit
    assert job.data == DataSettings(None, 128, 16, None) and job.data.limits == {
        "max_seq_length": 128, "max_train_samples": 16, "max_eval_samples": None}
    assert job.trainer == composed["trainer"] and job.refits and job.output_root == str(tmp_path)
    assert dict(job.settings) == composed  # recorded as composed (W&B config, finetune.json)
    composed["seed"] = 7
    composed["trainer"]["learning_rate"] = 1.0
    assert job.seed == 3 and job.settings["seed"] == 3 and job.settings["trainer"]["learning_rate"] == 2e-5
    assert job.trainer["learning_rate"] == 2e-5  # the job holds its own copy
    assert GlueJob.of(settings("task=rte", "seed=3", "refit=distill", "data.max_train_samples=16",
                               f"output_root={tmp_path}")) == job


def test_the_job_is_frozen():
    job = GlueJob.of(settings())
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.seed = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.data.max_seq_length = 64
    with pytest.raises(TypeError):
        job.trainer["learning_rate"] = 1.0
    with pytest.raises(TypeError):
        job.refit["enabled"] = False
    with pytest.raises(TypeError):
        job.settings["seed"] = 1


def test_stages_take_the_job_not_the_settings():
    """Only the reading of the settings takes them; every stage takes the job, and ``run_job`` refuses a dict."""
    with pytest.raises(TypeError, match=r"run_job takes a GlueJob \(GlueJob.of\(settings\)\), not a dict"):
        pipeline.run_job(settings())
    for module in (jobs, pipeline):
        for name, function in inspect.getmembers(module, inspect.isfunction):
            if function.__module__ == module.__name__ and name != "validate":
                assert "settings" not in inspect.signature(function).parameters, f"{module.__name__}.{name}"
    stages = (pipeline.run_job, pipeline.check_inputs, pipeline.checkpoints_dir, pipeline.finetuned_checkpoint,
              pipeline.finetuned_metrics, pipeline.stage_record, pipeline.reparametrize_stage, pipeline.refit_stage,
              pipeline.refit_trainer)
    for stage in stages:
        assert next(iter(inspect.signature(stage).parameters.values())).annotation == "GlueJob", stage.__name__


def test_validate_returns_the_job():
    composed = settings()
    assert pipeline.validate(composed) == GlueJob.of(composed)


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["task.name=mrcp"], ValueError, "task.name=mrcp: unknown GLUE task 'mrcp'"),
        (["weights=scratch"], ValueError, "weights='scratch': choose 'pretrained'"),
        (["weights=random", "finetune=false"], ValueError, "weights=random needs finetune=true"),
        (["finetune=maybe"], ValueError, "finetune must be true or false"),
        (["checkpoint_every=0"], ValueError, "checkpoint_every must be a positive number of training steps"),
        (["seed=-1"], ValueError, "seed must be an integer >= 0, got -1"),
        (["+collab.importance_samples=8"], ValueError, "collab.importance_samples does not apply to collab.method=cp"),
        (["collab.budget=mean:-3"], ValueError, "budget"),
        (["collab.calibration=x.txt", "collab.fit_steps=5"], ValueError,
         "collab.fit_steps=5: the GLUE pipeline does not fit the converted layers"),
        (["collab.calibration=x.txt", "collab.e2e_steps=5"], ValueError,
         "collab.e2e_steps=5: the GLUE pipeline does not fit the converted layers"),
        (["collab.calibration=x.txt", "collab.distill_steps=5"], ValueError,
         "collab.distill_steps=5: the GLUE pipeline does not fit the converted layers"),
        (["+trainer.learning_rat=1e-4"], ValueError, "trainer.learning_rat is not a transformers.TrainingArguments"),
        (["trainer.per_device_train_batch_size=0"], ValueError, "trainer.per_device_train_batch_size must be a"),
        (["refit.max_steps=0"], ValueError, "refit.max_steps must be a positive number of steps or -1"),
        (["refit.enabled=sometimes"], ValueError, "refit.enabled must be true or false"),
        (["refit=distill", "+refit.distill.gamma=1"], ValueError, "refit.distill.gamma is not a distillation setting"),
        (["data.max_seq_length=0"], ValueError, "data.max_seq_length must be a positive integer"),
        (["data.max_eval_samples=-2"], ValueError, "data.max_eval_samples must be a positive integer or null"),
        (["+data.shuffle=true"], ValueError, "data.shuffle is not a data setting"),
        (["logger.name=tensorboard"], ValueError, "unknown logger 'tensorboard'"),
    ],
)
def test_bad_values_are_refused_when_the_job_is_built(overrides, error, message):
    composed = settings(*overrides)
    with pytest.raises(error, match=message):
        GlueJob.of(composed)
    with pytest.raises(error, match=message):
        pipeline.validate(composed)  # the script's check: the same refusal


@pytest.mark.parametrize(
    "overrides, error, message",
    [
        (["model=/no/such/checkpoint"], FileNotFoundError, "no checkpoint at"),
        (["collab.rank=999"], ValueError, r"rank 999 for layer 0 is invalid.*\[1, 384\]"),
        (["data.glue_dir=/no/such/glue"], FileNotFoundError, "data.glue_dir=/no/such/glue does not exist"),
        (["collab.calibration=/no/texts.txt"], FileNotFoundError, "collab.calibration=/no/texts.txt: no such file"),
    ],
)
def test_what_the_settings_name_is_checked_by_validate(tmp_path, overrides, error, message):
    """The job reads no file (a finished job is found and skipped without its model or data); ``validate`` and
    ``run_job`` check the model, the rank against it, the GLUE files and the calibration texts."""
    job = GlueJob.of(settings(f"output_root={tmp_path / 'out'}", *overrides))
    with pytest.raises(error, match=message):
        pipeline.validate(dict(job.settings))
    with pytest.raises(error, match=message):
        pipeline.run_job(job)
    assert not (tmp_path / "out").exists()
