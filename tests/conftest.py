"""Shared fixtures. SSH: a real sshd (session), a HOME that trusts it, a cuttable proxy to it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from sshd import (
    PROXY_ALIAS,
    SSHD,
    CuttableProxy,
    SshHome,
    SshServer,
    make_ssh_home,
    start_impostor,
    start_sshd,
)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A real OpenSSH sshd on 127.0.0.1, key auth only, for the current user."""
    if not SSHD.exists():
        pytest.skip(f"{SSHD} is missing: install openssh-server to run the SSH tests")
    server = start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def impostor(sshd: SshServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    """A second real sshd with an unknown host key that accepts the test client's key."""
    server = start_impostor(tmp_path_factory.mktemp("impostor"), sshd)
    try:
        yield server
    finally:
        server.stop()


@dataclass
class Where:
    """Where a run goes: the target spec and the HOME its console uses."""

    spec: str
    home: Path


@pytest.fixture(params=["local", "ssh"])
def where(request: pytest.FixtureRequest, tmp_path: Path) -> Where:
    """The local target, then the real sshd: one test, both transports."""
    if request.param == "local":
        home = tmp_path / "home"
        home.mkdir()
        return Where("local", home)
    ssh_home = request.getfixturevalue("ssh_home")
    return Where(ssh_home.server.spec, ssh_home.path)


@pytest.fixture
def ssh_home(sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SshHome:
    """HOME set to a fresh dir whose ~/.ssh reaches the test sshd (alias testbox) and trusts it."""
    home = make_ssh_home(sshd, tmp_path / "home")
    monkeypatch.setenv("HOME", str(home.path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # the operator's agent stays out of tests
    return home


@pytest.fixture
def ssh_proxy(sshd: SshServer, ssh_home: SshHome) -> Iterator[CuttableProxy]:
    """A cuttable TCP proxy to the test sshd; ssh_home trusts it and names it `testbox-proxy`."""
    proxy = CuttableProxy(sshd.host, sshd.port).start()
    ssh_home.add_alias(PROXY_ALIAS, proxy.port)
    ssh_home.trust(proxy.port)
    try:
        yield proxy
    finally:
        proxy.stop()
