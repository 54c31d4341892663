"""Every config composes, its values reach the library, and every documented sweep finds its committed results.

- Config groups and options are found by listing ``configs/``: each group folder, each yaml in it, against each
  primary config whose defaults list names the group (hydra/* groups: every primary; experiment files: the GLUE
  pipeline, the only entry point with sweeps).
- The ``collab`` group is read once into ``MethodSettings``; the tests check that its fields are the composed
  values and that the GLUE stage, ``scripts/reparametrize.py`` and ``scripts/visualize.py`` pass exactly those to
  ``reparametrize`` (monkeypatched to record its arguments).
- Nothing already run is lost: the committed sweeps' commands (the experiments' pages), composed job by job as
  Hydra's basic sweeper would (the experiment's ``hydra.sweeper.params`` included), all name a folder under
  ``experiments/`` that holds ``results.jsonl``, and ``run_job`` skips them without training.
"""

import copy
import importlib.util
import inspect
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from collab_attn import tracking
from collab_attn.char_lm import runs as lm_runs
from collab_attn.char_lm.data import corpus_from_text, val_blocks
from collab_attn.char_lm.models import MODEL_KEYS, gpt_config
from collab_attn.distillation import DistillationTrainer, DistillSettings
from collab_attn.glue import calibrate as calibrate_module
from collab_attn.glue import pipeline
from collab_attn.glue.jobs import GlueJob
from collab_attn.models.methods import METHODS
from collab_attn.models.settings import MethodSettings, choices, group_keys
from collab_attn.training import training_args

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


DATE = r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}"  # ${now:%Y-%m-%d_%H-%M-%S}
# What each interpolated value of a primary config must resolve to, from the resolved config ``s``: a value, or a
# pattern for one that holds the time of the run. A primary config not named has no interpolations.
RESOLVED = {
    "convert_lm": {
        "train_dir": lambda s: f"outputs/shakespeare_char/{s['recipe_name']}",
        "model_dir": lambda s: f"{s['train_dir']}/models/concat-k{s['model']['n_embd']}-seed0",
        "output_dir": lambda s: f"{s['train_dir']}/convert",
    },
    "reparametrize": {"output_dir": lambda s: re.compile(rf"outputs/reparametrized/{s['collab']['method']}-{DATE}")},
    "scratch": {"output_dir": lambda s: f"outputs/scratch_{s['task']}"},
    "train_lm": {
        "save_models": lambda s: [f"concat-k{s['model']['n_embd']}-seed0"],
        "output_dir": lambda s: f"outputs/shakespeare_char/{s['recipe_name']}",
    },
    "visualize": {
        "output_dir": lambda s: re.compile(
            rf"outputs/visualize/{s['collab']['method']}-rank{s['collab']['rank']}-{DATE}"),
    },
}


def file_values(primary: str) -> dict:
    """What a primary config's files set, read without Hydra: the default option of every group its defaults list
    names (its values under the group's package, ``group_file``) and its own values (``hydra`` aside), merged in the
    order of the defaults list (``_self_`` last unless placed); interpolations are left as written."""
    own = OmegaConf.to_container(OmegaConf.load(CONFIGS / f"{primary}.yaml"))
    defaults = own.pop("defaults", [])
    own.pop("hydra", None)
    values = OmegaConf.create()
    for entry in defaults if "_self_" in defaults else [*defaults, "_self_"]:
        if entry == "_self_":
            values = OmegaConf.merge(values, own)
            continue
        ((group, option),) = entry.items()
        package, group_values = group_file(group, option)
        for name in reversed(package.split(".") if package else []):
            group_values = {name: group_values}
        values = OmegaConf.merge(values, group_values)
    return OmegaConf.to_container(values, resolve=False)


@pytest.mark.parametrize("primary", PRIMARIES)
def test_every_primary_composes_and_resolves(primary):
    """Composed without overrides, a primary config holds exactly the values that its file and the default options
    of its groups set (``file_values``): the same keys, each value of the same type, and every interpolation
    resolved to what it points at (``RESOLVED``: the resolved values of other keys, themselves checked here)."""
    settings = resolved(primary)
    got, expected = leaves(settings), leaves(file_values(primary))
    assert sorted(got) == sorted(expected)
    interpolated = {key for key, value in expected.items() if "${" in str(value)}
    assert interpolated == set(RESOLVED.get(primary, {})), "every interpolation has its expected value here"
    for key, value in expected.items():
        if key not in interpolated:
            assert (type(got[key]), got[key]) == (type(value), value), key
            continue
        want = RESOLVED[primary][key](settings)
        if isinstance(want, re.Pattern):
            assert isinstance(got[key], str) and want.fullmatch(got[key]), (key, got[key], want.pattern)
        else:
            assert got[key] == want, key
    assert "${" not in str(settings)


