"""Process ownership and concurrency, attacked by an adversarial tester (each failed before its
fix): an interrupted cancel left the runner stopped holding the lock; a cancel asked during the
launch was ignored and the run passed; looking at a lock made a launch LOCK_BUSY; a NOT_JUDGED
end was taken for the run's; a reused runner pid kept a dead run alive, or had its group
signalled. A fleet host lost while its batch ran is kept by prune (a real two-host fleet)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from faults import host_path, lock_free, record_of
from patience import patience
from runhelp import (
    ROOT,
    cli_env,
    events,
    pid_alive,
    run_dirs,
    spawn,
    tracedeck,
    wait_for,
    write_lines_preset,
)
from sshd import Fleet
from test_fleet import lines_preset, members

from console.cancel_cmd import cancel_run
from console.headless import Printer


def slow_term(gate: Path) -> str:
    """A cell that obeys a TERM only once `gate` exists (a process flushing its state)."""
    return (
        f"trap 'echo got-term >&2; while [ ! -e {gate} ]; do sleep 0.05; done; exit 0' TERM; "
        "echo up; while :; do sleep 0.1; done"
    )


def _state(pid: int) -> str:
    try:
        stat = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return ""
    return stat[stat.rfind(b")") + 2 :].split()[0].decode()


def _start_run(tmp: Path, env: dict[str, str], command: str) -> tuple[subprocess.Popen, Path]:
    preset = write_lines_preset(tmp, lines=1, pause=0)
    out = tmp / "out"
    console = subprocess.Popen(
        [sys.executable, "-m", "console.cli", "run", str(preset), "--target", "local",
         "--out", str(out), "--set", f"engine.command={command!r}", "--set", "matrix.n=[1]"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # a terminal's Ctrl-C goes to its whole process group
    )  # fmt: skip
    local = wait_for(lambda: run_dirs(out), what="run dir")[0]
    wait_for(lambda: any(e["type"] == "output" for e in events(local)), what="output")
    return console, local


def _cleanup(local: Path, env: dict[str, str], *procs: subprocess.Popen | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                if os.getpgid(proc.pid) == proc.pid:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.kill()
            proc.communicate()
    runner = Path(record_of(local)["remote_dir"]) / "pgid"
    if runner.exists():  # whatever the test left: KILL the run's group (a stopped one too)
        with contextlib.suppress(ProcessLookupError, ValueError, OSError):
            pid = int(runner.read_text())
            if b"run.sh" in Path(f"/proc/{pid}/cmdline").read_bytes():
                os.killpg(pid, signal.SIGKILL)
    tracedeck("cancel", str(local), "--grace", "1", env=env)


def test_ctrl_c_on_tracedeck_cancel_never_leaves_the_runner_stopped_holding_the_lock(
    tmp_path: Path,
) -> None:
    """`tracedeck cancel` STOPs the runner first; a Ctrl-C while it waits out the grace kills
    the cancel script (LocalTarget.run SIGKILLs its group on CancelledError) before it KILLs or
    continues the runner: the runner stays stopped (state T) for ever, holding the host lock;
    the run never ends and no later run can take the lock."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    gate = tmp_path / "flushed"
    console, local = _start_run(tmp_path, env, slow_term(gate))
    cancel = None
    try:
        console.kill()  # nobody follows: the run goes on alone
        console.communicate()
        runner = int((Path(record_of(local)["remote_dir"]) / "pgid").read_text())
        cancel = spawn("cancel", str(local), "--grace", "30", env=env)
        err = Path(record_of(local)["remote_dir"]) / "cells" / "000" / "stderr.log"
        wait_for(lambda: err.exists() and "got-term" in err.read_text(), what="the TERM")
        assert _state(runner) == "T"  # the cancel stopped the runner, waits for the cell
        cancel.send_signal(signal.SIGINT)  # the operator gives up waiting
        cancel.communicate(timeout=patience(30))
        gate.touch()  # the cell obeys its TERM now. Then the run must be over (cancelled) or
        # going on: never a stopped runner holding the GPU's lock.
        wait_for(
            lambda: lock_free(str(tmp_path / "gpu.lock")),
            timeout=patience(60),
            what=f"the lock to be freed (runner {runner} state {_state(runner)!r})",
        )
        # the cancel that finished on its own removed its output file (it was left behind)
        run_dir = Path(record_of(local)["remote_dir"])
        wait_for(lambda: not list(run_dir.glob(".cancel.*")), what="no .cancel.* left")
    finally:
        gate.touch()
        _cleanup(local, env, console, cancel)


