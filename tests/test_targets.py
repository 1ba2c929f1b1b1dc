"""Targets against the real thing: the local machine and a real OpenSSH sshd on loopback."""

from __future__ import annotations

import asyncio
import os
import shlex
import stat
import uuid
from collections.abc import AsyncIterator, Awaitable
from pathlib import Path
from typing import TypeVar

import pytest
from runhelp import pid_alive, wait_for
from sshd import CuttableProxy, SilentServer, SshHome, SshServer, free_port, keygen

from runners.targets.base import (
    ConnectionLost,
    HostKeyMismatch,
    HostKeyUnknown,
    Target,
    TargetError,
)
from runners.targets.factory import parse_target, ssh_config_aliases
from runners.targets.local import LocalTarget
from runners.targets.ssh import SshTarget
from runners.trust import fetch_host_key, trust_host

T = TypeVar("T")

# Far above any real wait here: only there so a hang fails the test instead of the suite.
GUARD_S = 30.0


async def guard(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, GUARD_S)


@pytest.fixture(params=["local", "ssh"])
async def target(request: pytest.FixtureRequest) -> AsyncIterator[Target]:
    if request.param == "local":
        t: Target = LocalTarget()
    else:
        server: SshServer = request.getfixturevalue("sshd")
        request.getfixturevalue("ssh_home")
        t = parse_target(server.spec)
    await guard(t.connect())
    yield t
    await t.close()


# -- both targets -----------------------------------------------------------------------------


async def test_run_reports_status_stdout_and_stderr(target: Target) -> None:
    result = await guard(target.run("echo out; echo err >&2; exit 3"))
    assert (result.exit_status, result.stdout, result.stderr) == (3, "out\n", "err\n")
    assert (await guard(target.run("true"))).exit_status == 0


async def test_run_has_sh_quoting(target: Target) -> None:
    weird = 'it\'s "quoted" $HOME `x` \\ ; | & ünï\nline2'
    result = await guard(target.run(f"printf %s {shlex.quote(weird)} | cat; printf '[%s]' $0"))
    assert result.stdout == weird + "[/bin/sh]"
    assert result.exit_status == 0


async def test_run_timeout_is_an_error(target: Target) -> None:
    with pytest.raises(TargetError, match="did not finish within"):
        await guard(target.run("sleep 3", timeout=0.3))
    assert (await guard(target.run("echo still-usable"))).stdout == "still-usable\n"


async def test_a_timed_out_command_leaves_nothing_running_on_the_target(
    target: Target, tmp_path: Path
) -> None:
    """Over SSH a timed-out command was abandoned and went on there (a host judge: 900 s)."""
    pidfile = tmp_path / "child.pid"
    with pytest.raises(TargetError, match="did not finish within 1 s and was killed"):
        await guard(target.run(f"sleep 60 & echo $! > {pidfile}; wait", timeout=1))
    pid = int(pidfile.read_text())
    wait_for(lambda: not pid_alive(pid), what=f"the timed-out command's child {pid} to be gone")


def test_the_login_shell_is_handed_one_sh_command_with_or_without_a_timeout() -> None:
    """A csh or fish login shell cannot read sh's if/then or >/dev/null 2>&1: whatever the
    timeout wrapping, the login shell sees `exec /bin/sh -c WORD` alone (tcsh failed with
    'Ambiguous output redirect' on every command given a timeout)."""
    from runners.targets.ssh import sh_command

    for timeout in (None, 0.3, 900):
        words = shlex.split(sh_command("echo 'a b' > x; exit 3", timeout))
        assert words[:3] == ["exec", "/bin/sh", "-c"] and len(words) == 4


async def test_a_command_that_exits_124_itself_is_no_timeout(target: Target) -> None:
    result = await guard(target.run("exit 124", timeout=20))
    assert result.exit_status == 124


