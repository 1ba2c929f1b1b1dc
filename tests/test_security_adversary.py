"""Found by an adversarial security review (each failed before its fix): preset text that
became shell syntax, processes killed that were not the run's, a holder written through a
planted link, prune deleting what was no run of its own, Slurm directives split by the run
directory, and environment names and values no shell carries."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
from faults import lock_free, record_of
from patience import patience
from runhelp import cli_env, run_dirs, spawn, tracedeck, wait_for

from runners.host_prep import resolve_dir
from runners.kinds import load_preset
from runners.launchers.slurm import SlurmSettings, job_script
from runners.plan import build_plan
from runners.presets import PresetError
from runners.targets.base import TargetError
from runners.targets.local import LocalTarget

PRESET = """
[preset]
name = "{name}"
kind = "command"

[target]
runs = "{runs}"
lock = "{lock}"
{target_extra}

[engine]
command = {command}
{engine_extra}

[matrix]
n = [1, 2]
{tail}
"""


def write_preset(
    tmp: Path,
    name: str = "adv",
    command: str = '"true"',
    *,
    target_extra: str = "",
    engine_extra: str = "",
    tail: str = "",
    lock: Path | None = None,
) -> Path:
    path = tmp / f"{name}.toml"
    path.write_text(
        PRESET.format(
            name=name,
            runs=tmp / "remote-runs",
            lock=lock or tmp / "gpu.lock",
            command=command,
            target_extra=target_extra,
            engine_extra=engine_extra,
            tail=tail,
        )
    )
    return path


@pytest.fixture
def home(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


def has_open(pid: int, path: Path) -> bool:
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.path.samefile(fd, path) for fd in fds.iterdir())
    except OSError:
        return False


def stop(proc: subprocess.Popen[bytes] | None) -> None:
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- a value in a shared trace pattern is data, never shell ------------------------------------


@pytest.mark.parametrize(
    "how", [("$(touch PWNED)", []), ("x", ["--set", "vars.tag='`touch PWNED`'"])]
)
def test_a_var_in_a_shared_trace_pattern_never_runs_as_shell(
    home: Path, tmp_path: Path, how: tuple[str, list[str]]
) -> None:
    """run.sh's sizes() globbed the shared pattern unquoted after only the template was checked."""
    value, sets = how
    preset = write_preset(
        tmp_path, tail=f'[vars]\ntag = "{value}"\n\n[traces]\nfollow = ["t_{{tag}}_*.jsonl"]\n'
    )
    done = tracedeck("run", str(preset), *sets, "--out", str(tmp_path / "o"), env=cli_env(home))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "traces.follow[0]" in done.stderr and "file-name pattern" in done.stderr
    assert not list(tmp_path.rglob("PWNED"))


def test_a_pattern_word_keeps_its_glob_and_quotes_the_rest() -> None:
    from runners.launchers.detached import _shell_word
    from runners.plan import TraceFile

    word = _shell_word(TraceFile("/r s/a/t_$(x)_[0-9]*.jsonl", None))
    assert word == "'/r s/a'/'t_$(x)_'[0-9]*.jsonl"


# -- a process is the run's by the run's own hold of the lock ----------------------------------


def test_a_cell_end_never_kills_a_process_waiting_for_the_lock(home: Path, tmp_path: Path) -> None:
    """reap_cell counted every process with the lock file open as the run's while the holder
    named the run: a job waiting for the GPU under the same lock was TERMed at a cell's end."""
    lock, gate = tmp_path / "gpu.lock", tmp_path / "gate"
    script = tmp_path / "cell.sh"
    script.write_text(f"while [ ! -e {gate} ]; do sleep 0.05; done\n")
    preset = write_preset(tmp_path, command=f'"sh {script}"', lock=lock)
    console = spawn("run", str(preset), "--out", str(tmp_path / "o"), env=cli_env(home))
    waiter = None
    try:
        wait_for(lambda: not lock_free(str(lock)), what="the run to hold the lock")
        waiter = subprocess.Popen(["flock", str(lock), "sleep", "300"], start_new_session=True)
        wait_for(lambda: has_open(waiter.pid, lock), what="the waiter to open the lock")
        gate.touch()
        out, err = console.communicate(timeout=patience(120))
        assert console.returncode == 0, out + err
        assert waiter.poll() is None, f"the waiter was killed ({waiter.returncode})\n{out}"
        assert "left processes running" not in out
    finally:
        if console.poll() is None:
            console.kill()
            console.communicate()
        stop(waiter)


