"""Result files that a reader never sees half-written (write beside the target, then rename over it), and a lock
for work that concurrent jobs must not do twice."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
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


def write_text_atomic(path: str | Path, text: str) -> Path:
    """``Path(path).write_text(text)``, all or nothing."""
    with replacing(path) as tmp:
        tmp.write_text(text)
    return Path(path)


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