@pytest.mark.parametrize("primary, group, option", CASES)
def test_every_option_of_every_group_composes(primary, group, option):
    if group.startswith("hydra/"):
        cfg = composed(primary, f"{group}={option}", hydra_config=True)
        assert OmegaConf.select(cfg, group.replace("/", ".")) is not None
        return
    settings = resolved(primary, f"{group}={option}")
    if group != "collab":
        assert_option_values_arrive(primary, group, option, settings)
        return
    collab = settings["collab"]
    method = MethodSettings.from_config(collab)
    keys = method.to_group()
    assert keys == {key: collab[key] for key in keys}, "every key the method takes arrives with its value"
    if method.converts:
        assert method.reparametrize_kwargs() == {
            "rank": collab.get("budget") or collab["rank"], "method": collab["method"],
            **{key: collab[key] for key in method.conversion.option_names},
        }


def group_file(group: str, option: str) -> tuple[str, dict]:
    """What ``configs/<group>/<option>.yaml`` sets and where, read as Hydra reads it: the package its values go to
    (its ``# @package`` header among the leading comments; none: the group's path, dotted; ``""`` for
    ``_global_``) and its values after those of the options of the same group its defaults list names (``_self_``
    last unless placed)."""
    path = CONFIGS / group / f"{option}.yaml"
    leading = []
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            break
        leading.append(line)
    headers = [line.split("@package", 1)[1].strip() for line in leading if line.startswith("# @package")]
    package = headers[0] if headers else group.replace("/", ".")
    package = "" if package == "_global_" else package.removeprefix("_global_.")
    own = OmegaConf.to_container(OmegaConf.load(path))
    defaults = own.pop("defaults", [])
    assert all(isinstance(entry, str) for entry in defaults), f"{path}: only same-group defaults are read here"
    values = OmegaConf.create()
    for entry in defaults if "_self_" in defaults else [*defaults, "_self_"]:
        values = OmegaConf.merge(values, own if entry == "_self_" else group_file(group, entry)[1])
    return package, OmegaConf.to_container(values)


def leaves(values: dict, prefix: str = "") -> dict:
    """Every value of a nested dict that is not itself a non-empty dict, by its dotted key."""
    flat = {}
    for key, value in values.items():
        dotted = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(leaves(value, dotted))
        else:
            flat[dotted] = value
    return flat


def assert_option_values_arrive(primary: str, group: str, option: str, settings: dict) -> None:
    """Every value of the option's file is in the resolved settings under the group's package, of the same type
    (``temperature: 4`` and ``4.0`` hash apart), and reaches what the entry point builds from it. No primary config
    overrides a value of the groups it names: an option's file is what its jobs get."""
    package, values = group_file(group, option)
    composed_values = leaves(settings)
    for key, value in leaves(values).items():
        where = f"{package}.{key}" if package else key
        assert where in composed_values, f"{where} of {group}/{option}.yaml is missing from {primary}"
        assert (type(composed_values[where]), composed_values[where]) == (type(value), value), where
    ARRIVALS[group](primary, option, values, settings)


CHECKPOINTS = Path("unused-checkpoint-dir")  # TrainingArguments only records it


def _trainer_arrives(primary: str, option: str, values: dict, settings: dict) -> None:
    """Fine-tuning: ``run_job`` hands ``trainer`` to ``train``, which builds the TrainingArguments with
    ``training_args``; re-fine-tuning: ``GlueJob.refit_recipe``, which keeps each trainer field the refit group
    leaves out or null (here ``refit=paper``: ``max_steps``)."""
    job = pipeline.validate(settings)  # every field is a TrainingArguments field
    finetune = training_args(CHECKPOINTS, settings["seed"], settings["trainer"])
    refit = training_args(CHECKPOINTS, settings["seed"], job.refit_recipe)
    inherited = [key for key in values if settings["refit"].get(key) is None]
    assert "max_steps" in inherited
    for key, value in values.items():
        assert getattr(finetune, key) == value, key
        if key in inherited:
            assert getattr(refit, key) == value, key


