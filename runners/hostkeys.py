"""known_hosts read and a server's key judged exactly as OpenSSH 9.2's client does
(hostfile.c, match.c, sshconnect.c check_host_key), with strict checking always on.

The rules that matter, each one OpenSSH's:
- the name looked up is HostKeyAlias when set (bare: no port is ever added to it), else the
  lower-cased HostName, as `[host]:port` off port 22;
- a line matches when one of its comma-separated patterns (`*`, `?`, no character classes)
  matches the name and none of its `!` patterns does; a hashed line `|1|salt|hash` matches
  when HMAC-SHA1(salt, name) equals hash;
- among the matching plain lines: one with the server's key means known (OK); none with it but
  some other key means CHANGED; none at all means NEW. A matching `@revoked` line with the key
  means REVOKED whatever else is listed;
- NEW off port 22 with no HostKeyAlias is looked up again under the bare host name and address
  ("found matching key w/out port"), where only an exact OK counts;
- CheckHostIP compares the key listed for the server's address too, except for a loopback
  address, a ProxyCommand, or a HostName that is that very address;
- NoHostAuthenticationForLocalhost yes (without HostKeyAlias) accepts any key on loopback.
tracedeck never adds a key by itself: NEW is a refusal (StrictHostKeyChecking yes).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import hmac
import ipaddress
from pathlib import Path

from runners.ssh_lib import asyncssh

CA_MARKER = "@cert-authority"
REVOKE_MARKER = "@revoked"
PROXY_NO_IP = "<no hostip for proxy command>"


class Status(enum.Enum):
    OK = "known"
    NEW = "not known"
    CHANGED = "changed"
    REVOKED = "revoked"


@dataclasses.dataclass(frozen=True, slots=True)
class Line:
    """One parsed known_hosts line: where it is, its marker, its host field and its key."""

    path: Path
    number: int
    marker: str  # "", CA_MARKER or REVOKE_MARKER
    hosts: str
    key: asyncssh.SSHKey

    @property
    def where(self) -> str:
        return f"{self.path}:{self.number}"


@dataclasses.dataclass(frozen=True, slots=True)
class Policy:
    """What ~/.ssh/config says about checking one host's key (as OpenSSH reads it)."""

    hostname: str  # HostName, lower-cased
    port: int
    alias: str | None  # HostKeyAlias, lower-cased
    check_host_ip: bool
    localhost_unchecked: bool  # NoHostAuthenticationForLocalhost yes
    proxy: bool  # ProxyCommand or ProxyJump: no address to check

    @property
    def name(self) -> str:
        """The name known_hosts entries for this host must carry."""
        return self.alias if self.alias else host_port(self.hostname, self.port)


@dataclasses.dataclass(frozen=True, slots=True)
class Verdict:
    """Accept or refuse a server key, with what was looked up and found, for the message."""

    accepted: bool
    status: Status
    name: str  # the name looked up first
    key: asyncssh.SSHKey
    known: tuple[Line, ...] = ()  # plain keys listed under name (what CHANGED differs from)
    revoked: Line | None = None
    ip_name: str = ""  # set when CheckHostIP refused: the address whose key differs
    ip_known: tuple[Line, ...] = ()
    without_port: str = ""  # set when accepted under the bare name
    localhost: bool = False  # accepted by NoHostAuthenticationForLocalhost


def host_port(host: str, port: int) -> str:
    """OpenSSH's put_host_port: host on port 22 (or 0), else `[host]:port`."""
    return host if port in (0, 22) else f"[{host}]:{port}"


def read_lines(path: Path) -> list[Line]:
    """The well-formed lines of a known_hosts file; malformed ones are skipped as OpenSSH does."""
    lines: list[Line] = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            text = raw.decode("utf-8", "replace").rstrip("\r\n")
            line = _parse(path, number, text)
            if line is not None:
                lines.append(line)
    return lines


