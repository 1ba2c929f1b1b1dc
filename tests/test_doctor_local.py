"""`tracedeck doctor` on this machine says what it found, not what it assumed (issue 24)."""

from __future__ import annotations

from pathlib import Path

from runhelp import cli_env, tracedeck


def test_doctor_says_an_absent_ssh_config_is_absent_and_counts_the_aliases_of_one(
    tmp_path: Path,
) -> None:
    home = tmp_path / "home"
    home.mkdir()
    args = ("doctor", "--out", str(tmp_path / "runs"))
    done = tracedeck(*args, env=cli_env(home))
    config = home / ".ssh" / "config"
    line = next(li for li in done.stdout.splitlines() if "ssh config:" in li)
    assert (
        line == f"  ok      ssh config: {config} is absent: no host aliases (ssh://USER@HOST works)"
    )
    config.parent.mkdir()
    config.write_text("Host a b\n  HostName 10.0.0.1\nHost *.lab\n  User x\nHost c\n  Port 2\n")
    done = tracedeck(*args, env=cli_env(home))
    line = next(li for li in done.stdout.splitlines() if "ssh config:" in li)
    assert line == f"  ok      ssh config: 3 host alias(es) in {config}", line
