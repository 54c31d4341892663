"""Bad input that used to slip through: one ``error:`` line and nothing left behind; refit inheriting trainer. The
scripts run in this process (their ``main`` with the command line; each script as a real process refusing bad input:
tests/test_entry_points.py)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from test_entry_points import script  # the scripts, each loaded once

from collab_attn.glue.jobs import GlueJob

ROOT = Path(__file__).resolve().parents[1]


def settings(*overrides: str) -> dict:
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return OmegaConf.to_container(compose(config_name="train_glue", overrides=list(overrides)), resolve=True)


def job(*overrides: str) -> GlueJob:
    return GlueJob.of(settings(*overrides))


@pytest.fixture
def run_script(monkeypatch, capsys):
    """``python scripts/<name> <overrides>`` run in ``cwd``: the script's ``main`` in this process, which must stop
    with ``SystemExit``; its exit status and output as a finished process's."""

    def run(name: str, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [name, *overrides])
        with pytest.raises(SystemExit) as stop:
            script(name.removesuffix(".py")).main()
        captured = capsys.readouterr()
        return subprocess.CompletedProcess([name, *overrides], stop.value.code, captured.out, captured.err)

    return run


def one_error_line(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    (line,) = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    return line


def test_truncated_checkpoint_is_one_error_line(tmp_path, minilm_path, run_script):
    checkpoint = tmp_path / "truncated"
    shutil.copytree(minilm_path, checkpoint)
    weights = checkpoint / "model.safetensors"
    with open(weights, "r+b") as handle:
        handle.truncate(weights.stat().st_size // 2)

    glue = run_script("train_glue.py", f"model={checkpoint}", f"output_root={tmp_path / 'out'}", "logger=none",
                      "hydra.run.dir=hydra", cwd=tmp_path)
    assert "model.safetensors is truncated or corrupted" in one_error_line(glue)
    assert not (tmp_path / "out").exists()
    converted = run_script("reparametrize.py", f"model={checkpoint}", f"output_dir={tmp_path / 'converted'}",
                           "hydra.run.dir=hydra", cwd=tmp_path)
    assert "model.safetensors is truncated or corrupted" in one_error_line(converted)
    assert not (tmp_path / "converted").exists()


@pytest.mark.glue
def test_malformed_tsv_stops_before_any_folder(tmp_path, glue_dir, run_script):
    """A short line in MRPC/train.tsv: the message names the file and line, and nothing is made, Hydra's log
    folder included (the rows are parsed before Hydra starts)."""
    broken = tmp_path / "glue" / "MRPC"
    shutil.copytree(glue_dir / "MRPC", broken)
    with open(broken / "train.tsv", "a") as handle:
        handle.write("1\t123\n")
    out = tmp_path / "out"
    result = run_script("train_glue.py", "task=mrpc", f"data.glue_dir={tmp_path / 'glue'}", f"output_root={out}",
                        cwd=tmp_path)
    assert "train.tsv" in one_error_line(result) and "expected 5 tab-separated fields" in result.stderr
    assert not out.exists()


def test_refit_inherits_the_trainer_fields_it_does_not_set(tmp_path):
    smoke = job("trainer.max_steps=4", f"output_root={tmp_path}")
    recipe = smoke.refit_recipe
    assert recipe["max_steps"] == 4 and recipe["num_train_epochs"] == 3 and recipe["learning_rate"] == 2e-5
    assert job("trainer.max_steps=4", "refit.max_steps=7").refit_recipe["max_steps"] == 7
    assert job("trainer.warmup_steps=5").refit_recipe["warmup_steps"] == 5
    # the hash sees what runs: a smoke run's folder is not that of a full re-fine-tuning after 4 fine-tuning steps
    full = job("trainer.max_steps=4", "refit.max_steps=-1", f"output_root={tmp_path}")
    assert smoke.folder != full.folder
    assert job("refit.max_steps=-1").folder == job().folder