async def test_write_file_replaces_by_rename_and_makes_parents(
    target: Target, tmp_path: Path
) -> None:
    path = tmp_path / "a" / "b" / "plan.json"
    await guard(target.write_file(str(path), b"first", mode=0o600))
    first_inode = path.stat().st_ino
    assert path.read_bytes() == b"first"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    await guard(target.write_file(str(path), b"second, longer", mode=0o755))
    assert path.read_bytes() == b"second, longer"
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert path.stat().st_ino != first_inode  # a new file renamed over, not rewritten in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["plan.json"]


async def test_read_from_offsets_and_missing_file(target: Target, tmp_path: Path) -> None:
    data = bytes(range(256)) * 4096  # 1 MiB: larger than one SFTP read
    path = tmp_path / "trace.bin"
    path.write_bytes(data)
    p = str(path)
    assert await guard(target.read_from(p, 0, 10)) == data[:10]
    assert await guard(target.read_from(p, 1000, 300)) == data[1000:1300]
    assert await guard(target.read_from(p, 0, len(data) + 5)) == data
    assert await guard(target.read_from(p, len(data) - 3, 100)) == data[-3:]
    assert await guard(target.read_from(p, len(data), 100)) == b""
    assert await guard(target.read_from(p, len(data) + 10, 100)) == b""
    assert await guard(target.read_from(p, 5, 0)) == b""
    assert await guard(target.read_from(str(tmp_path / "absent.jsonl"), 0, 100)) is None
    with path.open("ab") as f:  # a follower sees what was appended since
        f.write(b"tail\n")
    assert await guard(target.read_from(p, len(data), 100)) == b"tail\n"


async def test_download_renames_part_when_complete(target: Target, tmp_path: Path) -> None:
    remote = tmp_path / "remote" / "logits.bin"
    remote.parent.mkdir()
    remote.write_bytes(os.urandom(300_000))
    local = tmp_path / "fetched" / "cell-1" / "logits.bin"
    local.parent.mkdir(parents=True)
    local.with_name("logits.bin.part").write_bytes(b"stale partial")
    await guard(target.download(str(remote), local))
    assert local.read_bytes() == remote.read_bytes()
    assert sorted(p.name for p in local.parent.iterdir()) == ["logits.bin"]


async def test_download_of_missing_file_leaves_nothing(target: Target, tmp_path: Path) -> None:
    local = tmp_path / "fetched" / "x.bin"
    with pytest.raises(TargetError, match="absent.bin"):
        await guard(target.download(str(tmp_path / "absent.bin"), local))
    assert not local.exists()
    assert list(local.parent.iterdir()) == []


