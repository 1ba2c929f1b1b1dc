"""The SSH target: commands over exec channels, files over one multiplexed SFTP session."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import posixpath
import secrets
import shlex
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from runners.hostkeys import Line, Status, Verdict, ca_status, entries_for, judge
from runners.ssh_lib import asyncssh
from runners.targets.base import (
    CommandResult,
    ConnectionLost,
    HostKeyMismatch,
    HostKeyUnknown,
    NotRegular,
    TargetError,
    local_write_error,
)
from runners.trust import (
    ResolvedHost,
    describe_mismatch,
    describe_revoked,
    host_key_algorithms,
    no_user_file,
    read_known_hosts,
    resolve_host,
)

# A command run with a timeout is stopped by the host itself (coreutils or busybox `timeout`,
# which signals the command's whole process group: TERM, then KILL after HOST_KILL_S); 124 is
# timeout's word for it. A host without `timeout` runs the command as it is.
HOST_KILL_S = 5
TIMED_OUT = 124


def sh_command(command: str, timeout: float | None = None, mark: str = "") -> str:
    """What the login shell is handed: `exec /bin/sh -c WORD`, whatever that shell is (csh,
    fish), so quoting means what sh says; with a timeout, sh runs the command under timeout(1).
    mark: a line sh writes on stdout and on stderr before the command (see own_output)."""
    if timeout is not None:
        inner = shlex.quote(command)
        limit = f"timeout -k {HOST_KILL_S} {max(1, math.ceil(timeout))}"
        command = (
            f"if command -v timeout >/dev/null 2>&1; then exec {limit} /bin/sh -c {inner}; fi; "
            f"exec /bin/sh -c {inner}"
        )
    if mark:
        command = marked(command, mark)
    return "exec /bin/sh -c " + shlex.quote(command)


def marked(command: str, mark: str, stderr: bool = True) -> str:
    """command, run once sh has written the mark line on stdout (and on stderr)."""
    line = f"printf '%s\\n' {mark}"
    return f"{line}; {line} >&2; {command}" if stderr else f"{line}; {command}"


def new_mark() -> str:
    """A line no rc file prints: where a command's own output begins."""
    return f"TRACEDECK-OUTPUT-{secrets.token_hex(8)}"


def at_mark(text: str, mark: str) -> tuple[str, str] | None:
    """What the login shell's startup files printed before the mark line (a greeting, `module
    load` notes; bash reads ~/.bashrc before every command sshd starts), and the command's own
    output after it. None: no mark, the command never ran."""
    said, found, own = text.partition(mark + "\n")
    return (said, own) if found else None


def own_output(text: str, mark: str) -> str | None:
    """The command's own output (at_mark); None: the command never ran."""
    split = at_mark(text, mark)
    return None if split is None else split[1]


# sshd allows 10 sessions per connection (MaxSessions); SFTP holds one, a stream (the change
# notifier) one, leave one spare.
MAX_COMMAND_CHANNELS = 7

T = TypeVar("T")

# sshd frees a closed session's slot only once it collects the channel, which can come after
# the next channel open on the same connection: a session refused right after others closed
# is that lag, not the limit. A refused channel is asked for again after each of these pauses.
CHANNEL_RETRY_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.6)
# (OpenSSH says "open failed" with OPEN_CONNECT_FAILED when it has no session to give.)
_REFUSALS = (
    asyncssh.OPEN_CONNECT_FAILED,
    asyncssh.OPEN_ADMINISTRATIVELY_PROHIBITED,
    asyncssh.OPEN_RESOURCE_SHORTAGE,
)

# Errors that mean the link itself failed, whatever operation was under way. (A refused channel,
# ChannelOpenError, means that only when the connection is gone too: see _failure.)
_LINK_ERRORS = (
    asyncssh.ConnectionLost,
    asyncssh.DisconnectError,
    asyncssh.sftp.SFTPConnectionLost,
    asyncssh.sftp.SFTPNoConnection,
    ConnectionError,
    BrokenPipeError,
)


