"""Every config composes, its values reach the library, and every documented sweep finds its committed results.

- Config groups and options are found by listing ``configs/``: each group folder, each yaml in it, against each
  primary config whose defaults list names the group (hydra/* groups: every primary; experiment files: the GLUE
  pipeline, the only entry point with sweeps).
- The ``collab`` group is read once into ``MethodSettings``; the tests check that its fields are the composed
  values and that the GLUE stage, ``scripts/reparametrize.py`` and ``scripts/visualize.py`` pass exactly those to
  ``reparametrize`` (monkeypatched to record its arguments).
- Nothing already run is lost: the committed sweeps' commands (the experiments' READMEs), composed job by job as
  Hydra's basic sweeper would (the experiment's ``hydra.sweeper.params`` included), all name a folder under
  ``experiments/`` that holds ``results.jsonl``, and ``run_job`` skips them without training.
"""

import importlib.util
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from collab_attn.distillation import DistillationTrainer, DistillSettings
from collab_attn.glue import pipeline
from collab_attn.models.settings import CHOICES, TAKES, MethodSettings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
EXPERIMENTS = ROOT / "experiments"
PRIMARIES = sorted(p.stem for p in CONFIGS.glob("*.yaml"))
GROUPS = sorted(
    str(folder.relative_to(CONFIGS)) for folder in CONFIGS.rglob("*") if folder.is_dir() and any(folder.glob("*.yaml"))
)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


def groups_of(primary: str) -> list[str]:
    """The config groups a primary config's defaults list names (``- collab: cp``, ``- override /trainer: x``)."""
    defaults = yaml.safe_load((CONFIGS / f"{primary}.yaml").read_text()).get("defaults", [])
    names = [next(iter(entry)).removeprefix("override ").strip("/") for entry in defaults if isinstance(entry, dict)]
    return [name for name in names if name in GROUPS]


def composed(primary: str, *overrides: str, hydra_config: bool = False):
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return compose(config_name=primary, overrides=list(overrides), return_hydra_config=hydra_config)


def resolved(primary: str, *overrides: str) -> dict:
    return OmegaConf.to_container(composed(primary, *overrides), resolve=True)


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CASES = [
    pytest.param(primary, group, option, id=f"{primary}-{group}={option}")
    for primary in PRIMARIES
    for group in GROUPS
    if group != "experiment" and (group in groups_of(primary) or group.startswith("hydra/"))
    for option in options(group)
]
EXPERIMENT_FILES = options("experiment")


# ---------------------------------------------------------------------------------------------------------------
# (a) Everything composes, and the values reach the library


def test_the_listing_finds_every_group_and_primary():
    assert {"train_glue", "reparametrize", "visualize", "energy", "scratch"} <= set(PRIMARIES)
    assert {"collab", "task", "data", "trainer", "refit", "logger", "experiment", "hydra/launcher"} <= set(GROUPS)
    assert set(options("collab")) >= {"cp", "tucker", "svd", "prune", "none"}
    assert {"collab"} <= set(groups_of("reparametrize")) and {"collab"} <= set(groups_of("visualize"))
    used = {group for primary in PRIMARIES for group in groups_of(primary)}
    assert used | {"experiment", "hydra/launcher"} == set(GROUPS)  # no group is left unused


@pytest.mark.parametrize("primary", PRIMARIES)
def test_every_primary_composes_and_resolves(primary):
    assert resolved(primary)


@pytest.mark.parametrize("primary, group, option", CASES)
def test_every_option_of_every_group_composes(primary, group, option):
    if group.startswith("hydra/"):
        cfg = composed(primary, f"{group}={option}", hydra_config=True)
        assert OmegaConf.select(cfg, group.replace("/", ".")) is not None
        return
    settings = resolved(primary, f"{group}={option}")
    if group == "collab":
        collab = settings["collab"]
        method = MethodSettings.from_config(collab)
        for field in MethodSettings.__dataclass_fields__:
            assert getattr(method, field) == collab.get(field), field