def _refit_arrives(primary: str, option: str, values: dict, settings: dict) -> None:
    """The re-fine-tuning's TrainingArguments (``refit_recipe`` through ``training_args``) hold each field the
    group sets, and the trainer's where it says null; ``distill`` becomes the ``DistillSettings`` that
    ``validate`` returns (None without it); ``enabled`` is ``run_job``'s switch (followed by
    ``test_training_gets_the_composed_recipe``), no TrainingArguments field."""
    distill = pipeline.validate(settings).distill
    assert distill == (DistillSettings(**values["distill"]) if "distill" in values else None)
    fields = {key: value for key, value in values.items() if key not in ("enabled", "distill")}
    # the default trainer group has refit=paper's batch, rate and epochs: a trainer that differs in every field
    # tells the refit group's values from the trainer's
    other = {key: 11 if value is None else 2 * value + 1 for key, value in fields.items()}
    settings = resolved(primary, f"refit={option}", *(f"++trainer.{k}={v}" for k, v in other.items()))
    args = training_args(CHECKPOINTS, settings["seed"], GlueJob.of(settings).refit_recipe)
    for key, value in fields.items():
        assert getattr(args, key) == (other[key] if value is None else value), key
    assert not {"enabled", "distill"} & set(args.to_dict())


def _logger_arrives(primary: str, option: str, values: dict, settings: dict) -> None:
    """``make_tracker`` (the GLUE job's tracker; ``train_lm``: through ``log_to_tracker``, one W&B run per run)
    makes a W&B tracker with the group's project, mode, entity and tags, or none at all; W&B is not started (the
    tracker class is replaced by one that records its arguments)."""
    made = []
    signature = inspect.signature(tracking.WandbTracker)

    class Recorded(tracking.NoTracker):
        def __init__(self, *args, **kwargs):
            made.append(signature.bind(*args, **kwargs).arguments)

    tracking.check_logger(settings["logger"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tracking, "WandbTracker", Recorded)
        if primary == "train_glue":
            tracker = pipeline.make_tracker(settings["logger"], "job", settings["sweep_name"], settings, Path("run"))
            assert type(tracker) is (tracking.NoTracker if values["name"] == "none" else Recorded)
        else:
            record = {"recipe": "cpu", "name": "concat-k128-seed0", "signature": {}, "curve": [{"step": 0}],
                      "best_val_loss": 1.0, "tokens_per_second": 1.0, "cache_bytes_per_token_bf16": 1}
            lm_runs.log_to_tracker(settings, record)
    if values["name"] == "none":
        assert made == []
        return
    assert len(made) == 1, made
    (arguments,) = made
    for key in ("project", "mode", "entity", "tags"):
        assert arguments.get(key, signature.parameters[key].default) == values[key], key


def _recipe_arrives(primary: str, option: str, values: dict, settings: dict) -> None:
    """A language-model recipe (``# @package _global_``): its ``trainer`` fields are the runs' TrainingArguments
    (``trainer_fields`` through ``training_args``), its ``model`` and ``block_size`` the GPT-2 config of a run,
    ``eval_iters`` the number of validation batches, and everything the signature of a stored run holds; the
    conversion reads the model that ``train_lm`` saved with the same recipe."""
    fields = lm_runs.trainer_fields(settings, progress=False)
    args = training_args(CHECKPOINTS, 0, fields)
    for key, value in values["trainer"].items():
        assert fields[key] == value and getattr(args, key) == value, key
    signature = lm_runs.signature(settings)
    assert signature["model"] == {key: values["model"][key] for key in MODEL_KEYS}
    assert (signature["block_size"], signature["eval_iters"]) == (values["block_size"], values["eval_iters"])
    assert signature["trainer"] == {k: v for k, v in values["trainer"].items()
                                    if k not in ("disable_tqdm", "dataloader_num_workers")}  # no effect on a run
    corpus = corpus_from_text("".join(chr(97 + i % 26) for i in range(10 * values["block_size"] + 100)))
    val = val_blocks(corpus, settings["block_size"], fields["per_device_eval_batch_size"], settings["eval_iters"])
    assert len(val) == values["eval_iters"] * values["trainer"]["per_device_train_batch_size"]
    assert len(val[0]["input_ids"]) == values["block_size"]
    model = values["model"]
    trained = resolved("train_lm", f"recipe={option}")
    assert Path(trained["output_dir"]).name == values["recipe_name"]
    if primary == "train_lm":
        ((kind, rank, _),) = lm_runs.runs_of(settings)
        config = gpt_config(corpus.vocab_size, settings["block_size"], **settings["model"], kind=kind,
                            rank=rank)
        assert (config.n_layer, config.n_head, config.n_embd, config.n_positions) == (
            model["n_layer"], model["n_head"], model["n_embd"], values["block_size"])
        assert config.resid_pdrop == config.embd_pdrop == config.attn_pdrop == model["dropout"]
    else:
        assert Path(settings["model_dir"]) == Path(trained["output_dir"]) / "models" / trained["save_models"][0]
        assert Path(settings["model_dir"]).name == f"concat-k{model['n_embd']}-seed0"


def _task_arrives(primary: str, option: str, values: dict, settings: dict) -> None:
    """The task ``validate`` returns and the folder the job's results go to."""
    job = pipeline.validate(settings)
    assert job.task.name == values["name"]
    assert job.folder.relative_to(Path(settings["output_root"]) / "runs" / values["name"])


def _data_arrives(primary: str, option: str, values: dict, settings: dict) -> None:
    """``load_data`` reads the GLUE folder, truncates the splits and tokenizes to the length the group gives (the
    reading and tokenizing replaced by recorders)."""
    import datasets

    calls = {}
    splits = {"train": 300, "validation": 200}
    raw = datasets.DatasetDict({name: datasets.Dataset.from_dict({"idx": list(range(n))}) for name, n in
                                splits.items()})
    job = pipeline.validate(settings)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline.glue, "load_glue", lambda task, glue_dir: calls.update(glue_dir=glue_dir) or raw)
        patch.setattr(pipeline.glue, "tokenize_glue",
                      lambda data, tokenizer, task, max_seq_length: calls.update(length=max_seq_length) or data)
        data = pipeline.load_data(job.task, job.data, tokenizer=None)
    assert calls == {"glue_dir": values["glue_dir"], "length": values["max_seq_length"]}
    for name, limit in (("train", values["max_train_samples"]), ("validation", values["max_eval_samples"])):
        assert len(data[name]) == min(splits[name], limit or splits[name])


