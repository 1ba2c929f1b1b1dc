"""Host keys, looked up as OpenSSH does: fetch a server's key, match it in known_hosts by the
name and port the operator asked for (HostKeyAlias, CheckHostIP), trust it on explicit request.

asyncssh's own lookup differs from OpenSSH's in ways that matter here: it accepts a key listed
for the resolved IP address only, falls back from `[host]:port` to `host`, and accepts any key
when `UserKnownHostsFile none`. tracedeck never lets it decide: it hands asyncssh the keys it
matched itself, and no known_hosts file means no host is known.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path

import asyncssh

from runners.targets.base import ConnectionLost, HostKeyMismatch, TargetError

DEFAULT_KNOWN_HOSTS = Path("~", ".ssh", "known_hosts")
# OpenSSH's defaults when ~/.ssh/config names no UserKnownHostsFile / GlobalKnownHostsFile.
DEFAULT_USER_FILES = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
DEFAULT_GLOBAL_FILES = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedHost:
    """Where ~/.ssh/config sends a host or alias, and which known_hosts files vouch for it."""

    host: str  # after HostName
    port: int
    username: str
    key_name: str  # the name known_hosts entries use: HostKeyAlias, else host
    user_files: tuple[Path, ...]  # UserKnownHostsFile: where `tracedeck trust` writes
    global_files: tuple[Path, ...]  # GlobalKnownHostsFile: read only
    check_ip: bool  # CheckHostIP: the key listed for the address must agree too
    options: asyncssh.SSHClientConnectionOptions

    @property
    def known_hosts(self) -> tuple[Path, ...]:
        return self.user_files + self.global_files

    def entry_name(self, name: str | None = None) -> str:
        """`name`, or `[name]:port` off port 22: the only form OpenSSH matches for this host."""
        name = name or self.key_name
        return name if self.port == 22 else f"[{name}]:{self.port}"


@dataclasses.dataclass(frozen=True, slots=True)
class KnownKeys:
    """What the known_hosts files say of one name: its keys (with their files), CAs, revoked."""

    keys: list[tuple[Path, asyncssh.SSHKey]]
    ca_keys: list[asyncssh.SSHKey]
    revoked: list[asyncssh.SSHKey]


async def resolve_host(
    host: str,
    port: int | None = None,
    username: str | None = None,
    *,
    connect_timeout: float = 10.0,
    keepalive_interval: float = 0.0,
    keepalive_count_max: int = 3,
    load_keys: bool = True,
) -> ResolvedHost:
    """Apply the operator's ~/.ssh/config to host (an alias or a hostname) and return the result."""
    keys: dict[str, object] = {} if load_keys else {"client_keys": None}
    try:
        options = await asyncssh.SSHClientConnectionOptions.construct(
            config=(),  # () loads ~/.ssh/config; the options class alone defaults to none
            host=host,
            port=port if port is not None else (),
            username=username if username is not None else (),
            connect_timeout=connect_timeout,
            keepalive_interval=keepalive_interval,
            keepalive_count_max=keepalive_count_max,
            **keys,
        )
    except (OSError, ValueError, asyncssh.Error) as exc:
        raise TargetError(
            f"cannot prepare an SSH connection to {host}: {exc}. "
            "Check ~/.ssh/config (IdentityFile, Host entries) and the key files it names."
        ) from exc
    port_used = options.port or 22
    return ResolvedHost(
        host=options.host,
        port=port_used,
        username=options.username,
        key_name=options.host_key_alias or options.host,
        user_files=_files(options.config.get("UserKnownHostsFile", ()), DEFAULT_USER_FILES),
        global_files=_files(options.config.get("GlobalKnownHostsFile", ()), DEFAULT_GLOBAL_FILES),
        check_ip=await _check_host_ip(host, port_used, username),
        options=options,
    )