async def test_relative_paths_use_home_or_cwd(
    target: Target, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # local: relative to cwd; ssh: relative to the login home
    name = f"tracedeck-test-{uuid.uuid4().hex}.txt"
    try:
        await guard(target.write_file(name, b"relative\n"))
        assert await guard(target.read_from(name, 0, 100)) == b"relative\n"
        assert (await guard(target.run(f"cat {name}"))).stdout == "relative\n"
    finally:
        await guard(target.run(f"rm -f {name}"))


# -- ssh: links that fail ---------------------------------------------------------------------


async def test_cut_link_raises_connection_lost_on_every_call_then_reconnects(
    ssh_proxy: CuttableProxy, tmp_path: Path
) -> None:
    t = parse_target(ssh_proxy.spec)
    (tmp_path / "f").write_bytes(b"x")
    calls = {
        "run": lambda: t.run("true"),
        "read_from": lambda: t.read_from(str(tmp_path / "f"), 0, 10),
        "write_file": lambda: t.write_file(str(tmp_path / "g"), b"y"),
        "download": lambda: t.download(str(tmp_path / "f"), tmp_path / "h"),
    }
    try:
        for call in calls.values():
            await guard(t.connect())  # after a loss, connect() again on the same object
            assert (await guard(t.run("echo up"))).stdout == "up\n"
            ssh_proxy.cut()
            with pytest.raises(ConnectionLost, match=f"127.0.0.1:{ssh_proxy.port}"):
                await guard(call())
            with pytest.raises(ConnectionLost):  # and stays lost until reconnected
                await guard(t.run("true"))
        await guard(t.connect())
        assert (await guard(t.read_from(str(tmp_path / "f"), 0, 10))) == b"x"
    finally:
        await t.close()


async def test_silent_link_is_noticed_by_keepalive(ssh_proxy: CuttableProxy) -> None:
    t = SshTarget("127.0.0.1", ssh_proxy.port, keepalive_interval=0.2, keepalive_count_max=2)
    try:
        await guard(t.connect())
        ssh_proxy.stall()
        with pytest.raises(ConnectionLost):
            await guard(t.run("true"))
        ssh_proxy.resume()
        await guard(t.connect())
        assert (await guard(t.run("echo back"))).stdout == "back\n"
    finally:
        await t.close()


async def test_refused_connection_is_lost_until_resumed(ssh_proxy: CuttableProxy) -> None:
    t = parse_target(ssh_proxy.spec)
    ssh_proxy.pause()
    with pytest.raises(ConnectionLost, match="cannot connect"):
        await guard(t.connect())
    ssh_proxy.resume()
    await guard(t.connect())
    assert (await guard(t.run("echo ok"))).stdout == "ok\n"
    await t.close()


async def test_port_that_never_speaks_ssh_fails_within_connect_timeout(ssh_home: SshHome) -> None:
    silent = SilentServer()
    try:
        t = parse_target(f"ssh://127.0.0.1:{silent.port}", connect_timeout=0.5)
        with pytest.raises(ConnectionLost, match="no SSH answer"):
            await guard(t.connect())
    finally:
        silent.stop()


async def test_closed_port_is_connection_lost(ssh_home: SshHome) -> None:
    t = parse_target(f"ssh://127.0.0.1:{free_port()}", connect_timeout=2.0)
    with pytest.raises(ConnectionLost, match="cannot connect"):
        await guard(t.connect())
    with pytest.raises(ConnectionLost, match="not connected"):
        await guard(t.run("true"))


async def test_commands_beyond_the_channel_limit_queue_on_one_connection(
    sshd: SshServer, ssh_home: SshHome, tmp_path: Path
) -> None:
    t = parse_target(sshd.spec)
    await guard(t.connect())
    try:
        # sshd allows 10 sessions per connection (SFTP holds one); 12 at once must queue, not fail.
        results = await guard(asyncio.gather(*(t.run(f"sleep 0.2; echo {i}") for i in range(12))))
        assert [r.stdout for r in results] == [f"{i}\n" for i in range(12)]
        for i in range(30):
            (tmp_path / f"{i}.jsonl").write_text(f"line {i}\n")
        reads = await guard(
            asyncio.gather(*(t.read_from(str(tmp_path / f"{i}.jsonl"), 0, 99) for i in range(30)))
        )
        assert reads == [f"line {i}\n".encode() for i in range(30)]
    finally:
        await t.close()


async def test_a_session_refused_while_sshd_is_full_is_asked_for_again(
    sshd: SshServer, ssh_home: SshHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sshd frees a closed session's slot late; a refusal is asked for again, not a failure.
    All ten sessions held (SFTP and nine streams), a command is refused, pauses, and runs
    once a stream ends."""
    import runners.targets.ssh as ssh

    paused = asyncio.Event()
    sleep = asyncio.sleep

    async def pause(seconds: float) -> None:
        paused.set()
        await sleep(seconds)

    monkeypatch.setattr(ssh.asyncio, "sleep", pause)
    t = parse_target(sshd.spec)
    await guard(t.connect())
    streams = [await guard(t.open_stream("cat")) for _ in range(9)]
    try:
        command = asyncio.ensure_future(t.run("echo ran"))
        await guard(paused.wait())  # refused: sshd holds every session
        assert not command.done()
        await guard(streams.pop().close())
        assert (await guard(command)).stdout == "ran\n"
    finally:
        for stream in streams:
            await stream.close()
        await t.close()


async def _pauses(monkeypatch: pytest.MonkeyPatch) -> list[asyncio.Event]:
    """Events set by the SSH target's 1st, 2nd, ... pause before asking for a channel again."""
    import runners.targets.ssh as ssh

    events = [asyncio.Event() for _ in ssh.CHANNEL_RETRY_S]
    count = 0
    sleep = asyncio.sleep

    async def pause(seconds: float) -> None:
        nonlocal count
        events[min(count, len(events) - 1)].set()
        count += 1
        await sleep(seconds)

    monkeypatch.setattr(ssh.asyncio, "sleep", pause)
    return events


async def test_a_refused_command_whose_link_was_replaced_is_lost_at_once(
    sshd: SshServer, ssh_home: SshHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconnect during a refused command's pause: the command's link is gone, and the next
    refusal on it says so (a lost link to resume on), not a failure after every pause."""
    pauses = await _pauses(monkeypatch)
    t = parse_target(sshd.spec)
    await guard(t.connect())
    streams = [await guard(t.open_stream("cat")) for _ in range(9)]
    try:
        command = asyncio.ensure_future(t.run("echo ran"))
        await guard(pauses[0].wait())  # refused: sshd holds every session
        await guard(t.close())
        await guard(t.connect())  # another link now; the command's is closed
        with pytest.raises(ConnectionLost):
            await guard(command)
        assert not pauses[2].is_set()  # not asked for again on the closed link
        assert (await guard(t.run("echo again"))).stdout == "again\n"
    finally:
        for stream in streams:
            await stream.close()
        await t.close()


async def test_time_refused_is_not_counted_against_a_commands_timeout(
    sshd: SshServer, ssh_home: SshHome, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Refused for longer than its 1 s timeout, a command that then exits 124 on its own
    (timeout(1)'s code) is that exit, not 'killed by the host's timeout'."""
    pauses = await _pauses(monkeypatch)
    t = parse_target(sshd.spec)
    await guard(t.connect())
    streams = [await guard(t.open_stream("cat")) for _ in range(9)]
    try:
        command = asyncio.ensure_future(t.run("exit 124", timeout=1))
        await guard(pauses[4].wait())  # 0.75 s of pauses done and 0.8 s more begun: over 1 s
        await guard(streams.pop().close())
        result = await guard(command)
        assert result.exit_status == 124
    finally:
        for stream in streams:
            await stream.close()
        await t.close()


# -- ssh: host keys, auth, config -------------------------------------------------------------


async def test_unknown_host_is_refused_with_fingerprint_then_trusted(
    sshd: SshServer, ssh_home: SshHome
) -> None:
    ssh_home.known_hosts.write_text("")
    t = parse_target(sshd.spec)
    with pytest.raises(HostKeyUnknown) as info:
        await guard(t.connect())
    err = info.value
    assert (err.host, err.port) == ("127.0.0.1", sshd.port)
    assert err.fingerprint == sshd.fingerprint  # what `ssh-keygen -lf` says of the real key
    assert err.key_type == "ssh-ed25519"
    assert err.trust_command == f"tracedeck trust 127.0.0.1:{sshd.port}"
    assert err.trust_command in str(err) and sshd.fingerprint in str(err)
    assert ssh_home.known_hosts.read_text() == ""  # never trusted silently

    key_type, fp, line = await guard(fetch_host_key("127.0.0.1", sshd.port))
    assert (key_type, fp, line) == (
        "ssh-ed25519",
        sshd.fingerprint,
        sshd.known_hosts_line().strip(),
    )
    assert await guard(trust_host("127.0.0.1", sshd.port, expected_fingerprint=fp)) == fp
    assert ssh_home.known_hosts.read_text() == sshd.known_hosts_line()
    assert await guard(trust_host("127.0.0.1", sshd.port)) == fp  # already trusted: no-op
    assert ssh_home.known_hosts.read_text() == sshd.known_hosts_line()
    await guard(t.connect())
    assert (await guard(t.run("echo trusted"))).stdout == "trusted\n"
    await t.close()


async def test_unknown_alias_names_the_alias_in_the_trust_command(
    sshd: SshServer, ssh_home: SshHome
) -> None:
    ssh_home.known_hosts.unlink()
    with pytest.raises(HostKeyUnknown) as info:
        await guard(parse_target("testbox").connect())
    assert info.value.trust_command == f"tracedeck trust testbox:{sshd.port}"
    host, _, port = info.value.trust_command.split()[-1].partition(":")
    assert await guard(trust_host(host, int(port))) == sshd.fingerprint
    assert ssh_home.known_hosts.read_text() == sshd.known_hosts_line()
    t = parse_target("testbox")
    await guard(t.connect())
    await t.close()


async def test_trust_creates_ssh_dir_and_known_hosts_private(
    sshd: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    home = tmp_path / "bare-home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    assert await guard(trust_host("127.0.0.1", sshd.port)) == sshd.fingerprint
    assert stat.S_IMODE((home / ".ssh").stat().st_mode) == 0o700
    known = home / ".ssh" / "known_hosts"
    assert stat.S_IMODE(known.stat().st_mode) == 0o600
    assert known.read_text() == sshd.known_hosts_line()
    other = tmp_path / "elsewhere" / "kh"
    await guard(trust_host("127.0.0.1", sshd.port, other))
    assert other.read_text() == sshd.known_hosts_line()


async def test_changed_host_key_is_refused_and_not_overwritten(
    sshd: SshServer, ssh_home: SshHome, tmp_path: Path
) -> None:
    impostor = tmp_path / "old_host_key"
    keygen(impostor, "old")
    key_type, b64 = impostor.with_suffix(".pub").read_text().split()[:2]
    ssh_home.known_hosts.write_text(f"[127.0.0.1]:{sshd.port} {key_type} {b64}\n")
    before = ssh_home.known_hosts.read_text()
    with pytest.raises(HostKeyMismatch) as info:
        await guard(parse_target(sshd.spec).connect())
    message = str(info.value)
    assert "CHANGED" in message and sshd.fingerprint in message and "ssh-keygen -R" in message
    with pytest.raises(HostKeyMismatch):
        await guard(trust_host("127.0.0.1", sshd.port))
    assert ssh_home.known_hosts.read_text() == before


async def test_trust_refuses_a_key_other_than_the_one_shown(
    sshd: SshServer, ssh_home: SshHome
) -> None:
    ssh_home.known_hosts.write_text("")
    with pytest.raises(HostKeyMismatch, match="nothing was trusted"):
        await guard(trust_host("127.0.0.1", sshd.port, expected_fingerprint="SHA256:not-it"))
    assert ssh_home.known_hosts.read_text() == ""


async def test_alias_from_ssh_config(sshd: SshServer, ssh_home: SshHome) -> None:
    t = parse_target("testbox")
    await guard(t.connect())
    try:
        result = await guard(t.run("id -un; pwd"))
        assert result.stdout == f"{sshd.user}\n{os.path.expanduser('~' + sshd.user)}\n"
    finally:
        await t.close()


async def test_refused_key_names_user_and_keys_tried(sshd: SshServer, ssh_home: SshHome) -> None:
    ssh_home.identity.unlink()
    ssh_home.identity.with_suffix(".pub").unlink()
    keygen(ssh_home.identity, "not-authorised")
    with pytest.raises(TargetError) as info:
        await guard(parse_target("testbox").connect())
    assert not isinstance(info.value, ConnectionLost)
    message = str(info.value)
    assert f"user {sshd.user!r}" in message and "not-authorised" in message
    assert "authorized_keys" in message


async def test_missing_identity_file_is_named(ssh_home: SshHome) -> None:
    ssh_home.identity.unlink()
    with pytest.raises(TargetError, match="id_ed25519") as info:
        await guard(parse_target("testbox").connect())
    assert not isinstance(info.value, ConnectionLost)
    assert "IdentityFile" in str(info.value)


async def test_trust_writes_where_ssh_config_says_known_hosts_are(
    sshd: SshServer, ssh_home: SshHome, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "team_known_hosts"
    with ssh_home.config.open("a") as f:
        f.write(f"\nHost *\n  UserKnownHostsFile {elsewhere}\n")
    with pytest.raises(HostKeyUnknown):
        await guard(parse_target("testbox").connect())
    await guard(trust_host("testbox"))
    assert elsewhere.read_text() == sshd.known_hosts_line()
    t = parse_target("testbox")
    await guard(t.connect())
    await t.close()


# -- host keys are matched as OpenSSH matches them (issue 10.3) -------------------------------


def key_entry(name: str, pub: Path) -> str:
    key_type, b64 = pub.read_text().split()[:2]
    return f"{name} {key_type} {b64}\n"


def add_host(home: SshHome, name: str, *lines: str) -> None:
    with home.config.open("a") as f:
        f.write(f"\nHost {name}\n" + "".join(f"  {line}\n" for line in lines))


async def test_user_known_hosts_none_knows_no_host(sshd: SshServer, ssh_home: SshHome) -> None:
    """asyncssh takes `UserKnownHostsFile none` as "accept any key"; OpenSSH as "none known"."""
    add_host(ssh_home, "*", "UserKnownHostsFile none")
    with pytest.raises(TargetError, match="UserKnownHostsFile none") as info:
        await guard(parse_target("testbox").connect())
    assert "tracedeck trust testbox" in str(info.value)
    with pytest.raises(TargetError, match="UserKnownHostsFile none"):
        await guard(trust_host("testbox"))


async def test_a_key_listed_without_the_port_vouches_only_when_the_port_has_none(
    sshd: SshServer, ssh_home: SshHome, tmp_path: Path
) -> None:
    """OpenSSH's "found matching key w/out port": a bare entry counts when `[host]:port` lists
    nothing, never when it lists another key (tests/test_hostkey_parity.py has the full table)."""
    ssh_home.known_hosts.write_text(key_entry("127.0.0.1", sshd.host_key_pub))  # port 22's entry
    t = parse_target(sshd.spec)
    await guard(t.connect())
    await t.close()
    other = tmp_path / "other_host_key"
    keygen(other, "other")
    ssh_home.known_hosts.write_text(
        key_entry(f"[127.0.0.1]:{sshd.port}", other.with_suffix(".pub"))
        + key_entry("127.0.0.1", sshd.host_key_pub)
    )
    with pytest.raises(HostKeyMismatch, match="CHANGED"):
        await guard(parse_target(sshd.spec).connect())


async def test_a_key_listed_for_the_address_only_does_not_vouch_for_a_name(
    sshd: SshServer, ssh_home: SshHome
) -> None:
    add_host(
        ssh_home,
        "byname",
        "HostName localhost",
        f"Port {sshd.port}",
        f"User {sshd.user}",
        f"IdentityFile {ssh_home.identity}",
    )
    assert "[127.0.0.1]" in ssh_home.known_hosts.read_text()  # the address's entry, not the name's
    with pytest.raises(HostKeyUnknown) as info:
        await guard(parse_target("byname").connect())
    assert info.value.trust_command == f"tracedeck trust byname:{sshd.port}"


async def test_host_key_alias_is_the_only_name_looked_up(
    sshd: SshServer, ssh_home: SshHome
) -> None:
    add_host(
        ssh_home,
        "aliased",
        "HostName 127.0.0.1",
        f"Port {sshd.port}",
        f"User {sshd.user}",
        f"IdentityFile {ssh_home.identity}",
        "HostKeyAlias gpubox",
    )
    with pytest.raises(HostKeyUnknown):  # the [127.0.0.1]:port entry is not the alias's
        await guard(parse_target("aliased").connect())
    assert await guard(trust_host("aliased")) == sshd.fingerprint
    # OpenSSH looks the alias up bare, never as [gpubox]:port.
    assert key_entry("gpubox", sshd.host_key_pub) in ssh_home.known_hosts.read_text()
    t = parse_target("aliased")
    await guard(t.connect())
    await t.close()


async def test_check_host_ip_is_off_for_a_loopback_address(
    sshd: SshServer, ssh_home: SshHome, tmp_path: Path
) -> None:
    """OpenSSH turns CheckHostIP off for a local address; the refusal on a real address is in
    tests/test_hostkey_parity.py."""
    other = tmp_path / "other_host_key"
    keygen(other, "other")
    ssh_home.known_hosts.write_text(
        key_entry(f"[localhost]:{sshd.port}", sshd.host_key_pub)
        + key_entry(f"[127.0.0.1]:{sshd.port}", other.with_suffix(".pub"))
    )
    add_host(
        ssh_home,
        "checked",
        "HostName localhost",
        f"Port {sshd.port}",
        f"User {sshd.user}",
        f"IdentityFile {ssh_home.identity}",
        "CheckHostIP yes",
    )
    t = parse_target("checked")
    await guard(t.connect())
    await t.close()


async def test_an_impostor_on_a_trusted_name_is_refused_as_changed(
    sshd: SshServer, impostor: SshServer, ssh_home: SshHome
) -> None:
    """The impostor lets our client in: only the host-key check keeps the console away."""
    add_host(
        ssh_home,
        "gpu",
        "HostName 127.0.0.1",
        f"Port {impostor.port}",
        f"User {sshd.user}",
        f"IdentityFile {ssh_home.identity}",
        "HostKeyAlias gpu",
    )
    ssh_home.known_hosts.write_text(key_entry("gpu", sshd.host_key_pub))
    with pytest.raises(HostKeyMismatch, match="CHANGED") as info:
        await guard(parse_target("gpu").connect())
    assert impostor.fingerprint in str(info.value)


# -- parsing ----------------------------------------------------------------------------------


def test_parse_target_forms() -> None:
    assert isinstance(parse_target("local"), LocalTarget)
    t = parse_target("ssh://alice@gpu-7.lab:2222", connect_timeout=3.0, keepalive=1.0)
    assert isinstance(t, SshTarget)
    assert (t.host, t.port, t.username, t.name) == ("gpu-7.lab", 2222, "alice", t.name)
    assert t.name == "ssh://alice@gpu-7.lab:2222"
    assert (t.connect_timeout, t.keepalive_interval) == (3.0, 1.0)
    alias = parse_target("MI300X-box")
    assert isinstance(alias, SshTarget)
    assert (alias.host, alias.port, alias.username) == ("MI300X-box", None, None)
    plain = parse_target("ssh://gpu1")
    assert isinstance(plain, SshTarget)
    assert (plain.host, plain.port, plain.username) == ("gpu1", None, None)


@pytest.mark.parametrize(
    "spec",
    ["ssh://", "ssh://host:notaport", "ssh://host:0", "ssh://host:99999", "ssh://h/p", "a b", ""],
)
def test_parse_target_rejects_bad_specs(spec: str) -> None:
    with pytest.raises(ValueError, match="ssh://\\[user@\\]host\\[:port\\]") as info:
        parse_target(spec)
    assert repr(spec) in str(info.value)


def test_ssh_config_aliases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    ssh = tmp_path / ".ssh"
    (ssh / "conf.d").mkdir(parents=True)
    (ssh / "config").write_text(
        "# lab hosts\nInclude conf.d/*.conf\nHost gpu1 gpu2 *.lab !bad\n  User me\n"
        "Host=mi300x\n  HostName 10.0.0.7\nMatch host foo\n  User x\n"
        "Host *\n  ServerAliveInterval 5\n"
    )
    (ssh / "conf.d" / "extra.conf").write_text("host cluster-head # front node\n")
    assert ssh_config_aliases() == ["cluster-head", "gpu1", "gpu2", "mi300x"]
    assert ssh_config_aliases(tmp_path / "nope") == []
