"""The host-key step of `plan --check` and `tracedeck doctor`: what the SSH connection's own
check of the server's key found (runners.hostkeys, OpenSSH's rules), said on its own line:
the known_hosts line that matches, or that no line names the host, or that the key changed.

It reads the judgement the connection made rather than judging again, so the step can never
say "known" of a key the connection refused (or the other way round).
"""

from __future__ import annotations

from dataclasses import dataclass

from runners.hostkeys import Status, entries_for
from runners.targets.base import TargetError
from runners.targets.ssh import SshTarget
from runners.trust import read_known_hosts


@dataclass(frozen=True, slots=True)
class HostKeyStep:
    ok: bool | None  # True: known; False: refused (a problem); None: not checked (a warning)
    text: str


def host_key_step(target: SshTarget, connected: bool, error: TargetError | None) -> HostKeyStep:
    """The step for `target` after a connect that succeeded (`connected`) or raised `error`."""
    seen = target.host_key
    if seen is None:
        return HostKeyStep(None, f"not checked: {error or 'the host was not resolved'}")
    resolved, verdict = seen
    where = f"{resolved.host}:{resolved.port}"
    present = [str(p) for p in resolved.known_hosts if p.is_file()]
    looked = ", ".join(str(p) for p in resolved.known_hosts) or "none (UserKnownHostsFile none)"
    files = ", ".join(present) if present else f"the known_hosts files (none exists of {looked})"
    if verdict is None:
        if connected:  # asyncssh judged a host certificate against our @cert-authority lines
            return HostKeyStep(
                True, f"{where} presents a host certificate signed by a @cert-authority key "
                f"listed for {resolved.key_name} in {files}"
            )  # fmt: skip
        return HostKeyStep(None, f"not checked: {where} presented no key (see reachable)")
    key = f"{verdict.key.get_algorithm()} {verdict.key.get_fingerprint('sha256')}"
    if verdict.accepted:
        if verdict.localhost:
            return HostKeyStep(
                None, f"not checked: {where} presents {key}, and NoHostAuthenticationForLocalhost "
                "yes (~/.ssh/config) accepts any key on a loopback address"
            )  # fmt: skip
        name = verdict.without_port or verdict.name
        lines = [
            line
            for line in entries_for(read_known_hosts(resolved), name)
            if not line.marker and line.key.public_data == verdict.key.public_data
        ]
        listed = f" in {lines[0].where}" if lines else ""
        also = " (without the port, which OpenSSH accepts)" if verdict.without_port else ""
        return HostKeyStep(True, f"known: {where} presents {key}, listed for {name}{also}{listed}")
    if verdict.status is Status.NEW:
        return HostKeyStep(
            False, f"not known: no line of {files} names {verdict.name}; {error or ''}".rstrip()
        )
    word = "changed" if verdict.status is Status.CHANGED else verdict.status.value
    return HostKeyStep(False, f"{word}: {error or key}")