def _files(configured: object, default: tuple[str, ...]) -> tuple[Path, ...]:
    # asyncssh reads "none" as [] and an absent option as ().
    names = default if configured == () else configured
    return tuple(Path(str(f)).expanduser() for f in names)  # type: ignore[union-attr]


async def _check_host_ip(host: str, port: int, username: str | None) -> bool:
    """CheckHostIP for this host, as OpenSSH's own `ssh -G` reads ~/.ssh/config (asyncssh does
    not know the option); OpenSSH's default, no, when no ssh client is installed."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return False
    config = Path("~", ".ssh", "config").expanduser()
    argv = [ssh, "-G", "-F", str(config) if config.is_file() else "none", "-p", str(port)]
    argv += ["-l", username] if username else []
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            "--",
            host,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise TargetError(f"cannot run `ssh -G` to read the ssh config of {host}: {exc}") from exc
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout=10)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise TargetError(
            f"`ssh -G {host}` gave no answer within 10 s: check ~/.ssh/config (a Match exec?)"
        ) from None
    if proc.returncode != 0:
        return False  # ssh rejects a config asyncssh accepted: asyncssh's reading stands
    return any(line.strip().lower() == "checkhostip yes" for line in out.decode().splitlines())


def read_known_hosts(resolved: ResolvedHost) -> list[tuple[Path, asyncssh.SSHKnownHosts]]:
    """The known_hosts files that exist, parsed; an unreadable one is named."""
    parsed = []
    for path in resolved.known_hosts:
        if not path.is_file():
            continue
        try:
            parsed.append((path, asyncssh.read_known_hosts(str(path))))
        except (OSError, ValueError) as exc:
            raise TargetError(f"cannot read known_hosts file {path}: {exc}") from exc
    return parsed


def lookup(
    files: list[tuple[Path, asyncssh.SSHKnownHosts]], resolved: ResolvedHost, name: str
) -> KnownKeys:
    """The entries for exactly `name` at the host's port: `[name]:port` off port 22, with no
    fallback to the bare name and no match by address (OpenSSH's rules)."""
    port = None if resolved.port == 22 else resolved.port
    keys: list[tuple[Path, asyncssh.SSHKey]] = []
    ca_keys: list[asyncssh.SSHKey] = []
    revoked: list[asyncssh.SSHKey] = []
    for path, entries in files:
        # _match is the exact lookup; the public match() adds the fallbacks OpenSSH does not make.
        host_keys, cas, bad, *_ = entries._match(name, "", port)
        keys += [
            (path, k) for k in host_keys if all(k.public_data != o.public_data for _, o in keys)
        ]
        ca_keys += cas
        revoked += bad
    return KnownKeys(keys, ca_keys, revoked)


def known_keys(resolved: ResolvedHost) -> list[tuple[Path, asyncssh.SSHKey]]:
    """The host keys that the known_hosts files list for this host (file, key), in file order."""
    return lookup(read_known_hosts(resolved), resolved, resolved.key_name).keys


async def server_key(
    resolved: ResolvedHost, algorithms: list[str] | None = None
) -> asyncssh.SSHKey:
    """The key the server presents (limited to the given algorithms when asked)."""
    where = f"{resolved.host}:{resolved.port}"
    timeout = resolved.options.connect_timeout or 10.0
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(
                resolved.host,
                resolved.port,
                server_host_key_algs=algorithms or (),
                options=resolved.options,
                config=None,
            ),
            timeout=timeout + 1.0,
        )
    except (OSError, asyncssh.Error, TimeoutError) as exc:
        raise ConnectionLost(
            f"cannot fetch the host key of {where}: {exc or type(exc).__name__}. "
            "Check that the host is up and that sshd listens on that port."
        ) from exc
    if key is None:
        raise TargetError(f"{where} presented no host key")
    return key


def known_hosts_line(resolved: ResolvedHost, key: asyncssh.SSHKey) -> str:
    """The OpenSSH known_hosts line for key at this host: `[host]:port` when port != 22."""
    name = resolved.entry_name()
    key_type, key_data = key.export_public_key("openssh").decode().split()[:2]
    return f"{name} {key_type} {key_data}"