@pytest.mark.parametrize("experiment", EXPERIMENT_FILES)
def test_every_experiment_composes_with_its_sweep(experiment):
    text = (CONFIGS / "experiment" / f"{experiment}.yaml").read_text()
    assert text.startswith("# @package _global_")
    assert "scripts/train_glue.py" in text, "experiment files are for the GLUE pipeline; test other entry points too"
    jobs = sweep_jobs(f"+experiment={experiment}")
    assert jobs and all(job["output_root"] == resolved("train_glue", f"+experiment={experiment}")["output_root"]
                        for job in jobs)
    for job in jobs:
        MethodSettings.from_config(job["collab"])


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"method": "cp", "rank": 128, "rnak": 3}, "unknown key collab.rnak"),
        ({"rank": 128}, "collab.method is missing"),
        ({"method": "svdd", "rank": 96}, "unknown collab.method 'svdd'"),
        ({"method": "cp", "rank": "abc"}, "collab.rank must be an integer"),
        ({"method": "cp", "rank": 128, "solver": "dense"}, "unknown collab.solver 'dense'"),
        ({"method": "cp", "rank": 128, "n_iter_max": 0}, "collab.n_iter_max must be a positive integer"),
        ({"method": "cp", "rank": 128, "tol": -1}, "collab.tol must be a number >= 0"),
        ({"method": "cp", "rank": 128, "budget": "mean:-3"}, "budget"),
        ({"method": "svd", "rank": 96, "budget": "mean:96"}, "collab.budget does not apply to collab.method=svd"),
        ({"method": "prune", "rank": 96, "importance_samples": 0}, "importance_samples must be a positive integer"),
        ({"method": "svd", "rank": 96, "solver": "implicit"}, "collab.solver does not apply"),
    ],
)
def test_settings_refuse_bad_values_naming_the_key(bad, message):
    with pytest.raises(ValueError, match=message):
        MethodSettings.from_config(bad)


def test_settings_helpers():
    assert set(TAKES) == set(CHOICES)  # every method the library has says which keys it takes
    cp = MethodSettings.from_config(resolved("train_glue")["collab"])
    assert (cp.label, cp.rank_request, cp.converts) == ("cp", 192, True)
    assert cp.reparametrize_kwargs() == {"rank": 192, "method": "cp", "solver": "implicit", "init": "svd",
                                         "n_iter_max": 100, "tol": 5e-4}
    aware = MethodSettings(method="cp", rank=128, budget="mean:128", solver="tensorly", calibration="task")
    assert (aware.label, aware.rank_request, aware.keeps_full_size(384)) == ("cp-tensorly-aware", "mean:128", False)
    assert MethodSettings(method="cp", rank=[384] * 6).keeps_full_size(384)
    svd = MethodSettings.from_config({"method": "svd", "rank": 96})
    assert svd.reparametrize_kwargs() == {"rank": 96, "method": "svd"} and svd.label == "svd"
    none = MethodSettings.from_config({**resolved("train_glue")["collab"], "method": "none"})  # collab.method=none
    assert not none.converts and none.record_rank() is None
    with pytest.raises(ValueError, match="nothing to reparametrize"):
        none.reparametrize_kwargs()


def _expected_kwargs(collab: dict, seed: int) -> dict:
    """What reparametrize must receive for a composed collab group: its method's keys, with their values."""
    options = {"cp": ("solver", "init", "n_iter_max", "tol", "tucker_core_size"), "svd": (), "prune": ()}
    options["tucker"] = options["cp"]
    taken = {k: collab[k] for k in options[collab["method"]] if collab.get(k) is not None}
    rank = collab.get("budget") or collab["rank"]
    return {"rank": rank, "method": collab["method"], "seed": seed, **taken}


class _Stop(Exception):
    """Raised by a patched library call once it has recorded its arguments."""


def _recorder(calls: list, stop: bool = False):
    def record(*args, **kwargs):
        calls.append((args, kwargs))
        if stop:
            raise _Stop
        return SimpleNamespace(seconds=0.0, mean_relative_error=0.0, layers=[], details={})
    return record


