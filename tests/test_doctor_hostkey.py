"""`tracedeck doctor` checks the target's host key as its own step, against a real sshd: the
known_hosts line that matches (the line OpenSSH's ssh-keygen -F finds), a key no line names,
a changed key; and a key judged before a failed login is still said (issue 24)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from runhelp import cli_env, tracedeck
from sshd import SshHome, SshServer, keygen

pytestmark = pytest.mark.ssh


def doctor(home: SshHome, tmp_path: Path) -> tuple[int, list[dict[str, str]], str]:
    """Doctor on the alias testbox: its exit code, the target's checks (JSON) and its text."""
    args = ("doctor", "--target", "testbox", "--out", str(tmp_path / "runs"))
    doc = tracedeck(*args, "--json", env=cli_env(home.path))
    text = tracedeck(*args, env=cli_env(home.path))
    assert doc.returncode == text.returncode, doc.stdout + text.stdout
    assert "Traceback" not in doc.stderr + text.stderr, doc.stderr + text.stderr
    return doc.returncode, json.loads(doc.stdout)["target_checks"], text.stdout


def step(checks: list[dict[str, str]], what: str) -> dict[str, str]:
    (found,) = [c for c in checks if c["what"] == what]
    return found


def name_of(server: SshServer) -> str:
    return f"[127.0.0.1]:{server.port}"


def test_a_known_host_key_names_the_line_that_matches(ssh_home: SshHome, tmp_path: Path) -> None:
    server = ssh_home.server
    with ssh_home.known_hosts.open("r+") as f:  # the match is on line 3, after two others
        line = f.read()
        f.seek(0)
        f.write(f"[127.0.0.1]:1 {line.split(' ', 1)[1]}# a comment\n{line}")
    found = subprocess.run(
        ["ssh-keygen", "-F", name_of(server), "-f", str(ssh_home.known_hosts)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert f"# Host {name_of(server)} found: line 3" in found, found  # OpenSSH's own finding
    code, checks, text = doctor(ssh_home, tmp_path)
    key = step(checks, "host key")
    assert key == {
        "level": "ok",
        "what": "host key",
        "text": f"known: 127.0.0.1:{server.port} presents ssh-ed25519 {server.fingerprint}, "
        f"listed for {name_of(server)} in {ssh_home.known_hosts}:3",
    }
    whats = [c["what"] for c in checks]
    assert whats.index("host key") < whats.index("reachable"), whats  # its own step, first
    assert f"  ok      host key: known: 127.0.0.1:{server.port}" in text


def test_an_unknown_host_key_is_a_problem_naming_the_name_looked_up(
    ssh_home: SshHome, tmp_path: Path
) -> None:
    server = ssh_home.server
    ssh_home.known_hosts.write_text(server.known_hosts_line(1))  # another port: another name
    code, checks, text = doctor(ssh_home, tmp_path)
    assert code == 3, text
    key = step(checks, "host key")
    assert key["level"] == "problem", key
    assert key["text"].startswith(f"not known: no line of {ssh_home.known_hosts}"), key
    assert f"names {name_of(server)}; " in key["text"]
    assert f"(ssh-ed25519 {server.fingerprint})" in key["text"]
    assert key["text"].endswith(f"run: tracedeck trust testbox:{server.port}"), key
    assert "reachable" not in [c["what"] for c in checks]  # nothing is connected to
    assert "PROBLEM host key: not known" in text


def test_a_changed_host_key_is_a_problem_naming_both_keys(
    ssh_home: SshHome, impostor: SshServer, tmp_path: Path
) -> None:
    server = ssh_home.server
    # the impostor's key listed under the real server's name: the server's own key "changed"
    ssh_home.known_hosts.write_text(impostor.known_hosts_line(server.port))
    code, checks, text = doctor(ssh_home, tmp_path)
    assert code == 3, text
    key = step(checks, "host key")
    assert key["level"] == "problem", key
    assert key["text"].startswith(f"changed: HOST KEY CHANGED for 127.0.0.1:{server.port}: ")
    assert f"the server presents ssh-ed25519 {server.fingerprint}" in key["text"]
    assert (
        f"known_hosts has ssh-ed25519 {impostor.fingerprint} in {ssh_home.known_hosts}:1"
        in key["text"]
    ), key
    assert f"ssh-keygen -R '{name_of(server)}'" in key["text"]
    assert "reachable" not in [c["what"] for c in checks]


def test_a_known_key_is_said_when_the_login_then_fails(ssh_home: SshHome, tmp_path: Path) -> None:
    server = ssh_home.server
    for suffix in ("", ".pub"):
        Path(f"{ssh_home.identity}{suffix}").unlink()
    keygen(ssh_home.identity, "not-authorised")  # a key the server does not let in
    code, checks, text = doctor(ssh_home, tmp_path)
    assert code == 3, text
    assert step(checks, "host key")["level"] == "ok"
    assert step(checks, "host key")["text"].startswith(f"known: 127.0.0.1:{server.port} ")
    reach = step(checks, "reachable")
    assert reach["level"] == "problem" and "public key authentication failed" in reach["text"]