ARRIVALS = {"trainer": _trainer_arrives, "refit": _refit_arrives, "logger": _logger_arrives,
            "recipe": _recipe_arrives, "task": _task_arrives, "data": _data_arrives}


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
        ({"method": "cp", "rank": 128, "solver": "dense"}, "collab.solver 'dense' is unknown"),
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
    assert choices() == ("none", *METHODS)
    cp = MethodSettings.from_config(resolved("train_glue")["collab"])
    assert (cp.label, cp.rank_request, cp.converts) == ("cp", 192, True)
    assert cp.reparametrize_kwargs() == {"rank": 192, "method": "cp", "solver": "implicit", "init": "svd",
                                         "n_iter_max": 100, "tol": 5e-4}
    aware = MethodSettings.from_config(
        dict(method="cp", rank=128, budget="mean:128", solver="tensorly", calibration="task")
    )
    assert (aware.label, aware.rank_request, aware.keeps_full_size(384)) == ("cp-tensorly-aware", "mean:128", False)
    assert MethodSettings(method="cp", rank=[384] * 6).keeps_full_size(384)  # options: the method's defaults
    svd = MethodSettings.from_config({"method": "svd", "rank": 96})
    assert svd.reparametrize_kwargs() == {"rank": 96, "method": "svd"} and svd.label == "svd"
    none = MethodSettings.from_config({**resolved("train_glue")["collab"], "method": "none"})  # collab.method=none
    assert not none.converts and none.record_rank() is None
    with pytest.raises(ValueError, match="nothing to reparametrize"):
        none.reparametrize_kwargs()


def _expected_kwargs(collab: dict, seed: int) -> dict:
    """What reparametrize must receive for a composed collab group: its method's keys, with their values."""
    taken = {k: collab[k] for k in METHODS[collab["method"]].option_names}
    rank = collab.get("budget") or collab["rank"]
    return {"rank": rank, "method": collab["method"], "seed": seed, **taken}


class _Stop(Exception):
    """Raised by a patched library call once it has recorded its arguments."""


