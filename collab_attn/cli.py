"""Bad input, handled one way by every entry point in ``scripts/``: check everything, then work.

An entry point is a ``check`` and the work. ``check`` reads every argument and the whole grid of runs, writes
nothing and raises on anything wrong; the work starts only once it has returned. Whatever ``check`` raises reaches
the user as one ``error: ...`` line on stderr and exit status 2 (``exit_on_bad_input``); what the work raises is a
real error and keeps its traceback, except ``BadInput``. Some input can only be judged once the work has it in hand:
a conversion checks the checkpoint's weights (NaN or Inf), the ranks against the loaded layers, its options and the
calibration statistics before it changes anything. Such a step runs under ``as_bad_input()``, which makes the
ValueErrors it raises ``BadInput`` (message kept); ``BadInput`` raised anywhere in the work is one ``error: ...``
line and exit status 2 too, and whatever the work has not finished writing is left unwritten (results are written
all at once at the end, ``collab_attn.files``).

- Hydra scripts decorate their task function with ``hydra_main(config_name, check)`` in place of ``hydra.main``: it
  composes every job of the command line (each job of a ``-m`` sweep, ``hydra.sweeper.params`` included) and checks
  it before Hydra makes its run folder or log file. An override Hydra cannot compose is bad input too.
- argparse scripts use ``ArgumentParser`` (its own errors are one ``error:`` line too) and ``positive_arg``, then
  ``exit_on_bad_input(lambda: check(args))``.

The checks below raise ``BadInput`` (a ValueError; ``Missing``, also a FileNotFoundError, for a path that is not
there) naming the argument and what to pass instead. Plain helpers: no torch, Hydra imported only where used.
"""

from __future__ import annotations

import argparse
import codecs
import functools
import inspect
import json
import math
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class BadInput(ValueError):
    """Input the user has to change; the message names the argument and what to pass instead."""


class Missing(BadInput, FileNotFoundError):
    """A file or folder the input names that is not there."""


# ---------------------------------------------------------------------------------------------------
# Values


