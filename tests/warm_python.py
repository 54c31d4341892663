"""A warm ``python`` for the tests' processes: a server imports torch and transformers once (about 8 s a process),
then forks a real process for each command line it is given, with those modules already loaded.

    python warm_python.py serve SOCKET          # prints "ready" once it listens; ends when its stdin closes
    python warm_python.py client SOCKET ARGS... # runs as ``python ARGS...`` would, and exits with its status

The client hands the forked process its stdin, stdout and stderr, its working directory and its environment, passes
on the signals it gets (SIGTERM, SIGINT, SIGHUP), and the process is killed when the client goes away (a timeout's
SIGKILL); the client ends as the process does (its status, or its signal). The process ends as the interpreter ends
a program, without tearing its modules down (``end``: 2 to 3 s less a process). A command runs warm only where it
would run the same cold: no interpreter options but ``-u``, and the environment variables that the preloaded modules
read at import (``IMPORT_ENV``) as the server's. Otherwise the forked process ``exec``s the interpreter: an ordinary
cold start. Nothing of collab_attn is preloaded, so every process imports the sources as they are on disk
(tests/mutate.py changes them). A server ends when its stdin closes and no other process holds it (``hold``: the
other workers of a test session, tests/conftest.py).
"""

import atexit
import contextlib
import io
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
import types

# variables read when the preloaded modules (torch, transformers, huggingface_hub, datasets, pyarrow, scikit-learn,
# tokenizers, tqdm, matplotlib) or the interpreter start
IMPORT_ENV = ("PYTHON", "HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "TRITON", "OMP_", "MKL_", "KMP_",
              "OPENBLAS", "CUDA", "NVIDIA", "TOKENIZERS", "TQDM_", "SAFETENSORS", "ACCELERATE", "ARROW_", "SKLEARN_",
              "JOBLIB_", "LOKY_", "SCIPY_", "PANDAS_", "XDG_", "HOME", "LANG", "LC_", "TMPDIR", "MPL")
# the model families collab_attn converts, whose modeling modules its package imports
FAMILIES = ("albert", "bert", "distilbert", "gpt2", "llama", "mistral", "opt", "qwen2", "roberta")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STARTED = dict(os.environ)  # before anything is imported


