"""The logger group and its trackers; W&B curves are written while training runs, not replayed when a stage ends."""

import struct
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from collab_attn.glue import pipeline
from collab_attn.glue.jobs import GlueJob
from collab_attn.tracking import NoTracker, check_logger, make_tracker

ROOT = Path(__file__).resolve().parents[1]


def offline_history(run_file: Path, block: int = 32768) -> list[dict]:
    """The history rows of an offline W&B run file (a LevelDB-style log of protobuf records after a 7-byte header),
    each as {key: value}."""
    from wandb.proto import wandb_internal_pb2

    data, position, pending, rows = run_file.read_bytes(), 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): float(item.value_json)
                             for item in record.history.item})
    return rows


def test_the_logger_group_is_checked_and_makes_its_tracker(tmp_path):
    for logger in (None, {"name": "none"}, {"name": "wandb", "mode": None}, {"name": "wandb", "mode": "offline"}):
        check_logger(logger)
    for logger, message in [({"name": "tensorboard"}, "unknown logger 'tensorboard'"),
                            ({"name": "wandb", "mode": "sometimes"}, "unknown logger.mode 'sometimes'")]:
        with pytest.raises(ValueError, match=message):
            check_logger(logger)
    tracker = make_tracker({"name": "none"}, "job", "sweep", {}, tmp_path / "run")
    assert isinstance(tracker, NoTracker) and tracker.training_callbacks("refit") == []
    tracker.log_step({"val_loss": 1.0}, 3)
    tracker.finish({})
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValueError, match="unknown logger 'tensorboard'"):
        make_tracker({"name": "tensorboard"}, "job", "sweep", {}, tmp_path / "run")


@pytest.mark.glue
def test_training_curves_are_logged_while_training(tmp_path, glue_dir, monkeypatch):
    """Each training log (loss, learning rate) reaches the offline run during training: its rows are stamped
    before the stage's training returned; the stage's metrics come after."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train_glue", overrides=[
            "task=rte", f"data.glue_dir={glue_dir}", "trainer=smoke", "trainer.max_steps=3",
            "data.max_train_samples=24", "data.max_eval_samples=16", "collab.rank=96", "collab.n_iter_max=2",
            "refit.per_device_train_batch_size=8", f"output_root={tmp_path}",
        ])
    settings = OmegaConf.to_container(cfg, resolve=True)
    trained, real_train = [], pipeline.train

    def train(*args, **kwargs):
        result = real_train(*args, **kwargs)
        trained.append(time.time())
        return result

    monkeypatch.setattr(pipeline, "train", train)
    job = GlueJob.of(settings)
    pipeline.run_job(job)
    (run_file,) = job.folder.glob("wandb/offline-run-*/run-*.wandb")
    rows = offline_history(run_file)
    for stage, ended in zip(("finetuned", "refit"), trained):
        curve = [row for row in rows if f"{stage}/train_loss" in row]
        assert [row[f"{stage}/train_step"] for row in curve] == [1, 2, 3]  # refit inherits trainer.max_steps
        assert all(f"{stage}/learning_rate" in row and row["_timestamp"] < ended for row in curve)
        (end,) = [row for row in rows if f"{stage}/main" in row]
        assert end["_timestamp"] > ended
