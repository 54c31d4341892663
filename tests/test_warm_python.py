"""tests/warm_python.py, the tests' warm ``python``: a command run through it sees what it would see run cold (its
arguments, ``sys.path[0]``, ``__name__``, working directory, environment, stdin, exit status, stdout and stderr),
with torch already imported; it runs cold where the variables read at import differ from the server's; a timeout
kills it and a signal reaches it."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import WARM_PYTHON
from warm_python import hold

SCRIPT = """import json, os, sys
warm = "torch" in sys.modules
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "name": __name__, "cwd": os.getcwd(),
                  "given": os.environ.get("GIVEN"), "stdin": sys.stdin.read(), "warm": warm}))
print("to stderr", file=sys.stderr)
sys.exit(int(os.environ.get("STATUS", "0")))
"""


def both(warm_python, argv, tmp_path, env=None):
    env = {**os.environ, "GIVEN": "here", "STATUS": "3", **(env or {})}
    runs = [subprocess.run([python, *argv], cwd=tmp_path, env=env, input="some input", capture_output=True, text=True,
                           timeout=120) for python in (warm_python(), sys.executable)]
    return [(run.returncode, json.loads(run.stdout), run.stderr) for run in runs]


@pytest.mark.parametrize("form", ["script", "-u script", "-c", "-m"])
def test_a_command_sees_what_it_sees_cold_with_torch_imported(warm_python, tmp_path, form):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "tool.py").write_text(SCRIPT)
    argv = {"script": ["pkg/tool.py", "a", "b c"], "-u script": ["-u", "pkg/tool.py", "a"],
            "-c": ["-c", SCRIPT, "a"], "-m": ["-m", "pkg.tool", "a"]}[form]
    warm, cold = both(warm_python, argv, tmp_path)
    assert warm[1].pop("warm") and not cold[1].pop("warm")
    assert warm == cold
    assert cold[0] == 3 and cold[1]["given"] == "here" and cold[1]["cwd"] == str(tmp_path)
    assert cold[2] == "to stderr\n"


def test_a_program_on_stdin_reads_the_rest_of_it(warm_python, tmp_path):
    program = "import sys; print(sys.argv, 'torch' in sys.modules); print(sys.stdin.read().strip())"
    warm, cold = (subprocess.run([python, "-", "x"], cwd=tmp_path, input=program, capture_output=True, text=True,
                                 timeout=120).stdout for python in (warm_python(), sys.executable))
    assert warm == "['-', 'x'] True\n\n" and cold == "['-', 'x'] False\n\n"


@pytest.mark.parametrize("options", [[], ["-u"]])
def test_what_is_written_before_an_abrupt_exit_is_what_a_cold_process_leaves(warm_python, tmp_path, options):
    """Buffered as the interpreter buffers (PYTHONUNBUFFERED, -u): a forked child that ends in ``os._exit`` keeps or
    loses its unflushed output alike."""
    program = "import os, sys; print('out'); print('err', file=sys.stderr); os._exit(0)"
    warm, cold = (subprocess.run([python, *options, "-c", program], capture_output=True, text=True, timeout=120)
                  for python in (warm_python(), sys.executable))
    assert (warm.stdout, warm.stderr) == (cold.stdout, cold.stderr)
    assert cold.stderr == "err\n"


def test_other_import_variables_or_options_run_cold(warm_python, tmp_path):
    (tmp_path / "tool.py").write_text(SCRIPT)
    warm, cold = both(warm_python, ["tool.py"], tmp_path, env={"TRANSFORMERS_VERBOSITY": "error"})
    assert not warm[1]["warm"] and warm == cold
    warm, cold = both(warm_python, ["-B", "tool.py"], tmp_path)
    assert not warm[1]["warm"] and warm == cold


def test_what_torchrun_sets_for_its_workers_runs_warm(warm_python, tmp_path):
    """torchrun's TORCHELASTIC_* and TORCH_NCCL_ASYNC_ERROR_HANDLING are read when a worker runs, not at import: a
    command given them runs warm (tests/test_distributed.py's workers), as it runs cold."""
    (tmp_path / "tool.py").write_text(SCRIPT)
    launched = {"TORCHELASTIC_RUN_ID": "run", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
    warm, cold = both(warm_python, ["tool.py"], tmp_path, env=launched)
    assert warm[1].pop("warm") and not cold[1].pop("warm")
    assert warm == cold


def test_an_exception_prints_its_traceback_and_exits_1(warm_python, tmp_path):
    done = subprocess.run([warm_python(), "-c", "raise ValueError('broken')"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "Traceback" in done.stderr and done.stderr.endswith("ValueError: broken\n")


ENDINGS = {
    "at the end": "print('done')",
    "sys.exit(message)": "import sys; print('out'); sys.exit('a message')",
    "sys.exit(300)": "import sys; sys.exit(300)",
    "sys.exit(None)": "import sys; sys.exit(None)",
    "KeyboardInterrupt": "raise KeyboardInterrupt",
    "threads and atexit": "import atexit, sys, threading, time\n"
                          "atexit.register(lambda: print('atexit ran'))\n"
                          "threading.Thread(target=lambda: (time.sleep(0.3), print('thread joined'))).start()\n"
                          "sys.stdout.write('unflushed, ')",
    "stdout unflushable": "import io, os, sys\n"
                          "sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, 'w', closefd=False)))\n"
                          "print('lost'); os.close(1)",
}


@pytest.mark.parametrize("ending", ENDINGS)
def test_a_program_ends_as_it_ends_cold(warm_python, tmp_path, ending):
    """Status, signal, output, the traceback's last line, threads joined and atexit functions run, as the
    interpreter's own ending (the warm process skips only the teardown of its modules)."""
    warm, cold = (subprocess.run([python, "-c", ENDINGS[ending]], cwd=tmp_path, capture_output=True, text=True,
                                 timeout=120) for python in (warm_python(), sys.executable))
    assert (warm.returncode, warm.stdout, warm.stderr.splitlines()[-1:]) == (
        cold.returncode, cold.stdout, cold.stderr.splitlines()[-1:])
    assert {"at the end": cold.stdout == "done\n", "sys.exit(message)": cold.returncode == 1,
            "sys.exit(300)": cold.returncode == 44, "sys.exit(None)": cold.returncode == 0,
            "KeyboardInterrupt": cold.returncode == -signal.SIGINT,
            "threads and atexit": cold.stdout == "unflushed, thread joined\natexit ran\n",
            "stdout unflushable": cold.returncode == 120}[ending]


def wait_for(path, seconds=60.0):
    end = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.05)


def test_a_timeout_kills_the_process_and_a_signal_reaches_it(warm_python, tmp_path):
    sleeper = ("import os, signal, sys, time\n"
               "signal.signal(signal.SIGTERM, lambda *_: (open('got-term', 'w').close(), sys.exit(7)))\n"
               "open('pid', 'w').write(str(os.getpid()))\n"
               "time.sleep(300)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        subprocess.run([warm_python(), "-c", sleeper], cwd=tmp_path, timeout=3)
    pid = int((tmp_path / "pid").read_text())
    end = time.monotonic() + 30
    while os.path.exists(f"/proc/{pid}") and "Z" not in open(f"/proc/{pid}/stat").read().split()[2]:
        assert time.monotonic() < end, "the process outlived its client"
        time.sleep(0.05)

    (tmp_path / "pid").unlink()
    client = subprocess.Popen([warm_python(), "-c", sleeper], cwd=tmp_path)
    wait_for(tmp_path / "pid")
    client.send_signal(signal.SIGTERM)
    assert client.wait(timeout=60) == 7
    assert (tmp_path / "got-term").exists()


def test_a_server_held_by_another_worker_outlives_its_stdin_and_ends_when_let_go(tmp_path):
    """The workers of one session share a server (tests/conftest.py): the one that started it closes its stdin at the
    end, the server goes on answering while another holds it, and ends when that one lets go."""
    socket_path = str(tmp_path / "socket")
    assert hold(socket_path) is None  # no server there
    server = subprocess.Popen([sys.executable, str(WARM_PYTHON), "serve", socket_path], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline() == "ready\n"
        held = hold(socket_path)
        assert held is not None
        server.stdin.close()
        time.sleep(0.5)
        assert server.poll() is None
        done = subprocess.run([sys.executable, str(WARM_PYTHON), "client", socket_path, "-c", "print('still here')"],
                              capture_output=True, text=True, timeout=120)
        assert done.stdout == "still here\n"
        held.close()
        assert server.wait(timeout=60) == 0
    finally:
        server.kill()
