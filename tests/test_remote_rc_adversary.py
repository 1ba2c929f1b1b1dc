"""Hosts whose login shell's rc file misbehaves in ways test_remote_rc.py does not cover: text
with no trailing newline and bytes that are not UTF-8, a command whose own output looks like a
mark, and an rc that reads stdin."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import enter_ssh_home, rc_host
from sshd import SshServer

from runners.targets.base import Target, TargetError
from runners.targets.factory import parse_target

pytestmark = pytest.mark.ssh

T = TypeVar("T")
GUARD_S = 30.0  # far above any real wait: only there so a hang fails the test


async def guard(aw: Awaitable[T]) -> T:
    return await asyncio.wait_for(aw, GUARD_S)


# No newline at the end of either stream, and bytes that are not UTF-8 (half a euro sign at
# the very end, where the mark follows): without the mark the text runs into the first line.
RAGGED_RC = r"""printf 'Welcome to gpu-node-7 \377\376 4242'
printf 'module: rocm/6.2 loaded \342\202' >&2
unset BASH_ENV
"""

# An rc that asks something and waits for the answer on stdin.
READS_STDIN_RC = """read -r answer
echo "rc read [$answer]" >&2
unset BASH_ENV
"""


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SshServer]:
    with rc_host(tmp_path_factory.mktemp("ragged"), RAGGED_RC) as server:
        yield server


async def _connected(
    server: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Target]:
    enter_ssh_home(server, tmp_path / "home", monkeypatch)
    t = parse_target(server.spec)
    await guard(t.connect())
    try:
        yield t
    finally:
        await t.close()


@pytest.fixture
async def on_ragged(
    ragged: SshServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Target]:
    async for t in _connected(ragged, tmp_path, monkeypatch):
        yield t


async def test_unterminated_and_undecodable_rc_text_stays_out_of_every_answer(
    on_ragged: Target,
) -> None:
    result = await guard(on_ragged.run("echo 123; echo err >&2"))
    assert (result.exit_status, result.stdout, result.stderr) == (0, "123\n", "err\n")
    # with a timeout the command is wrapped once more (timeout(1)); the mark still comes first
    result = await guard(on_ragged.run("pwd", timeout=30))
    assert result.exit_status == 0 and result.stdout.startswith("/"), result
    assert result.stderr == ""


async def test_a_command_may_print_what_looks_like_a_mark(on_ragged: Target) -> None:
    """Only this command's own random mark counts, and only its first line."""
    words = "TRACEDECK-OUTPUT-0000000000000000"
    result = await guard(on_ragged.run(f"echo {words}; echo {words} >&2; echo last"))
    assert result.stdout == f"{words}\nlast\n" and result.stderr == f"{words}\n", result


async def test_a_stream_reads_its_own_first_line_after_unterminated_rc_text(
    on_ragged: Target,
) -> None:
    stream = await guard(on_ragged.open_stream("echo c; head -n 1"))
    try:
        assert await guard(stream.readline()) == b"c\n"
        stream.write(b"mine\n")
        assert await guard(stream.readline()) == b"mine\n"
        assert await guard(stream.readline()) == b""
    finally:
        await stream.close()


async def test_an_rc_that_reads_stdin_does_not_hold_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each command's stdin is at EOF from the start: the rc's `read` returns at once instead of
    holding the command forever (or, with a timeout, until tracedeck abandons it and says it
    'did not finish', of a command that never began)."""
    with rc_host(tmp_path / "host", READS_STDIN_RC) as server:
        async for t in _connected(server, tmp_path, monkeypatch):
            result = await guard(t.run("echo mine"))
            assert (result.exit_status, result.stdout, result.stderr) == (0, "mine\n", "")


async def test_an_rc_that_never_lets_the_command_start_is_not_blamed_on_the_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An rc held (a `module load` waiting on a dead license server, here a FIFO nobody
    writes) past a command's timeout: tracedeck said the command 'did not finish within 1 s
    ... (it may still be running there)' of a command that never began. It says the login
    shell did not start it."""
    hold, fifo = tmp_path / "hold", tmp_path / "fifo"
    os.mkfifo(fifo)
    with rc_host(
        tmp_path / "host", f"[ -e {hold} ] && read -r x < {fifo}\nunset BASH_ENV\n"
    ) as server:
        async for t in _connected(server, tmp_path, monkeypatch):
            hold.touch()  # from here on the rc waits (the connection was made before)
            with pytest.raises(TargetError) as caught:
                await guard(t.run("echo mine", timeout=1))
            said = str(caught.value)
            assert "did not start the command within 11 s" in said, said
            assert "never ran" in said and "did not finish" not in said, said
            hold.unlink()
            try:  # the held rc reads its line and its shell ends
                release = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader left: that shell already went with its channel
                pass
            else:
                os.write(release, b"go\n")
                os.close(release)
            result = await guard(t.run("echo mine", timeout=5))
            assert result.stdout == "mine\n", result