class _Client(asyncssh.SSHClient):
    """Remembers that the connection went away, so the next call fails fast and clearly."""

    def __init__(self, owner: SshTarget, generation: int) -> None:
        self._owner = owner
        self._generation = generation

    def connection_lost(self, exc: Exception | None) -> None:
        if self._owner._generation == self._generation:  # not a late word from an old link
            self._owner._lost = exc or ConnectionResetError("connection closed")

    def validate_host_public_key(
        self, host: str, addr: str, port: int, key: asyncssh.SSHKey
    ) -> bool:
        """Every plain host key comes here (tracedeck hands asyncssh no trusted keys)."""
        return self._owner._judge_key(addr, key)

    def validate_host_ca_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
        """A host certificate's signer: trusted when a @cert-authority line for the host lists
        it and nothing revokes it (asyncssh then checks the principals and validity)."""
        return self._owner._judge_ca(key)


class SshTarget:
    """A host reached over SSH; host may be a hostname or an alias in ~/.ssh/config."""

    def __init__(
        self,
        host: str,
        port: int | None = None,
        username: str | None = None,
        *,
        connect_timeout: float = 10.0,
        keepalive_interval: float = 5.0,
        keepalive_count_max: int = 3,
    ) -> None:
        self.host = host
        self.port = port
        self.username = username
        self.connect_timeout = connect_timeout
        self.keepalive_interval = keepalive_interval
        self.keepalive_count_max = keepalive_count_max
        user = f"{username}@" if username else ""
        where = f"[{host}]" if ":" in host else host
        self.name = f"ssh://{user}{where}" + (f":{port}" if port is not None else "")
        self._conn: asyncssh.SSHClientConnection | None = None
        self._sftp: asyncssh.SFTPClient | None = None
        self._lost: BaseException | None = None
        self._generation = 0
        self._resolved: ResolvedHost | None = None
        self._files: list[list[Line]] = []
        self._verdict: Verdict | None = None  # the host-key judgement of the last connect
        self._connect_lock = asyncio.Lock()
        self._channels = asyncio.Semaphore(MAX_COMMAND_CHANNELS)

    # -- connection -------------------------------------------------------------------------

    @property
    def host_key(self) -> tuple[ResolvedHost, Verdict | None] | None:
        """How the last connect judged the server's key: the host as ~/.ssh/config resolves it
        and the verdict (None there: no plain key judged, a certificate or no key exchange);
        None before a connect resolved the host."""
        if self._resolved is None:
            return None
        return self._resolved, self._verdict

    @property
    def _where(self) -> str:
        r = self._resolved
        if r is None:
            return self.name
        return f"{r.username}@{r.host}:{r.port}"

    async def connect(self) -> None:
        """Open the connection and its SFTP session; after a loss, open fresh ones."""
        async with self._connect_lock:
            if self._conn is not None and self._lost is None:
                return
            await self._drop()
            resolved = await resolve_host(
                self.host,
                self.port,
                self.username,
                connect_timeout=self.connect_timeout,
                keepalive_interval=self.keepalive_interval,
                keepalive_count_max=self.keepalive_count_max,
            )
            self._resolved = resolved
            self._lost = None
            self._generation += 1
            generation = self._generation
            self._files = read_known_hosts(resolved)
            self._verdict = None
            algorithms = host_key_algorithms(resolved, self._files)
            try:
                conn = await asyncssh.connect(
                    self.host,
                    self.port if self.port is not None else (),
                    options=resolved.options,
                    client_factory=lambda: _Client(self, generation),
                    # Always a callable with no keys: every key reaches validate_host_public_key,
                    # never asyncssh's own lookup, never "accept all".
                    known_hosts=_no_keys,
                    server_host_key_algs=algorithms or (),
                )
            except asyncssh.HostKeyNotVerifiable as exc:
                raise await self._host_key_error(resolved, exc) from exc
            except asyncssh.PermissionDenied as exc:
                raise TargetError(self._auth_message(resolved)) from exc
            except TimeoutError as exc:
                raise ConnectionLost(
                    f"no SSH answer from {self._where} within {self.connect_timeout:g} s: the host "
                    "is down, unreachable, or something other than sshd listens on that port. "
                    "Check the host and the port, then try again."
                ) from exc
            except OSError as exc:
                if exc.filename is None:
                    raise self._connect_failed(exc) from exc
                raise TargetError(
                    f"cannot read {exc.filename} to connect to {self._where}: {exc.strerror}. "
                    "Check the files ~/.ssh/config names (IdentityFile, UserKnownHostsFile)."
                ) from exc
            except asyncssh.Error as exc:
                raise self._connect_failed(exc) from exc
            try:
                sftp = await conn.start_sftp_client()
            except (OSError, asyncssh.Error) as exc:
                said = await _rc_text(conn) if isinstance(exc, asyncssh.sftp.SFTPBadMessage) else ""
                conn.abort()
                if self._lost is not None or isinstance(exc, _LINK_ERRORS):
                    raise self._lost_error(exc) from exc
                if said:
                    raise TargetError(
                        f"{self._where}: the SFTP session began with text that is no SFTP "
                        f"({_reason(exc)}): sshd starts the sftp server through the login shell, "
                        f"whose startup files print {said!r}. Make ~/.bashrc print only in "
                        "interactive shells (`case $- in *i*) ;; *) return;; esac` at its top), "
                        "or set `Subsystem sftp internal-sftp` in the host's sshd_config."
                    ) from exc
                raise TargetError(
                    f"{self._where} refused an SFTP session ({_reason(exc)}); enable the sftp "
                    "subsystem in the host's sshd_config (Subsystem sftp internal-sftp)."
                ) from exc
            self._conn, self._sftp = conn, sftp

    def _connect_failed(self, exc: BaseException) -> ConnectionLost:
        return ConnectionLost(
            f"cannot connect to {self._where}: {_reason(exc)}. Check that the host is up, "
            "reachable from here, and that sshd listens on that port; then try again."
        )

    async def close(self) -> None:
        async with self._connect_lock:
            await self._drop()

    async def _drop(self) -> None:
        sftp, conn = self._sftp, self._conn
        self._sftp = self._conn = None
        if sftp is not None:
            sftp.exit()
        if conn is not None:
            conn.close()
            try:
                await asyncio.wait_for(conn.wait_closed(), timeout=2.0)
            except (TimeoutError, OSError, asyncssh.Error):
                conn.abort()

    def _judge_key(self, addr: str, key: asyncssh.SSHKey) -> bool:
        assert self._resolved is not None
        self._verdict = judge(self._resolved.policy, self._files, key, addr)
        return self._verdict.accepted

    def _judge_ca(self, ca_key: asyncssh.SSHKey) -> bool:
        assert self._resolved is not None
        entries = entries_for(self._files, self._resolved.key_name)
        return ca_status(entries, ca_key) is Status.OK

    async def _host_key_error(self, resolved: ResolvedHost, exc: Exception) -> TargetError:
        verdict = self._verdict
        if verdict is None:  # a host certificate refused: say so, with the key behind it
            return TargetError(
                f"{self._where}: host certificate refused ({exc}); check the @cert-authority "
                f"lines in {', '.join(str(p) for p in resolved.known_hosts)} and the "
                "certificate's principals"
            )
        key = verdict.key
        if verdict.status is Status.NEW:
            if not verdict.known and not resolved.user_files:
                return TargetError(f"{self._where}: {no_user_file(self.host)}")
            # Name the host as the operator wrote it, so `tracedeck trust` resolves it the same way.
            return HostKeyUnknown(
                self.host, resolved.port, key.get_fingerprint("sha256"), key.get_algorithm()
            )
        if verdict.status is Status.REVOKED:
            return HostKeyMismatch(f"{self._where}: {describe_revoked(resolved, verdict)}")
        if verdict.ip_name:
            ip = verdict.ip_name
            return HostKeyMismatch(
                f"{self._where}: the host key {key.get_algorithm()} "
                f"{key.get_fingerprint('sha256')} is the one known for {verdict.name}, but "
                f"known_hosts lists another key for its address {ip} (CheckHostIP yes): "
                "possible DNS spoofing, or the address moved to another host. Refusing to "
                f"connect. Check the host, then remove the stale entry (ssh-keygen -R '{ip}')."
            )
        return HostKeyMismatch(describe_mismatch(resolved, list(verdict.known), key))

    def _auth_message(self, resolved: ResolvedHost) -> str:
        tried = [_key_label(k) for k in resolved.options.client_keys or ()]
        if resolved.options.agent_path:  # from $SSH_AUTH_SOCK or IdentityAgent
            tried.append(f"keys from the ssh-agent at {resolved.options.agent_path}")
        keys = ", ".join(tried) if tried else "none (no key files in ~/.ssh, no agent)"
        return (
            f"{resolved.host}:{resolved.port} refused user {resolved.username!r}: public key "
            f"authentication failed. Keys tried: {keys}. Add your public key to "
            f"~{resolved.username}/.ssh/authorized_keys on the host, or name the right key with "
            "IdentityFile (and User) in ~/.ssh/config."
        )

    def _lost_error(self, exc: BaseException | None = None) -> ConnectionLost:
        reason = _reason(exc or self._lost) if (exc or self._lost) else "not connected"
        return ConnectionLost(
            f"lost the SSH connection to {self._where} ({reason}). Work started on the host keeps "
            "running; check the network, then reconnect to resume."
        )

    def _live(self) -> tuple[asyncssh.SSHClientConnection, asyncssh.SFTPClient]:
        if self._conn is None or self._sftp is None or self._lost is not None:
            raise self._lost_error()
        return self._conn, self._sftp

    # -- operations -------------------------------------------------------------------------

    async def run(self, command: str, timeout: float | None = None) -> CommandResult:
        conn, _ = self._live()
        # The login shell may not be sh; with a timeout the host stops the command itself (an
        # abandoned channel leaves it running there).
        mark = new_mark()
        wrapped = sh_command(command, timeout, mark)
        loop = asyncio.get_running_loop()
        began: list[float] = []  # when the command's channel was asked for, each time
        abandon = None if timeout is None else timeout + HOST_KILL_S + 5

        def start() -> Awaitable[asyncssh.SSHCompletedProcess]:
            began.append(loop.time())
            return conn.run(
                wrapped,
                check=False,
                # stdin at EOF: a startup file that reads it (a prompt, `read`) goes on at once
                # instead of holding the command until the timeout, or forever
                stdin=asyncssh.DEVNULL,
                timeout=abandon,
                encoding="utf-8",
                errors="replace",
            )

        async with self._channels:
            try:
                result = await self._refused_again(conn, start)
            except asyncssh.TimeoutError as exc:
                if own_output(str(exc.stdout or ""), mark) is None:
                    raise TargetError(
                        f"the login shell on {self._where} did not start the command within "
                        f"{abandon:g} s: its startup files (~/.bashrc, "
                        f"BASH_ENV) are slow or wait for something; it never ran: {command[:200]}"
                    ) from exc
                raise TargetError(
                    f"command on {self._where} did not finish within {timeout:g} s and was "
                    f"abandoned (it may still be running there): {command[:200]}"
                ) from exc
            except (OSError, asyncssh.Error) as exc:
                raise self._failure(conn, exc, "run a command") from exc
        status = result.returncode
        if timeout is not None and status == TIMED_OUT and loop.time() - began[-1] >= timeout:
            raise TargetError(
                f"command on {self._where} did not finish within {timeout:g} s and was killed "
                f"there: {command[:200]}"
            )
        if status is None:
            if self._lost is not None:
                raise self._lost_error()
            raise TargetError(f"{self._where} gave no exit status for: {command[:200]}")
        out, err = str(result.stdout or ""), str(result.stderr or "")
        own_out = own_output(out, mark)
        if own_out is None:
            said = (err or out).strip()[-500:] or "nothing"
            raise TargetError(
                f"the login shell on {self._where} never ran the command (exit {status}): its "
                f"startup files (~/.bashrc, BASH_ENV) may end the session or exec another "
                f"program; it said: {said}"
            )
        own_err = own_output(err, mark)
        return CommandResult(status, own_out, err if own_err is None else own_err)

    async def write_file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        conn, sftp = self._live()
        part = path + ".part"
        try:
            parent = posixpath.dirname(path)
            if parent:
                await sftp.makedirs(parent, exist_ok=True)
            async with sftp.open(part, "wb") as f:
                await f.write(data)
                with contextlib.suppress(asyncssh.sftp.SFTPOpUnsupported):
                    await f.fsync()
            await sftp.chmod(part, mode)
            try:
                await sftp.posix_rename(part, path)
            except asyncssh.sftp.SFTPOpUnsupported:
                if await sftp.exists(path):
                    await sftp.remove(path)
                await sftp.rename(part, path)
        except (OSError, asyncssh.Error) as exc:
            failure = self._failure(conn, exc, f"write {path}")
            if not isinstance(failure, ConnectionLost):
                with contextlib.suppress(OSError, asyncssh.Error):
                    await sftp.remove(part)
            raise failure from exc

    async def read_from(self, path: str, offset: int, max_bytes: int) -> bytes | None:
        if offset < 0 or max_bytes < 0:
            raise ValueError(f"read_from({path!r}): offset and max_bytes must be >= 0")
        conn, sftp = self._live()
        try:
            async with sftp.open(path, "rb") as f:
                data = await f.read(max_bytes, offset) if max_bytes else b""
        except asyncssh.sftp.SFTPNoSuchFile:
            return None
        except (OSError, asyncssh.Error) as exc:
            raise self._failure(conn, exc, f"read {path}") from exc
        return bytes(data)

    async def list_dir(self, path: str) -> list[str] | None:
        conn, sftp = self._live()
        try:
            names = await sftp.listdir(path)
        except asyncssh.sftp.SFTPNoSuchFile:
            return None
        except (OSError, asyncssh.Error) as exc:
            raise self._failure(conn, exc, f"list {path}") from exc
        return sorted(str(n) for n in names if n not in (".", ".."))

    async def open_stream(self, command: str) -> SshStream:
        conn, _ = self._live()
        try:
            mark = new_mark()
            proc = await self._refused_again(
                conn,
                lambda: conn.create_process(
                    # the command's stderr joins its stdout after the mark, in sh: merged at the
                    # channel, the rc's stderr could arrive after the mark (sshd reads the two
                    # pipes apart) and be read as the command's first line; it is discarded
                    "exec /bin/sh -c " + shlex.quote(marked(f"exec 2>&1; {command}", mark, False)),
                    encoding=None,
                    stderr=asyncssh.DEVNULL,
                ),
            )
        except (OSError, asyncssh.Error) as exc:
            raise self._failure(conn, exc, "start a command") from exc
        return SshStream(proc, mark.encode() + b"\n")

    async def download(
        self, path: str, local: Path, progress: Callable[[int, int], None] | None = None
    ) -> None:
        conn, sftp = self._live()
        local.parent.mkdir(parents=True, exist_ok=True)
        part = local.with_name(local.name + ".part")

        def handler(_src: bytes, _dst: bytes, done: int, total: int) -> None:
            if progress is not None:
                progress(done, total)

        try:
            # only a regular file is fetched: checked before the open (a FIFO's open would
            # block the server) and on the file opened (it may have been swapped since); no
            # more than the size it had then is copied (a device never ends)
            self._regular(await sftp.stat(path), path)
            async with sftp.open(path, "rb") as remote:
                attrs = await remote.stat()
                self._regular(attrs, path)
                total, done = attrs.size or 0, 0
                with open(part, "wb") as out:
                    while done < total:
                        chunk = await remote.read(min(FETCH_CHUNK, total - done), done)
                        if not chunk:
                            break
                        out.write(chunk)
                        done += len(chunk)
                        handler(b"", b"", done, total)
            os.replace(part, local)
        except BaseException as exc:
            part.unlink(missing_ok=True)
            local_failure = local_write_error(exc, local)
            if local_failure is not None:
                raise local_failure from exc
            if isinstance(exc, OSError | asyncssh.Error):
                raise self._failure(conn, exc, f"download {path} to {local}") from exc
            raise

    def _regular(self, attrs: asyncssh.SFTPAttrs, path: str) -> None:
        if not stat.S_ISREG(attrs.permissions or 0):
            raise NotRegular(
                f"{self._where}:{path} is not a regular file (a FIFO, device or directory): "
                "not fetched"
            )

    async def _refused_again(
        self, conn: asyncssh.SSHClientConnection, open_channel: Callable[[], Awaitable[T]]
    ) -> T:
        """open_channel() on conn, asked again (CHANNEL_RETRY_S) while sshd refuses the channel
        and conn stands; a refused channel never started its command."""
        for pause in (*CHANNEL_RETRY_S, None):
            try:
                return await open_channel()
            except asyncssh.ChannelOpenError as exc:
                if pause is None or self._gone(conn) or exc.code not in _REFUSALS:
                    raise
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    def _gone(self, conn: asyncssh.SSHClientConnection) -> bool:
        """Whether conn is lost: closed, known lost, or already replaced by a reconnect."""
        return conn is not self._conn or self._lost is not None or conn.is_closed()

    def _failure(
        self, conn: asyncssh.SSHClientConnection, exc: BaseException, what: str
    ) -> TargetError:
        """ConnectionLost when conn, the operation's link, is gone (whatever the error said),
        else a TargetError."""
        if self._gone(conn) or isinstance(exc, _LINK_ERRORS):
            return self._lost_error(exc)
        return TargetError(f"cannot {what} on {self._where}: {_reason(exc)}")


