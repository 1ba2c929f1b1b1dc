"""Host keys accepted and refused exactly as OpenSSH 9.2 does: every row of the table is run, in
the test itself, through the real `ssh -o BatchMode=yes` and through tracedeck's SSH target,
against a real sshd, and both must answer the same.

tracedeck never trusts on first use: it behaves as `StrictHostKeyChecking yes` whatever the
config says. Rows whose config relaxes that (no, accept-new) record what ssh does as configured,
and check tracedeck against ssh forced to `StrictHostKeyChecking=yes`.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from runhelp import cli_env, tracedeck
from sshd import SshHome, SshServer, keygen, start_sshd

from runners.targets.base import HostKeyMismatch, HostKeyUnknown, TargetError
from runners.targets.ssh import SshTarget

pytestmark = pytest.mark.ssh

ACCEPT, REFUSE = "accept", "refuse"
GUARD_S = 60.0  # far above any real connect: only there so a hang fails the row


def _key(pub: Path) -> str:
    return " ".join(pub.read_text().split()[:2])


def _outbound_address() -> str | None:
    """A non-loopback IPv4 address of this machine (where CheckHostIP is not switched off)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # no packet is sent: this only picks a route
        except OSError:
            return None
        addr = s.getsockname()[0]
    return None if addr.startswith("127.") else addr


@dataclass
class Keys:
    """The servers and the keys a row's known_hosts can name."""

    main: SshServer  # ed25519 only, on 127.0.0.1
    multi: SshServer  # ed25519 and ecdsa, on 127.0.0.1
    remote: SshServer | None  # ed25519, on a non-loopback address of this machine
    other: str  # an ed25519 key no server has
    other_rsa: str  # an RSA key no server has


@pytest.fixture(scope="module")
def keys(sshd: SshServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Keys]:
    d = tmp_path_factory.mktemp("parity-keys")
    keygen(d / "other", "other")
    keygen(d / "other_rsa", "other-rsa", "rsa")
    multi = start_sshd(tmp_path_factory.mktemp("multikey"), extra_host_keys=("ecdsa",))
    (multi.dir / "authorized_keys").write_text(Path(f"{sshd.client_key}.pub").read_text())
    addr = _outbound_address()
    remote = None
    if addr is not None:
        remote = start_sshd(tmp_path_factory.mktemp("remote"), listen=addr)
        (remote.dir / "authorized_keys").write_text(Path(f"{sshd.client_key}.pub").read_text())
    try:
        yield Keys(sshd, multi, remote, _key(d / "other.pub"), _key(d / "other_rsa.pub"))
    finally:
        multi.stop()
        if remote is not None:
            remote.stop()


@dataclass
class Files:
    """Where a row's known_hosts files live (fresh for each row)."""

    kh: Path  # the UserKnownHostsFile unless the row names others
    kh2: Path
    gkh: Path  # the GlobalKnownHostsFile unless the row names another


Text = Callable[[Keys, SshServer, Files], str]


@dataclass(frozen=True)
class Row:
    name: str
    expect: str  # what `ssh -o BatchMode=yes` does with this config
    known: Text = lambda k, s, f: ""  # the UserKnownHostsFile's text
    config: Text = lambda k, s, f: ""  # lines for the Host block (before the defaults)
    kh2: Text = lambda k, s, f: ""
    global_known: Text = lambda k, s, f: ""
    server: str = "main"  # main, multi or remote
    hostname: Text = lambda k, s, f: s.host
    hashed: bool = False  # run `ssh-keygen -H` on the user file first
    tracedeck: str | None = None  # tracedeck's answer where it differs on purpose
    why: str = ""
    extra: dict[str, str] = field(default_factory=dict)


def key(s: SshServer) -> str:
    """The server's ed25519 host key, as known_hosts writes it."""
    return _key(s.host_key_pub)


def at(s: SshServer) -> str:
    return f"[{s.host}]:{s.port}"