@pytest.mark.parametrize("option", options("collab"))
@pytest.mark.parametrize("extra", [[], ["seed=3"], ["collab.calibration=task"]], ids=["default", "seed", "task"])
def test_glue_stage_passes_the_composed_values(option, extra, monkeypatch):
    if "collab.calibration=task" in extra and option not in ("cp", "tucker"):
        pytest.skip("calibration is an option of the decompositions")
    settings = resolved("train_glue", f"collab={option}", *extra)
    collab = settings["collab"]
    task, _, method, _ = pipeline.validate(settings)
    if option == "none":
        assert not method.converts
        return
    calls, importance, texts, calibrations = [], [], [], []
    monkeypatch.setattr(pipeline, "reparametrize", _recorder(calls))
    monkeypatch.setattr(pipeline, "head_importance", lambda *a, **kw: importance.append(kw) or "scores")
    monkeypatch.setattr(pipeline.glue, "task_texts", lambda *a, **kw: texts.append(kw) or ["a text"])
    monkeypatch.setattr(pipeline, "calibration_from_texts", lambda *a, **kw: calibrations.append(kw) or "stats")
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=384))
    pipeline.reparametrize_stage(model, None, method, settings["seed"], task=task, train_data=["examples"])
    ((args, kwargs),) = calls
    measured = {"importance": "scores"} if option == "prune" else {"calibration": "stats"} if texts else {}
    assert args == (model,) and kwargs == {**_expected_kwargs(collab, settings["seed"]), **measured}
    if option == "prune":
        assert importance == [{"samples": collab["importance_samples"], "batch_size": collab["importance_batch_size"],
                               "seed": settings["seed"]}]
    if texts:
        assert texts == [{"limit": collab["calibration_samples"], "seed": settings["seed"]}]
        assert calibrations == [{"max_length": collab["calibration_max_length"]}]


@pytest.mark.parametrize("option", options("collab"))
def test_reparametrize_script_passes_the_composed_values(option, tmp_path, monkeypatch):
    script = load_script("reparametrize")
    calls = []
    monkeypatch.setattr(script, "reparametrize", _recorder(calls, stop=True))
    cfg = composed("reparametrize", f"collab={option}", "seed=5", f"output_dir={tmp_path / 'out'}")
    if option in ("none", "prune"):
        with pytest.raises(ValueError, match=f"collab={option}"):
            script.run(cfg)
        return
    with pytest.raises(_Stop):
        script.run(cfg)
    ((args, kwargs),) = calls
    collab = OmegaConf.to_container(cfg.collab)
    assert kwargs == {**_expected_kwargs(collab, 5), "calibration": None, "progress": True}
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("option", options("collab"))
def test_visualize_script_passes_the_composed_values(option, tmp_path, monkeypatch):
    script = load_script("visualize")
    calls = []
    monkeypatch.setattr(script, "collaborative_copy", _recorder(calls, stop=True))
    cfg = composed("visualize", f"collab={option}", "collab.rank=96", "seed=5", f"output_dir={tmp_path / 'out'}")
    if cfg.collab.method not in ("cp", "tucker"):
        with pytest.raises(ValueError, match=f"collab.method={option}"):
            script.run(cfg)
        return
    with pytest.raises(_Stop):
        script.run(cfg)
    ((args, kwargs),) = calls
    method = args[1]
    assert method == MethodSettings.from_config(cfg.collab) and method.rank == 96 and args[2] == 5
    assert kwargs == {"calibration": None}


