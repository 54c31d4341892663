import re
import subprocess
import time

import pytest

from collab_attn.files import atomic_directory, exclusive_lock, new_result_stem, replacing, write_text_atomic


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


def test_a_directory_appears_only_when_complete(tmp_path):
    target = tmp_path / "new" / "energy"
    with atomic_directory(target) as folder:
        assert folder.is_dir() and not any(folder.iterdir()) and folder.parent == target.parent
        (folder / "energy.csv").write_text("a,b\n")
        assert not target.exists()
    assert [p.name for p in target.iterdir()] == ["energy.csv"]
    assert [p.name for p in target.parent.iterdir()] == ["energy"]


def test_a_directory_replaces_an_old_one_only_with_overwrite(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with pytest.raises(ValueError, match=f"{target}.*overwrite=true"):
        with atomic_directory(target):
            pytest.fail("the block runs only when the directory may be written")
    with atomic_directory(target, overwrite=True) as folder:
        (folder / "new.txt").write_text("new")
        assert (target / "old.txt").read_text() == "old"
    assert [p.name for p in target.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_an_empty_directory_needs_no_overwrite_and_a_file_is_always_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with atomic_directory(tmp_path / "empty") as folder:
        (folder / "a").write_text("1")
    assert (tmp_path / "empty" / "a").read_text() == "1"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        with atomic_directory(tmp_path / "file", overwrite=True):
            pass
    assert (tmp_path / "file").read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "file"]


@pytest.mark.parametrize("existing", [False, True])
def test_a_failed_directory_write_leaves_no_folder_and_keeps_the_old_one(tmp_path, existing):
    target = tmp_path / "out"
    if existing:
        target.mkdir()
        (target / "old.txt").write_text("old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_directory(target, overwrite=True) as folder:
            (folder / "half.png").write_bytes(b"half a plo")
            raise KeyboardInterrupt
    assert not folder.exists()
    assert [p.name for p in tmp_path.iterdir()] == (["out"] if existing else [])
    if existing:
        assert [p.name for p in target.iterdir()] == ["old.txt"]


def test_a_second_process_waits_for_the_lock_and_gets_it_when_released(tmp_path, warm_python):
    lock, ready, entered = tmp_path / "model.lock", tmp_path / "ready", tmp_path / "entered"
    waiter = (
        "import sys; from pathlib import Path; from collab_attn.files import exclusive_lock\n"
        "Path(sys.argv[2]).touch()\n"
        "with exclusive_lock(sys.argv[1]): Path(sys.argv[3]).touch()"
    )
    with exclusive_lock(lock):
        other = subprocess.Popen([warm_python(), "-c", waiter, str(lock), str(ready), str(entered)])
        deadline = time.monotonic() + 120
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ready.exists(), "the waiting process did not start"
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=2)
        assert not entered.exists()
    assert other.wait(timeout=60) == 0 and entered.exists()


def test_a_benchmark_result_is_never_overwritten(tmp_path):
    """A given stem is taken only when none of its result files exists; the default gets the UTC time appended."""
    assert new_result_stem(tmp_path / "decode", tmp_path / "unused") == tmp_path / "decode"
    (tmp_path / "decode.json").write_text("{}")
    with pytest.raises(FileExistsError, match=r"decode\.json is already there .* never overwritten"):
        new_result_stem(tmp_path / "decode", tmp_path / "unused")
    with pytest.raises(FileExistsError, match=r"decode\.json"):  # a stem given with a suffix means the same files
        new_result_stem(tmp_path / "decode.md", tmp_path / "unused")
    stamped = new_result_stem(None, tmp_path / "decode")
    assert stamped.parent == tmp_path and re.fullmatch(r"decode_\d{8}-\d{6}", stamped.name)
