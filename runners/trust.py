"""Host keys as OpenSSH checks them: resolve a host through ~/.ssh/config, fetch its key, trust
it on explicit request under the name OpenSSH looks up (runners.hostkeys holds the rules).

asyncssh's own lookup differs from OpenSSH's in ways that matter here (it accepts a key listed
for the resolved IP address only, appends the port to HostKeyAlias, accepts any key when
`UserKnownHostsFile none`), so tracedeck never lets it decide: the SSH target judges every key
the server presents with runners.hostkeys.judge.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
from pathlib import Path

from runners.hostkeys import (
    Line,
    Policy,
    Status,
    Verdict,
    judge,
    known_types,
    order_algorithms,
    read_lines,
)
from runners.ssh_lib import asyncssh
from runners.targets.base import ConnectionLost, HostKeyMismatch, TargetError

# OpenSSH's defaults when ~/.ssh/config names no UserKnownHostsFile / GlobalKnownHostsFile.
DEFAULT_USER_FILES = ("~/.ssh/known_hosts", "~/.ssh/known_hosts2")
DEFAULT_GLOBAL_FILES = ("/etc/ssh/ssh_known_hosts", "/etc/ssh/ssh_known_hosts2")


@dataclasses.dataclass(frozen=True, slots=True)
class ResolvedHost:
    """Where ~/.ssh/config sends a host or alias, and how its key is checked (OpenSSH's rules)."""

    host: str  # after HostName
    port: int
    username: str
    policy: Policy  # the name known_hosts must carry, CheckHostIP, ...
    user_files: tuple[Path, ...]  # UserKnownHostsFile: where `tracedeck trust` writes
    global_files: tuple[Path, ...]  # GlobalKnownHostsFile: read only
    algorithms: tuple[str, ...]  # OpenSSH's HostKeyAlgorithms for this host (`ssh -G`)
    algorithms_verbatim: bool  # HostKeyAlgorithms set outright: no reordering by known keys
    options: asyncssh.SSHClientConnectionOptions

    @property
    def known_hosts(self) -> tuple[Path, ...]:
        return self.user_files + self.global_files

    @property
    def key_name(self) -> str:
        """The name known_hosts entries use: HostKeyAlias as is, else `[host]:port` off 22."""
        return self.policy.name


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
    ssh_g = await _ssh_config(host, port_used, username)
    alias = options.host_key_alias
    configured_algs = options.config.get("HostKeyAlgorithms", ())
    policy = Policy(
        hostname=options.host.lower(),
        port=port_used,
        alias=alias.lower() if alias else None,
        check_host_ip=ssh_g.get("checkhostip") == "yes",
        localhost_unchecked=ssh_g.get("nohostauthenticationforlocalhost") == "yes",
        proxy=bool(options.proxy_command or options.tunnel),
    )
    return ResolvedHost(
        host=options.host,
        port=port_used,
        username=options.username,
        policy=policy,
        user_files=_files(options.config.get("UserKnownHostsFile", ()), DEFAULT_USER_FILES),
        global_files=_files(options.config.get("GlobalKnownHostsFile", ()), DEFAULT_GLOBAL_FILES),
        algorithms=tuple(a for a in ssh_g.get("hostkeyalgorithms", "").split(",") if a),
        algorithms_verbatim=isinstance(configured_algs, str)
        and not configured_algs.startswith(("+", "-")),
        options=options,
    )


def _files(configured: object, default: tuple[str, ...]) -> tuple[Path, ...]:
    # asyncssh reads "none" as [] and an absent option as ().
    names = default if configured == () else configured
    return tuple(Path(str(f)).expanduser() for f in names)  # type: ignore[union-attr]


async def _ssh_config(host: str, port: int, username: str | None) -> dict[str, str]:
    """The options OpenSSH's own `ssh -G` reads from ~/.ssh/config for this host (asyncssh does
    not know CheckHostIP, NoHostAuthenticationForLocalhost or the default HostKeyAlgorithms);
    empty, so OpenSSH's defaults, when no ssh client is installed."""
    ssh = shutil.which("ssh")
    if ssh is None:
        return {}
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
        return {}  # ssh rejects a config asyncssh accepted: asyncssh's reading stands
    values: dict[str, str] = {}
    for line in out.decode(errors="replace").splitlines():
        key, _, value = line.strip().partition(" ")
        values.setdefault(key.lower(), value.strip())
    return values


def read_known_hosts(resolved: ResolvedHost) -> list[list[Line]]:
    """The known_hosts files that exist, parsed; an unreadable one is named."""
    parsed = []
    for path in resolved.known_hosts:
        if not path.is_file():
            continue
        try:
            parsed.append(read_lines(path))
        except OSError as exc:
            raise TargetError(f"cannot read known_hosts file {path}: {exc}") from exc
    return parsed


def host_key_algorithms(resolved: ResolvedHost, files: list[list[Line]]) -> list[str] | None:
    """The host key algorithms to offer, in OpenSSH's order for this host (those asyncssh
    knows); None (asyncssh's own) when `ssh -G` gave none."""
    if not resolved.algorithms:
        return None
    ordered = order_algorithms(
        list(resolved.algorithms), files, resolved.key_name, resolved.algorithms_verbatim
    )
    _, has_ca = known_types(files, resolved.key_name)
    supported = {a.decode() for a in asyncssh.public_key.get_public_key_algs()}
    if has_ca:
        supported |= {a.decode() for a in asyncssh.public_key.get_certificate_algs()}
    offered = [a for a in ordered if a in supported]
    return offered or None


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
    """The known_hosts line OpenSSH looks up for key at this host: the HostKeyAlias as is, else
    the lower-cased host as `[host]:port` when the port is not 22."""
    key_type, key_data = key.export_public_key("openssh").decode().split()[:2]
    return f"{resolved.key_name} {key_type} {key_data}"


def describe_mismatch(resolved: ResolvedHost, known: list[Line], key: asyncssh.SSHKey) -> str:
    """A message for a changed host key that says what was expected and how to recover."""
    name = resolved.key_name
    expected = "; ".join(
        f"{line.key.get_algorithm()} {line.key.get_fingerprint('sha256')} in {line.where}"
        for line in known
    )
    files = sorted({str(line.path) for line in known})
    return (
        f"HOST KEY CHANGED for {resolved.host}:{resolved.port}: the server presents "
        f"{key.get_algorithm()} {key.get_fingerprint('sha256')}, but known_hosts has {expected}. "
        "Someone may be intercepting the connection, or the host was reinstalled. Refusing to "
        "connect. Confirm the new fingerprint with the host's administrator, then remove the old "
        f"entry (ssh-keygen -R '{name}' -f {files[0]}) and run: tracedeck trust "
        f"{trust_spec(resolved)}"
    )


def describe_revoked(resolved: ResolvedHost, verdict: Verdict) -> str:
    where = verdict.revoked.where if verdict.revoked else "known_hosts"
    return (
        f"REVOKED HOST KEY for {resolved.host}:{resolved.port}: the server presents "
        f"{verdict.key.get_algorithm()} {verdict.key.get_fingerprint('sha256')}, which "
        f"{where} marks @revoked. Refusing to connect; the host must get a new key."
    )


def trust_spec(resolved: ResolvedHost) -> str:
    return resolved.host if resolved.port == 22 else f"{resolved.host}:{resolved.port}"


async def fetch_host_key(host: str, port: int | None = None) -> tuple[str, str, str]:
    """(key_type, SHA256 fingerprint, known_hosts line) of the key that host:port presents."""
    resolved = await resolve_host(host, port, load_keys=False)
    key = await server_key(resolved, host_key_algorithms(resolved, read_known_hosts(resolved)))
    return key.get_algorithm(), key.get_fingerprint("sha256"), known_hosts_line(resolved, key)


async def trust_host(
    host: str,
    port: int | None = None,
    known_hosts: Path | None = None,
    *,
    expected_fingerprint: str | None = None,
) -> str:
    """Append host's key to known_hosts, under the name OpenSSH looks up; return its fingerprint.

    known_hosts None means the first UserKnownHostsFile of ~/.ssh/config, else ~/.ssh/known_hosts.
    port None lets ~/.ssh/config decide (else 22). Idempotent when OpenSSH already accepts the key.
    Raises HostKeyMismatch when known_hosts already holds a different key for the host (or marks
    this one revoked), or when expected_fingerprint is given (what the operator was shown) and the
    server now presents another.
    """
    resolved = await resolve_host(host, port, load_keys=False)
    if known_hosts is None:  # what the host's files say, as a connection would read them
        if not resolved.user_files:
            raise TargetError(no_user_file(host))
        path = resolved.user_files[0]
        files = read_known_hosts(resolved)
    else:  # the file named: what it says alone
        path = known_hosts.expanduser()
        named = dataclasses.replace(resolved, user_files=(path,), global_files=())
        files = read_known_hosts(named)
    key = await server_key(resolved, host_key_algorithms(resolved, files))
    fingerprint = key.get_fingerprint("sha256")
    if expected_fingerprint is not None and fingerprint != expected_fingerprint:
        raise HostKeyMismatch(
            f"{resolved.host}:{resolved.port} now presents {key.get_algorithm()} {fingerprint}, "
            f"not the {expected_fingerprint} you were shown; nothing was trusted. Check the host "
            "and run the trust command again."
        )
    # No address: trusting writes the name; CheckHostIP is for the connection to judge.
    verdict = judge(resolved.policy, files, key, "")
    if verdict.accepted:
        return fingerprint
    if verdict.status is Status.REVOKED:
        raise HostKeyMismatch(describe_revoked(resolved, verdict))
    if verdict.status is Status.CHANGED:
        raise HostKeyMismatch(describe_mismatch(resolved, list(verdict.known), key))
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
