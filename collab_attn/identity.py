"""What a result was made from, so that it is never mixed up with another's.

- ``weights_fingerprint(model)``: a hash of every tensor of a model's state (names, dtypes, shapes, values), and
  ``file_fingerprint(path)`` one of a file's bytes: two models (or texts) with the same fingerprint are the same.
- ``check_folder_identity(folder, identity, name)``: a results folder records what it was made from in
  ``identity.json`` (``write_folder_identity``, on first use); a command whose model or texts differ from the ones
  recorded is refused with both named, before it reads or writes a result there.
- ``check_same_source(converted, original)``: the API functions that compare a converted model with its original
  (``fit_to_original``, ``fit_end_to_end``, ``layer_sensitivity``, ``answer_agreement``) check that ``original``
  is the model ``converted`` was made from: the same weights outside the attention layers (embeddings, MLPs, norms,
  head), not only the same config. ``trained=True`` allows for a converted model trained beyond its attention
  layers (distilled): its other weights moved, but stayed near the original's.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

IDENTITY_FILE = "identity.json"
# a converted model trained further (distilled) moves each weight tensor outside the attention by a few percent of
# its norm; in another model of the same architecture a randomly initialized tensor is about 1.4 away (independent
# weights of the same scale)
TRAINED_DISTANCE = 0.5


def weights_fingerprint(model) -> str:
    """A BLAKE2b hash (32 hex digits) of ``model``'s state dict: every tensor's name, dtype, shape and bytes."""
    import torch

    digest = hashlib.blake2b(digest_size=16)
    for key, tensor in model.state_dict().items():
        tensor = tensor.detach().to("cpu").contiguous()
        digest.update(f"{key}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def file_fingerprint(path: str | Path) -> str:
    """The SHA-256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_folder_identity(folder: str | Path) -> dict | None:
    """The identity ``folder`` records, or None where it records none."""
    from collab_attn import cli

    path = Path(folder) / IDENTITY_FILE
    if not path.exists():
        return None
    identity = cli.json_file("--out", path)
    if not isinstance(identity, dict) or not {"model", "weights", "texts"} <= set(identity):
        raise cli.BadInput(f"{path} is not an identity file of this project (it needs model, weights and texts): "
                           "move it away, or pass another folder")
    return identity


def check_folder_identity(folder: str | Path, identity: dict, name: str = "--out") -> bool:
    """Refuse (``cli.BadInput``) when ``folder`` records another model or other texts than ``identity`` (``model``:
    the name it was given, ``weights``: its fingerprint; ``texts``: per text, its ``path`` and ``sha256``), naming
    both. Returns whether the folder records its identity already."""
    from collab_attn import cli

    recorded = read_folder_identity(folder)
    if recorded is None:
        return False
    if recorded["weights"] != identity["weights"]:
        raise cli.BadInput(
            f"{name}={folder} holds results of the model {recorded['model']!r} (weights {recorded['weights'][:12]}), "
            f"not of this command's model {identity['model']!r} (weights {identity['weights'][:12]}): pass another "
            f"{name} for this model, or the model {recorded['model']!r}")
    for text, now in identity["texts"].items():
        then = recorded["texts"].get(text)
        if then is None or then["sha256"] != now["sha256"]:
            before = "no such text" if then is None else f"{then['path']} (sha256 {then['sha256'][:12]})"
            raise cli.BadInput(
                f"{name}={folder} was made from other texts: its {text} was {before}, this command reads "
                f"{now['path']} (sha256 {now['sha256'][:12]}): pass another {name} for these texts, or the same texts")
    return True


def write_folder_identity(folder: str | Path, identity: dict) -> Path:
    """``identity`` into ``folder/identity.json``, all or nothing."""
    from collab_attn.files import write_text_atomic

    return write_text_atomic(Path(folder) / IDENTITY_FILE, json.dumps(identity, indent=2) + "\n")


def _attention_prefixes(original) -> list[str]:
    """The module names of ``original``'s attention layers (with the output projection beside each, in BERT and
    RoBERTa): what a conversion replaces and the fits train."""
    from collab_attn.models.families import family_of, find_attention

    family = family_of(original.config)
    names = [name for name, _ in find_attention(original)[1]]
    if family.output is None:
        names += [family.output_projection_name(name) for name in names]
    return [name + "." for name in names]


def check_same_source(converted, original, *, trained: bool = False) -> None:
    """Refuse (``ValueError``) an ``original`` that is not the model ``converted`` was made from: every tensor of
    ``original``'s state outside its attention layers must be in ``converted``, in the same shape, with the same
    values (``trained=True``: each within a relative distance ``||a - b|| / max(||a||, ||b||)`` of
    ``TRAINED_DISTANCE``, for a converted model trained beyond its attention layers)."""
    import torch

    prefixes = _attention_prefixes(original)
    ours, theirs = converted.state_dict(), original.state_dict()
    differ = {}  # key: relative distance (floating-point tensors; inf for others)
    with torch.no_grad():
        for key, reference in theirs.items():
            if key.startswith(tuple(prefixes)):
                continue
            value = ours.get(key)
            if value is None or value.shape != reference.shape:
                raise ValueError(f"original has {key} {tuple(reference.shape)}, which converted "
                                 f"{'lacks' if value is None else f'has as {tuple(value.shape)}'}: original must be "
                                 "the model converted was made from")
            reference = reference.to(device=value.device, dtype=value.dtype)
            if torch.equal(value, reference):
                continue
            if not value.is_floating_point():
                differ[key] = math.inf
                continue
            a, b = value.double(), reference.double()
            scale = max(float(torch.linalg.vector_norm(a)), float(torch.linalg.vector_norm(b)), 1e-300)
            differ[key] = float(torch.linalg.vector_norm(a - b)) / scale
    if not differ or (trained and max(differ.values()) <= TRAINED_DISTANCE):
        return
    worst = sorted(differ, key=differ.get, reverse=True)
    shown = ", ".join(worst[:3]) + (f" and {len(worst) - 3} more" if len(worst) > 3 else "")
    raise ValueError(f"original's weights outside the attention layers differ from converted's ({shown}; relative "
                     f"distance up to {differ[worst[0]]:.3g}): original must be the model converted was made from, "
                     "not only a model of the same config; pass that model (e.g. a copy made before reparametrize)")
