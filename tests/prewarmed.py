"""The suite's `python` subprocesses, forked from an interpreter that has already imported torch.

Most of the suite's time goes to the commands it runs as subprocesses (train.py, sample.py, the tools), and a
fresh interpreter spends about four seconds importing torch, dynamo and Hydra before a command starts. Under
pytest, `subprocess.Popen([sys.executable, ...])` is instead forked from a server process that imported torch,
dynamo, NumPy and Hydra with the suite's own environment (`conftest.subprocess_env()` as it is at that moment),
when the command's environment agrees with it on every variable those imports may read (`READ_AT_IMPORT`), so
what they read is what a fresh process reads. The forked child then runs the command as
`python` does: its argv, cwd, `sys.path[0]`, `__main__`, standard streams, exit status, atexit handlers, signals.
Anything else (another program, interpreter flags, an environment that differs there, a new session) starts a
fresh process as usual, and so does every command while `TREAD_TESTS_FRESH=1` is set (in the suite's environment
or in the command's).

The child is the server's, not the test's: the test process gets its pid and exit status from the server.
"""
import atexit
import gc
import importlib
import inspect
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

PRELOAD = ("torch", "torch._dynamo", "numpy", "hydra", "omegaconf")
# What those libraries (and the interpreter) may read from the environment while importing: a command whose
# environment differs from the suite's elsewhere (HOME, HF_HOME, HF_HUB_OFFLINE: huggingface_hub reads those when
# imported, which is why it is not preloaded) is forked all the same, and gets its own environment before it runs.
READ_AT_IMPORT = ("PYTHON", "LD_", "PATH", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS", "GOTO", "NUMEXPR",
                  "NPY_", "NUMPY", "CUDA", "NCCL", "TRITON", "HYDRA", "TMP", "TEMP", "USER", "LOGNAME", "LANG", "LC_")
READ_WHEN_USED = ("TORCH_HOME", "CUDA_VISIBLE_DEVICES")  # read by torch.hub and at CUDA's first use, not on import
EXECUTE_CHILD = list(inspect.signature(subprocess.Popen._execute_child).parameters)[1:]  # the names, after self
STATUS = struct.Struct("q")


# ---- the server: `python tests/prewarmed.py SOCKET`, started by the first eligible Popen of a test process ----

def serve(path: str):
    """Accepts spawn requests; returns (request, fds) in each forked child, loops forever in the server."""
    for name in PRELOAD:
        importlib.import_module(name)
    gc.freeze()  # the collector of each child leaves the preloaded objects alone (no copy-on-write of their pages)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the client connects once the server is ready
    parent, children = os.getppid(), {}
    while os.getppid() == parent:  # the test process is gone: so is its server
        if select.select([listener], [], [], 0.02)[0]:
            conn, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                for other in (listener, conn, *children.values()):
                    other.close()
                return json.loads(message), fds
            for fd in fds:
                os.close(fd)
            conn.send(STATUS.pack(pid))
            children[pid] = conn
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is not None:
                try:
                    conn.send(STATUS.pack(status))
                except OSError:  # the test stopped listening
                    pass
                conn.close()
    sys.exit(0)


def become(request, fds):
    """In the forked child: the streams, directory, environment and argv of the command, then the command itself,
    as `python -c CODE`, `python -m MODULE` or `python SCRIPT` runs it."""
    import builtins
    import types

    import numpy as np

    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    np.random.seed()  # a fresh interpreter's global NumPy stream is seeded from the OS, not shared
    main = sys.modules["__main__"] = types.ModuleType("__main__")  # the command's, not this file's
    main.__builtins__ = builtins
    try:
        run_command(request["args"], main)
        code = 0
    except SystemExit as e:
        code = exit_code(e.code)
    except KeyboardInterrupt:
        code = -signal.SIGINT
        sys.excepthook(*sys.exc_info())
    except BaseException:
        code = 1
        sys.excepthook(*sys.exc_info())
    exit_as_python_does(code)


def run_command(args, main):
    import runpy

    if args[0] == "-c":
        sys.argv, sys.path[0] = ["-c", *args[2:]], ""
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    elif args[0] == "-m":
        sys.argv, sys.path[0] = [args[1], *args[2:]], os.getcwd()
        runpy._run_module_as_main(args[1])
    else:
        sys.argv, sys.path[0] = list(args), os.path.dirname(os.path.abspath(args[0]))
        main.__file__, main.__cached__ = args[0], None
        with open(args[0], "rb") as f:
            source = f.read()
        exec(compile(source, args[0], "exec"), main.__dict__)


def exit_code(value) -> int:
    """SystemExit's value as the interpreter turns it into an exit status (a message goes to stderr, status 1)."""
    if value is None or isinstance(value, bool) and not value:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1