ROWS = [
    Row("port entry", ACCEPT, lambda k, s, f: f"{at(s)} {key(s)}"),
    Row("port entry, other key", REFUSE, lambda k, s, f: f"{at(s)} {k.other}"),
    Row("nothing known", REFUSE),
    Row("entry for another port", REFUSE, lambda k, s, f: f"[{s.host}]:1 {key(s)}"),
    Row(
        "bare address off port 22 (found w/out port)",
        ACCEPT,
        lambda k, s, f: f"{s.host} {key(s)}",
    ),
    Row("bare address, other key", REFUSE, lambda k, s, f: f"{s.host} {k.other}"),
    Row(
        "port entry changed, bare address right: no fallback",
        REFUSE,
        lambda k, s, f: f"{at(s)} {k.other}\n{s.host} {key(s)}",
    ),
    Row(
        "HostKeyAlias, bare alias entry",
        ACCEPT,
        lambda k, s, f: f"gpubox {key(s)}",
        config=lambda k, s, f: "HostKeyAlias gpubox",
    ),
    Row(
        "HostKeyAlias, [alias]:port entry",
        REFUSE,
        lambda k, s, f: f"[gpubox]:{s.port} {key(s)}",
        config=lambda k, s, f: "HostKeyAlias gpubox",
    ),
    Row(
        "HostKeyAlias, only the address's entry",
        REFUSE,
        lambda k, s, f: f"{at(s)} {key(s)}\n{s.host} {key(s)}",
        config=lambda k, s, f: "HostKeyAlias gpubox",
    ),
    Row(
        "HostKeyAlias is the address, bare entry",
        ACCEPT,
        lambda k, s, f: f"{s.host} {key(s)}",
        config=lambda k, s, f: f"HostKeyAlias {s.host}",
    ),
    Row(
        "HostKeyAlias is the address, [address]:port entry",
        REFUSE,
        lambda k, s, f: f"{at(s)} {key(s)}",
        config=lambda k, s, f: f"HostKeyAlias {s.host}",
    ),
    Row(
        "HostKeyAlias upper-case, entry lower-case",
        ACCEPT,
        lambda k, s, f: f"gpubox {key(s)}",
        config=lambda k, s, f: "HostKeyAlias GPUBox",
    ),
    Row(
        "HostName upper-case",
        ACCEPT,
        lambda k, s, f: f"[localhost]:{s.port} {key(s)}",
        hostname=lambda k, s, f: "LOCALHOST",
    ),
    Row(
        "entry upper-case",
        ACCEPT,
        lambda k, s, f: f"[LocalHost]:{s.port} {key(s)}",
        hostname=lambda k, s, f: "localhost",
    ),
    Row(
        "HostName is not the alias: [alias]:port entry",
        REFUSE,
        lambda k, s, f: f"[h]:{s.port} {key(s)}\nh {key(s)}",
    ),
    Row("hashed port entry", ACCEPT, lambda k, s, f: f"{at(s)} {key(s)}", hashed=True),
    Row("hashed bare entry", ACCEPT, lambda k, s, f: f"{s.host} {key(s)}", hashed=True),
    Row(
        "hashed alias entry",
        ACCEPT,
        lambda k, s, f: f"gpubox {key(s)}",
        config=lambda k, s, f: "HostKeyAlias gpubox",
        hashed=True,
    ),
    Row(
        "hashed entry, other key",
        REFUSE,
        lambda k, s, f: f"{at(s)} {k.other}",
        hashed=True,
    ),
    Row("wildcard *", ACCEPT, lambda k, s, f: f"* {key(s)}"),
    Row(
        "wildcard in the address",
        ACCEPT,
        lambda k, s, f: f"[{s.host.rsplit('.', 1)[0]}.*]:{s.port} {key(s)}",
    ),
    Row(
        "wildcard ? in the port",
        ACCEPT,
        lambda k, s, f: f"[{s.host}]:{str(s.port)[:-1]}? {key(s)}",
    ),
    Row(
        "no character classes: [ ] are literal",
        REFUSE,
        lambda k, s, f: f"[{s.host}]:[0-9]* {key(s)}",
    ),
    Row(
        "negated [address]:port, but the bare retry matches",
        ACCEPT,
        lambda k, s, f: f"*,!{at(s)} {key(s)}",
    ),
    Row(
        "negated both names",
        REFUSE,
        lambda k, s, f: f"*,!{at(s)},!{s.host} {key(s)}",
    ),
    Row(
        "comma list",
        ACCEPT,
        lambda k, s, f: f"gpubox,{at(s)},other {key(s)}",
    ),
    Row(
        "@revoked key",
        REFUSE,
        lambda k, s, f: f"{at(s)} {key(s)}\n@revoked * {key(s)}",
    ),
    Row(
        "@revoked another key",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {key(s)}\n@revoked * {k.other}",
    ),
    Row(
        "@revoked for another name only",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {key(s)}\n@revoked elsewhere {key(s)}",
    ),
    Row(
        "@cert-authority line holding the plain key",
        REFUSE,
        lambda k, s, f: f"@cert-authority {at(s)} {key(s)}",
    ),
    Row(
        "unknown marker",
        REFUSE,
        lambda k, s, f: f"@trusted {at(s)} {key(s)}",
    ),
    Row(
        "malformed lines and comments around the entry",
        ACCEPT,
        lambda k, s, f: (
            f"# c\n\ngarbage\n{at(s)} ssh-ed25519 AAAAnotbase64\n  {at(s)} {key(s)} comment here"
        ),
    ),
    Row(
        "two keys listed, second right",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {k.other}\n{at(s)} {key(s)}",
    ),
    Row(
        "only an RSA key known, server has ed25519",
        REFUSE,
        lambda k, s, f: f"{at(s)} {k.other_rsa}",
    ),
    Row(
        "RSA key known for the port, bare address right: different type is CHANGED",
        REFUSE,
        lambda k, s, f: f"{at(s)} {k.other_rsa}\n{s.host} {key(s)}",
    ),
    Row(
        "two-key server, only its ecdsa key known",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {_key(s.dir / 'ssh_host_ecdsa_key.pub')}",
        server="multi",
    ),
    Row(
        "two-key server, wrong ed25519 and right ecdsa known",
        REFUSE,
        lambda k, s, f: f"{at(s)} {k.other}\n{at(s)} {_key(s.dir / 'ssh_host_ecdsa_key.pub')}",
        server="multi",
        why="ed25519 comes first in HostKeyAlgorithms and is known, so it is what is negotiated",
    ),
    Row(
        "HostKeyAlgorithms names ecdsa first, wrong ed25519 known",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {k.other}\n{at(s)} {_key(s.dir / 'ssh_host_ecdsa_key.pub')}",
        config=lambda k, s, f: "HostKeyAlgorithms ecdsa-sha2-nistp256,ssh-ed25519",
        server="multi",
    ),
    Row(
        "two UserKnownHostsFiles, key in the second",
        ACCEPT,
        kh2=lambda k, s, f: f"{at(s)} {key(s)}",
        config=lambda k, s, f: f"UserKnownHostsFile {f.kh} {f.kh2}",
    ),
    Row(
        "two UserKnownHostsFiles, other key in the first",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {k.other}",
        kh2=lambda k, s, f: f"{at(s)} {key(s)}",
        config=lambda k, s, f: f"UserKnownHostsFile {f.kh} {f.kh2}",
    ),
    Row(
        "UserKnownHostsFile none, key in GlobalKnownHostsFile",
        ACCEPT,
        global_known=lambda k, s, f: f"{at(s)} {key(s)}",
        config=lambda k, s, f: "UserKnownHostsFile none",
    ),
    Row(
        "UserKnownHostsFile none, nothing global",
        REFUSE,
        config=lambda k, s, f: "UserKnownHostsFile none",
    ),
    Row(
        "GlobalKnownHostsFile only",
        ACCEPT,
        global_known=lambda k, s, f: f"{at(s)} {key(s)}",
    ),
    Row(
        "GlobalKnownHostsFile other key, user file right",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {key(s)}",
        global_known=lambda k, s, f: f"{at(s)} {k.other}",
    ),
    Row(
        "GlobalKnownHostsFile right, user file other key",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {k.other}",
        global_known=lambda k, s, f: f"{at(s)} {key(s)}",
    ),
    Row(
        "CheckHostIP yes on loopback: off",
        ACCEPT,
        lambda k, s, f: f"[localhost]:{s.port} {key(s)}\n{at(s)} {k.other}",
        hostname=lambda k, s, f: "localhost",
        config=lambda k, s, f: "CheckHostIP yes",
    ),
    Row(
        "CheckHostIP yes, address lists another key",
        REFUSE,
        lambda k, s, f: f"gpubox {key(s)}\n{at(s)} {k.other}",
        config=lambda k, s, f: "HostKeyAlias gpubox\n  CheckHostIP yes",
        server="remote",
    ),
    Row(
        "CheckHostIP no, address lists another key",
        ACCEPT,
        lambda k, s, f: f"gpubox {key(s)}\n{at(s)} {k.other}",
        config=lambda k, s, f: "HostKeyAlias gpubox\n  CheckHostIP no",
        server="remote",
    ),
    Row(
        "CheckHostIP yes, address not listed",
        ACCEPT,
        lambda k, s, f: f"gpubox {key(s)}",
        config=lambda k, s, f: "HostKeyAlias gpubox\n  CheckHostIP yes",
        server="remote",
    ),
    Row(
        "StrictHostKeyChecking yes, known",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {key(s)}",
        config=lambda k, s, f: "StrictHostKeyChecking yes",
    ),
    Row(
        "StrictHostKeyChecking accept-new, nothing known",
        ACCEPT,
        config=lambda k, s, f: "StrictHostKeyChecking accept-new",
        tracedeck=REFUSE,
        why="tracedeck never trusts on first use",
    ),
    Row(
        "StrictHostKeyChecking no, nothing known",
        ACCEPT,
        config=lambda k, s, f: "StrictHostKeyChecking no",
        tracedeck=REFUSE,
        why="tracedeck never trusts on first use",
    ),
    Row(
        "StrictHostKeyChecking no, key changed",
        ACCEPT,
        lambda k, s, f: f"{at(s)} {k.other}",
        config=lambda k, s, f: "StrictHostKeyChecking no",
        tracedeck=REFUSE,
        why="tracedeck never connects to a changed key",
    ),
    Row(
        "NoHostAuthenticationForLocalhost yes, nothing known",
        ACCEPT,
        config=lambda k, s, f: "NoHostAuthenticationForLocalhost yes",
    ),
    Row(
        "NoHostAuthenticationForLocalhost yes with HostKeyAlias",
        REFUSE,
        config=lambda k, s, f: "NoHostAuthenticationForLocalhost yes\n  HostKeyAlias gpubox",
    ),
]