def test_cancel_says_when_the_console_holding_the_record_is_stopped(tmp_path: Path) -> None:
    """A console suspended (Ctrl-Z) keeps the record's lock: `cancel` said the console
    following the run records its end, and nothing did while it stayed stopped. It names the
    stopped console and how to let it go on; once it goes on, it records the cancel."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    console, local = _start_run(tmp_path, env, "echo up; while :; do sleep 0.1; done")
    try:
        os.kill(console.pid, signal.SIGSTOP)
        wait_for(lambda: _state(console.pid) == "T", what="the console stopped")
        done = tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"(pid {console.pid}) is stopped" in done.stdout, done.stdout
        assert f"kill -CONT {console.pid}" in done.stdout
        # the runs screen's cancel (the same cancel_run) hears it too, for its notification
        said: list[str] = []
        asyncio.run(cancel_run(local, 1.0, Printer(out=io.StringIO()), said.append))
        assert any(f"(pid {console.pid}) is stopped" in line for line in said), said
        os.kill(console.pid, signal.SIGCONT)
        console.communicate(timeout=patience(60))
        [end] = [e for e in events(local) if e["type"] == "run_finished"]
        assert end["verdict"] == "CANCELLED", end
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(console.pid, signal.SIGCONT)
        _cleanup(local, env, console)


def test_a_second_ctrl_c_detaches_and_the_run_goes_on_not_stopped(tmp_path: Path) -> None:
    """README: the first Ctrl-C cancels, 'Ctrl-C again to detach and leave it running'. The
    second one ends asyncio.run while the cancel task still waits: its script is SIGKILLed with
    the runner STOPPED. The run neither goes on nor ends: stopped, lock held, for ever."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    gate = tmp_path / "flushed"
    console, local = _start_run(tmp_path, env, slow_term(gate))
    try:
        runner = int((Path(record_of(local)["remote_dir"]) / "pgid").read_text())
        err = Path(record_of(local)["remote_dir"]) / "cells" / "000" / "stderr.log"
        os.killpg(console.pid, signal.SIGINT)  # Ctrl-C: cancel
        wait_for(lambda: err.exists() and "got-term" in err.read_text(), what="the TERM")
        os.killpg(console.pid, signal.SIGINT)  # Ctrl-C again: detach
        stdout, stderr = console.communicate(timeout=patience(60))
        # (the cancel's grace, 5 s, may have run out on a busy machine: then it said so)
        assert "detached; " in stderr, stderr
        gate.touch()
        wait_for(
            lambda: lock_free(str(tmp_path / "gpu.lock")),
            timeout=patience(60),
            what=f"the run to end and free its lock (runner {runner} state {_state(runner)!r})",
        )
    finally:
        gate.touch()
        _cleanup(local, env, console)


