"""The suite catches a wrong conversion: every mutation of ``tests/mutate.py`` (the bugs that once passed the whole
suite, and a few it already caught) makes the tests named beside it fail."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from mutate import MUTATIONS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def results(warm_python) -> dict:
    """Every mutation run once (one process, a forked child per mutation: about a minute)."""
    run = subprocess.run([warm_python(), str(ROOT / "tests" / "mutate.py"), "--json"], cwd=ROOT,
                         capture_output=True, text=True, timeout=900)
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert lines, run.stdout[-2000:] + run.stderr[-2000:]
    return {r["name"]: r for r in lines}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_the_suite_catches_the_mutation(name, results):
    result = results[name]
    assert result["caught"], f"{name}: not caught by {result['tests']} (status {result['status']})\n{result['output']}"
    # what failed is what was named (a test named without its parameters fails as one of its cases)
    assert all(any(failed.startswith(test) for test in result["tests"]) for failed in result["failed"])