def integer(name: str, value, minimum: int | None = None, nullable: bool = False) -> int | None:
    """``value`` if it is an integer (not a bool, not a string) of at least ``minimum``; also None if ``nullable``."""
    if value is None and nullable:
        return None
    if type(value) is not int or (minimum is not None and value < minimum):
        what = {None: "an integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise BadInput(f"{name} must be {what}{' or null' if nullable else ''}, got {value!r}")
    return value


def renamed(settings: dict, old: str, new: str) -> dict:
    """Take the deprecated setting ``old`` as ``new`` (``collab_attn.deprecation``), in place: a value given under
    ``old`` moves to ``new`` with a ``FutureWarning``; both given different values is refused. The configs keep
    ``old: null`` so that ``old=...`` still parses on a command line; ``settings`` holds ``new`` only afterwards."""
    from collab_attn.deprecation import conflict, warn_renamed

    value = settings.pop(old, None)
    if value is None:
        return settings
    if settings.get(new) is not None and settings[new] != value:
        raise BadInput(conflict(old, new, value, settings[new]))
    warn_renamed(old, new, "setting", stacklevel=3)
    settings[new] = value
    return settings


def positive_int(name: str, value, nullable: bool = False) -> int | None:
    """A size, a count, a number of steps: an integer > 0 (zero and negative sizes are refused, never defaulted)."""
    return integer(name, value, 1, nullable)


def number(name: str, value, low: float | None = None, high: float | None = None, *, above: bool = False,
           below: bool = False, nullable: bool = False) -> float | None:
    """A real number in ``[low, high]`` (``above``/``below``: strictly above ``low``/below ``high``)."""
    if value is None and nullable:
        return None
    ok = type(value) in (int, float) and value == value
    ok = ok and (low is None or (value > low if above else value >= low))
    ok = ok and (high is None or (value < high if below else value <= high))
    if not ok:
        if low is not None and high is not None:
            where = f" in {'(' if above else '['}{low:g}, {high:g}{')' if below else ']'}"
        elif low is not None:
            where = f" {'>' if above else '>='} {low:g}"
        else:
            where = "" if high is None else f" {'<' if below else '<='} {high:g}"
        raise BadInput(f"{name} must be a number{where}{' or null' if nullable else ''}, got {value!r}")
    return value


def boolean(name: str, value) -> bool:
    if type(value) is not bool:
        raise BadInput(f"{name} must be true or false, got {value!r}")
    return value


def choice(name: str, value, choices: Sequence):
    if not isinstance(value, (str, int, float, type(None))) or value not in choices:
        raise BadInput(f"unknown {name} {value!r}; choose one of {', '.join(map(str, choices))}")
    return value


def nonempty_list(name: str, value) -> list:
    if not isinstance(value, (list, tuple)) or not value:
        raise BadInput(f"{name} must be a non-empty list (e.g. '{name}=[a,b]'), got {value!r}")
    return list(value)


def trainer_fields(group: str, fields: dict) -> dict:
    """The ``transformers.TrainingArguments`` fields a recipe group (``trainer``, ``refit``, ``train``) sets, where
    a wrong value would only show hours later or never: batch sizes positive integers, step counts and intervals
    positive (below 1: a fraction of the run, as the Trainer reads them), ``max_steps`` positive or -1 (off),
    epochs and learning rate positive. Unset (null) fields are left to the Trainer."""
    for key, value in fields.items():
        name = f"{group}.{key}"
        if value is None:
            continue
        if key.endswith("batch_size") or key == "gradient_accumulation_steps":
            positive_int(name, value)
        elif key == "max_steps":
            if integer(name, value) == 0 or value < -1:
                raise BadInput(f"{name} must be a positive number of steps or -1 (train num_train_epochs), got {value}")
        elif key in ("logging_steps", "eval_steps", "save_steps", "num_train_epochs", "learning_rate"):
            number(name, value, 0, above=True)
        elif key in ("warmup_steps", "warmup_ratio", "weight_decay", "max_grad_norm"):
            number(name, value, 0)
        elif key in ("adam_beta1", "adam_beta2"):
            number(name, value, 0, 1, below=True)
        elif key == "adam_epsilon":
            number(name, value, 0, above=True)
        elif key == "lr_scheduler_kwargs" and isinstance(value, dict) and value.get("min_lr") is not None:
            number(f"{name}.min_lr", value["min_lr"], 0)
    return fields


# ---------------------------------------------------------------------------------------------------
# Paths


def _place(name: str, folder: Path, given, what: str) -> None:
    """``folder`` (absolute) may be made: the deepest part of it that exists is a folder we may write in. Refusals
    show ``given``, the path as the user wrote it."""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if not existing.is_dir():
        where = ("is a file" if existing == Path(given).expanduser().absolute()
                 else f"is under {existing}, which is a file")
        raise BadInput(f"{name}={given} {where}; pass {what}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise BadInput(f"{name}={given}: {existing} is not writable; pass a folder you may write to")


def output_dir(name: str, path, overwrite: bool | None = None, files: Sequence[str] = ()) -> Path:
    """``path`` as the folder results go into: not a file, under no file, writable. ``overwrite`` (for scripts that
    replace the whole folder): an existing non-empty folder needs ``overwrite=true``. ``files``: the names written
    into it, none of which may be a folder. Creates nothing."""
    if path is None or not str(path).strip():
        raise BadInput(f"{name} is empty; pass a folder path")
    given, path = path, Path(path).expanduser().absolute()
    _place(name, path, given, "a folder path (an existing folder or a new one)")
    if path.is_dir():
        if overwrite is not None and not overwrite and any(path.iterdir()):
            raise BadInput(f"{name}={given} exists and is not empty; pass overwrite=true to replace it, or another "
                           f"{name}")
        for file in files:
            if (path / file).is_dir():
                raise BadInput(f"{name}={given} holds a folder {file}/ where the file {file} goes; move it away")
    return path


def summary_outputs(name: str, root: Path, images: Sequence[str]) -> None:
    """The outputs of a summary written into the folder ``root``: its ``README.md`` (read first where there is one,
    since only its results part is replaced) and ``images``, none of them a folder."""
    if (root / "README.md").exists():
        text_file(name, root / "README.md")
    output_dir(name, root, files=("README.md", *images))


def output_file(name: str, path) -> Path:
    """``path`` as a file to write: not a folder, in a folder that is (or can be made) writable."""
    if path is None or not str(path).strip():
        raise BadInput(f"{name} is empty; pass a file path")
    given, path = path, Path(path).expanduser().absolute()
    if path.is_dir():
        raise BadInput(f"{name}={given} is a folder; pass a file path")
    _place(name, path.parent, given, "a file path in a folder")
    return path


def input_dir(name: str, path) -> Path:
    """An existing folder."""
    path = Path(str(path)).expanduser()
    if not path.exists():
        raise Missing(f"{name}={path}: no such folder (relative to {os.getcwd()})")
    if not path.is_dir():
        raise BadInput(f"{name}={path} is a file; pass a folder")
    return path


def text_file(name: str, path, limit: int | None = None) -> str:
    """The UTF-8 text of the file ``path``; a missing file, a folder, an unreadable or a binary file is refused.
    ``limit``: check (and return) only the first ``limit`` bytes, for large data files read later in full. Refusals
    say ``name=path`` (the path alone where ``name`` is empty: a positional argument)."""
    path = Path(str(path)).expanduser()
    shown = f"{name}={path}" if name else str(path)
    if not path.exists():
        raise Missing(f"{shown}: no such file (relative to {os.getcwd()})")
    if path.is_dir():
        raise BadInput(f"{shown} is a folder; pass a text file")
    try:
        with path.open("rb") as handle:
            raw = handle.read() if limit is None else handle.read(limit)
    except OSError as err:
        raise BadInput(f"{shown} cannot be read ({err.strerror or err}); pass a readable text file") from None
    try:
        if b"\0" in raw:
            raise UnicodeError("it holds NUL bytes")
        return codecs.getincrementaldecoder("utf-8")().decode(raw, final=limit is None)
    except UnicodeError as err:
        raise BadInput(f"{shown} is binary or not UTF-8 text ({err}); pass a UTF-8 text file") from None


def json_file(name: str, path, lines: bool = False):
    """A stored result: the JSON in ``path`` (``lines``: one JSON value per non-empty line, as a list)."""
    text = text_file(name, path)
    chunks = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()] if lines else [(1, text)]
    values = []
    for line_number, chunk in chunks:
        try:
            values.append(json.loads(chunk))
        except json.JSONDecodeError as err:
            where = f", line {line_number}" if lines else ""
            raise BadInput(f"{path}{where} is not JSON ({err}): not a result of this script; delete it or pass "
                           f"another {name}") from None
    return values if lines else values[0]


@contextmanager
def naming(name: str, value) -> Iterator[None]:
    """Errors raised in the block say ``name=value: ...`` first, unless they name ``name=`` already; the type is
    kept where it takes a single message (else ``BadInput``)."""
    try:
        yield
    except Exception as err:
        if f"{name}=" in str(err):
            raise
        text = f"{name}={value}: {one_line(err)}"
        try:
            renamed = type(err)(text)
        except Exception:  # an exception type that wants more than a message
            renamed = BadInput(text)
        raise renamed from err


# ---------------------------------------------------------------------------------------------------
# Reporting


def one_line(err: BaseException) -> str:
    """``err`` as one line: its message with whitespace folded (and the reason Hydra keeps in ``__cause__``); the
    type's name first where the message alone says little (a KeyError's key)."""
    text = str(err)
    from_config = type(err).__module__.split(".")[0] in ("hydra", "omegaconf")
    if from_config:
        text = text.split("Config search path:")[0]  # Hydra's list of where it looked follows a missing option
        if err.__cause__ is not None and str(err.__cause__) not in text:
            text += f" ({err.__cause__})"
    text = " ".join(text.split())
    if not (isinstance(err, (ValueError, OSError)) or from_config) or not text:
        text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text


def exit_on_bad_input(check: Callable[[], T], report: bool = True,
                      bad: type[BaseException] | tuple[type[BaseException], ...] = Exception) -> T:
    """``check()``'s result; anything it raises is bad input: one ``error: ...`` line on stderr (when ``report``: in
    a multi-process job one process speaks) and exit status 2. ``bad``: the exceptions that count as bad input (the
    work passes ``BadInput``: anything else it raises keeps its traceback)."""
    try:
        return check()
    except bad as err:  # whatever a check raises, the input has to change
        if report:
            print(f"error: {one_line(err)}", file=sys.stderr)
        sys.exit(2)


@contextmanager
def as_bad_input() -> Iterator[None]:
    """Around a step of the work that validates its input before it acts on it (a conversion: the checkpoint's
    weights, the ranks, the method's options, the calibration statistics): a ValueError raised in the block is bad
    input, raised again as ``BadInput`` with the same message (the original chained as its cause), which the entry
    point reports in one line. Other exceptions pass unchanged."""
    try:
        yield
    except BadInput:
        raise
    except ValueError as err:
        raise BadInput(str(err)) from err


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose own errors (unknown option, missing or unparsable value, bad choice) are one ``error:`` line
    on stderr and exit status 2, like every other refusal."""

    def error(self, message: str):
        print(f"error: {' '.join(message.split())}", file=sys.stderr)
        sys.exit(2)


def _argument(text: str, parse, holds, expected: str, must: str):
    """``parse(text)`` where it parses and ``holds`` the value, else the ``ArgumentTypeError`` argparse reports,
    naming the option."""
    try:
        value = parse(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not holds(value):
        raise argparse.ArgumentTypeError(f"must be {must}, got {text if parse is float else value}")
    return value


def positive_arg(text: str) -> int:
    """argparse type of sizes and counts: ``--heads 0`` and ``--heads x`` are refused, naming the option."""
    return _argument(text, int, lambda v: v > 0, "a positive integer", "a positive integer")


def count_arg(text: str) -> int:
    """argparse type of counts where 0 means none (``--warmup``, ``--distill-tokens``): ``-1`` and ``x`` refused."""
    return _argument(text, int, lambda v: v >= 0, "an integer >= 0", "an integer >= 0")


def positive_number_arg(text: str) -> float:
    """argparse type of a rate, a tolerance or an amount: a finite number > 0 (``nan``, ``inf``, ``0`` refused)."""
    return _argument(text, float, lambda v: math.isfinite(v) and v > 0, "a positive number", "a finite number > 0")


def device(name: str, value) -> str:
    """``value`` as a torch device this machine has: ``cpu``, or ``cuda``/``cuda:N`` where torch sees that GPU. A
    name torch does not know (``gpu``), a GPU that is not there and a device kind the scripts do not run on are
    refused, listing the devices there are."""
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    there = "cpu" + "".join(f", cuda:{i}" for i in range(gpus))
    seen = f"torch {torch.__version__} sees {gpus or 'no'} CUDA GPU{'s' * (gpus > 1)} here"
    try:
        parsed = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise BadInput(f"{name} {value!r} is not a device; pass one of: {there} ({seen})") from None
    if parsed.type == "cpu" or (parsed.type == "cuda" and (parsed.index or 0) < gpus):
        return str(value)
    if parsed.type == "cuda":
        raise BadInput(f"{name} {value}: {seen}; pass one of: {there}")
    raise BadInput(f"{name} {value}: the scripts run on the CPU or a CUDA GPU; pass one of: {there} ({seen})")


def compile_backend(name: str, value) -> str:
    """``value`` as a backend ``torch.compile(backend=...)`` takes here (inductor, aot_eager, ...)."""
    import torch._dynamo

    backends = sorted(b for b in torch._dynamo.list_backends(exclude_tags=()) if "TESTING" not in b)
    if value not in backends:
        raise BadInput(f"{name} {value!r} is not a torch.compile backend here; choose one of {', '.join(backends)}")
    return value


def result_stem(name: str, out, default, suffixes: tuple[str, ...] = (".md", ".json")) -> Path:
    """Where a benchmark writes its results (``collab_attn.files.new_result_stem``: ``out`` or ``default`` stamped
    with the time, never over an earlier result), each file checked writable before any work: not a folder, not
    under a file."""
    from collab_attn.files import new_result_stem

    if out is not None and not str(out).strip():
        raise BadInput(f"{name} is empty; pass a new file path without suffix")
    try:
        stem = new_result_stem(out, default, suffixes)
    except FileExistsError as err:
        raise BadInput(str(err)) from None
    for suffix in suffixes:
        output_file(name, stem.with_suffix(suffix))
    return stem


# ---------------------------------------------------------------------------------------------------
# Hydra


def settings_of(cfg) -> dict:
    """A composed config as a plain dict, interpolations resolved, without Hydra's own node."""
    from omegaconf import OmegaConf

    settings = OmegaConf.to_container(cfg, resolve=True)
    settings.pop("hydra", None)
    return settings


def hydra_main(config_name: str, check: Callable[[dict], object], report: Callable[[], bool] = lambda: True):
    """``hydra.main(config_path="../configs", config_name=config_name)`` for a task function in ``scripts/``, with
    each job of the command line composed and its settings passed to ``check`` first, before Hydra makes its run
    folder: bad input exits with one ``error:`` line and status 2 having written nothing. ``--help``, ``--cfg``,
    ``--info``, ``--config-dir`` and the like go straight to Hydra. ``BadInput`` raised by the task itself (a step
    run ``as_bad_input()``) ends the same way, with its one line and status 2, and no traceback. ``report()``:
    whether this process prints the error (in a multi-process job one process speaks)."""
    import hydra

    def decorate(task: Callable) -> Callable[[], None]:
        configs = Path(inspect.getfile(task)).resolve().parent.parent / "configs"

        @functools.wraps(task)  # Hydra unwraps it to find the script (its name, its configs)
        def task_reporting_bad_input(cfg) -> None:
            exit_on_bad_input(lambda: task(cfg), report(), bad=BadInput)

        run_hydra = hydra.main(version_base="1.3", config_path="../configs", config_name=config_name)(
            task_reporting_bad_input)

        @functools.wraps(task)
        def main() -> None:
            exit_on_bad_input(lambda: check_command_line(configs, config_name, sys.argv[1:], check), report())
            run_hydra()

        return main

    return decorate


def check_command_line(configs: Path, config_name: str, argv: list[str], check: Callable[[dict], object]) -> int:
    """Compose every job ``argv`` asks for from the configs in ``configs`` and ``check`` its settings and Hydra's
    folder; returns how many jobs were checked (0 when the command line only asks Hydra something)."""
    from hydra import compose, initialize_config_dir
    from hydra._internal.utils import get_args_parser
    from omegaconf import open_dict

    parser = get_args_parser()

    def refuse(message: str):
        raise BadInput(f"{message} (see --hydra-help)")

    parser.error = refuse
    args = parser.parse_args(argv)
    if any((args.help, args.hydra_help, args.cfg, args.info, args.shell_completion, args.experimental_rerun,
            args.config_path, args.config_dir)):
        return 0
    name = args.config_name or config_name
    with initialize_config_dir(config_dir=str(configs), version_base="1.3"):
        jobs = _sweep(name, args.overrides) if args.multirun else [(args.overrides, args.overrides)]
        for shown, overrides in jobs:
            cfg = compose(name, overrides, return_hydra_config=True)
            folder = ("hydra.sweep.dir", cfg.hydra.sweep.dir) if args.multirun else ("hydra.run.dir", cfg.hydra.run.dir)
            with open_dict(cfg):
                del cfg["hydra"]
            try:
                check(settings_of(cfg))
                output_dir(*folder)
            except Exception as err:
                if len(jobs) > 1:
                    raise BadInput(f"job {' '.join(shown)}: {one_line(err)}") from err
                raise
    return len(jobs)


def _sweep(config_name: str, overrides: list[str]) -> list[tuple[list[str], list[str]]]:
    """The jobs of a ``-m`` command line as Hydra's basic sweeper makes them (``hydra.sweeper.params`` first, the
    command line's sweeps after): (the job's own overrides, every override it is composed with). Another sweeper
    chooses its jobs as it runs: none are checked ahead."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    hydra = GlobalHydra.instance()
    master = hydra.hydra.compose_config(config_name, overrides, run_mode=RunMode.MULTIRUN, with_log_configuration=False)
    sweeper = master.hydra.sweeper
    if sweeper.get("_target_") != f"{BasicSweeper.__module__}.{BasicSweeper.__name__}":
        return []
    params = [f"{key}={value}" for key, value in (sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create(config_loader=hydra.config_loader()).parse_overrides(
        params + list(master.hydra.overrides.task))
    own = list(master.hydra.overrides.hydra)
    return [(job, own + job) for job in BasicSweeper.split_arguments(parsed, None)[0]]