def _write(path: Path, text: str) -> None:
    path.write_text(text + ("\n" if text else ""))


def _prepare(row: Row, keys: Keys, server: SshServer, home: SshHome, files: Files) -> None:
    """Write this row's ~/.ssh/config and known_hosts files (again before each client)."""
    for path in (files.kh, files.kh2, files.gkh):
        path.unlink(missing_ok=True)
        Path(f"{path}.old").unlink(missing_ok=True)
    _write(files.kh, row.known(keys, server, files))
    if row.hashed:
        subprocess.run(["ssh-keygen", "-q", "-H", "-f", str(files.kh)], check=True)
        Path(f"{files.kh}.old").unlink(missing_ok=True)
    _write(files.kh2, row.kh2(keys, server, files))
    _write(files.gkh, row.global_known(keys, server, files))
    own = row.config(keys, server, files)
    lines = [
        "Host h",
        *([f"  {own}"] if own else []),
        f"  HostName {row.hostname(keys, server, files)}",
        f"  Port {server.port}",
        f"  User {server.user}",
        f"  IdentityFile {home.identity}",
        f"  UserKnownHostsFile {files.kh}",
        f"  GlobalKnownHostsFile {files.gkh}",
        "  ConnectTimeout 30",
        "",
    ]
    home.config.write_text("\n".join(lines))