FETCH_CHUNK = 16 << 20  # asyncssh reads a large block as parallel requests


class SshStream:
    """A command on the host over its own channel; it ends when the channel closes."""

    def __init__(self, proc: asyncssh.SSHClientProcess, mark: bytes) -> None:  # type: ignore[type-arg]
        self._proc = proc
        self._mark: bytes | None = mark  # the line before the command's own (own_output)

    async def readline(self) -> bytes:
        try:
            while self._mark is not None:  # what the login shell's rc files said is skipped
                line = bytes(await self._proc.stdout.readline())
                if not line:
                    return b""
                if line.endswith(self._mark):
                    self._mark = None
            return bytes(await self._proc.stdout.readline())
        except (OSError, asyncssh.Error):
            return b""  # the channel or the link went away: the stream has ended

    def write(self, data: bytes) -> None:
        with contextlib.suppress(OSError, asyncssh.Error):
            self._proc.stdin.write(data)

    async def close(self) -> None:
        with contextlib.suppress(OSError, asyncssh.Error):
            self._proc.stdin.write_eof()
        self._proc.close()
        with contextlib.suppress(OSError, asyncssh.Error, TimeoutError):
            await asyncio.wait_for(self._proc.wait_closed(), timeout=2.0)


async def _rc_text(conn: asyncssh.SSHClientConnection) -> str:
    """What the login shell's startup files print before a command (the text before the mark);
    "" when nothing, or when it cannot be told."""
    mark = new_mark()
    try:
        result = await asyncio.wait_for(
            conn.run(sh_command("true", None, mark), stdin=asyncssh.DEVNULL, errors="replace"),
            timeout=15,
        )
    except (OSError, asyncssh.Error, TimeoutError):
        return ""
    split = at_mark(str(result.stdout or ""), mark)
    return "" if split is None else split[0].strip()[:200]


def _no_keys(host: str, addr: str, port: int | None) -> tuple[list[object], ...]:
    """asyncssh's known_hosts hook: no key trusted up front, so each goes to the client's
    validate_host_public_key (tracedeck's judgement, runners.hostkeys)."""
    return [], [], []


def _key_label(keypair: asyncssh.SSHKeyPair) -> str:
    try:
        key = asyncssh.public_key.decode_ssh_public_key(keypair.public_data)
        label = f"{key.get_algorithm()} {key.get_fingerprint('sha256')}"
    except (ValueError, asyncssh.KeyImportError):
        label = keypair.get_algorithm()
    comment = keypair.get_comment()
    return f"{label} ({comment})" if comment else label


def _reason(exc: BaseException | None) -> str:
    if exc is None:
        return "connection closed"
    return str(exc).strip() or type(exc).__name__
