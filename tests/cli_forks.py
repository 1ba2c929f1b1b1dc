"""The `tracedeck` CLI for the tests, forked from an interpreter that has imported it already.

A test runs the CLI hundreds of times; each fresh `python -m console.cli` spent ~0.3 s of CPU
importing (numpy, asyncssh, every run kind) before doing anything, about a fifth of the suite's
CPU. Here one server process per test process imports all of it once, then forks a child per
command: the child gets the command's argv, environment, cwd, stdin and output pipes, runs
`console.cli` as `python -m console.cli` would (the same `__main__` start, interrupts recorded),
and ends as the interpreter's shutdown would (`_end`). The server holds only what the program
holds when it dispatches (console.cli, the run kinds) and third-party packages; a command's own
imports happen in its child. One difference stays: a child's /proc/PID/environ and cmdline are the
server's (Linux shows a process's exec-time ones), so a test that finds the CLI process itself by
its environment or command line starts it with fresh=True. Anything that Python reads only when
it starts (PYTHON* variables, the locale) must match the server's, else the caller runs a fresh
process (`forkable`); tests of the program's start itself pass fresh=True to `runhelp.spawn`.

    python tests/cli_forks.py SOCKET WATCH_FD
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import selectors
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# What the interpreter reads once at its start: a command whose environment differs from the
# server's in any of these runs as a fresh process.
AT_START = ("LANG", "LC_ALL", "LC_CTYPE")
THIRD_PARTY = ("asyncssh", "pyarrow", "pyarrow.parquet", "pyarrow.csv", "msgspec", "isal.igzip")


def at_start(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON") or k in AT_START}


def _preload() -> None:
    """Import what `python -m console.cli` has imported when it dispatches a command (the module
    and the parser's run kinds) and the heavy third-party packages its commands import. None of
    tracedeck's other modules: a command imports them in its child as a fresh process would, so
    a missing import in a command fails here as it would for a user."""
    import console.cli

    console.cli.build_parser()  # discovers every run kind, as the program does before dispatch
    for name in THIRD_PARTY:
        importlib.import_module(name)


def _child(request: dict[str, Any], fds: list[int], closing: list[Any]) -> None:
    """In the forked child: become the command, run it and exit as Python does (its SystemExit
    goes up to the top, so the interpreter's shutdown runs: atexit, threads joined, flushes)."""
    for thing in closing:
        thing.close()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    time.tzset()
    tempfile.tempdir = None
    sys.argv = [str(ROOT / "console" / "cli.py"), *request["args"]]
    from console import cli, startup

    startup.installed_as_program("__main__")
    try:
        code: object = cli.main(request["args"])
    except SystemExit as exc:
        code = exc.code
    _end(code)


def _end(code: object) -> None:
    """End the child as the interpreter's shutdown would, as far as anyone can see: threads
    joined, atexit handlers run, the command's unreachable objects collected (their finalizers'
    words, an unclosed transport's say, still reach stderr), the standard streams flushed, and
    SystemExit's code; then os._exit. What it leaves out is freeing the server's objects one by
    one, which wrote to every page the child shares with the server (copy-on-write: ~0.1 s of
    CPU a command, a tenth of the suite's). An exception that escapes the command still gets the
    interpreter's own shutdown (its traceback printed as Python prints it)."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    gc.collect()
    if code is None:
        status = 0
    elif isinstance(code, int):
        status = code & 0xFF
    else:  # as Python does with sys.exit("words")
        print(code, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            status = 120
    os._exit(status)


def serve(path: str, watch: int) -> None:
    _preload()
    gc.freeze()  # the children's collections pass over the server's objects, never write them
    sys.stdout.flush()
    sys.stderr.flush()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".new")
    listener.listen(64)
    os.rename(path + ".new", path)  # the name appears only once it accepts
    wake_r, wake_w = socket.socketpair()
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno())
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    sel.register(wake_r, selectors.EVENT_READ)
    watching = open(watch, "rb", buffering=0)  # noqa: SIM115 (for the life of the server)
    sel.register(watching, selectors.EVENT_READ)
    running: dict[int, socket.socket] = {}
    while True:
        for key, _ in sel.select():
            if key.fileobj is watching:  # the test process is gone
                for pid in running:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                return
            if key.fileobj is wake_r:
                wake_r.recv(4096)
                _reap(running)
                continue
            conn, _ = listener.accept()
            raw, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)
            size = struct.unpack("!i", raw[:4])[0]
            raw = raw[4:] + _exactly(conn, size - len(raw) + 4)
            request = json.loads(raw)
            pid = os.fork()
            if pid == 0:
                _child(
                    request, fds, [sel, listener, conn, wake_r, wake_w, watching, *running.values()]
                )
            for fd in fds:
                os.close(fd)
            conn.sendall(struct.pack("!i", pid))
            running[pid] = conn
            _reap(running)


def _reap(running: dict[int, socket.socket]) -> None:
    while running:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))
            conn.close()


class Forks:
    """The client: one server for this process, started at first use."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._path = ""
        self._env: dict[str, str] = {}

    def _server(self, env: dict[str, str]) -> str:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                if self._proc is not None:  # it ended: a new one, with a watch pipe of its own
                    os.close(self._watch_w)
                folder = tempfile.mkdtemp(prefix="tracedeck-forks-")
                self._path = os.path.join(folder, "s")
                watch_r, self._watch_w = os.pipe()  # the write end lives as long as this process
                self._env = dict(env)
                self._proc = subprocess.Popen(
                    [sys.executable, __file__, self._path, str(watch_r)],
                    cwd=ROOT,
                    env=self._env,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(watch_r,),
                )
                os.close(watch_r)
                while not os.path.exists(self._path):
                    if self._proc.poll() is not None:
                        raise RuntimeError(f"the CLI fork server ended ({self._proc.returncode})")
                    time.sleep(0.02)
            return self._path

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def close(self) -> None:
        """Stop the server (its running commands are killed)."""
        with self._lock:
            if self._proc is not None:
                os.close(self._watch_w)  # the server sees its end and stops
                self._proc.wait()
                os.unlink(self._path)
                os.rmdir(os.path.dirname(self._path))
                self._proc = None

    def forkable(self, env: dict[str, str]) -> bool:
        return self._proc is None or at_start(env) == at_start(self._env)

    def start(self, args: list[str], env: dict[str, str]) -> ForkedProcess:
        """`tracedeck ARGS` started, its output on pipes: as subprocess.Popen(..., text=True)."""
        path = self._server(env)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            request = json.dumps({"args": args, "env": env, "cwd": str(ROOT)}).encode()
            header = struct.pack("!i", len(request))
            socket.send_fds(conn, [header + request[:1024]], [0, out_w, err_w])
            conn.sendall(request[1024:])
            pid = struct.unpack("!i", _exactly(conn, 4))[0]
        except BaseException:
            conn.close()
            os.close(out_r)
            os.close(err_r)
            raise
        finally:
            os.close(out_w)
            os.close(err_w)
        return ForkedProcess([sys.executable, "-m", "console.cli", *args], pid, conn, out_r, err_r)

    def run(
        self, args: list[str], env: dict[str, str], timeout: float
    ) -> subprocess.CompletedProcess[str]:
        """As subprocess.run(..., capture_output=True, text=True, timeout=timeout)."""
        with self.start(args, env) as proc:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


class ForkedProcess:
    """A forked command, as much of subprocess.Popen as the tests use: pid, stdout and stderr
    (text), poll, wait, communicate, send_signal, terminate, kill, returncode. Its exit status
    comes from the server, its parent."""

    def __init__(self, args: list[str], pid: int, conn: socket.socket, out: int, err: int) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._conn = conn
        self.stdout = open(out, encoding="utf-8", newline=None)  # noqa: SIM115
        self.stderr = open(err, encoding="utf-8", newline=None)  # noqa: SIM115
        self._got: dict[int, list[bytes]] = {out: [], err: []}

    def __enter__(self) -> ForkedProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        for f in (self.stdout, self.stderr):
            if not f.closed:
                f.close()
        if self.returncode is None:
            self.wait()

    def _status(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if ready:
                self.returncode = struct.unpack("!i", _exactly(self._conn, 4))[0]
                self._conn.close()
        return self.returncode

    def poll(self) -> int | None:
        return self._status(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._status(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return code

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # (once reaped, the pid may be another process's)
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Both pipes to their end, then the status; a timeout keeps what was read for the
        next call, as Popen does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        files = {f.fileno(): f for f in (self.stdout, self.stderr) if not f.closed}
        sel = selectors.DefaultSelector()
        for fd in files:
            sel.register(fd, selectors.EVENT_READ)
        try:
            while sel.get_map():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired(self.args, timeout or 0)
                for key, _ in sel.select(left):
                    data = os.read(key.fd, 65536)
                    if data:
                        self._got[key.fd].append(data)
                    else:
                        sel.unregister(key.fd)
                        files[key.fd].close()
        finally:
            sel.close()
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        self.wait(left)
        # as Popen(text=True) gives them: UTF-8 here, universal newlines
        out, err = (
            b"".join(chunks).decode().replace("\r\n", "\n").replace("\r", "\n")
            for chunks in self._got.values()
        )
        return out, err


def _exactly(conn: socket.socket, n: int) -> bytes:
    data = b""
    if n <= 0:
        return data
    while len(data) < n:
        got = conn.recv(n - len(data))
        if not got:
            raise RuntimeError("the CLI fork server closed the connection")
        data += got
    return data


if __name__ == "__main__":
    sys.path[0] = str(ROOT)  # as `python -m console.cli` run in the checkout has it
    serve(sys.argv[1], int(sys.argv[2]))