def _ssh(home: SshHome, *options: str) -> str:
    """What the real client does: accept (it ran `true` on the host) or refuse (host key)."""
    done = subprocess.run(
        ["ssh", "-F", str(home.config), "-o", "BatchMode=yes", *options, "h", "true"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=GUARD_S,
    )
    if done.returncode == 0:
        return ACCEPT
    assert "Host key verification failed" in done.stderr, f"ssh failed otherwise:\n{done.stderr}"
    return REFUSE


def _tracedeck() -> str:
    """What tracedeck's SSH target does with the same ~/.ssh/config."""

    async def attempt() -> str:
        target = SshTarget("h")
        try:
            await asyncio.wait_for(target.connect(), GUARD_S)
        except (HostKeyUnknown, HostKeyMismatch):
            return REFUSE
        except TargetError as exc:
            if "UserKnownHostsFile none" in str(exc):
                return REFUSE
            raise
        await target.close()
        return ACCEPT

    return asyncio.run(attempt())


@pytest.fixture
def files(tmp_path: Path) -> Files:
    return Files(tmp_path / "known_hosts", tmp_path / "known_hosts2", tmp_path / "global_known")


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_host_key_parity_with_openssh(
    row: Row, keys: Keys, ssh_home: SshHome, files: Files
) -> None:
    server = {"main": keys.main, "multi": keys.multi, "remote": keys.remote}[row.server]
    if server is None:
        pytest.skip("this machine has no non-loopback IPv4 address for the CheckHostIP rows")
    _prepare(row, keys, server, ssh_home, files)
    ours = _tracedeck()
    _prepare(row, keys, server, ssh_home, files)
    theirs = _ssh(ssh_home)
    assert theirs == row.expect, f"OpenSSH itself: {row.name}"
    if row.tracedeck is None:
        assert ours == theirs, f"{row.name}: ssh would {theirs}, tracedeck would {ours}"
        return
    assert ours == row.tracedeck, row.why
    _prepare(row, keys, server, ssh_home, files)
    strict = _ssh(ssh_home, "-o", "StrictHostKeyChecking=yes")
    assert ours == strict, f"{row.name}: strict ssh would {strict}, tracedeck would {ours}"


# -- `tracedeck trust` writes what OpenSSH looks up ----------------------------------------------

TRUST_CASES = {
    # name: (extra config lines, HostName, the known_hosts name expected)
    "Port from the config, no port given": ("", "{host}", "[{host}]:{port}"),
    "HostKeyAlias": ("HostKeyAlias gpubox", "{host}", "gpubox"),
    "HostKeyAlias upper-case": ("HostKeyAlias GpuBox", "{host}", "gpubox"),
    "HostName upper-case": ("", "LOCALHOST", "[localhost]:{port}"),
}


@pytest.mark.parametrize("case", TRUST_CASES, ids=list(TRUST_CASES))
def test_trust_writes_the_entry_openssh_accepts(
    case: str, sshd: SshServer, ssh_home: SshHome, files: Files
) -> None:
    own, hostname, name = (t.format(host=sshd.host, port=sshd.port) for t in TRUST_CASES[case])
    ssh_home.config.write_text(
        "\n".join(
            [
                "Host h",
                *([f"  {own}"] if own else []),
                f"  HostName {hostname}",
                f"  Port {sshd.port}",
                f"  User {sshd.user}",
                f"  IdentityFile {ssh_home.identity}",
                f"  UserKnownHostsFile {files.kh}",
                f"  GlobalKnownHostsFile {files.gkh}",
                "",
            ]
        )
    )
    assert _ssh(ssh_home) == REFUSE and _tracedeck() == REFUSE  # nothing known yet
    done = tracedeck("trust", "h", "--yes", env=cli_env(ssh_home.path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert files.kh.read_text() == f"{name} {_key(sshd.host_key_pub)}\n"
    assert _ssh(ssh_home) == ACCEPT
    assert _tracedeck() == ACCEPT
    again = tracedeck("trust", "h", "--yes", env=cli_env(ssh_home.path))
    assert again.returncode == 0, again.stdout + again.stderr
    assert files.kh.read_text() == f"{name} {_key(sshd.host_key_pub)}\n"  # already trusted


def test_check_host_ip_refusal_names_the_address(
    keys: Keys, ssh_home: SshHome, files: Files
) -> None:
    server = keys.remote
    if server is None:
        pytest.skip("this machine has no non-loopback IPv4 address")
    row = next(r for r in ROWS if r.name == "CheckHostIP yes, address lists another key")
    _prepare(row, keys, server, ssh_home, files)

    async def attempt() -> str:
        with pytest.raises(HostKeyMismatch) as info:
            await asyncio.wait_for(SshTarget("h").connect(), GUARD_S)
        return str(info.value)

    message = asyncio.run(attempt())
    assert "CheckHostIP yes" in message and at(server) in message, message
