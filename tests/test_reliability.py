"""Issue 10: no false pass, no escaped process, one writer per record, bounded memory, disk full.

Every scenario ends by checking that no process of the run is alive and the host lock is free.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import orjson
import pytest
from conftest import Where
from faults import assert_run_gone, grow_disk, lock_free, record_of, small_disk
from patience import patience
from runhelp import (
    ROOT,
    cli_env,
    events,
    held_engine,
    pid_alive,
    run_alive,
    run_dirs,
    spawn,
    tracedeck,
    wait_for,
    write_lines_preset,
)
from sshd import PROXY_ALIAS, CuttableProxy, SshHome, SshServer

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

SAMPLE = ROOT / "presets" / "samples" / "b3_12_mi300x.jsonl"


def readout_preset(tmp: Path, command: str) -> Path:
    path = tmp / "trace.toml"
    path.write_text(f"""
[preset]
name = "trace_end"
kind = "readout"
[target]
python = "{sys.executable}"
runs = "{tmp}/remote"
lock = "{tmp}/lock"
[engine]
command = "mkdir -p {{out}} && {command}"
[matrix]
n = [1]
[artifacts]
fetch = ["trace.jsonl"]
[traces]
follow = ["trace.jsonl"]
""")
    return path


# -- 1. the last line of a trace, without its newline -------------------------------------------


def test_a_last_line_without_newline_is_judged_not_dropped(where: Where, tmp_path: Path) -> None:
    """Issue 10.1: the run said OK while analyze on the same file said NO OK."""
    lines = SAMPLE.read_text().splitlines()
    trace = tmp_path / "src.jsonl"
    # prompt 1 (prefill + decode), then prompt 2's prefill as the last line, with no newline:
    # dropping it leaves a single prompt whose verdict reads differently.
    ok = orjson.loads(lines[0])
    decode = orjson.loads(lines[1])
    decode["top1_id"] = ok["top1_id"]
    trace.write_bytes(orjson.dumps(ok) + b"\n" + orjson.dumps(decode) + b"\n" + lines[2].encode())
    preset = readout_preset(tmp_path, f"cp {trace} {{out}}/trace.jsonl")
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(tmp_path / "out"),
        env=cli_env(where.home),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "RESULT: NO OK (exit 1)" in done.stdout and "no decode step" in done.stdout
    local = run_dirs(tmp_path / "out")[0]
    fetched = local / "trace.jsonl"
    again = tracedeck("analyze", str(fetched), env=cli_env(where.home))
    assert again.returncode == 1  # the run and analyze on its own file agree
    assert_run_gone(local)


def test_a_truncated_last_line_is_a_located_error(where: Where, tmp_path: Path) -> None:
    lines = SAMPLE.read_text().splitlines()
    trace = tmp_path / "src.jsonl"
    trace.write_text(lines[0] + "\n" + lines[1][:40])  # the writer was cut off mid-line
    preset = readout_preset(tmp_path, f"cp {trace} {{out}}/trace.jsonl")
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(tmp_path / "out"),
        env=cli_env(where.home),
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert re.search(r"trace\.jsonl:2: truncated last line at byte \d+", done.stdout)
    assert_run_gone(run_dirs(tmp_path / "out")[0])


# -- 6. processes that outlive their run ------------------------------------------------------------

ESCAPE = """
import os, sys, time
marker = sys.argv[1]
if os.fork() == 0:
    os.setsid()                 # leaves the run's process group
    with open(marker + ".part", "w") as fh:
        fh.write(str(os.getpid()))
    os.rename(marker + ".part", marker)
    time.sleep(300)
    sys.exit(0)
while not os.path.exists(marker):  # the run stops what is left once this command ends
    time.sleep(0.01)
