"""Shared fixtures. SSH: a real sshd (session), a HOME that trusts it, a cuttable proxy to it."""

from __future__ import annotations

import ast
import contextlib
import signal
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


def enter_ssh_home(server: SshServer, path: Path, monkeypatch: pytest.MonkeyPatch) -> SshHome:
    """HOME set to a fresh dir at path whose ~/.ssh reaches server (alias testbox), trusting it."""
    home = make_ssh_home(server, path)
    monkeypatch.setenv("HOME", str(home.path))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)  # the operator's agent stays out of tests
    return home


@contextlib.contextmanager
def rc_host(d: Path, rc_text: str, sftp: str = "internal-sftp") -> Iterator[SshServer]:
    """A real sshd whose login shell reads rc_text before each command, stopped on leaving:
    through BASH_ENV, the rc a non-interactive bash reads, as bash run by sshd reads ~/.bashrc
    (an rc that unsets BASH_ENV speaks, like ~/.bashrc, in that shell alone, not in the engine's
    own shells)."""
    if not SSHD.exists():
        pytest.skip(f"{SSHD} is missing: install openssh-server to run the SSH tests")
    d.mkdir(parents=True, exist_ok=True)
    rc = d / "host.rc"
    rc.write_text(rc_text)
    server = start_sshd(d / "sshd", session_env=(f"BASH_ENV={rc}",), sftp=sftp)
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def ssh_home(sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> SshHome:
    """HOME set to a fresh dir whose ~/.ssh reaches the test sshd (alias testbox) and trusts it."""
    return enter_ssh_home(sshd, tmp_path / "home", monkeypatch)


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


# The programs the tests start must get Ctrl-C as an operator's terminal sends it. A suite started
# as a background job of a script (`cmd &` without job control) inherits SIGINT ignored, and an
# ignored signal stays ignored across exec: every `tracedeck run` a test starts would then
# ignore the Ctrl-C a test sends it. A Python handler here is reset to the default in them.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _sigint_stays_as_it_was() -> Iterator[None]:
    """A test that leaves this process's Ctrl-C handler changed (SIG_IGN above all) passes it to
    every program a later test starts: a `tracedeck run` that ignores Ctrl-C then launches
    anyway. Put back, and the test that did it fails, named."""
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before)
        raise AssertionError(
            f"this test left the test process's SIGINT handler {after!r} (was {before!r}); "
            "restore it before the test ends"
        )


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


def pytest_sessionfinish(session: pytest.Session) -> None:
    """On an xdist worker: hand its fault tallies to the main process (pytest_testnodedown)."""
    out = getattr(session.config, "workeroutput", None)
    if out is not None:
        out["fault_tally"] = dict(faults.TALLY)
        out["fault_inputs"] = dict(faults.INPUTS)


@pytest.hookimpl(optionalhook=True)  # an xdist hook: absent without xdist
def pytest_testnodedown(node: object, error: object) -> None:
    """In the main process: add a finished worker's fault tallies to this process's."""
    out = getattr(node, "workeroutput", {})
    for mine, theirs in ((faults.TALLY, out.get("fault_tally")), (faults.INPUTS, out.get("fault_inputs"))):  # fmt: skip
        for key, value in (theirs or {}).items():
            mine[key] += value


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


# Fixtures that start real servers or clusters, or draw the console: a test using one is e2e.
E2E_FIXTURES = frozenset(
    {
        "sshd",
        "impostor",
        "ssh_home",
        "ssh_proxy",
        "where",
        "fleet",
        "fleet_servers",
        "slurm_cluster",
        "snap_compare",
    }
)
E2E_MARKS = frozenset({"slow", "ssh", "slurm"})
# Calls that start a process or an app: the CLI (runhelp's tracedeck/spawn), any subprocess,
# a Textual app under Pilot, a preset started from the console.
LAUNCHERS = frozenset({"tracedeck", "spawn", "Popen", "run_test", "start_preset"})


def _launching(path: Path) -> set[str]:
    """Names of the module's functions that start a process or an app, directly or through
    another function of the module (async functions count: they drive the console)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    funcs = {
        n.name: n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    calls: dict[str, set[str]] = {}
    direct: set[str] = set()
    for name, fn in funcs.items():
        names: set[str] = set()
        for node in ast.walk(fn):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute):
                names.add(func.attr)
                if isinstance(func.value, ast.Name) and func.value.id == "subprocess":
                    direct.add(name)
            elif isinstance(func, ast.Name):
                names.add(func.id)
        calls[name] = names
        if names & LAUNCHERS or isinstance(fn, ast.AsyncFunctionDef):
            direct.add(name)
    found = set(direct)
    grew = True
    while grew:
        grew = False
        for name, names in calls.items():
            if name not in found and names & found:
                found.add(name)
                grew = True
    return found


def _uses_module_fixture(item: pytest.Item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    defs = info.name2fixturedefs.values() if info is not None else ()
    return any(d[-1].scope == "module" for d in defs if d)


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups (test_suite_groups.py)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark e2e every test that starts a real server, a process or the console app, or is
    marked slow/ssh/slurm, so the fast tier (`-m "not e2e"`) selects itself; put the Slurm
    tests on one worker (one cluster per machine: --dist loadgroup keeps an xdist_group
    together), and the tests of a module-scoped fixture on one worker too (each worker would
    build it again: the reference engine's runs took 74 s on each of three workers)."""
    launching: dict[Path, set[str]] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        marks = {m.name for m in item.iter_markers()}
        path = Path(str(item.fspath))
        if path not in launching:
            launching[path] = _launching(path) if path.suffix == ".py" else set()
        name = getattr(item, "originalname", item.name)
        started = launching[path]  # by the test itself, or by a fixture of its module
        if fixtures & E2E_FIXTURES or marks & E2E_MARKS or ({name} | fixtures) & started:
            item.add_marker(pytest.mark.e2e)
        if "slurm_cluster" in fixtures or "slurm" in marks:
            item.add_marker(pytest.mark.xdist_group("slurm"))
        elif _uses_module_fixture(item):
            item.add_marker(pytest.mark.xdist_group(path.stem))