# what torchrun sets for its workers among those, read when they run, not when they import
LAUNCHER_ENV = ("TORCHELASTIC_", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def import_env(env: dict) -> dict:
    return {k: v for k, v in env.items()  # PYTHON: a script's own
            if k.startswith(IMPORT_ENV) and not k.startswith(LAUNCHER_ENV) and k != "PYTHON"}


def preload() -> None:
    """What most tests' processes import; nothing that prints at import (transformers.Trainer does, under
    WANDB_MODE=offline), which a process run warm would not print."""
    import importlib

    import datasets  # noqa: F401  (with pandas and pyarrow; about 2 s of a script's start)
    import hydra  # noqa: F401
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import omegaconf  # noqa: F401
    import scipy.stats  # noqa: F401
    import sklearn.metrics  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.utils.data  # noqa: F401
    import transformers  # noqa: F401
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationMixin, PreTrainedModel  # noqa: F401

    for family in FAMILIES:
        importlib.import_module(f"transformers.models.{family}.modeling_{family}")


# ---------------------------------------------------------------------------------------------------
# server


def receive(conn: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
    size = int.from_bytes(data[:8], "big")
    data = data[8:]
    while len(data) < size:
        more = conn.recv(size - len(data))
        if not more:
            raise ConnectionError("the client left before its request was whole")
        data += more
    return json.loads(data), fds


def serve(path: str) -> dict | None:
    """Answers clients until stdin closes and no other process holds the server (``hold``); returns a request only
    in a forked process, which then runs it."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        preload()
    if out.getvalue() or err.getvalue():
        raise RuntimeError(f"preloading printed {out.getvalue() + err.getvalue()!r}, which a process run warm would "
                           "not print: leave out of preload() what prints it")
    server = os.getpid()
    children = {}  # pidfd -> (connection, pid)
    holders, stdin_open = set(), True
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener, selectors.DefaultSelector() as selector:
        listener.bind(path)
        listener.listen(64)
        selector.register(listener, selectors.EVENT_READ, "accept")
        selector.register(sys.stdin, selectors.EVENT_READ, "stdin")
        print("ready", flush=True)
        try:
            while True:
                for key, _ in selector.select():
                    if key.data == "stdin":
                        if not os.read(sys.stdin.fileno(), 1 << 10):
                            selector.unregister(sys.stdin)
                            stdin_open = False
                    elif key.data == "holder":
                        if not key.fileobj.recv(1 << 10):  # the holder let go
                            selector.unregister(key.fileobj)
                            holders.discard(key.fileobj)
                            key.fileobj.close()
                    elif key.data == "accept":
                        conn, _ = listener.accept()
                        try:
                            request, fds = receive(conn)
                        except (OSError, ValueError):
                            conn.close()
                            continue
                        if request.get("hold"):
                            holders.add(conn)
                            selector.register(conn, selectors.EVENT_READ, "holder")
                            conn.sendall(b"held")
                            continue
                        pid = os.fork()
                        if pid == 0:
                            os.setpgid(0, 0)
                            for pidfd, (other, _) in children.items():
                                os.close(pidfd)
                                other.close()
                            for other in holders:
                                other.close()
                            listener.close()
                            selector.close()
                            conn.close()
                            for i, fd in enumerate(fds):
                                os.dup2(fd, i)
                                os.close(fd)
                            return request
                        for fd in fds:
                            os.close(fd)
                        pidfd = os.pidfd_open(pid)
                        children[pidfd] = (conn, pid)
                        selector.register(pidfd, selectors.EVENT_READ, "exit")
                        selector.register(conn, selectors.EVENT_READ, ("client", pidfd))
                    elif key.data == "exit":
                        conn, pid = children.pop(key.fd)
                        selector.unregister(key.fd)
                        os.close(key.fd)
                        with contextlib.suppress(KeyError):  # unless the client left before
                            selector.unregister(conn)
                        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                        with contextlib.suppress(OSError):  # unless the client is gone
                            conn.sendall(json.dumps({"status": status}).encode())
                        conn.close()
                    else:  # a client's signal, or the client gone: its process gets the signal, or SIGKILL
                        conn, pid = children[key.data[1]]
                        message = conn.recv(1 << 10)
                        for number in message.split() if message else [signal.SIGKILL]:
                            with contextlib.suppress(ProcessLookupError):
                                os.killpg(pid, int(number))
                        if not message:
                            selector.unregister(conn)
                if not stdin_open and not holders:
                    return None
        finally:
            if os.getpid() == server:
                for _, pid in children.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(pid, signal.SIGKILL)
                os.unlink(path)


def run(request: dict) -> None:
    """In the forked process: stdin, stdout and stderr are the client's already; the rest as ``python ARGS``."""
    for number in FORWARDED:
        signal.signal(number, signal.SIG_DFL)
    os.chdir(request["cwd"])
    argv, env, options = list(request["argv"]), request["env"], []
    while argv and argv[0].startswith("-") and argv[0] not in ("-", "-c", "-m"):
        options.append(argv.pop(0))
    complete = argv and (argv[0] not in ("-c", "-m") or len(argv) > 1)
    if not complete or set(options) - {"-u"} or import_env(env) != import_env(STARTED):
        os.execve(sys.executable, [sys.executable, *request["argv"]], env)
    added = {k: v for k, v in os.environ.items() if k not in STARTED}  # what the imports set (torch's inductor cache)
    os.environ.clear()
    os.environ.update({**added, **env})
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()  # a fresh process draws a fresh seed
    # the streams as the interpreter makes them: the server's encoding and errors (its PYTHON* variables are the
    # command's), unbuffered where the server's are (PYTHONUNBUFFERED) or under -u, stdout line-buffered where it is a
    # terminal, stderr always
    def stream(fd: int, like, line_buffering: bool):
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        if fd == 0:
            return io.TextIOWrapper(io.BufferedReader(raw), encoding=like.encoding, errors=like.errors)
        unbuffered = isinstance(like.buffer, io.FileIO) or "-u" in options
        return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding=like.encoding,
                                errors=like.errors, line_buffering=line_buffering, write_through=unbuffered)

    sys.stdin = sys.__stdin__ = stream(0, sys.__stdin__, False)
    sys.stdout = sys.__stdout__ = stream(1, sys.__stdout__, os.isatty(1))
    sys.stderr = sys.__stderr__ = stream(2, sys.__stderr__, True)
    first, rest = argv[0], argv[1:]
    if first == "-m":
        sys.argv, sys.path[0] = [first, *rest[1:]], os.getcwd()
        runpy.run_module(rest[0], run_name="__main__", alter_sys=True)
    elif first in ("-c", "-"):
        code = rest.pop(0) if first == "-c" else sys.stdin.read()
        main = types.ModuleType("__main__")
        sys.modules["__main__"], sys.argv, sys.path[0] = main, [first, *rest], ""
        exec(compile(code, "<string>" if first == "-c" else "<stdin>", "exec"), main.__dict__)
    else:
        sys.argv, sys.path[0] = argv, os.path.dirname(os.path.realpath(first))
        runpy.run_path(first, run_name="__main__")


# ---------------------------------------------------------------------------------------------------
# client


def hold(path: str) -> socket.socket | None:
    """Keeps the server at ``path`` running until the returned connection closes (another process's session that
    uses it, besides the one whose stdin it reads); None where no server answers there."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
        header = json.dumps({"hold": True}).encode()
        conn.sendall(len(header).to_bytes(8, "big") + header)
        if conn.recv(4) == b"held":
            return conn
    except OSError:
        pass
    conn.close()
    return None


def client(path: str, argv: list[str]) -> int:
    stdio = []
    for fd in range(3):
        try:
            os.fstat(fd)
            stdio.append(fd)
        except OSError:  # closed: the process gets /dev/null, as a child of a process without it would
            stdio.append(os.open(os.devnull, os.O_RDWR))
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        header = json.dumps({"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
        socket.send_fds(conn, [len(header).to_bytes(8, "big") + header], stdio)
        for number in FORWARDED:
            signal.signal(number, lambda number, _: conn.sendall(b"%d " % number))
        reply = b""
        while chunk := conn.recv(1 << 10):
            reply += chunk
    status = json.loads(reply)["status"]
    if status < 0:  # the process died of a signal: so does the client
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    return 128 - status if status < 0 else status


def end(request: dict) -> None:
    """In the forked process: runs ``request`` and ends as the interpreter ends a program (an uncaught exception's
    traceback, SystemExit's status or message, KeyboardInterrupt's SIGINT, non-daemon threads joined, atexit functions
    run, stdout and stderr flushed), short of tearing its modules down. That teardown takes 2 to 3 s once torch,
    transformers and datasets are imported; all it would still do is free memory and finalize what is alive at the
    end, and this project's commands close their files before they end."""
    interrupted = False
    try:
        run(request)
        status = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            status = stop.code or 0
        else:  # a message: printed, status 1
            print(stop.code, file=sys.stderr)
            status = 1
    except BaseException as error:  # noqa: BLE001  (as the interpreter: any exception ends the program)
        sys.excepthook(type(error), error, error.__traceback__)
        status, interrupted = 1, isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # what the interpreter calls first when it finalizes: joins the non-daemon threads
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError) as error:  # reported as the interpreter reports it, with its status
            with contextlib.suppress(OSError, ValueError):
                sys.stderr.write(f"Exception ignored in: {stream!r}\n{''.join(traceback.format_exception_only(error))}")
            status = 120
    if interrupted:  # an uncaught KeyboardInterrupt ends the interpreter by SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(status & 0xFF)


if __name__ == "__main__":
    role, socket_path = sys.argv[1:3]
    if role == "client":
        sys.exit(client(socket_path, sys.argv[3:]))
    request = serve(socket_path)
    if request is None:
        os._exit(0)  # the server is done: no need to tear its modules down
    end(request)