def test_a_cancel_asked_while_the_run_is_being_launched_is_not_ignored(tmp_path: Path) -> None:
    """`tracedeck cancel` while the launching console is between its upload and its start
    (here: while [engine] version_command answers). The cancel finds nothing running, touches
    RUN_DIR/cancel and says 'the console following run X records its end'; the launch then
    starts the run anyway (launch.sh never looks at the cancel file, a run on one host never
    at the local cancel mark): the run the operator cancelled runs to a PASS."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    preset = write_lines_preset(tmp_path, lines=3, pause=0.05)
    gate, asked = tmp_path / "gate", tmp_path / "asked"
    version = f"touch {asked}; while [ ! -e {gate} ]; do sleep 0.05; done; echo v1"
    out = tmp_path / "out"
    console = spawn(
        "run", str(preset), "--target", "local", "--out", str(out),
        "--set", f"engine.version_command={version!r}", env=env,
    )  # fmt: skip
    try:
        wait_for(asked.exists, what="the launch to ask the engine's version")
        local = run_dirs(out)[0]
        cancel = tracedeck("cancel", str(local), "--grace", "1", env=env)
        gate.touch()
        stdout, stderr = console.communicate(timeout=patience(120))
        said = cancel.stdout + cancel.stderr
        # What should happen: the run is cancelled (never started, or stopped at once), or the
        # cancel says it could not stop it. Never a cancel taken and then a pass.
        assert console.returncode != 0 or cancel.returncode != 0, (said, stdout)
    finally:
        gate.touch()
        if console.poll() is None:
            console.kill()
            console.communicate()


def test_looking_at_a_free_lock_never_makes_a_launch_lock_busy(tmp_path: Path) -> None:
    """`tracedeck status` (the Runs screen's f5, `plan --check`, `doctor`) asks who holds a host's
    lock by TAKING it (launchers.detached.lock_state: `flock -n -s LOCK true`); a fleet host waiting for
    its lock does the same exclusively (Scheduler.lock_free). A launch whose `flock -n 9` falls
    in that instant is refused LOCK_BUSY, naming as holder the last run in LOCK.json (one long
    over). Here the probe runs in a loop, as several operators' status screens would."""
    import asyncio
    import threading

    from runners.launchers.detached import lock_state
    from runners.targets.local import LocalTarget

    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    lock = tmp_path / "gpu.lock"
    preset = write_lines_preset(tmp_path, lines=1, pause=0, lock=lock)
    first = tracedeck("run", str(preset), "--out", str(tmp_path / "o0"), env=env)
    assert first.returncode == 0, first.stdout + first.stderr  # a past holder is on record
    stop = threading.Event()

    def look() -> None:
        async def loop() -> None:
            target = LocalTarget()
            while not stop.is_set():
                await lock_state(target, str(lock))

        asyncio.run(loop())

    looker = threading.Thread(target=look, daemon=True)
    looker.start()
    refused = []
    try:
        for i in range(1, 5):
            done = tracedeck("run", str(preset), "--out", str(tmp_path / f"o{i}"), env=env)
            if done.returncode != 0:
                refused.append(done.stderr.strip().splitlines()[-1:])
    finally:
        stop.set()
        looker.join()
    assert not refused, f"{len(refused)} of 4 launches on a free lock were refused: {refused}"


def test_a_lock_look_says_absent_free_and_held(tmp_path: Path) -> None:
    """The look takes a shared flock for an instant (the kernel's table of locks is not to be
    trusted: a container leaves out a lock whose taker exited, an overlay names another
    device); a launch meeting it retries."""
    import asyncio

    from runners.launchers.detached import lock_state
    from runners.targets.local import LocalTarget

    lock = tmp_path / "gpu.lock"
    assert asyncio.run(lock_state(LocalTarget(), str(lock)))[0] == "absent"
    lock.touch()
    assert asyncio.run(lock_state(LocalTarget(), str(lock)))[0] == "free"
    holder = subprocess.Popen(["flock", str(lock), "sleep", "300"], start_new_session=True)
    try:
        wait_for(lambda: not lock_free(str(lock)), what="the lock to be held")
        assert asyncio.run(lock_state(LocalTarget(), str(lock)))[0] == "held"
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


FAILING_CONSOLE = """
import sys
from runners.follower import RunFollower
from console.cli import main

real, calls = RunFollower.poll, [0]

async def poll(self):
    calls[0] += 1
    if calls[0] == 20:  # a bug of tracedeck's own while following (anything unexpected)
        raise RuntimeError("injected: tracedeck itself failed here")
    return await real(self)

RunFollower.poll = poll
sys.exit(main(sys.argv[1:]))
"""


def test_after_a_not_judged_end_attach_follows_and_prune_keeps_the_live_run(
    tmp_path: Path,
) -> None:
    """When following raises what nothing expected, the record ends NOT_JUDGED saying 'The run
    goes on on local; reattach: tracedeck attach DIR' (runners/run.py _following_failed). But
    attach folds that recorded RunFinished as the run's end (runners/run.py attach skips only
    DISCONNECTED) and prints NOT_JUDGED without following; prune and status take NOT_JUDGED
    for an ending (runners/prune.py NOT_ENDINGS): prune deletes the live run's record and its
    remote directory."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    script = tmp_path / "failing.py"
    script.write_text(FAILING_CONSOLE)
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    gate = tmp_path / "gate"
    engine = f"echo up; while [ ! -e {gate} ]; do sleep 0.05; done; echo released"
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, str(script), "run", str(preset), "--out", str(out),
         "--set", f"engine.command={engine!r}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=patience(120),
    )  # fmt: skip
    assert "NOT_JUDGED" in done.stdout + done.stderr, done.stdout + done.stderr
    local = run_dirs(out)[0]
    remote = Path(record_of(local)["remote_dir"])
    try:
        problems = []
        dry = tracedeck("prune", "--out", str(out), "--keep", "0", env=env)  # a dry run
        status = tracedeck("status", "--out", str(out), env=env)
        attach = spawn("attach", str(local), env=env)
        gate.touch()
        a_out, a_err = attach.communicate(timeout=patience(60))
        if attach.returncode != 0 or "RESULT: PASS" not in a_out:
            problems.append(
                f"attach did not follow the run on: rc {attach.returncode}: {a_out[-300:]}"
            )
        if "live" not in dry.stdout:
            problems.append(f"prune would delete the live run: {dry.stdout}")
        if not status.stdout.startswith("STATE") or "\nlive" not in status.stdout:
            problems.append(f"status does not call it live: {status.stdout}")
        assert not problems, "\n---\n".join(problems)
    finally:
        gate.touch()
        tracedeck("cancel", str(local), "--grace", "1", env=env)
        assert remote.exists()


def test_two_viewers_take_over_a_killed_writer_once_and_lose_no_line(tmp_path: Path) -> None:
    """Two `attach` view a run read-only; its console is SIGKILLed mid-cell: one viewer takes
    the writing over, the other keeps viewing; the record ends once, no output line twice or
    lost, both print the pass."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    preset = write_lines_preset(tmp_path, lines=60, pause=0.05)
    out = tmp_path / "out"
    first = spawn("run", str(preset), "--out", str(out), env=env)
    viewers: list[subprocess.Popen] = []
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(lambda: any(e["type"] == "output" for e in events(local)), what="output")
        errs = [tmp_path / f"v{i}.err" for i in range(2)]
        for err in errs:
            with err.open("w") as fh:
                viewers.append(subprocess.Popen(
                    [sys.executable, "-m", "console.cli", "attach", str(local)], cwd=ROOT,
                    env=env, stdout=subprocess.PIPE, stderr=fh, text=True))  # fmt: skip
        for err in errs:
            wait_for(lambda err=err: "read-only" in err.read_text(), what="viewing")
        first.kill()
        first.communicate()
        outs = [v.communicate(timeout=patience(120))[0] for v in viewers]
    finally:
        for proc in (first, *viewers):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    evts = events(local)
    assert [e["type"] for e in evts].count("run_finished") == 1
    lines = [ln for e in evts if e["type"] == "output" for ln in e["lines"]]
    want = [f"cell {n} line {i}" for n in (1, 2, 3) for i in range(1, 61)]
    assert sorted(lines) == sorted(want), (len(lines), len(set(lines)))
    for v, o in zip(viewers, outs, strict=True):
        assert v.returncode == 0 and "RESULT: PASS (exit 0)" in o, (v.returncode, o[-400:])


def test_attach_to_a_crashed_run_whose_runner_pid_was_reused_says_it_crashed(
    tmp_path: Path,
) -> None:
    """The run dies whole (OOM killer, a reboot of its processes) with no console following;
    its runner's pid is later reused by another program (simulated: the pgid file names a
    process of the test's own, as a reused pid would). DetachedLauncher.alive() believes any
    live non-zombie /proc/PGID (runners/launchers/detached.py alive; prune checks the cmdline,
    the follower does not): attach follows a dead run for as long as that program lives."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    console, local = _start_run(tmp_path, env, "echo up; sleep 300")
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # the pid's new owner
    attach = None
    try:
        console.kill()
        console.communicate()
        pgid_file = Path(record_of(local)["remote_dir"]) / "pgid"
        runner = int(pgid_file.read_text())
        os.killpg(runner, signal.SIGKILL)  # the whole run dies: no end written
        wait_for(lambda: not pid_alive(runner), what="the run to die")
        pgid_file.write_text(f"{other.pid}\n")  # the runner's pid, now someone else's
        attach = spawn("attach", str(local), env=env)
        try:
            a_out, a_err = attach.communicate(timeout=patience(30))
        except subprocess.TimeoutExpired:
            pytest.fail("attach still follows a run that died 30 s ago (its pid reused)")
        assert attach.returncode == 3 and "ended without finishing" in a_out, a_out + a_err
    finally:
        other.kill()  # first: while it lives, the cleanup's cancel would follow it too
        other.wait()
        _cleanup(local, env, attach)


def test_cancel_never_signals_the_process_group_a_reused_runner_pid_now_names(
    tmp_path: Path,
) -> None:
    """A run's runner died (killed with its group) while a process of the run that left the
    group lives on; the runner's pid is reused by an unrelated program leading its own group
    (simulated as above). cancel_script does `pg=$(cat pgid)` and `kill -TERM -"$pg"` /
    `kill -KILL -"$pg"` with no check that pg is still the runner (runner_pid does that check
    for rp, not for pg): it kills the unrelated program's whole group."""
    home = tmp_path / "home"
    home.mkdir()
    env = cli_env(home)
    escapee = tmp_path / "escapee.pid"
    command = f"setsid sh -c 'echo $$ > {escapee}; exec sleep 300' & echo up; sleep 300"
    console, local = _start_run(tmp_path, env, command)
    other = subprocess.Popen(["sleep", "300"], start_new_session=True)  # not the run's
    try:
        console.kill()
        console.communicate()
        wait_for(lambda: escapee.exists() and escapee.read_text().strip(), what="escapee")
        pgid_file = Path(record_of(local)["remote_dir"]) / "pgid"
        runner = int(pgid_file.read_text())
        os.killpg(runner, signal.SIGKILL)  # the runner's group dies; the escapee lives on
        wait_for(lambda: not pid_alive(runner), what="the runner to die")
        pgid_file.write_text(f"{other.pid}\n")  # the runner's pid, now another program's
        tracedeck("cancel", str(local), "--grace", "1", env=env, timeout=60)
        assert other.poll() is None, f"cancel killed an unrelated process (rc {other.returncode})"
    finally:
        other.kill()
        other.wait()
        with contextlib.suppress(Exception):
            os.kill(int(escapee.read_text()), signal.SIGKILL)
        _cleanup(local, env)


# -- a fleet host lost while its batch ran --------------------------------------------------------

HOLD = "/tmp/adv-hold"  # each fleet host has its own /tmp: made on gpu-a only


@pytest.mark.ssh
def test_prune_never_deletes_a_fleet_run_whose_lost_host_still_runs_its_batch(
    fleet: Fleet, tmp_path: Path
) -> None:
    """gpu-a's link goes down for good: its cells run again on gpu-b and the run ends PASS,
    while gpu-a's batch goes on there (the run says so: 'its run there may go on ...
    `tracedeck cancel DIR` stops it'). The link comes back. `tracedeck prune` believes the
    recorded end (runners/prune.py check_local: a recorded end means 'its processes are
    gone'), deletes the record the cancel needs and rm -rf's RUNS/RUN_ID on gpu-a under the
    live batch. `tracedeck status` says the run ENDED while it still holds gpu-a's lock."""
    preset = lines_preset(tmp_path, cells=4, attempts=1)
    out = tmp_path / "out"
    env = cli_env(fleet.home.path)
    hold = Path(host_path("gpu-a", HOLD))
    hold.touch()
    engine = f"while [ -e {HOLD} ]; do sleep 0.1; done; echo cell {{n}} done"
    console = spawn(
        "run", str(preset), "--target", "gpu-a,gpu-b", "--out", str(out),
        "--set", f"engine.command={engine!r}", env=env,
    )  # fmt: skip
    pgid = None
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        wait_for(
            lambda: any(e.get("host") == "gpu-a" for e in events(local) if e["type"] == "cell_started"),
            what="gpu-a's batch to start",
        )  # fmt: skip
        a_dir = next(m["run_dir"] for m in members(local) if m["host"] == "gpu-a")
        pgid = int(
            wait_for(
                lambda: (
                    (Path(a_dir) / "pgid").exists() and (Path(a_dir) / "pgid").read_text().strip()
                ),
                what="pgid",
            )
        )
        fleet.proxies["gpu-a"].pause()
        fleet.proxies["gpu-a"].cut()
        stdout, stderr = console.communicate(timeout=patience(120))
        assert console.returncode == 0, stdout + stderr
        assert "RESULT: PASS (exit 0)" in stdout and "may go on" in stdout
        fleet.proxies["gpu-a"].resume()
        assert pid_alive(pgid)  # gpu-a's batch goes on
        status = tracedeck("status", "--out", str(out), "--json", env=env)
        pruned = tracedeck("prune", "--out", str(out), "--keep", "0", "--yes", env=env)
        problems = []
        if '"state": "ended"' in status.stdout or '"state":"ended"' in status.stdout:
            problems.append("status: ended, while gpu-a's batch runs")
        if not local.exists():
            problems.append(f"prune deleted the record: {pruned.stdout}")
        if not Path(a_dir).exists():
            problems.append("prune rm -rf'd gpu-a's live batch directory")
        assert not problems, problems
    finally:
        fleet.proxies["gpu-a"].resume()
        hold.unlink(missing_ok=True)  # gpu-a's cells end by themselves
        if console.poll() is None:
            console.kill()
            console.communicate()
        if pgid is not None:
            wait_for(lambda: not pid_alive(pgid), what="gpu-a's batch to end")


def test_only_a_host_lost_while_its_batch_ran_keeps_a_fleet_run_from_prune() -> None:
    """Any lost host made prune ask every host, for ever while that one stays down."""
    from runners.events import HostState
    from runners.prune import LostHosts

    def states(*pairs: tuple[str, str]) -> LostHosts:
        hosts = LostHosts()
        for host, state in pairs:
            event = HostState(state=state, message="")
            event.host = host
            hosts.fold(event)
        return hosts

    assert not states(("a", "connecting"), ("a", "lost")).batch_left  # never started one
    assert not states(("a", "running"), ("a", "idle"), ("a", "lost")).batch_left
    assert states(("a", "running"), ("b", "running"), ("b", "idle"), ("a", "lost")).batch_left


def test_a_forged_run_end_while_the_runner_runs_is_said_and_never_believed(tmp_path: Path) -> None:
    """The engine shares the run's directory: it wrote its cell's end (rc 0) and the run's
    'done' into progress.jsonl and the console stopped following at once, before run.sh's real
    lines could contradict them (a forged pass). The end of a run is believed only once its
    runner has gone."""
    home = tmp_path / "home"
    home.mkdir()
    gate = tmp_path / "gate"
    forge = tmp_path / "forge.sh"
    forge.write_text(
        f'p={tmp_path}/remote-runs/"$TRACEDECK_RUN_ID"/progress.jsonl\n'
        """printf '%s\\n' '{"e":"end","cell":"000","rc":0,"t":1}' '{"e":"done","t":1}' >> "$p"\n"""
        f"while [ ! -e {gate} ]; do sleep 0.05; done\nexit 1\n"
    )
    console, local = _start_run(tmp_path, cli_env(home), f"echo up; sh {forge}")
    try:
        wait_for(
            lambda: any(
                "the run's end while its runner still runs" in e.get("message", "")
                for e in events(local)
                if e["type"] == "error"
            ),
            what="the forged end to be said",
        )
        assert console.poll() is None  # still following
        gate.touch()
        stdout, stderr = console.communicate(timeout=patience(60))
        assert console.returncode != 0 and "RESULT: PASS" not in stdout, stdout + stderr
    finally:
        gate.touch()
        _cleanup(local, cli_env(home), console)