@pytest.mark.parametrize("trainer", options("trainer"))
@pytest.mark.parametrize("refit", options("refit"))
def test_training_gets_the_composed_recipe(trainer, refit, tmp_path, monkeypatch):
    """``train`` receives the trainer group (fine-tuning) and the trainer group updated by the fields the refit group
    sets (re-fine-tuning; a null one is the trainer's), as composed; the data, the evaluation and the conversion are
    stubbed out."""
    settings = resolved("train_glue", f"trainer={trainer}", f"refit={refit}", "logger=none",
                        f"output_root={tmp_path}", "collab=svd", "collab.rank=96")
    calls = []

    def train(model, data, collator, recipe, seed, checkpoints, every, callbacks=(), **distillation):
        calls.append((recipe, seed, every))
        if distillation:
            assert distillation["trainer_class"] is DistillationTrainer
            assert distillation["distill"] == DistillSettings(**settings["refit"]["distill"])
            assert distillation["teacher"].name_or_path == str(pipeline.finetuned_dir(settings))
        return SimpleNamespace(seconds=0.0, resumed_seconds=0.0, history=[])

    monkeypatch.setattr(pipeline, "train", train)
    monkeypatch.setattr(pipeline, "load_data", lambda *a: {"train": ["examples"]})
    monkeypatch.setattr(pipeline, "evaluate", lambda *a, **kw: {"accuracy": 0.5, "f1": 0.5, "main": 0.5})
    monkeypatch.setattr(pipeline, "reparametrize", _recorder([]))
    records = pipeline.run_job(settings)
    expected = [(settings["trainer"], 0, settings["checkpoint_every"])]
    if settings["refit"]["enabled"]:
        refit_set = {k: v for k, v in settings["refit"].items() if v is not None and k != "distill"}
        expected.append(({**settings["trainer"], **refit_set}, 0, settings["checkpoint_every"]))
        assert expected[-1][0]["max_steps"] == settings["trainer"]["max_steps"]  # refit=paper leaves it to trainer
    assert calls == expected
    assert [r["stage"] for r in records] == ["finetuned", "reparam", "refit"][: len(expected) + 1]


# ---------------------------------------------------------------------------------------------------------------
# (b) Nothing already run is lost


def sweep_jobs(*arguments: str, multirun: bool = True) -> list[dict]:
    """The resolved settings of every job ``python scripts/train_glue.py [-m] <arguments>`` runs, composed as
    Hydra does it: with ``-m``, the config is composed from the non-sweep arguments, its ``hydra.sweeper.params``
    come first and the command line's arguments after them (overriding the same keys), and the basic sweeper runs
    the cartesian product of the resulting values."""
    if not multirun:
        return [resolved("train_glue", *arguments)]
    parser = OverridesParser.create()
    fixed = [o.input_line for o in parser.parse_overrides(list(arguments)) if not o.is_sweep_override()]
    params = composed("train_glue", *fixed, hydra_config=True).hydra.sweeper.params or {}
    overrides = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + list(arguments))
    (batch,) = BasicSweeper.split_arguments(overrides, None)
    with initialize_config_dir(config_dir=str(CONFIGS), version_base="1.3"):
        return [OmegaConf.to_container(compose("train_glue", overrides=job), resolve=True) for job in batch]


