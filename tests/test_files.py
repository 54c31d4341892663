import subprocess
import sys
import time

import pytest

from collab_attn.files import exclusive_lock, replacing, write_text_atomic


def test_write_text_atomic_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "summary.md"
    target.write_text("old table\n")
    assert write_text_atomic(target, "new table\n") == target
    assert target.read_text() == "new table\n"
    assert [p.name for p in tmp_path.iterdir()] == ["summary.md"]


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path):
    target = tmp_path / "curves.png"
    target.write_bytes(b"old plot")
    with pytest.raises(RuntimeError, match="plotting failed"):
        with replacing(target) as tmp:
            assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp != target
            tmp.write_bytes(b"half a plo")
            raise RuntimeError("plotting failed")
    assert target.read_bytes() == b"old plot"
    assert [p.name for p in tmp_path.iterdir()] == ["curves.png"]


def test_a_new_file_appears_only_when_complete(tmp_path):
    target = tmp_path / "results.csv"
    with replacing(target) as tmp:
        tmp.write_text("a,b\n")
        assert not target.exists()
    assert target.read_text() == "a,b\n"


def test_a_second_process_waits_for_the_lock_and_gets_it_when_released(tmp_path):
    lock, ready, entered = tmp_path / "model.lock", tmp_path / "ready", tmp_path / "entered"
    waiter = (
        "import sys; from pathlib import Path; from collab_attn.files import exclusive_lock\n"
        "Path(sys.argv[2]).touch()\n"
        "with exclusive_lock(sys.argv[1]): Path(sys.argv[3]).touch()"
    )
    with exclusive_lock(lock):
        other = subprocess.Popen([sys.executable, "-c", waiter, str(lock), str(ready), str(entered)])
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the waiting process did not start"
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=2)
        assert not entered.exists()
    assert other.wait(timeout=60) == 0 and entered.exists()