def describe_mismatch(
    resolved: ResolvedHost, known: list[tuple[Path, asyncssh.SSHKey]], key: asyncssh.SSHKey
) -> str:
    """A message for a changed host key that says what was expected and how to recover."""
    name = resolved.entry_name()
    expected = "; ".join(
        f"{k.get_algorithm()} {k.get_fingerprint('sha256')} in {path}" for path, k in known
    )
    files = sorted({str(path) for path, _ in known})
    spec = resolved.key_name if resolved.port == 22 else f"{resolved.key_name}:{resolved.port}"
    return (
        f"HOST KEY CHANGED for {resolved.host}:{resolved.port}: the server presents "
        f"{key.get_algorithm()} {key.get_fingerprint('sha256')}, but known_hosts has {expected}. "
        "Someone may be intercepting the connection, or the host was reinstalled. Refusing to "
        "connect. Confirm the new fingerprint with the host's administrator, then remove the old "
        f"entry (ssh-keygen -R '{name}' -f {files[0]}) and run: tracedeck trust {spec}"
    )


async def fetch_host_key(host: str, port: int | None = None) -> tuple[str, str, str]:
    """(key_type, SHA256 fingerprint, known_hosts line) of the key that host:port presents."""
    resolved = await resolve_host(host, port, load_keys=False)
    key = await server_key(resolved)
    return key.get_algorithm(), key.get_fingerprint("sha256"), known_hosts_line(resolved, key)


async def trust_host(
    host: str,
    port: int | None = None,
    known_hosts: Path | None = None,
    *,
    expected_fingerprint: str | None = None,
) -> str:
    """Append host's key to known_hosts; return its fingerprint.

    known_hosts None means the first UserKnownHostsFile of ~/.ssh/config, else ~/.ssh/known_hosts.
    port None lets ~/.ssh/config decide (else 22). Idempotent when the key is already trusted.
    Raises HostKeyMismatch when known_hosts already holds a different key for the host, or when
    expected_fingerprint is given (what the operator was shown) and the server now presents another.
    """
    resolved = await resolve_host(host, port, load_keys=False)
    if known_hosts is None:
        if not resolved.user_files:
            raise TargetError(no_user_file(host))
        known_hosts = resolved.user_files[0]
    path = known_hosts.expanduser()
    check = dataclasses.replace(resolved, user_files=(path,), global_files=())
    known = known_keys(check)
    algorithms = sorted({k.get_algorithm() for _, k in known}) or None
    try:
        key = await server_key(resolved, algorithms)
    except ConnectionLost:
        if not algorithms:
            raise
        key = await server_key(resolved)  # the server no longer offers the known key's type
    fingerprint = key.get_fingerprint("sha256")
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise HostKeyMismatch(
            f"{resolved.host}:{resolved.port} now presents {key.get_algorithm()} {fingerprint}, "
            f"not the {expected_fingerprint} you were shown; nothing was trusted. Check the host "
            "and run the trust command again."
        )
    if any(k.public_data == key.public_data for _, k in known):
        return fingerprint
    if known:
        raise HostKeyMismatch(describe_mismatch(check, known, key))
    _append_line(path, known_hosts_line(resolved, key))
    return fingerprint


def no_user_file(host: str) -> str:
    return (
        f"~/.ssh/config sets UserKnownHostsFile none for {host}: no key can be trusted for it, "
        "and tracedeck never connects to a host whose key is not known. Name a known_hosts "
        "file there (or remove the line), then run: tracedeck trust " + host
    )


def _append_line(path: Path, line: str) -> None:
    if not path.parent.exists():
        path.parent.mkdir(parents=True)
        path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        if f.tell() > 0 and not path.read_bytes().endswith(b"\n"):
            f.write("\n")
        f.write(line + "\n")
