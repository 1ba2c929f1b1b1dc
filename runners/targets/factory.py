"""Turn a target spec ("local", "ssh://user@host:port", an ssh alias) into a Target."""

from __future__ import annotations

import glob
import re
import shlex
from pathlib import Path
from urllib.parse import urlsplit

from runners.targets.base import Target
from runners.targets.local import LocalTarget

ACCEPTED_FORMS = (
    "'local', 'ssh://[user@]host[:port]', a host or alias from ~/.ssh/config, "
    "'slurm://LOGIN-HOST[/PARTITION]', or several hosts as 'a,b' (a fleet)"
)
SLURM = "slurm://"
# A Slurm login node named so is this machine: sbatch runs here, not over SSH.
LOCAL_NAMES = ("local", "localhost", "127.0.0.1")
_PARTITION = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
_USER = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*\$?")


def slurm_spec(spec: str) -> tuple[str, str] | None:
    """slurm://LOGIN[/PARTITION] as (the login node's target spec, partition or ""), or None
    when spec is not a Slurm URL. LOGIN is local/localhost (sbatch here) or an SSH host."""
    text = spec.strip()
    if not text.startswith(SLURM):
        return None
    rest = text[len(SLURM) :]
    login, _, partition = rest.partition("/")
    if not login:
        raise _bad(spec, "no login host (slurm://localhost/PARTITION runs sbatch here)")
    if "/" in partition or (partition and not _PARTITION.fullmatch(partition)):
        raise _bad(spec, f"{partition!r} is not a partition name")
    if login in LOCAL_NAMES:
        return "local", partition
    # With a port it is an ssh:// URL; else a host, user@host or alias as ssh_config knows it.
    login_spec = f"ssh://{login}" if ":" in login else login
    parse_target(login_spec)  # the same checks as any SSH target
    return login_spec, partition


def parse_target(spec: str, *, connect_timeout: float = 10.0, keepalive: float = 5.0) -> Target:
    """The target a spec names; ValueError naming the spec and the accepted forms when it is bad.

    For a Slurm URL this is its login node (where sbatch, squeue and scancel run)."""
    text = spec.strip()
    slurm = slurm_spec(text)
    if slurm is not None:
        text = slurm[0]
    if "," in text:
        raise _bad(spec, "a list of hosts is a fleet, not one target")
    if text == "local":
        return LocalTarget()
    if text.startswith("ssh://"):
        host, port, user = _parse_ssh_url(spec, text)
    else:
        user, _, host = text.rpartition("@")
        if not _NAME.fullmatch(host) or (user and not _USER.fullmatch(user)):
            raise _bad(spec, "not a host name or ~/.ssh/config alias")
        port = None
    # asyncssh (a tenth of a second to import) only where a target is reached over SSH
    from runners.targets.ssh import SshTarget

    return SshTarget(
        host,
        port,
        user or None,
        connect_timeout=connect_timeout,
        keepalive_interval=keepalive,
    )


def _parse_ssh_url(spec: str, text: str) -> tuple[str, int | None, str]:
    parts = urlsplit(text)
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise _bad(spec, "a path, query or fragment is not allowed")
    if parts.password is not None:
        raise _bad(spec, "passwords are not accepted; use a key")
    try:
        port = parts.port
    except ValueError:
        raise _bad(spec, "the port must be a number from 1 to 65535") from None
    if port == 0:
        raise _bad(spec, "the port must be a number from 1 to 65535")
    host = parts.hostname or ""
    if not host:
        raise _bad(spec, "no host")
    netloc_host = parts.netloc.rpartition("@")[2]
    if not netloc_host.startswith("[") and not _NAME.fullmatch(host):
        raise _bad(spec, f"{host!r} is not a host name")
    user = parts.username
    if user is not None and not _USER.fullmatch(user):
        raise _bad(spec, f"{user!r} is not a user name")
    # urlsplit lowercases the host; keep it as written (aliases are case-sensitive).
    written = netloc_host.rsplit(":", 1)[0] if not netloc_host.startswith("[") else host
    return written, port, user or ""


def _bad(spec: str, why: str) -> ValueError:
    return ValueError(f"bad target {spec!r}: {why}. Use {ACCEPTED_FORMS}.")


def ssh_config_aliases(config: Path | None = None) -> list[str]:
    """Host names declared in ~/.ssh/config (and files it Includes), without wildcard patterns."""
    path = config if config is not None else Path("~/.ssh/config").expanduser()
    seen: dict[str, None] = {}
    _collect_aliases(path, seen, depth=0)
    return list(seen)


def _collect_aliases(path: Path, seen: dict[str, None], depth: int) -> None:
    if depth > 8:
        return
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in lines:
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        keyword, rest = (re.split(r"\s*=\s*|\s+", stripped, maxsplit=1) + [""])[:2]
        try:
            words = shlex.split(rest, comments=True)
        except ValueError:
            words = rest.split()
        if keyword.lower() == "host":
            for word in words:
                if not any(c in word for c in "*?!") and word not in seen:
                    seen[word] = None
        elif keyword.lower() == "include":
            for pattern in words:
                full = Path(pattern).expanduser()
                if not full.is_absolute():
                    full = Path("~/.ssh").expanduser() / full
                for found in sorted(glob.glob(str(full))):
                    _collect_aliases(Path(found), seen, depth + 1)