"""


def test_a_child_that_leaves_the_group_is_still_the_runs_and_never_outlives_its_cell(
    where: Where, tmp_path: Path
) -> None:
    script = tmp_path / "escape.py"
    script.write_text(ESCAPE)
    marker = tmp_path / "escaped.pid"
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    out = tmp_path / "out"
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(out),
        "--set",
        f"engine.command='{sys.executable} {script} {marker}; sleep 0.1'",
        "--set",
        "matrix.n=[1]",
        env=cli_env(where.home),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    escaped = int(marker.read_text())
    assert re.search(r"left processes running after its command ended \(pids \d+", done.stdout)
    assert not pid_alive(escaped)  # killed at its cell's end, not left holding the lock
    assert_run_gone(run_dirs(out)[0])


def test_killing_the_group_leader_leaves_a_run_that_cancel_still_stops(
    where: Where, tmp_path: Path
) -> None:
    preset = write_lines_preset(tmp_path, lines=400, pause=0.05)
    env = cli_env(where.home)
    out = tmp_path / "out"
    console = spawn("run", str(preset), "--target", where.spec, "--out", str(out), env=env)
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: any(e["type"] == "output" for e in events(local)), what="output")
        pgid = int((Path(record_of(local)["remote_dir"]) / "pgid").read_text())
        seen = sum(e["type"] == "output" for e in events(local))
        os.kill(pgid, signal.SIGKILL)  # run.sh dies; the engine (its child) goes on
        # 60 more lines at 0.05 s each: the console kept following past its next alive check
        # (every 2 s), which must not take the lost leader for the run's end.
        wait_for(
            lambda: sum(e["type"] == "output" for e in events(local)) >= seen + 60,
            what="60 more output lines after the leader was killed",
        )
        assert run_alive(record_of(local)["run_id"])
        assert console.poll() is None
        cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        assert "already finished" not in cancel.stdout
        stdout, stderr = console.communicate(timeout=patience(60))
        assert console.returncode == 130, stdout + stderr
        assert_run_gone(local)
    finally:
        if console.poll() is None:
            console.kill()


def test_zombies_are_not_alive_and_are_not_killed(tmp_path: Path) -> None:
    from runners.launchers.detached import pids_command

    run_id = "zombie-check"
    # A parent outside the run that never reaps its marked child: the child stays a zombie.
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, subprocess, sys, time\n"
            f"env = dict(os.environ, TRACEDECK_RUN_ID='{run_id}')\n"
            "p = subprocess.Popen(['sh', '-c', 'exit 0'], env=env)\n"
            "print(p.pid, flush=True)\n"
            "time.sleep(30)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        wait_for(
            lambda: Path(f"/proc/{child}/stat").read_text().split(") ")[1][0] == "Z",
            what="a zombie",
        )
        listed = subprocess.run(["sh", "-c", pids_command(run_id)], capture_output=True, text=True)
        assert listed.stdout.split() == []
    finally:
        parent.kill()
        parent.wait()


# -- 7. the lock holder names its process group -------------------------------------------------


def test_lock_busy_names_the_holders_process_group(where: Where, tmp_path: Path) -> None:
    lock = tmp_path / "gpu.lock"
    slow = write_lines_preset(tmp_path, lines=1, pause=0, lock=lock)
    held, release = held_engine(tmp_path)  # the first run holds the lock until released
    env = cli_env(where.home)
    first = spawn(
        "run", str(slow), "--target", where.spec, "--out", str(tmp_path / "a"), *held, env=env
    )
    try:
        local_a = wait_for(lambda: run_dirs(tmp_path / "a"), what="first run dir")[0]
        wait_for(lambda: any(e["type"] == "lock_acquired" for e in events(local_a)), what="lock")
        pgid = Path(record_of(local_a)["remote_dir"], "pgid").read_text().strip()
        second = tracedeck(
            "run", str(slow), "--target", where.spec, "--out", str(tmp_path / "b"), env=env
        )
        assert second.returncode == 3, second.stdout + second.stderr
        assert f"pgid={pgid}" in second.stderr and "pgid=None" not in second.stderr
    finally:
        release.touch()
        out1, err1 = first.communicate(timeout=patience(120))
    assert first.returncode == 0, out1 + err1
    assert_run_gone(local_a)


# -- 2. two consoles on one run ------------------------------------------------------------------


def test_a_second_console_views_read_only_and_the_record_has_one_writer(
    where: Where, tmp_path: Path
) -> None:
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    held, release = held_engine(tmp_path)  # the run goes on until the second console is in
    env = cli_env(where.home)
    out = tmp_path / "out"
    first = spawn("run", str(preset), "--target", where.spec, "--out", str(out), *held, env=env)
    said = tmp_path / "second.err"
    second = None
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: any(e["type"] == "output" for e in events(local)), what="output")
        with said.open("w") as err:
            second = subprocess.Popen(
                [sys.executable, "-m", "console.cli", "attach", str(local)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )
        wait_for(lambda: "read-only" in said.read_text(), what="the second console to view")
        release.touch()
        out1, err1 = first.communicate(timeout=patience(120))
        out2, _ = second.communicate(timeout=patience(120))
    finally:
        release.touch()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
    assert first.returncode == 0, out1 + err1
    assert second.returncode == 0, out2 + said.read_text()
    evts = events(local)
    assert [e["type"] for e in evts].count("run_finished") == 1
    lines = [tuple(e["lines"]) + (e["end_offset"],) for e in evts if e["type"] == "output"]
    assert len(lines) == len(set(lines)), "an output batch was recorded twice"
    assert "RESULT: PASS (exit 0)" in out2
    assert_run_gone(local)


def test_a_cancel_from_another_terminal_is_a_cancel(where: Where, tmp_path: Path) -> None:
    preset = write_lines_preset(tmp_path, lines=400, pause=0.05)
    env = cli_env(where.home)
    out = tmp_path / "out"
    first = spawn("run", str(preset), "--target", where.spec, "--out", str(out), env=env)
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: any(e["type"] == "output" for e in events(local)), what="output")
        cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert cancel.returncode == 0, cancel.stdout + cancel.stderr
        # the following console records the end (it may have done so before cancel returned)
        assert "records its end" in cancel.stdout or "ended CANCELLED" in cancel.stdout
        out1, err1 = first.communicate(timeout=patience(60))
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, out1 + err1
    assert "RESULT: CANCELLED (exit 130)" in out1
    final = [e for e in events(local) if e["type"] == "run_finished"]
    assert len(final) == 1 and final[0]["verdict"] == "CANCELLED"
    assert_run_gone(local)


# -- 3. host keys: a host that is not the one trusted -------------------------------------------


def test_a_run_on_an_impostor_host_is_refused_before_anything_runs(
    impostor: SshServer, ssh_home: SshHome, tmp_path: Path
) -> None:
    with ssh_home.config.open("a") as f:
        f.write(
            f"\nHost gpu\n  HostName 127.0.0.1\n  Port {impostor.port}\n  User {impostor.user}\n"
            f"  IdentityFile {ssh_home.identity}\n  HostKeyAlias gpu\n"
        )
    trusted = ssh_home.server.known_hosts_line().split()[1:]
    # OpenSSH looks a HostKeyAlias up bare: `gpu`, never `[gpu]:port`.
    ssh_home.known_hosts.write_text(" ".join(["gpu", *trusted]) + "\n")
    preset = write_lines_preset(tmp_path, lines=3, pause=0.01)
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        "gpu",
        "--out",
        str(tmp_path / "o"),
        env=cli_env(ssh_home.path),
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "HOST KEY CHANGED" in done.stderr and impostor.fingerprint in done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "remote-runs").exists()  # nothing was written on the impostor
    assert lock_free(str(tmp_path / "gpu.lock"))


# -- 12. what the operator is told -------------------------------------------------------------


def test_a_trace_that_never_appears_is_named(where: Where, tmp_path: Path) -> None:
    preset = readout_preset(tmp_path, "echo no trace written")
    done = tracedeck(
        "run",
        str(preset),
        "--target",
        where.spec,
        "--out",
        str(tmp_path / "o"),
        env=cli_env(where.home),
    )
    assert done.returncode == 1, done.stdout + done.stderr  # no readout: never OK
    remote = record_of(run_dirs(tmp_path / "o")[0])["remote_dir"]
    assert f"trace file {where.spec}:{remote}/artifacts/trace.jsonl never appeared" in done.stdout


def test_a_cancel_that_records_the_end_numbers_cells_as_the_run_did(tmp_path: Path) -> None:
    """Issue 10.12: cancel printed [1/0] for the cells it recorded."""
    preset = write_lines_preset(tmp_path, lines=400, pause=0.05)
    env = cli_env(tmp_path)
    out = tmp_path / "out"
    first = spawn("run", str(preset), "--out", str(out), env=env)
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: any(e["type"] == "output" for e in events(local)), what="output")
    finally:
        first.kill()  # the console dies; the run goes on with nobody recording it
        first.wait()
    cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
    assert cancel.returncode == 0, cancel.stdout + cancel.stderr
    assert "/0]" not in cancel.stdout
    assert re.search(r"^\[[123]/3\] cancelled", cancel.stdout, re.M), cancel.stdout
    assert "ended CANCELLED" in cancel.stdout
    assert_run_gone(local)


# -- 10. a console killed during the launch -----------------------------------------------------

STUCK_LAUNCH = """
import asyncio, sys
from pathlib import Path
from runners.launchers.detached import DetachedLauncher
from runners.kinds import load_preset
from runners.run import Run