def _parse(path: Path, number: int, text: str) -> Line | None:
    rest = text.lstrip(" \t")
    if not rest or rest.startswith("#"):
        return None
    marker = ""
    if rest.startswith("@"):
        marker, _, rest = _split(rest)
        if marker not in (CA_MARKER, REVOKE_MARKER) or rest.startswith("@"):
            return None  # unknown marker, or a second one
    hosts, _, rest = _split(rest)
    key_type, _, rest = _split(rest)
    key_b64, _, _ = _split(rest)
    if not hosts or not key_type or not key_b64:
        return None
    try:
        key = asyncssh.import_public_key(f"{key_type} {key_b64}")
    except (asyncssh.KeyImportError, ValueError):
        return None
    return Line(path, number, marker, hosts, key)


def _split(text: str) -> tuple[str, str, str]:
    i = 0
    while i < len(text) and text[i] not in " \t":
        i += 1
    head = text[:i]
    j = i
    while j < len(text) and text[j] in " \t":
        j += 1
    return head, text[i:j], text[j:]


def matches(name: str, hosts: str) -> bool:
    """Whether a known_hosts host field names `name` (OpenSSH's match_maybe_hashed)."""
    if hosts.startswith("|"):
        return _hashed_match(name, hosts)
    return _pattern_list(name.lower(), hosts) == 1


def _hashed_match(name: str, field: str) -> bool:
    parts = field.split("|")
    if len(parts) != 4 or parts[1] != "1":
        return False
    try:
        salt = base64.b64decode(parts[2], validate=True)
        want = base64.b64decode(parts[3], validate=True)
    except ValueError:
        return False
    if len(salt) != 20:
        return False
    got = hmac.new(salt, name.encode(), hashlib.sha1).digest()
    return hmac.compare_digest(got, want)


def _pattern_list(name: str, patterns: str) -> int:
    """match.c match_pattern_list: -1 when a `!` pattern matches, 1 when a plain one does."""
    got = 0
    for pattern in patterns.split(","):
        negated = pattern.startswith("!")
        pattern = (pattern[1:] if negated else pattern).lower()
        if _wildcard(name, pattern):
            if negated:
                return -1
            got = 1
    return got


def _wildcard(text: str, pattern: str) -> bool:
    """match.c match_pattern: `*` any run, `?` one character, all else literal."""
    t = p = 0
    star_p, star_t = -1, 0
    while t < len(text):
        if p < len(pattern) and (pattern[p] == "?" or pattern[p] == text[t]):
            t += 1
            p += 1
        elif p < len(pattern) and pattern[p] == "*":
            star_p, star_t = p, t
            p += 1
        elif star_p >= 0:
            star_t += 1
            t, p = star_t, star_p + 1
        else:
            return False
    while p < len(pattern) and pattern[p] == "*":
        p += 1
    return p == len(pattern)


def entries_for(files: list[list[Line]], name: str) -> list[Line]:
    """The lines naming `name`, in file order (user files first, then global ones)."""
    return [line for lines in files for line in lines if matches(name, line.hosts)]


def _same(a: asyncssh.SSHKey, b: asyncssh.SSHKey) -> bool:
    return a.public_data == b.public_data


def status_of(entries: list[Line], key: asyncssh.SSHKey) -> tuple[Status, Line | None]:
    """hostfile.c check_key_in_hostkeys for a plain key."""
    status, found = Status.NEW, None
    for line in entries:
        if line.marker:
            continue
        if _same(line.key, key):
            status, found = Status.OK, line
            break
        status, found = Status.CHANGED, line
    for line in entries:
        if line.marker == REVOKE_MARKER and _same(line.key, key):
            return Status.REVOKED, line
    return status, found


def ca_status(entries: list[Line], ca_key: asyncssh.SSHKey) -> Status:
    """For a host certificate signed by ca_key: OK when a matching @cert-authority lists it."""
    if any(line.marker == REVOKE_MARKER and _same(line.key, ca_key) for line in entries):
        return Status.REVOKED
    if any(line.marker == CA_MARKER and _same(line.key, ca_key) for line in entries):
        return Status.OK
    return Status.NEW