def _recorder(calls: list, stop: bool = False):
    def record(*args, **kwargs):
        calls.append((args, kwargs))
        if stop:
            raise _Stop
        return SimpleNamespace(seconds=0.0, mean_relative_error=0.0, layers=[], pruning=None)
    return record


# Every collab option by default and with another seed; with task calibration, every option whose group takes a
# calibration (the others refuse the key: no case of theirs could run).
GLUE_STAGE_CASES = [
    pytest.param(option, extra, id=f"{name}-{option}")
    for name, extra in (("default", []), ("seed", ["seed=3"]), ("task", ["collab.calibration=task"]))
    for option in options("collab")
    if name != "task" or "calibration" in group_file("collab", option)[1]
]


@pytest.mark.parametrize("option, extra", GLUE_STAGE_CASES)
def test_glue_stage_passes_the_composed_values(option, extra, monkeypatch):
    settings = resolved("train_glue", f"collab={option}", *extra)
    collab = settings["collab"]
    job = pipeline.validate(settings)
    method = job.method
    if option == "none":
        assert not method.converts
        return
    calls, importance, texts, calibrations = [], [], [], []
    monkeypatch.setattr(pipeline, "reparametrize", _recorder(calls))
    monkeypatch.setattr(pipeline, "head_importance", lambda *a, **kw: importance.append(kw) or "scores")
    monkeypatch.setattr(pipeline.glue, "task_texts", lambda *a, **kw: texts.append(kw) or ["a text"])
    monkeypatch.setattr(calibrate_module, "calibration_from_texts", lambda *a, **kw: calibrations.append(kw) or "stats")
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=384))
    pipeline.reparametrize_stage(job, model, None, train_data=["examples"])
    ((args, kwargs),) = calls
    calibrated = collab.get("calibration") == "task"  # the task's texts are drawn and measured, or nothing is
    measured = {"importance": "scores"} if option == "prune" else {"calibration": "stats"} if calibrated else {}
    assert args == (model,) and kwargs == {**_expected_kwargs(collab, settings["seed"]), **measured}
    assert importance == ([{"samples": collab["importance_samples"], "batch_size": collab["importance_batch_size"],
                            "seed": settings["seed"]}] if option == "prune" else [])
    if not calibrated:
        assert texts == calibrations == []
    else:
        assert collab["calibration_samples"] is collab["calibration_max_length"] is None  # null: 512 texts of 128
        assert texts == [{"limit": 512, "seed": settings["seed"]}]
        assert calibrations == [{"max_length": 128}]


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
            assert distillation["teacher"].name_or_path == str(GlueJob.of(settings).finetuned_dir)
        return SimpleNamespace(seconds=0.0, resumed_seconds=0.0, history=[])

    monkeypatch.setattr(pipeline, "train", train)
    monkeypatch.setattr(pipeline, "load_data", lambda *a: {"train": ["examples"]})
    monkeypatch.setattr(pipeline, "evaluate", lambda *a, **kw: {"accuracy": 0.5, "f1": 0.5, "main": 0.5})
    monkeypatch.setattr(pipeline, "reparametrize", _recorder([]))
    records = pipeline.run_job(GlueJob.of(settings))
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
    return [job_settings(job, GROUPS_COMPOSED) for job in batch]


GROUPS_COMPOSED = {}  # every sweep's jobs: the composition of train_glue by its groups' choices


