"""Shared fixtures. SSH: a real sshd (session), a HOME that trusts it, a cuttable proxy to it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import faults
import pytest
import slurm
from sshd import (
    PROXY_ALIAS,
    SSHD,
    CuttableProxy,
    Fleet,
    SshHome,
    SshServer,
    make_ssh_home,
    start_host,
    start_impostor,
    start_sshd,
)

FLEET_HOSTS = ("gpu-a", "gpu-b", "gpu-c")


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


@pytest.fixture(scope="session")
def fleet_servers(
    sshd: SshServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, SshServer]]:
    """Three more real sshd "hosts", each in its own mount namespace with a private /tmp (so its
    own default lock, /tmp/tracedeck.lock) while they share the tests' directories (the home)."""
    base = tmp_path_factory.getbasetemp()
    servers: dict[str, SshServer] = {}
    try:
        for name in FLEET_HOSTS:
            servers[name] = start_host(tmp_path_factory.mktemp(name), sshd, base)
            faults.HOSTS[name] = servers[name].pid  # scanned after every fault scenario
        yield servers
    finally:
        for name, server in servers.items():
            faults.HOSTS.pop(name, None)
            server.stop()


@pytest.fixture
def fleet(ssh_home: SshHome, fleet_servers: dict[str, SshServer]) -> Iterator[Fleet]:
    """ssh_home reaching each fleet host by its name through a cuttable proxy (and directly as
    NAME-direct), trusting each host's own key."""
    proxies: dict[str, CuttableProxy] = {}
    try:
        for name, server in fleet_servers.items():
            proxy = proxies[name] = CuttableProxy(server.host, server.port).start()
            ssh_home.add_alias(name, proxy.port)
            ssh_home.add_alias(f"{name}-direct", server.port)
            with ssh_home.known_hosts.open("a") as f:
                f.write(server.known_hosts_line(proxy.port))
                f.write(server.known_hosts_line())
        yield Fleet(ssh_home, fleet_servers, proxies)
    finally:
        for proxy in proxies.values():
            proxy.stop()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[slurm.SlurmCluster]:
    """A real one-node Slurm cluster on this machine (slurm-wlm 22.05, munge)."""
    missing = slurm.missing()
    if missing:
        pytest.skip(f"no Slurm here ({', '.join(missing)}): apt-get install slurm-wlm munge")
    cluster = slurm.start_cluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """Keep each phase's report on the test, for the fault check to know how the test went."""
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    setattr(item, f"report_{report.when}", report)


@pytest.fixture(autouse=True)
def _fault_scenario_leaves_nothing(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test marked `fault` ran, passed or failed (and after its own fixtures ended): scan
    the hosts, this one and every fleet host in its own mount namespace, for anything of its
    runs still alive or any lock still held (tests/faults.py after_scenario)."""
    yield
    report = getattr(request.node, "report_call", None)
    if request.node.get_closest_marker("fault") is None or report is None or report.skipped:
        return
    faults.after_scenario(request.node.funcargs.get("tmp_path"))


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    tried = faults.INPUTS
    if tried["tried"]:
        terminalreporter.write_line(
            f"bad inputs: {tried['tried']} tried, {tried['handled']} handled, "
            f"{tried['tracebacks']} tracebacks"
        )
    tally = faults.TALLY
    if tally["scenarios"]:
        terminalreporter.write_line(
            f"fault harness: {tally['scenarios']} scenarios ended with their hosts scanned; "
            f"processes left alive: {tally['processes_left']}; locks left held: "
            f"{tally['locks_held']}"
        )
