"""Test helpers: a real OpenSSH sshd on loopback, a HOME that trusts it, a cuttable TCP proxy."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import pwd
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SSHD = Path("/usr/sbin/sshd")
SSH_KEYGEN = "ssh-keygen"
ALIAS = "testbox"
PROXY_ALIAS = "testbox-proxy"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, comment: str, key_type: str = "ed25519") -> None:
    """Generate a key pair (ed25519 unless told) at path and path.pub, without a passphrase."""
    subprocess.run(
        [SSH_KEYGEN, "-q", "-t", key_type, "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
    )


def fingerprint(pub: Path) -> str:
    """The SHA256 fingerprint of a public key file, as `ssh-keygen -lf` prints it."""
    out = subprocess.run(
        [SSH_KEYGEN, "-lf", str(pub)], check=True, capture_output=True, text=True
    ).stdout
    return out.split()[1]


def known_hosts_line(host: str, port: int, pub: Path) -> str:
    """One known_hosts line for host:port with the key in pub (key type and base64 only)."""
    key_type, key_b64 = pub.read_text().split()[:2]
    name = host if port == 22 else f"[{host}]:{port}"
    return f"{name} {key_type} {key_b64}\n"


@dataclass
class SshServer:
    """A running sshd: where it listens, who may log in, and how to trust it."""

    host: str
    port: int
    user: str
    dir: Path
    client_key: Path  # private key authorised for `user`; client_key.with_suffix(".pub") too
    host_key_pub: Path
    known_hosts: Path  # contains "[127.0.0.1]:PORT ssh-ed25519 ..."
    fingerprint: str  # "SHA256:..." of the host key, from ssh-keygen -lf
    key_type: str  # "ssh-ed25519"
    log: Path
    pid: int
    process: subprocess.Popen[bytes] = field(repr=False)

    @property
    def spec(self) -> str:
        return f"ssh://{self.user}@{self.host}:{self.port}"

    def known_hosts_line(self, port: int | None = None) -> str:
        """The known_hosts line trusting this server's key at 127.0.0.1:port (default: its own)."""
        return known_hosts_line(self.host, self.port if port is None else port, self.host_key_pub)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(timeout=5)


def _sshd_config(
    d: Path,
    port: int,
    listen: str,
    extra_keys: tuple[str, ...],
    session_env: tuple[str, ...],
    sftp: str,
) -> str:
    return "\n".join(
        [
            f"Port {port}",
            f"ListenAddress {listen}",
            f"HostKey {d / 'ssh_host_ed25519_key'}",
            *(f"HostKey {d / f'ssh_host_{t}_key'}" for t in extra_keys),
            f"PidFile {d / 'sshd.pid'}",
            f"AuthorizedKeysFile {d / 'authorized_keys'}",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "UsePAM no",
            "StrictModes no",
            "PermitRootLogin prohibit-password",
            "PrintMotd no",
            # The test host's sessions start without the machine's own dotfiles: bash, run by
            # sshd as a top-level shell (SHLVL unset), sources ~/.bashrc before every command,
            # and root's here runs `pyenv init` (~0.2 s of CPU a command: 41% of the fleet
            # tests' CPU). SHLVL=1 makes it a nested shell, which does not. A host whose rc
            # is slow or writes to stdout is tested on purpose (test_remote_rc.py).
            " ".join(["SetEnv", "SHLVL=1", *session_env]),
            "UseDNS no",
            "LogLevel VERBOSE",
            f"Subsystem sftp {sftp}",
            "",
        ]
    )


def start_sshd(
    d: Path,
    *,
    attempts: int = 3,
    wrap: list[str] | None = None,
    listen: str = "127.0.0.1",
    extra_host_keys: tuple[str, ...] = (),
    session_env: tuple[str, ...] = (),
    sftp: str = "internal-sftp",
) -> SshServer:
    """Start /usr/sbin/sshd on a free port with fresh keys in d; wait until it listens.

    wrap: a command that execs the rest (e.g. a new mount namespace, see own_tmp).
    listen: the address (loopback unless told); extra_host_keys: more host key types
    ("ecdsa", "rsa") besides the ed25519 one; session_env: more NAME=VALUE words every
    session starts with (e.g. BASH_ENV, an rc file the login shell reads before each command);
    sftp: the sftp subsystem (a program is started through the login shell, internal-sftp not)."""
    d.mkdir(parents=True, exist_ok=True)
    host_key = d / "ssh_host_ed25519_key"
    client_key = d / "id_ed25519"
    if not host_key.exists():
        keygen(host_key, "tracedeck-test-host")
        keygen(client_key, "tracedeck-test-client")
    for key_type in extra_host_keys:
        extra = d / f"ssh_host_{key_type}_key"
        if not extra.exists():
            keygen(extra, f"tracedeck-test-host-{key_type}", key_type)
    (d / "authorized_keys").write_text(client_key.with_suffix(".pub").read_text())
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege separation dir
    user = pwd.getpwuid(os.geteuid()).pw_name
    host_pub = host_key.with_suffix(".pub")
    log = d / "sshd.log"
    last_error = ""
    for _ in range(attempts):
        port = free_port()
        config = d / "sshd_config"
        config.write_text(_sshd_config(d, port, listen, extra_host_keys, session_env, sftp))
        with log.open("ab") as log_file:
            proc = subprocess.Popen(
                [*(wrap or []), str(SSHD), "-D", "-e", "-f", str(config)],
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                preexec_fn=_die_with_parent,
            )
        if _wait_listening(proc, listen, port, timeout=10.0):
            known_hosts = d / "known_hosts"
            known_hosts.write_text(known_hosts_line(listen, port, host_pub))
            return SshServer(
                host=listen,
                port=port,
                user=user,
                dir=d,
                client_key=client_key,
                host_key_pub=host_pub,
                known_hosts=known_hosts,
                fingerprint=fingerprint(host_pub),
                key_type=host_pub.read_text().split()[0],
                log=log,
                pid=proc.pid,
                process=proc,
            )
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=5)
        last_error = log.read_text(errors="replace")[-2000:]
    raise RuntimeError(f"sshd did not start after {attempts} attempts; its log:\n{last_error}")


