"""Host keys: fetch a server's key, look it up in known_hosts, and trust it on explicit request."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from pathlib import Path

import asyncssh

from runners.targets.base import ConnectionLost, HostKeyMismatch, TargetError

DEFAULT_KNOWN_HOSTS = Path("~", ".ssh", "known_hosts")


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedHost:
    """Where ~/.ssh/config sends a host or alias, and which known_hosts files vouch for it."""

    host: str  # after HostName
    port: int
    username: str
    key_name: str  # the name known_hosts entries use: HostKeyAlias, else host
    known_hosts: tuple[Path, ...]
    options: asyncssh.SSHClientConnectionOptions


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
    files: tuple[Path, ...]
    if options.known_hosts is None:
        files = ()
    elif isinstance(options.known_hosts, list | tuple) and options.known_hosts:
        files = tuple(Path(str(f)).expanduser() for f in options.known_hosts)
    else:
        files = (DEFAULT_KNOWN_HOSTS.expanduser(),)
    return ResolvedHost(
        host=options.host,
        port=options.port or 22,
        username=options.username,
        key_name=options.host_key_alias or options.host,
        known_hosts=files,
        options=options,
    )


def known_keys(resolved: ResolvedHost) -> list[tuple[Path, asyncssh.SSHKey]]:
    """The host keys that the known_hosts files list for this host (file, key), in file order."""
    port = None if resolved.port == 22 else resolved.port
    found: list[tuple[Path, asyncssh.SSHKey]] = []
    for path in resolved.known_hosts:
        if not path.is_file():
            continue
        try:
            entries = asyncssh.read_known_hosts(str(path))
        except (OSError, ValueError) as exc:
            raise TargetError(f"cannot read known_hosts file {path}: {exc}") from exc
        for key in entries.match(resolved.key_name, resolved.host, port)[0]:
            if all(key.public_data != k.public_data for _, k in found):
                found.append((path, key))
    return found


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
    name = resolved.key_name if resolved.port == 22 else f"[{resolved.key_name}]:{resolved.port}"
    key_type, key_data = key.export_public_key("openssh").decode().split()[:2]
    return f"{name} {key_type} {key_data}"


def describe_mismatch(
    resolved: ResolvedHost, known: list[tuple[Path, asyncssh.SSHKey]], key: asyncssh.SSHKey
) -> str:
    """A message for a changed host key that says what was expected and how to recover."""
    name = resolved.key_name if resolved.port == 22 else f"[{resolved.key_name}]:{resolved.port}"
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
        known_hosts = resolved.known_hosts[0] if resolved.known_hosts else DEFAULT_KNOWN_HOSTS
    path = known_hosts.expanduser()
    check = dataclasses.replace(resolved, known_hosts=(path,))
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


def _append_line(path: Path, line: str) -> None:
    if not path.parent.exists():
        path.parent.mkdir(parents=True)
        path.parent.chmod(0o700)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    with os.fdopen(fd, "a") as f:
        if f.tell() > 0 and not path.read_bytes().endswith(b"\n"):
            f.write("\n")
        f.write(line + "\n")
