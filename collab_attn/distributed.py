"""Several processes training one model: ``torchrun``, ``accelerate launch`` or SLURM tasks through submitit.

Every process trains (the Trainer's DistributedDataParallel); global rank 0 alone does the file work (locks, cached
models, results, tracking) and the others wait for it in a collective (a barrier or a broadcast of its decision),
never on a file lock. In one process every helper here is a no-op."""

from __future__ import annotations

import atexit
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from collab_attn.files import exclusive_lock


def world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    """Global rank 0, the process that writes files (the only process of a plain run)."""
    return int(os.environ.get("RANK", "0")) == 0


def _export_slurm_tasks() -> None:
    """SLURM tasks started by submitit (``tasks_per_node`` > 1) get the variables torchrun would set."""
    if "RANK" in os.environ or os.environ.get("SUBMITIT_EXECUTOR") != "slurm":
        return
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        from submitit.helpers import TorchDistributedEnvironment

        TorchDistributedEnvironment().export(set_cuda_visible_devices=False)


def setup() -> None:
    """Join the launch's process group (NCCL on GPUs, gloo on the CPU); the Trainer reuses it."""
    _export_slurm_tasks()
    if world_size() == 1 or dist.is_initialized():
        return
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    atexit.register(_teardown)


def _teardown() -> None:
    """Leave the process group before the interpreter exits: a gloo group left to die with the process can abort it
    ("terminate called without an active exception") after its work is done."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _active() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def barrier() -> None:
    if _active():
        dist.barrier()


def from_main(value):
    """Rank 0's ``value`` on every process (a decision that reads files, taken once)."""
    if not _active():
        return value
    box = [value if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


@contextmanager
def main_lock(path: str | Path) -> Iterator[None]:
    """``exclusive_lock(path)`` held by rank 0 alone, against other jobs; the other ranks follow rank 0 through the
    block's collectives and wait at a barrier at its end, while rank 0 still holds the lock."""
    if not is_main():
        yield
        barrier()
        return
    with exclusive_lock(path):
        yield
        barrier()


@torch.no_grad()
def sync_parameters(model) -> None:
    """Copy rank 0's parameters and buffers to every process (after a conversion each process made on its own)."""
    if not _active():
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    for tensor in [*model.parameters(), *model.buffers()]:
        buffer = tensor.detach().to(device)
        dist.broadcast(buffer, src=0)
        tensor.copy_(buffer)


def split_batch(recipe: dict) -> dict:
    """``recipe`` with ``per_device_train_batch_size`` (the batch of one optimizer step, as in one process) split
    evenly over the processes, so that a step sees the same examples and the schedule the same steps."""
    n = world_size()
    if n == 1 or "per_device_train_batch_size" not in recipe:
        return recipe
    batch = recipe["per_device_train_batch_size"]
    if batch % n:
        raise ValueError(
            f"per_device_train_batch_size={batch} (the batch of one step) does not split evenly over {n} processes; "
            "choose a batch size or a process count that divides it"
        )
    return {**recipe, "per_device_train_batch_size": batch // n}