def start_impostor(d: Path, trusted: SshServer) -> SshServer:
    """A second sshd with a host key of its own that lets in the trusted server's client: only
    the host-key check stands between a console and it (a host taken over, a spoofed name)."""
    d.mkdir(parents=True, exist_ok=True)
    keygen(d / "ssh_host_ed25519_key", "impostor-host")
    for suffix in ("", ".pub"):
        (d / f"id_ed25519{suffix}").write_bytes(Path(f"{trusted.client_key}{suffix}").read_bytes())
    (d / "id_ed25519").chmod(0o600)
    return start_sshd(d)


# In a new mount namespace: a fresh tmpfs on /tmp (its own /tmp, so its own default lock), with
# the directory $1 (under the real /tmp: the tests' files, the shared home) bound back in.
_OWN_TMP = r"""set -e
keep=/run/tracedeck-ns-$$
i=0
for p in "$@"; do  # each path kept, bound by itself (it may lie on a mount below /tmp)
  [ "$p" = -- ] && break
  case "$p" in /tmp/*)
    i=$((i+1))
    mkdir -p "$keep/$i"
    mount --bind "$p" "$keep/$i";;
  esac
done
mount -t tmpfs -o size=256m tracedeck-tmp /tmp
i=0
while [ "$1" != -- ]; do
  case "$1" in /tmp/*)
    i=$((i+1))
    mkdir -p "$1"
    mount --bind "$keep/$i" "$1"
    umount -l "$keep/$i";;
  esac
  shift
done
rmdir "$keep"/* "$keep" 2>/dev/null || true
shift
exec "$@"
"""


def own_tmp(shared: Path) -> list[str]:
    """The wrap for start_sshd that gives a "host" its own /tmp while it shares `shared` (the
    tests' base directory, where the home directory all hosts share lives) and this checkout
    and its Python (a CI clone may lie under /tmp: the cells run its .venv's python)."""
    keep = {shared.resolve(), Path(__file__).resolve().parent.parent, Path(sys.prefix).resolve()}
    paths = sorted(str(p) for p in keep)  # a parent before what lies under it
    return ["unshare", "-m", "sh", "-c", _OWN_TMP, "sh", *paths, "--"]


def start_host(d: Path, trusted: SshServer, shared: Path) -> SshServer:
    """One more "host" for a fleet: a real sshd in its own mount namespace (its own /tmp), that
    lets in the trusted server's client key, with a host key of its own."""
    d.mkdir(parents=True, exist_ok=True)
    keygen(d / "ssh_host_ed25519_key", f"tracedeck-test-{d.name}")
    for suffix in ("", ".pub"):
        (d / f"id_ed25519{suffix}").write_bytes(Path(f"{trusted.client_key}{suffix}").read_bytes())
    (d / "id_ed25519").chmod(0o600)
    return start_sshd(d, wrap=own_tmp(shared))


def _die_with_parent() -> None:
    """In the child: ask Linux to TERM sshd if the test process dies without stopping it."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _wait_listening(proc: subprocess.Popen[bytes], host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        with contextlib.suppress(OSError), socket.create_connection((host, port), 0.5):
            return True
        time.sleep(0.02)
    return False


@dataclass
class SshHome:
    """A HOME whose .ssh has a config (alias testbox), the authorised key and a known_hosts."""

    path: Path
    server: SshServer
    alias: str = ALIAS

    @property
    def ssh_dir(self) -> Path:
        return self.path / ".ssh"

    @property
    def config(self) -> Path:
        return self.ssh_dir / "config"

    @property
    def known_hosts(self) -> Path:
        return self.ssh_dir / "known_hosts"

    @property
    def identity(self) -> Path:
        return self.ssh_dir / "id_ed25519"

    def add_alias(self, name: str, port: int, host: str = "127.0.0.1") -> None:
        """Append a Host block naming host:port as the given user with this home's identity."""
        with self.config.open("a") as f:
            f.write(
                f"\nHost {name}\n  HostName {host}\n  Port {port}\n"
                f"  User {self.server.user}\n  IdentityFile {self.identity}\n"
            )

    def trust(self, port: int) -> None:
        """Add the test server's host key for [127.0.0.1]:port to this home's known_hosts."""
        with self.known_hosts.open("a") as f:
            f.write(self.server.known_hosts_line(port))