def exit_as_python_does(code: int):
    """The interpreter's exit (non-daemon threads joined, atexit handlers, streams flushed) without tearing down
    every module, which in a forked child writes to every page the server shares with it (about a second)."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if code == -signal.SIGINT:  # an uncaught KeyboardInterrupt ends the process by SIGINT, as in CPython
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


# ---- the client: a Popen that sends eligible commands to the server ----

_servers = {}  # the environment a server imported with (less what `comparable` ignores) -> its socket, or None
_servers_lock = threading.Lock()
MAX_SERVERS = 3  # a variable some library sets once (KMP_DUPLICATE_LIB_OK) changes the suite's environment for good


def base_env() -> dict:
    from conftest import subprocess_env

    return subprocess_env()


def server_for(env: dict):
    """The socket of the server that imported with `env`, started on first use, if `env` is the suite's own
    environment now (`conftest.subprocess_env()`); None otherwise, or if it cannot start."""
    key = frozenset(comparable(env).items())
    if key != frozenset(comparable(base_env()).items()):
        return None
    with _servers_lock:
        if key not in _servers:
            _servers[key] = start_server(env) if len(_servers) < MAX_SERVERS else None
        return _servers[key]


def start_server(env: dict):
    path = os.path.join(tempfile.mkdtemp(prefix="tread-prewarmed-"), "socket")
    proc = subprocess._ORIGINAL_POPEN([sys.executable, __file__, path], env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    atexit.register(proc.kill)
    deadline = time.monotonic() + 120
    while not os.path.exists(path) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return path if os.path.exists(path) else None


def comparable(env: dict) -> dict:
    """The part of an environment that the server's imports may have read."""
    return {k: v for k, v in env.items() if k.startswith(READ_AT_IMPORT) and k not in READ_WHEN_USED}


def command_args(args):
    """`python -c CODE ...`, `python -m MODULE ...` or `python SCRIPT ...` as the arguments after the interpreter;
    None for anything else (interpreter flags, another program)."""
    if isinstance(args, (str, bytes, os.PathLike)) or not args or os.fspath(args[0]) != sys.executable:
        return None
    rest = [os.fspath(a) for a in args[1:]]
    if not rest or not all(isinstance(a, str) for a in rest):
        return None
    if rest[0] in ("-c", "-m"):
        return rest if len(rest) >= 2 else None
    return None if rest[0].startswith("-") else rest


class PrewarmedPopen(subprocess.Popen):
    _status = None
    _conn = None

    def _execute_child(self, *call):
        given = dict(zip(EXECUTE_CHILD, call))
        args = command_args(given["args"])
        env = dict(os.environ if given["env"] is None else given["env"])
        plain = (not given["shell"] and given["executable"] is None and given["preexec_fn"] is None
                 and not given["pass_fds"] and not given["start_new_session"] and given.get("process_group", -1) == -1
                 and given["uid"] is None and given["gid"] is None and given["gids"] is None and given["umask"] < 0)
        fresh = env.get("TREAD_TESTS_FRESH") == "1"
        path = server_for(env) if args is not None and plain and not fresh else None
        if path is None:
            return super()._execute_child(*call)
        streams = [fd if fd != -1 else own for fd, own in
                   ((given["p2cread"], 0), (given["c2pwrite"], 1), (given["errwrite"], 2))]
        request = {"args": args, "cwd": os.fspath(given["cwd"]) if given["cwd"] is not None else os.getcwd(),
                   "env": env}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(path)
        socket.send_fds(conn, [json.dumps(request).encode()], streams)
        self.pid = STATUS.unpack(conn.recv(STATUS.size))[0]
        self._conn, self._child_created = conn, True
        self._close_pipe_fds(*(given[k] for k in ("p2cread", "p2cwrite", "c2pread", "c2pwrite", "errread",
                                                  "errwrite")))

    def _server_status(self, block: bool):
        if self._status is None:
            if block or select.select([self._conn], [], [], 0)[0]:
                data = self._conn.recv(STATUS.size)
                self._status = STATUS.unpack(data)[0] if data else 255 << 8  # no status: the server died, exit 255
                self._conn.close()
        return self._status

    def _try_wait(self, wait_flags):
        if self._conn is None:
            return super()._try_wait(wait_flags)
        status = self._server_status(block=not wait_flags & os.WNOHANG)
        return (0, 0) if status is None else (self.pid, status)

    def _internal_poll(self, _deadstate=None, **kwargs):
        if self._conn is None:
            return super()._internal_poll(_deadstate, **kwargs)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None:
                    status = self._server_status(block=False)
                    if status is not None:
                        self._handle_exitstatus(status)
            except OSError:
                if _deadstate is not None:
                    self.returncode = _deadstate
            finally:
                self._waitpid_lock.release()
        return self.returncode


def install():
    """Route the suite's `python` subprocesses through the server (unless TREAD_TESTS_FRESH=1)."""
    if os.environ.get("TREAD_TESTS_FRESH") == "1" or sys.platform != "linux" or hasattr(subprocess, "_ORIGINAL_POPEN"):
        return
    subprocess._ORIGINAL_POPEN = subprocess.Popen
    subprocess.Popen = PrewarmedPopen


if __name__ == "__main__":
    become(*serve(sys.argv[1]))