started = sys.argv[3] == "after"
real_start = DetachedLauncher.start

async def start(self, plan):
    if started:
        await real_start(self, plan)   # the run starts on the host ...
    print("LAUNCHING", flush=True)
    await asyncio.sleep(600)           # ... and the console is killed before it records so

DetachedLauncher.start = start

async def main():
    session = Run.create(load_preset(sys.argv[1]), "local", Path(sys.argv[2]), lambda e: None)
    await session.launch()

asyncio.run(main())
"""


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_console_killed_during_launch_is_told_apart_on_attach(tmp_path: Path, when: str) -> None:
    script = tmp_path / "stuck.py"
    script.write_text(STUCK_LAUNCH)
    preset = write_lines_preset(tmp_path, lines=3, pause=0.05)
    out = tmp_path / "out"
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(preset), str(out), when],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "LAUNCHING"
        proc.kill()
        proc.wait()
    finally:
        if proc.poll() is None:
            proc.kill()
    local = run_dirs(out)[0]
    attach = tracedeck("attach", str(local), env=env)
    if when == "before":
        assert attach.returncode == 3, attach.stdout + attach.stderr
        assert "RESULT: NOT_STARTED (exit 3)" in attach.stdout
        assert "the run never started" in attach.stdout
        assert "CRASHED" not in attach.stdout
    else:
        assert attach.returncode == 0, attach.stdout + attach.stderr
        assert "RESULT: PASS (exit 0)" in attach.stdout
    assert_run_gone(local)


# -- 9. a full disk on the console's side ----------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_stops_recording_with_a_located_error_and_attach_resumes(
    tmp_path: Path,
) -> None:
    preset = write_lines_preset(tmp_path, lines=8000, pause=0)
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    with small_disk(tmp_path / "small", "128k") as disk:
        out = disk / "out"
        done = tracedeck("run", str(preset), "--out", str(out), env=env, timeout=120)
        assert done.returncode == 3, done.stdout + done.stderr
        text = done.stdout + done.stderr
        assert "No space left on device" in text and str(out) in text
        assert "Traceback" not in text
        assert "tracedeck attach" in text
        local = run_dirs(out)[0]
        wait_for(lambda: not run_alive(record_of(local)["run_id"]), what="the run to end")
        grow_disk(disk, "64m")
        attach = tracedeck("attach", str(local), env=env, timeout=120)
        assert attach.returncode == 0, attach.stdout + attach.stderr
        assert "RESULT: PASS (exit 0)" in attach.stdout
        output = [line for e in events(local) if e["type"] == "output" for line in e["lines"]]
        assert len(output) == 3 * 8000 and len(set(output)) == len(output)
        assert_run_gone(local)


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_disk_during_a_fetch_is_infra_not_a_verdict_and_attach_fetches_it(
    where: Where, tmp_path: Path
) -> None:
    """Issue 10.9: a fetch that filled the disk read as the engine's failure."""
    preset = tmp_path / "big.toml"
    preset.write_text(f"""
[preset]
name = "big_artifact"
kind = "command"
[target]
runs = "{tmp_path}/remote"
lock = "{tmp_path}/lock"
[engine]
command = "mkdir -p {{out}} && head -c 3000000 /dev/zero > {{out}}/big{{n}}.bin"
[matrix]
n = [1]
[artifacts]
fetch = ["big{{n}}.bin"]
""")
    env = cli_env(where.home)
    with small_disk(tmp_path / "small", "1m") as disk:
        out = disk / "out"
        done = tracedeck("run", str(preset), "--target", where.spec, "--out", str(out), env=env)
        text = done.stdout + done.stderr
        assert done.returncode == 3, text
        local = run_dirs(out)[0]
        assert "No space left on device" in text and str(local / "big1.bin") in text
        assert "tracedeck attach" in text and "Traceback" not in text
        assert not (local / "big1.bin").exists()
        assert not list(local.glob("*.part"))  # no half-written file left behind
        grow_disk(disk, "64m")
        attach = tracedeck("attach", str(local), env=env)
        assert attach.returncode == 0, attach.stdout + attach.stderr
        assert "RESULT: PASS (exit 0)" in attach.stdout
        assert (local / "big1.bin").stat().st_size == 3_000_000
        fetched = [e for e in events(local) if e["type"] == "artifact"]
        assert [e["path"] for e in fetched] == ["big1.bin"]
        assert_run_gone(local)