def job_settings(job: list[str], groups_composed: dict) -> dict:
    """One job's resolved settings, as Hydra composes ``train_glue`` with the overrides ``job``: the config groups'
    choices select the defaults, then each value override is set in order (what Hydra does after composing the
    defaults; ``OmegaConf.update``, merged). The composition of the groups is made once per choice of them
    (``groups_composed``): a sweep's jobs differ mostly in values (seeds, ranks). A job with an override other than
    setting a value is composed by Hydra whole."""
    groups, values = [], []
    for override in OverridesParser.create().parse_overrides(job):  # a config group is a folder of configs/
        (groups if (CONFIGS / override.key_or_group).is_dir() else values).append(override)
    groups = tuple(o.input_line for o in groups)
    if any(o.is_add() or o.is_force_add() or o.is_delete() for o in values):
        return resolved("train_glue", *job)
    if groups not in groups_composed:
        groups_composed[groups] = composed("train_glue", *groups)
    cfg = copy.deepcopy(groups_composed[groups])
    for override in values:
        OmegaConf.update(cfg, override.key_or_group, override.value(), merge=True)
    return OmegaConf.to_container(cfg, resolve=True)


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
# The commands of the experiments' pages, with the shell variables spelled out: (experiment, multirun, arguments).
SWEEPS = [
    # experiments/minilm_glue/LOG.md (the commands as run; its README.md lists the same jobs, not the alpha/T choice):
    # without retraining (refit=none), four tasks on three seeds and SST-2 on one
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
    # experiments/kv_cache/README.md: the MiniLM cache race, without retraining (SST-2 on a shorter fine-tuning)
    *[("kv_cache/minilm_glue", True, f"+experiment=kv_cache_glue {GLUE} refit=none {tasks} {m}") for m in (
        *[f"collab={d} collab.rank={r} collab.value_rank={r} collab.calibration=task"
          for d, ranks in (("cp", (186, 91, 44)), ("tucker", (82, 51, 30))) for r in ranks],
        "collab=prune collab.rank=183,88,41",
        *[f"collab=svd collab.rank={r} collab.value_rank={r}" for r in (180, 84, 36)],
        "collab=kv-svd collab.rank=192,96 collab.calibration=task")
      for tasks in ("task=mrpc,rte,stsb", "task=sst2 data.max_train_samples=20000 trainer.num_train_epochs=1")],
    # ... and re-fine-tuned with distillation for one epoch at a quarter of the attention parameters
    *[("kv_cache/minilm_glue", True, f"+experiment=kv_cache_glue {GLUE} refit=distill refit.num_train_epochs=1 "
       f"task=mrpc,stsb {m}") for m in (
        "collab=cp collab.rank=91 collab.value_rank=91 collab.calibration=task",
        "collab=tucker collab.rank=51 collab.value_rank=51 collab.calibration=task", "collab=prune collab.rank=88",
        "collab=svd collab.rank=84 collab.value_rank=84", "collab=kv-svd collab.rank=192 collab.calibration=task")],
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


def test_a_job_s_settings_are_what_hydra_composes():
    """``job_settings`` (the groups composed once, then each value set) gives what Hydra's compose gives for the same
    overrides: for jobs of two sweeps (config groups, one of them added with ``+``, and values)."""
    parser = OverridesParser.create()
    jobs = []
    for _, _, command in (SWEEPS[0], SWEEPS[-1]):
        (batch,) = BasicSweeper.split_arguments(parser.parse_overrides(command.split()), None)
        jobs += batch[:2] + batch[-1:]
    cache = {}
    for job in jobs:
        assert job_settings(job, cache) == resolved("train_glue", *job), job
    assert len(cache) < len(jobs)  # the cache was used


@pytest.mark.parametrize("experiment, multirun, command", SWEEPS)
def test_committed_sweeps_are_found_and_skipped(experiment, multirun, command, monkeypatch, capsys):
    def no_training(*args, **kwargs):
        raise AssertionError("a committed job started training")

    monkeypatch.setattr(pipeline, "train", no_training)
    monkeypatch.setattr(pipeline, "check_inputs", no_training)  # the model, the GLUE files: not needed to skip
    monkeypatch.chdir(ROOT)  # output_root is relative to where the sweep was launched: the repository root
    jobs = sweep_jobs(*command.split(), multirun=multirun)
    missing = []
    for settings in jobs:
        job = GlueJob.of(settings)
        assert Path(job.output_root) == Path("experiments") / experiment
        stored = job.store.finished(job.stored_name)
        if stored is None:
            missing.append(str(job.folder))
            continue
        records = pipeline.run_job(job)
        assert records == stored and records
        assert {r["seed"] for r in records} == {job.seed} and records[0]["stage"] == "finetuned"
    assert capsys.readouterr().out.count("skipping") == len(jobs) - len(missing)
    assert not missing, f"{len(missing)} of {len(jobs)} documented jobs have no results: {missing}"


@pytest.mark.parametrize("name", list(METHODS))
def test_each_method_group_holds_the_keys_and_defaults_of_its_method(name):
    """``configs/collab/<method>.yaml`` is the method's group: ``method``, ``rank`` and ``group_keys`` with the
    dataclasses' defaults (rank is the file's own choice), and nothing else."""
    group = OmegaConf.to_container(OmegaConf.load(CONFIGS / "collab" / f"{name}.yaml"))
    assert group.pop("method") == name and type(group.pop("rank")) is int
    assert group == group_keys(METHODS[name])