def make_ssh_home(server: SshServer, path: Path) -> SshHome:
    """Create (but do not activate) a HOME at path that reaches server as alias `testbox`."""
    ssh_dir = path / ".ssh"
    ssh_dir.mkdir(parents=True, exist_ok=True)
    ssh_dir.chmod(0o700)
    home = SshHome(path=path, server=server)
    for suffix in ("", ".pub"):
        src = Path(str(server.client_key) + suffix)
        dst = Path(str(home.identity) + suffix)
        dst.write_bytes(src.read_bytes())
        dst.chmod(0o600 if suffix == "" else 0o644)
    home.config.write_text("")
    home.add_alias(ALIAS, server.port)
    home.known_hosts.write_text(server.known_hosts_line())
    home.known_hosts.chmod(0o600)
    return home


class CuttableProxy:
    """A loopback TCP proxy to (host, port) on its own thread and loop, whose links can be cut.

    cut() drops every open connection at once (new ones are still accepted); pause() makes new
    connections close at once, resume() accepts them again; stall() stops moving bytes on every
    connection (a link that went silent, as when a cable is pulled) until resume().
    """

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.host = "127.0.0.1"
        self.port = 0
        self.accepted = 0
        self.bytes_up = 0  # client -> server, through every connection so far
        self.bytes_down = 0  # server -> client
        self._paused = False
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._loop = asyncio.new_event_loop()
        self._flowing: asyncio.Event | None = None
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def start(self) -> CuttableProxy:
        self._thread.start()
        self._call(self._start())
        return self

    def _call(self, coro: object, timeout: float = 10.0) -> object:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)  # type: ignore[arg-type]
        return fut.result(timeout)

    async def _start(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._handle, self.host, 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        if self._paused:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer, up_writer)
        self._conns.add(pair)
        try:
            await asyncio.gather(
                self._pump(reader, up_writer, up=True), self._pump(up_reader, writer, up=False)
            )
        finally:
            self._conns.discard(pair)
            writer.transport.abort()
            up_writer.transport.abort()

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, up: bool
    ) -> None:
        assert self._flowing is not None
        with contextlib.suppress(OSError):
            while True:
                await self._flowing.wait()
                data = await src.read(65536)
                if not data:
                    break
                await self._flowing.wait()  # bytes read while stalling are held, not lost
                if up:
                    self.bytes_up += len(data)
                else:
                    self.bytes_down += len(data)
                dst.write(data)
                await dst.drain()
        dst.transport.abort()

    @property
    def spec(self) -> str:
        return f"ssh://{pwd.getpwuid(os.geteuid()).pw_name}@{self.host}:{self.port}"

    @property
    def open_connections(self) -> int:
        return len(self._conns)

    def cut(self) -> None:
        """Drop every open connection now (both sides see a reset); keep accepting new ones."""

        async def _cut() -> None:
            for client, upstream in list(self._conns):
                client.transport.abort()
                upstream.transport.abort()
            self._conns.clear()

        self._call(_cut())

    def pause(self) -> None:
        """Refuse new connections (accepted, then closed at once) until resume()."""
        self._paused = True

    def stall(self) -> None:
        """Stop moving bytes on every connection, open or new, until resume()."""
        assert self._flowing is not None
        self._loop.call_soon_threadsafe(self._flowing.clear)

    def resume(self) -> None:
        """Undo pause() and stall()."""
        self._paused = False
        assert self._flowing is not None
        self._loop.call_soon_threadsafe(self._flowing.set)

    def stop(self) -> None:
        if not self._thread.is_alive():
            return

        async def _stop() -> None:
            assert self._server is not None
            self._server.close()
            for client, upstream in list(self._conns):
                client.transport.abort()
                upstream.transport.abort()
            self._conns.clear()

        self._call(_stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


class SilentServer:
    """A loopback TCP listener that accepts connections and never says a word (a hung sshd)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(16)
        self.port: int = self._sock.getsockname()[1]
        self._clients: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        self._sock.settimeout(0.1)
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError, OSError):
                conn, _ = self._sock.accept()
                self._clients.append(conn)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for c in self._clients:
            c.close()
        self._sock.close()


@dataclass
class Fleet:
    """Fleet hosts for a test: the home that reaches them, their servers, their proxies."""

    home: SshHome
    servers: dict[str, SshServer]
    proxies: dict[str, CuttableProxy]
