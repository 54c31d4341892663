"""What every Hydra entry point in ``scripts/`` does with bad input: one ``error:`` line and exit status 2."""

from __future__ import annotations

import sys
from collections.abc import Callable


def run_or_exit(run: Callable, cfg, *, report: bool = True) -> None:
    """``run(cfg)``; a ValueError or FileNotFoundError (bad input) prints ``error: ...`` on stderr (when ``report``:
    multi-process jobs let one process speak) and exits with status 2."""
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as err:
        if report:
            print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