def is_local(addr: str) -> bool:
    """sshconnect.c sockaddr_is_local: 127.0.0.0/8 or ::1."""
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def judge(policy: Policy, files: list[list[Line]], key: asyncssh.SSHKey, addr: str) -> Verdict:
    """OpenSSH's check_host_key for a plain key presented by the server at address addr."""
    local = bool(addr) and not policy.proxy and is_local(addr)
    if policy.localhost_unchecked and local and policy.alias is None:
        return Verdict(True, Status.OK, policy.name, key, localhost=True)
    state = {"check_ip": policy.check_host_ip and bool(addr)}
    return _check(policy, files, key, addr, policy.port, local, state)


def _check(
    policy: Policy,
    files: list[list[Line]],
    key: asyncssh.SSHKey,
    addr: str,
    port: int,
    local: bool,
    state: dict[str, bool],
) -> Verdict:
    name = policy.alias if policy.alias else host_port(policy.hostname, port)
    ip = PROXY_NO_IP if policy.proxy else host_port(addr, port)
    # OpenSSH clears the option itself, so a bare-name retry turns it off for the caller too.
    if state["check_ip"] and (local or policy.hostname == ip or policy.proxy):
        state["check_ip"] = False
    entries = entries_for(files, name)
    known = tuple(line for line in entries if not line.marker)
    host_status, found = status_of(entries, key)
    ip_entries: list[Line] = entries_for(files, ip) if state["check_ip"] else []
    ip_status = status_of(ip_entries, key)[0] if state["check_ip"] else host_status
    without_port = ""
    if host_status is Status.REVOKED:
        return Verdict(False, Status.REVOKED, name, key, known, revoked=found)
    if host_status is Status.CHANGED:
        return Verdict(False, Status.CHANGED, name, key, known)
    if host_status is Status.NEW:
        if policy.alias is None and port not in (0, 22):
            bare = _check(policy, files, key, addr, 0, local, state)
            if bare.accepted:
                without_port = bare.name
        if not without_port:
            return Verdict(False, Status.NEW, name, key, known)
    if state["check_ip"] and ip_status is Status.CHANGED:
        ip_known = tuple(line for line in ip_entries if not line.marker)
        return Verdict(False, Status.CHANGED, name, key, known, ip_name=ip, ip_known=ip_known)
    return Verdict(True, Status.OK, name, key, known, without_port=without_port)


def known_types(files: list[list[Line]], name: str) -> tuple[set[bytes], bool]:
    """The key algorithms listed (plain) for name, and whether a @cert-authority line names it."""
    entries = entries_for(files, name)
    types = {line.key.algorithm for line in entries if not line.marker}
    return types, any(line.marker == CA_MARKER for line in entries)


def order_algorithms(
    algorithms: list[str], files: list[list[Line]], name: str, verbatim: bool
) -> list[str]:
    """sshconnect2.c order_hostkeyalgs: the algorithms whose key type known_hosts lists for name
    first (all certificate ones when a @cert-authority line names it), the order kept."""
    if verbatim or not algorithms:
        return algorithms
    types, has_ca = known_types(files, name)
    if _plain_type(algorithms[0]) in types:
        return algorithms
    first, last = [], []
    for alg in algorithms:
        if (has_ca and "-cert-" in alg) or _plain_type(alg) in types:
            first.append(alg)
        else:
            last.append(alg)
    return first + last


def _plain_type(alg: str) -> bytes:
    """The known_hosts key type an algorithm uses: rsa-sha2-* and their certs are ssh-rsa."""
    base = alg.replace("-cert-v01@openssh.com", "").replace("-cert-v01", "")
    if base.startswith("rsa-sha2-") or base == "ssh-rsa":
        return b"ssh-rsa"
    if base.startswith("sk-ssh-ed25519"):
        return b"sk-ssh-ed25519@openssh.com"
    if base.startswith("sk-ecdsa-sha2-nistp256"):
        return b"sk-ecdsa-sha2-nistp256@openssh.com"
    return base.encode()