# -- 8. a backlog of any size is read in bounded steps -------------------------------------------

BURST = """
import sys
line = "x" * 120
out = sys.stdout
for i in range(int(sys.argv[1]) // 1000):
    out.write("".join(f"{i * 1000 + j:09d} {line}\\n" for j in range(1000)))
"""

MEASURE = """
import resource, subprocess, sys
with open(sys.argv[1], "wb") as sink:
    done = subprocess.run(sys.argv[2:], stdout=sink, stderr=subprocess.STDOUT)
print(done.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
"""


def peak_rss_mib(tmp: Path, log: Path, *args: str, env: dict[str, str]) -> tuple[int, float]:
    """Run tracedeck in a fresh parent; (exit code, peak RSS of it and what it waited for)."""
    measure = tmp / "measure.py"
    measure.write_text(MEASURE)
    done = subprocess.run(
        [sys.executable, str(measure), str(log), sys.executable, "-m", "console.cli", *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=patience(600),
    )
    code, rss_kib = done.stdout.split()
    return int(code), int(rss_kib) / 1024


@pytest.mark.slow
def test_a_million_line_burst_and_its_attach_stay_under_200_mib(tmp_path: Path) -> None:
    lines = 1_000_000
    burst = tmp_path / "burst.py"
    burst.write_text(BURST)
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    out = tmp_path / "out"
    sets = ["--set", f"engine.command='{sys.executable} {burst} {lines}'", "--set", "matrix.n=[1]"]
    code, rss = peak_rss_mib(
        tmp_path, tmp_path / "run.log", "run", str(preset), "--out", str(out), *sets, env=env
    )
    assert code == 0, (tmp_path / "run.log").read_text()[-2000:]
    assert rss < 200, f"peak RSS {rss:.0f} MiB following a {lines}-line burst"
    local = run_dirs(out)[0]
    recorded = [line for e in events(local) if e["type"] == "output" for line in e["lines"]]
    assert len(recorded) == lines and recorded[-1].startswith(f"{lines - 1:09d}")
    # The console gone, the whole burst waits on the host: attach reads it in bounded steps.
    (local / "events.jsonl").write_bytes(
        b"".join(e + b"\n" for e in (local / "events.jsonl").read_bytes().splitlines()[:2])
    )
    code, rss = peak_rss_mib(tmp_path, tmp_path / "attach.log", "attach", str(local), env=env)
    assert code == 0, (tmp_path / "attach.log").read_text()[-2000:]
    assert rss < 200, f"peak RSS {rss:.0f} MiB attaching after a {lines}-line backlog"
    assert sum(len(e["lines"]) for e in events(local) if e["type"] == "output") == lines
    assert_run_gone(local)


# -- 5. Ctrl-C during the launch ----------------------------------------------------------------


@pytest.mark.ssh
@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_during_the_launch_never_leaves_a_run_unreported(
    ssh_home: SshHome, ssh_proxy: CuttableProxy, tmp_path: Path, presses: int
) -> None:
    preset = write_lines_preset(tmp_path, lines=200, pause=0.05)
    env = cli_env(ssh_home.path)
    out = tmp_path / "out"
    ssh_proxy.stall()  # the launch hangs on the link until resumed
    console = spawn("run", str(preset), "--target", PROXY_ALIAS, "--out", str(out), env=env)
    try:
        wait_for(lambda: ssh_proxy.accepted >= 1, what="the launch to reach the host")
        time.sleep(0.3)
        for _ in range(presses):
            console.send_signal(signal.SIGINT)
            time.sleep(0.3)
        ssh_proxy.resume()
        stdout, stderr = console.communicate(timeout=patience(120))
    finally:
        ssh_proxy.resume()
        if console.poll() is None:
            console.kill()
    assert console.returncode == 130, stdout + stderr
    if presses == 2:  # stopped before the host was reached: nothing started, and it says so
        assert "it never started on its target; nothing to cancel" in stderr, stderr
        run_id = re.search(r"launch of run (\S+)", stderr).group(1)  # type: ignore[union-attr]
        assert not run_alive(run_id)
        assert lock_free(str(tmp_path / "gpu.lock"))
        return
    local = run_dirs(out)[0]
    run_id = record_of(local)["run_id"]
    assert run_id in stderr and f"tracedeck cancel {local}" in stderr, stderr
    assert "RESULT: CANCELLED (exit 130)" in stdout
    assert_run_gone(local)
