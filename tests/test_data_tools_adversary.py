"""Found by an adversarial review of the data tools and the commands over run records (each
failed before its fix): prune deleting a directory no run of its own on a hand-edited record,
a summary.json nested past the parser's depth that was a traceback, a shard that is a FIFO or
a device (a hang, memory without end), CI reports written over a run's record, and a run
whose asked-for report could not be written that said exit 0."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from dsa_writer import write_trace
from runhelp import cli_env, run_dirs, tracedeck, write_lines_preset

DATA = Path(__file__).parent / "data"


def _run(tmp_path: Path, out: Path, *extra: str) -> Path:
    """One quick recorded run of the lines preset (one line a cell) under out."""
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    before = set(run_dirs(out))
    done = tracedeck("run", str(preset), "--out", str(out), *extra, env=cli_env(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    (new,) = set(run_dirs(out)) - before
    return new


# -- prune ---------------------------------------------------------------------------------------


def test_prune_never_deletes_a_directory_a_hand_edited_record_names_as_its_remote_dir(
    tmp_path: Path,
) -> None:
    out = tmp_path / "o"
    local = _run(tmp_path, out)
    victim = tmp_path / "precious"
    (victim / "keep").mkdir(parents=True)
    (victim / "keep" / "data").write_text("the operator's\n")
    record = json.loads((local / "run.json").read_text())
    # a record edited by hand (or by another tool): its id and remote dir name no run
    record["run_id"], record["remote_dir"] = victim.name, str(victim)
    (local / "run.json").write_text(json.dumps(record))
    done = tracedeck("prune", "--out", str(out), "--keep", "0", "--yes", env=cli_env(tmp_path))
    assert (victim / "keep" / "data").exists(), done.stdout + done.stderr
    assert "not a run directory of this run id; left alone" in done.stdout, done.stdout


# -- hostile DSA inputs --------------------------------------------------------------------------

VERBS = [
    (["analyze"], ["--workers", "1"]),
    (["dsa", "whatif"], ["--workers", "1"]),
    (["dsa", "tiers"], ["--hbm-blocks", "4"]),
    (["export"], ["--format", "csv"]),
]


@pytest.mark.parametrize(("verb", "opts"), VERBS)
def test_a_summary_nested_past_the_parsers_depth_is_named_never_a_traceback(
    verb: list[str], opts: list[str], tmp_path: Path
) -> None:
    folder = write_trace(tmp_path / "t")
    (folder / "summary.json").write_text("[" * 100_000)
    args = [*verb, str(folder), *opts]
    if verb == ["export"]:
        args += ["--output", str(tmp_path / "out.csv")]
    done = tracedeck(*args, env=cli_env(tmp_path), timeout=30)
    assert "Traceback" not in done.stderr, done.stderr
    if verb == ["analyze"]:  # the summary is judged: it is no engine's summary
        assert done.returncode == 1, done.stdout + done.stderr
        assert "summary.json" in done.stdout and "nested" in done.stdout, done.stdout
    else:  # the tools read it for the trace's settings: named, and what to do
        assert done.returncode == 2, done.stdout + done.stderr
        assert f"{folder / 'summary.json'}" in done.stderr and "nested" in done.stderr


@pytest.mark.parametrize("what", ["a FIFO", "/dev/zero"])
@pytest.mark.parametrize(("verb", "opts"), [*VERBS, (["analyze"], ["--workers", "2"])])
def test_a_shard_that_is_a_fifo_or_a_device_is_named_never_read_forever(
    what: str, verb: list[str], opts: list[str], tmp_path: Path
) -> None:
    folder = write_trace(tmp_path / "t")
    shard = folder / "trace_steps_9_10.jsonl"
    if what == "a FIFO":
        os.mkfifo(shard)  # nobody ever writes it: open() alone would wait for ever
    else:
        shard.symlink_to("/dev/zero")  # no newline, no end: read whole, memory without bound
    args = [*verb, str(folder), *opts]
    if verb == ["export"]:
        args += ["--output", str(tmp_path / "out.csv")]
    done = tracedeck(*args, env=cli_env(tmp_path), timeout=10)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{shard}: cannot read (not a regular file" in done.stderr, done.stderr
    assert not (tmp_path / "out.csv").exists()


# -- CI reports ----------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--junit", "--summary-md"])
@pytest.mark.parametrize("whose", ["its own", "another run's"])
def test_a_ci_report_is_never_written_over_a_runs_record(
    flag: str, whose: str, tmp_path: Path
) -> None:
    judged, other = tmp_path / "a", tmp_path / "b"
    shutil.copytree(DATA / "dsa_run", judged)
    shutil.copytree(DATA / "dsa_run", other)
    victim = (judged if whose == "its own" else other) / "run.json"
    before = victim.read_bytes()
    done = tracedeck("analyze", str(judged), "--output", str(tmp_path / "re"), flag, str(victim),
                     env=cli_env(tmp_path))  # fmt: skip
    assert victim.read_bytes() == before, done.stderr
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{flag} {victim}: inside the run's directory" in done.stderr, done.stderr


def test_a_run_whose_asked_report_could_not_be_written_is_no_exit_0(tmp_path: Path) -> None:
    out = tmp_path / "o"
    preset = write_lines_preset(tmp_path, lines=1, pause=0)
    junit = tmp_path / "no-such-dir-file"
    junit.write_text("a file where a directory should be\n")
    done = tracedeck("run", str(preset), "--out", str(out), "--junit", str(junit / "j.xml"),
                     env=cli_env(tmp_path))  # fmt: skip
    assert "RESULT: PASS" in done.stdout, done.stdout  # the run passed; its report was not made
    assert f"{junit / 'j.xml'}: cannot write it" in done.stderr, done.stderr
    assert done.returncode == 2, done.stdout + done.stderr


@pytest.mark.parametrize(("verb", "opts"), VERBS[1:])
def test_a_serving_line_that_is_no_utf8_is_named_by_file_and_line(
    verb: list[str], opts: list[str], tmp_path: Path
) -> None:
    folder = write_trace(tmp_path / "t")
    (folder / "serving.jsonl").write_bytes(
        b'{"request_id": 0, "arrival_ms": 1, "end_ms": 2}\n'
        b'{"request_id": 1, "arrival_ms": 1, "end_ms": 2, "note": "\xff"}\n'
    )
    args = [*verb, str(folder), *opts]
    if verb == ["export"]:
        args += ["--output", str(tmp_path / "out.csv")]
    done = tracedeck(*args, env=cli_env(tmp_path), timeout=30)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{folder / 'serving.jsonl'}:2: not a serving entry" in done.stderr, done.stderr
    assert not (tmp_path / "out.csv").exists()


# -- run records that are no regular file ----------------------------------------------------------


@pytest.mark.parametrize("what", ["a FIFO", "/dev/zero"])
def test_a_run_record_that_is_a_fifo_or_a_device_never_hangs_a_command(
    what: str, tmp_path: Path
) -> None:
    out = tmp_path / "o"
    good, bad = _run(tmp_path, out), _run(tmp_path, out)
    stray = out / "stray"
    stray.mkdir()

    def plant(path: Path) -> None:
        path.unlink(missing_ok=True)
        if what == "a FIFO":
            os.mkfifo(path)  # nobody writes it: open() alone waits for ever
        else:
            path.symlink_to("/dev/zero")  # never ends: read whole, memory without bound

    plant(stray / "run.json")  # found by every command that lists the runs
    plant(bad / "events.jsonl")
    env = cli_env(tmp_path)
    for args in (["history", "lines"], ["status"], ["prune", "--keep", "0"]):
        done = tracedeck(*args, "--out", str(out), env=env, timeout=30)
        assert "Traceback" not in done.stderr, (args, done.stderr)
        assert done.returncode == 0, (args, done.stdout + done.stderr)
    done = tracedeck("prune", "--out", str(out), "--keep", "0", env=env, timeout=30)
    assert f"{stray / 'run.json'}: cannot read the run record (not a regular file" in done.stdout
    for args in (["replay", str(bad), "--headless"], ["logs", str(bad)], ["diff", str(good), str(bad)]):  # fmt: skip
        done = tracedeck(*args, env=env, timeout=30)
        assert "Traceback" not in done.stderr, (args, done.stderr)
        assert done.returncode == 2, (args, done.stdout + done.stderr)
        assert f"{bad / 'events.jsonl'}" in done.stderr, (args, done.stderr)


# The command's own peak RSS, as its process says at exit (/proc/self/status VmHWM: the memory
# of this program only; a fork's rusage would count the test's pages from before the exec).
_PEAK = (
    "import runpy, sys\n"
    "sys.argv = ['tracedeck', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('console.cli', run_name='__main__')\n"
    "finally:\n"
    "    hwm = next(x for x in open('/proc/self/status') if x.startswith('VmHWM'))\n"
    "    print('PEAK', hwm.split()[1], file=sys.stderr)\n"
)


def _peak_rss_mib(args: list[str], env: dict[str, str]) -> tuple[float, str]:
    """A tracedeck command's own peak RSS in MiB, and its stderr."""
    import subprocess
    import sys

    from runhelp import ROOT

    done = subprocess.run(
        [sys.executable, "-c", _PEAK, *args], cwd=ROOT, env=env, capture_output=True, text=True
    )
    peak = [line for line in done.stderr.splitlines() if line.startswith("PEAK ")]
    assert peak, done.stderr
    return int(peak[-1].split()[1]) / 1024, done.stderr


