"""Result files and folders that a reader never sees half-written (write beside the target, then rename over it),
and a lock for work that concurrent jobs must not do twice."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path


@contextmanager
def replacing(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder (same suffix, so matplotlib and pandas infer the format); when
    the block succeeds it replaces ``path`` in one rename, when it raises it is deleted and ``path`` is untouched."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_result_pair(stem: Path, record: dict, markdown: str) -> None:
    """A benchmark's result: ``stem.json`` (``record``, what is not JSON written as text) and ``stem.md``, each all or
    nothing, the folder made if need be."""
    import json

    stem.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(stem.with_suffix(".json"), json.dumps(record, indent=2, default=str))
    write_text_atomic(stem.with_suffix(".md"), markdown)
    print(f"wrote {stem.with_suffix('.md')} and .json")


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``Path(path).write_text(text)``, all or nothing."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_section(path: str | Path, section: str, begin: str, end: str, new_file: str,
                  earlier_begins: tuple[str, ...] = ()) -> Path:
    """Put ``section`` (which starts with the ``begin`` marker and ends with the ``end`` marker) in place of the part
    of the text file ``path`` between those markers, or append it when they are missing; the rest of the file is kept
    as written. ``earlier_begins``: what the ``begin`` marker said before, read as ``begin``. A missing file starts
    as ``new_file``. All or nothing."""
    path = Path(path)
    text = path.read_text() if path.exists() else new_file
    for earlier in earlier_begins:
        text = text.replace(earlier, begin)
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        text = head + section + ("\n" + tail if tail else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    return write_text_atomic(path, text)


@contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a new, empty folder beside ``path`` to write a whole result into; when the block succeeds the folder
    takes ``path``'s place (``finalize_directory``: an old directory there is replaced), when it raises the folder
    is deleted and ``path`` is untouched. Refused with ``ValueError`` before the block runs (``prepare_directory``):
    a file at ``path``, and a non-empty directory unless ``overwrite``."""
    path = Path(path).expanduser().absolute()
    tmp = prepare_directory(path, overwrite)
    try:
        tmp.mkdir(parents=True)
        yield tmp
        finalize_directory(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare_directory(path: str | os.PathLike, overwrite: bool) -> Path:
    """Check that the directory ``path`` may be written and return the temporary sibling to write into (not created
    yet).

    An existing non-empty directory is refused unless ``overwrite``; a file at ``path`` always is. Pass the
    returned directory to ``finalize_directory`` once everything is written.
    """
    path = Path(path).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise ValueError(f"output path {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise ValueError(
            f"output directory {path} exists and is not empty; pass overwrite=true to replace it"
        )
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    if tmp.exists():  # left over from a crashed run of a process with the same pid
        shutil.rmtree(tmp)
    return tmp


def finalize_directory(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Move the fully written ``tmp`` directory to ``path``, replacing an existing directory there; returns
    ``path``, absolute.

    The old directory is first renamed aside and only deleted once the new one is in place, so ``path`` never
    holds a partial result.
    """
    tmp, path = Path(tmp), Path(path).expanduser().absolute()
    old = None
    if path.exists():
        old = path.with_name(f"{path.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        path.rename(old)
    try:
        tmp.rename(path)
    except OSError:
        if old is not None:
            old.rename(path)
        raise
    if old is not None:
        shutil.rmtree(old)
    return path


@contextmanager
def exclusive_lock(path: str | Path) -> Iterator[None]:
    """Hold an advisory lock on the file ``path`` (created if missing) for the block; another process entering
    the block on the same path waits. The operating system releases it when the process ends, however it ends."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def new_result_stem(out: str | Path | None, default: str | Path, suffixes: tuple[str, ...] = (".md", ".json")) -> Path:
    """Where a benchmark writes its result files (``stem.with_suffix(suffix)`` for each of ``suffixes``): ``out`` as
    given, or ``default`` stamped with the UTC time (``decode_cpu_float32_20261128-163000``). Results are never
    overwritten: a ``FileExistsError`` that names the file when one of them is already there."""
    if out is None:
        stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
        out = Path(default).with_name(f"{Path(default).name}_{stamp}")
    out = Path(out)
    existing = [path for path in (out.with_suffix(suffix) for suffix in suffixes) if path.exists()]
    if existing:
        raise FileExistsError(f"--out={out}: {existing[0]} is already there and benchmark results are never "
                              "overwritten; pass a new --out (or leave --out out for a time-stamped name)")
    return out