GLUE = "data.glue_dir=../shared/data/glue"
_G = f"+experiment=minilm_glue {GLUE}"
_FOUR = "seed=0,1,2 task=cola,mrpc,stsb,rte"
_SST2 = "seed=0 task=sst2 trainer.num_train_epochs=1"
_METHODS = {
    "cp": "",
    "cp-aware": "collab.calibration=task",
    "svd": "collab=svd collab.rank=252,192,120,96,60",
    "prune": "collab=prune collab.rank=256,192,128,96,64",
}
# The commands of the experiments' READMEs, with the shell variables spelled out: (experiment, multirun, arguments).
SWEEPS = [
    # experiments/minilm_glue/README.md: without retraining (refit=none), four tasks on three seeds and SST-2 on one
    *[("minilm_glue", True, f"{_G} refit=none {_FOUR} {m}") for m in _METHODS.values()],
    *[("minilm_glue", True, f"{_G} refit=none {_SST2} {m}") for m in _METHODS.values()],
    # ... and re-fine-tuned (its last code block)
    ("minilm_glue", True, f"{_G} {_FOUR} collab.rank=384,256,192,128,96,64"),
    ("minilm_glue", True, f"{_G} {_FOUR} collab.calibration=task collab.rank=256,192,128,96,64"),
    ("minilm_glue", True, f"{_G} {_FOUR} {_METHODS['prune']}"),
    ("minilm_glue", True, f"{_G} {_FOUR} {_METHODS['svd']}"),
    *[("minilm_glue", True, f"{_G} {_SST2} refit.num_train_epochs=1 {m}")
      for m in ("collab.rank=384,256,192,128,96,64", "collab.rank=256,192,128,96,64 collab.calibration=task",
                _METHODS["prune"], _METHODS["svd"])],
    # ... and re-fine-tuned with distillation ("Re-fine-tuned with distillation"): the choice of alpha and T
    ("minilm_glue", True, f"{_G} refit=distill task=mrpc seed=0 collab.calibration=task collab.rank=128 "
                          "refit.distill.alpha=0,0.5 refit.distill.temperature=1,4"),
    # ... and the race, seed 0, with the group's defaults (alpha 0.5, T 4)
    ("minilm_glue", True, f"{_G} refit=distill seed=0 task=mrpc,rte,cola,stsb collab.calibration=task "
                          "collab.rank=128,64"),
    ("minilm_glue", True, f"{_G} refit=distill seed=0 task=mrpc,rte,cola,stsb collab=prune collab.rank=128,64"),
    # ... and seeds 1 and 2 (SVD at 60: every seed in one command)
    ("minilm_glue", True, f"{_G} refit=distill seed=1,2 task=mrpc,rte,cola,stsb collab.calibration=task "
                          "collab.rank=128,64"),
    ("minilm_glue", True, f"{_G} refit=distill seed=1,2 task=mrpc,rte,cola,stsb collab=prune collab.rank=128,64"),
    ("minilm_glue", True, f"{_G} refit=distill seed=0,1,2 task=mrpc,cola,rte,stsb collab=svd collab.rank=60"),
    # ... and SST-2 (seed 0, one epoch)
    *[("minilm_glue", True, f"{_G} refit=distill {_SST2} refit.num_train_epochs=1 {m}")
      for m in ("collab.calibration=task collab.rank=128,64", "collab=prune collab.rank=128,64",
                "collab=svd collab.rank=60")],
    # ... and 192 on seed 0, the one GPU-grid size run on the CPU
    *[("minilm_glue", True, f"{_G} refit=distill seed=0 task=cola,mrpc,rte,stsb {m} collab.rank=192")
      for m in ("collab.calibration=task", "collab=prune")],
    # experiments/minilm_mrpc_rte/README.md
    ("minilm_mrpc_rte", True, f"+experiment=minilm_mrpc_rte {GLUE}"),
    ("minilm_mrpc_rte", False, f"+experiment=minilm_mrpc_rte {GLUE} task=mrpc collab.rank=128 collab.calibration=task"),
    # experiments/minilm_rte_recipe/README.md
    ("minilm_rte_recipe", False, f"{_G} task=rte collab=none trainer.learning_rate=3e-5 trainer.num_train_epochs=4 "
                                 "output_root=experiments/minilm_rte_recipe sweep_name=minilm_rte_recipe"),
    # experiments/minilm_random_init/README.md
    ("minilm_random_init", True, f"{_G} weights=random collab.method=none collab.rank=384 task=rte,cola seed=0,1,2 "
                                 "output_root=experiments/minilm_random_init sweep_name=minilm_random_init"),
    # experiments/minilm_sst2/README.md
    ("minilm_sst2", False, f"task=sst2 collab=none {GLUE} trainer.learning_rate=1e-4 trainer.num_train_epochs=1 "
                           "output_root=experiments/minilm_sst2 sweep_name=minilm_sst2"),
]


@pytest.mark.parametrize("experiment, multirun, command", SWEEPS)
def test_committed_sweeps_are_found_and_skipped(experiment, multirun, command, monkeypatch, capsys):
    def no_training(*args, **kwargs):
        raise AssertionError("a committed job started training")

    monkeypatch.setattr(pipeline, "train", no_training)
    monkeypatch.setattr(pipeline, "validate", no_training)
    monkeypatch.chdir(ROOT)  # output_root is relative to where the sweep was launched: the repository root
    jobs = sweep_jobs(*command.split(), multirun=multirun)
    missing = []
    for job in jobs:
        assert Path(job["output_root"]) == Path("experiments") / experiment
        results = pipeline.job_dir(job) / pipeline.RESULTS_FILE
        if not results.is_file():
            missing.append(str(pipeline.job_dir(job)))
            continue
        records = pipeline.run_job(job)
        assert records == pipeline.read_results(results) and records
        assert {r["seed"] for r in records} == {job["seed"]} and records[0]["stage"] == "finetuned"
    assert capsys.readouterr().out.count("skipping") == len(jobs) - len(missing)
    assert not missing, f"{len(missing)} of {len(jobs)} documented jobs have no results: {missing}"
