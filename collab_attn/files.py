"""Result files that a reader never sees half-written: write beside the target, then rename over it."""

from __future__ import annotations

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