def test_cancel_of_an_ended_run_never_kills_the_locks_next_user(home: Path, tmp_path: Path) -> None:
    """The holder still named the ended run, so `cancel` of it TERMed whoever took the lock
    by hand since."""
    lock, out = tmp_path / "gpu.lock", tmp_path / "o"
    done = tracedeck("run", str(write_preset(tmp_path, lock=lock)), "--out", str(out),
                     env=cli_env(home))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    manual = subprocess.Popen(["flock", str(lock), "sleep", "300"], start_new_session=True)
    try:
        wait_for(lambda: not lock_free(str(lock)), what="the next user to hold the lock")
        done = tracedeck("cancel", str(run_dirs(out)[0]), env=cli_env(home))
        assert manual.poll() is None, done.stdout + done.stderr
        assert "cancelled" not in done.stdout.lower() or "not running" in done.stdout.lower()
    finally:
        stop(manual)


def test_cancel_never_signals_a_process_group_it_cannot_tie_to_the_run(
    home: Path, tmp_path: Path
) -> None:
    """The pgid file was signalled unchecked (a reused number, or one written over)."""
    lock, out = tmp_path / "gpu.lock", tmp_path / "o"
    gate = tmp_path / "gate"
    script = tmp_path / "cell.sh"
    script.write_text(f"while [ ! -e {gate} ]; do sleep 0.05; done\n")
    preset = write_preset(tmp_path, command=f'"sh {script}"', lock=lock)
    console = spawn("run", str(preset), "--out", str(out), env=cli_env(home))
    victim = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        local = wait_for(lambda: run_dirs(out), what="run dir")[0]
        remote = wait_for(lambda: record_of(local).get("remote_dir"), what="remote dir")
        pgid = Path(remote) / "pgid"
        wait_for(pgid.exists, what="the run's process group")
        runner = int(pgid.read_text())
        os.kill(runner, signal.SIGKILL)  # the runner gone: its number is free to be reused
        pgid.write_text(f"{victim.pid}\n")  # ... as the victim's group's
        done = tracedeck("cancel", str(local), "--grace", "1", env=cli_env(home))
        assert victim.poll() is None, done.stdout + done.stderr
        console.communicate(timeout=patience(60))
    finally:
        gate.touch()
        if console.poll() is None:
            console.kill()
            console.communicate()
        stop(victim)


# -- the holder record beside a shared lock ----------------------------------------------------


def test_the_holder_record_is_never_written_through_a_planted_link(
    home: Path, tmp_path: Path
) -> None:
    shared = tmp_path / "shared-tmp"
    shared.mkdir()
    lock = shared / "tracedeck.lock"
    victim = tmp_path / "precious.txt"
    victim.write_text("precious\n")
    (shared / "tracedeck.lock.json.part").symlink_to(victim)
    done = tracedeck("run", str(write_preset(tmp_path, lock=lock)), "--out", str(tmp_path / "o"),
                     env=cli_env(home))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert victim.read_text() == "precious\n"
    holder = json.loads((shared / "tracedeck.lock.json").read_text())
    assert holder["run_id"] == record_of(run_dirs(tmp_path / "o")[0])["run_id"]
    assert not [p for p in shared.iterdir() if ".json." in p.name and not p.is_symlink()]


# -- prune deletes runs, and only runs ----------------------------------------------------------


def older(local: Path) -> None:
    """Make a recorded run a year older than any other (prune orders by start)."""
    record = record_of(local)
    record["started_at"] = "2025-01-01T00:00:00+00:00"
    (local / "run.json").write_text(json.dumps(record))


def test_prune_never_deletes_a_run_nested_in_a_pruned_one(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    done = tracedeck("run", str(write_preset(tmp_path, name="outer")), "--set",
                     'artifacts.dir="{date}"', "--out", str(out), env=cli_env(home))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    outer = run_dirs(out)[0]
    older(outer)
    done = tracedeck("run", str(write_preset(tmp_path, name="inner")), "--out", str(out),
                     env=cli_env(home))  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    inner = next(d for d in run_dirs(out) if d != outer)
    assert inner.is_relative_to(outer)
    done = tracedeck("prune", "--out", str(out), "--keep", "1", "--yes", env=cli_env(home))
    assert (inner / "run.json").exists() and (outer / "run.json").exists(), done.stdout
    assert "holds another run's record" in done.stdout


def test_the_out_dir_itself_is_never_a_runs_directory(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="artifacts.dir.*out directory itself"):
        load_preset(write_preset(tmp_path), ['artifacts.dir="./"'])


def test_prune_never_deletes_a_directory_that_is_no_run_record(home: Path, tmp_path: Path) -> None:
    out = tmp_path / "o"
    done = tracedeck("run", str(write_preset(tmp_path)), "--out", str(out), env=cli_env(home))
    assert done.returncode == 0, done.stdout + done.stderr
    other = out / "notebooks" / "experiment-7"
    other.mkdir(parents=True)
    (other / "run.json").write_text('{"name": "my experiment", "lr": 0.001}\n')
    (other / "results.csv").write_text("step,loss\n1,0.5\n")
    done = tracedeck("prune", "--out", str(out), "--keep", "0", "--yes", env=cli_env(home))
    assert (other / "results.csv").exists(), done.stdout
    assert "not a run record this tracedeck reads" in done.stdout
    assert run_dirs(out) == [other]  # the real run was pruned


# -- Slurm directives --------------------------------------------------------------------------


@pytest.mark.parametrize("runs", ["/home/op/My Runs", "/scratch/a%jb", "/x\ntouch PWNED\n#"])
def test_a_run_dir_sbatch_cannot_carry_is_refused_before_any_job(tmp_path: Path, runs: str) -> None:
    preset = load_preset(write_preset(tmp_path, target_extra='scheduler = "slurm"'))
    run_id = "20990101-000000-adv-abcd"
    plan = build_plan(preset, run_id=run_id, run_dir=f"{runs}/{run_id}", workdir="/w",
                      python="python3", date="2099-01-01", lock="/tmp/l")  # fmt: skip
    with pytest.raises(TargetError, match="cannot be written in an #SBATCH line"):
        job_script(plan, SlurmSettings(), {"preset": "adv"})


def test_a_target_path_with_a_control_character_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="target.runs.*control character"):
        load_preset(write_preset(tmp_path), ['target.runs="/x\\ntouch PWNED"'])
    made = tmp_path / "a\nb"
    made.mkdir()
    with pytest.raises(TargetError, match="control characters"):
        asyncio.run(resolve_dir(LocalTarget(), str(made), "target.runs"))


