"""`skilltrain` processes started from an interpreter that has imported litellm.

Importing litellm costs ~5 s of CPU, and the suite starts about a hundred
daemons: most of its CPU was that import, again and again (a SIGKILL test
restarts its daemon eight times). A fork server imports litellm and the
daemon's modules once, with no thread running; each daemon it starts is a
fork of it, then the command's own `main` with the test's argv, environment,
working folder and stdin/stdout/stderr. The child is a real process of its
own: it is signalled, killed and exits as one started by exec would be. What
differs: modules were imported before the test's environment was set (so a
variable a library reads at import time has the server's value), and the
process is the server's child, not the test's (so its exit status comes
back over the socket, see `Started`).

    server = ForkServer.start()       # one per test process, on first use
    proc = server.spawn(argv, env=..., cwd=..., stdout=fd, stderr=fd)
    proc.pid; proc.poll(); proc.wait(timeout); proc.send_signal(sig)

Run as `python -m tests.forkserver SOCKET` by `ForkServer.start`.
"""
from __future__ import annotations

import array
import atexit
import contextlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# What the server imports before it forks: everything `skilltrain daemon` will.
PRELOAD = (
    "litellm",
    "skilltrain.daemon.commands.cli",
    "skilltrain.daemon.service.lifecycle",
    "skilltrain.daemon.infra.llm",
)
_MAX_MESSAGE = 1 << 20


# ------------------------------------------------------------------ the client
class Started:
    """A process the server forked: the part of subprocess.Popen the tests use."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        # Signals go through a pidfd: once the server has reaped the child, its
        # pid may be any process's or thread's (pid_max is 32768 here).
        self._pidfd: int | None = None
        with contextlib.suppress(ProcessLookupError):
            self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        return self._read_status(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._read_status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout or 0.0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_status(self, timeout: float | None) -> int | None:
        """The exit status the server sends when it reaps the child (Popen's
        convention: -N for a signal)."""
        if self.returncode is not None:
            return self.returncode
        with selectors.DefaultSelector() as sel:
            sel.register(self._conn, selectors.EVENT_READ)
            if not sel.select(timeout):
                return None
        data = self._conn.recv(32)
        self._conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None
        # No status at all: the server is gone. Its way out (SIGTERM, or the test
        # process gone) kills its children first; a server killed outright leaves
        # its child running, and that child is then reported killed.
        self.returncode = int(data) if data.strip() else -signal.SIGKILL
        return self.returncode


class ForkServer:
    """The client's handle on a running server."""

    _started: ForkServer | None = None
    _lock = threading.Lock()

    def __init__(self, proc: subprocess.Popen[bytes], path: Path) -> None:
        self.proc, self.path = proc, path

    @classmethod
    def start(cls, env: dict[str, str]) -> ForkServer:
        """The test process's server, started on first use (its import takes a
        few seconds, paid once), stopped when the test process exits."""
        with cls._lock:
            if cls._started is not None and cls._started.proc.poll() is None:
                return cls._started
            folder = Path(tempfile.mkdtemp(prefix="skilltrain-forkserver-"))
            path = folder / "socket"
            proc = subprocess.Popen([sys.executable, "-m", "tests.forkserver", str(path)],
                                    env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    cwd=Path(__file__).resolve().parent.parent)
            deadline = time.monotonic() + 120
            while not path.exists():
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise RuntimeError(f"fork server did not start (exit {proc.poll()})")
                time.sleep(0.05)
            cls._started = cls(proc, path)
            atexit.register(cls._started.stop)
            return cls._started

    def spawn(self, argv: list[str], *, env: dict[str, str], cwd: Path,
              stdin: int, stdout: int, stderr: int) -> Started:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        conn.connect(str(self.path))
        message = json.dumps({"argv": argv, "env": env, "cwd": str(cwd)}).encode()
        fds = array.array("i", [stdin, stdout, stderr])
        conn.sendmsg([message], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds.tobytes())])
        pid = conn.recv(32)  # one message a reply: the socket keeps their bounds
        if not pid:
            raise RuntimeError("fork server closed the connection before the fork")
        return Started(int(pid), conn)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=10)
        with contextlib.suppress(OSError):
            self.path.unlink()
            self.path.parent.rmdir()


# ------------------------------------------------------------------ the server
def serve(path: Path) -> None:
    for name in PRELOAD:
        __import__(name)
    assert threading.active_count() == 1, threading.enumerate()  # a fork keeps one thread
    parent = os.getppid()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path) + ".new")
    listener.listen(64)
    os.rename(str(path) + ".new", path)  # seen by the client only once it accepts
    children: dict[int, socket.socket] = {}
    stopping = False

    def stop(_signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while not stopping and os.getppid() == parent:
        for _key, _ in sel.select(0.05):
            conn, _ = listener.accept()
            message, fds = _receive(conn)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:  # the child: never returns
                sel.close()
                listener.close()
                _run_child(conn, message, fds)
            for fd in fds:
                os.close(fd)
            conn.send(f"{pid}\n".encode())
            children[pid] = conn
        _reap(children)
    for pid in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while children and time.monotonic() < deadline:
        _reap(children)
        time.sleep(0.01)
    with contextlib.suppress(OSError):
        path.unlink()


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds = array.array("i")
    data, ancillary, _flags, _addr = conn.recvmsg(_MAX_MESSAGE, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return json.loads(data), list(fds)


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            conn.close()


def _run_child(conn: socket.socket, message: dict[str, Any], fds: list[int]) -> None:
    """As `exec(argv)` would leave it: its stdio, environment, folder and argv;
    no descriptor of the server's; default signal handlers."""
    code = 1
    try:
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update(message["env"])
        os.chdir(message["cwd"])
        sys.argv = list(message["argv"])
        from skilltrain.daemon.commands import cli

        try:
            cli.main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        threading._shutdown()  # type: ignore[attr-defined]  # as the interpreter's exit does
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001 - a child must never return into the server
        import traceback

        traceback.print_exc()
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve(Path(sys.argv[1]))