@pytest.mark.parametrize(("verb", "opts"), [*VERBS, (["analyze"], ["--workers", "2"])])
def test_one_enormous_line_is_read_no_further_than_a_record_can_be(
    verb: list[str], opts: list[str], tmp_path: Path
) -> None:
    """A shard holding one 48 MiB line: every reader kept all of it, and then some (a 100 MB
    line peaked at ~259 MB in analyze). A line longer than a record can be is read no further
    than that (MAX_LINE): memory stays what the same trace needs without it, and the line is
    one invalid record, said to be longer than the limit."""
    from analysis.dsa_record import MAX_RECORD_BYTES

    env = cli_env(tmp_path)
    peaks = []
    for name, big in (("plain", 0), ("big", 48 << 20)):
        folder = write_trace(tmp_path / name / "t")
        shard = folder / "trace_steps_9_10.jsonl"
        if big:  # written a MiB at a time: the line never in this process's memory
            with open(shard, "wb") as fh:
                fh.write(b'{"event": "dsa_topk", ')
                for _ in range(big >> 20):
                    fh.write(b" " * (1 << 20))
                fh.write(b"}\n")
        args = [*verb, str(folder), *opts]
        if verb == ["export"]:
            args += ["--output", str(tmp_path / name / "out.csv")]
        peak, err = _peak_rss_mib(args, env)
        assert "Traceback" not in err, err
        peaks.append(peak)
    assert peaks[1] < peaks[0] + 24, (
        f"peak RSS {peaks[1]:.0f} MiB against {peaks[0]:.0f} without it"
    )
    if verb == ["analyze"]:
        done = tracedeck(*verb, str(tmp_path / "big" / "t"), *opts, "--json", env=env)
        assert f"more than {MAX_RECORD_BYTES} bytes" in done.stdout, done.stdout[-2000:]