# -- environment names and values ---------------------------------------------------------------


def test_an_env_name_a_shell_cannot_export_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="engine.env.Épsilon"):
        load_preset(write_preset(tmp_path, engine_extra='env = { "Épsilon" = "1" }'))


def test_tracedecks_own_environment_names_are_refused(tmp_path: Path) -> None:
    """A preset's TRACEDECK_CELL (the shipped hello_command set one) replaced the marker
    reap_cell and cancel find a cell's processes by."""
    with pytest.raises(PresetError, match="determinism.env.TRACEDECK_CELL.*tracedeck's own"):
        load_preset(write_preset(tmp_path), ['determinism.env.TRACEDECK_CELL="{n}"'])


@pytest.mark.parametrize("extra", ['env = { "X" = "a\\u0000b" }', 'setup = ["echo a\\u0000b"]'])
def test_a_nul_anywhere_in_a_preset_is_refused(tmp_path: Path, extra: str) -> None:
    with pytest.raises(PresetError, match="NUL"):
        load_preset(write_preset(tmp_path, engine_extra=extra))


@pytest.mark.parametrize("placeholder", ["{out}", "{run_dir}", "{workdir}", "{python}"])
def test_an_artifact_path_made_absolute_by_a_placeholder_is_refused(
    tmp_path: Path, placeholder: str
) -> None:
    preset = write_preset(tmp_path, tail=f'[artifacts]\nfetch = ["{placeholder}/x.json"]\n')
    with pytest.raises(PresetError, match="absolute path"):
        load_preset(preset)


# -- the run's directory is the login user's own -------------------------------------------------


@pytest.mark.skipif(os.geteuid() != 0, reason="making a directory another user owns needs root")
def test_a_run_directory_someone_else_made_first_is_refused(tmp_path: Path) -> None:
    """In a shared runs directory another user could make RUNS/RUN_ID (or a link) first: the
    run's scripts would then be theirs to change."""
    from runners.host_prep import own_dirs

    runs = tmp_path / "runs"
    theirs = runs / "20990101-000000-adv-abcd"
    theirs.mkdir(parents=True)
    os.chown(theirs, 65534, 65534)
    (runs / "linked").symlink_to(tmp_path)
    local = LocalTarget()
    for run_dir, parents in ((theirs, 0), (theirs / "gpu-a-1", 1), (runs / "linked", 0)):
        with pytest.raises(TargetError, match="not a directory of this login user's own"):
            asyncio.run(own_dirs(local, str(run_dir), parents))
    asyncio.run(own_dirs(local, str(runs / "mine" / "gpu-a-1"), 1))
    assert (runs / "mine" / "gpu-a-1").is_dir()


def test_a_foreign_run_json_inside_a_run_goes_with_it(home: Path, tmp_path: Path) -> None:
    """An artifact named run.json deeper in a run's directory is its content: it neither keeps
    the run from prune nor is listed as a directory of its own."""
    out = tmp_path / "o"
    done = tracedeck("run", str(write_preset(tmp_path)), "--out", str(out), env=cli_env(home))
    assert done.returncode == 0, done.stdout + done.stderr
    [local] = run_dirs(out)
    (local / "deep" / "x").mkdir(parents=True)
    (local / "deep" / "x" / "run.json").write_text("[1, 2]\n")
    done = tracedeck("prune", "--out", str(out), "--keep", "0", "--yes", env=cli_env(home))
    assert not local.exists(), done.stdout
    assert "not a run record" not in done.stdout
