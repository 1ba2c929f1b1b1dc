"""Hand-written bad inputs, through the real CLI: each exits 2 (the input) or 3 (the host) with
a message naming the file, key, line, host or path at fault, and never with a traceback."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from dsa_writer import write_trace
from faults import assert_nothing_left, bad_input

from console.cli import main

pytestmark = pytest.mark.fault  # after each: the hosts scanned (conftest.py)

GOOD = """
[preset]
name = "t"
kind = "command"
description = "a bad-input test"

[engine]
command = "echo {word}"

[matrix]
word = ["a", "b"]
"""

READOUT_LINE = {
    "phase": "prefill_last",
    "step": 0,
    "tokens_total": 10,
    "top1_id": 5,
    "top1_logit": 12.5,
    "top2_id": 18,
    "top2_logit": 11.0,
    "gap": 1.5,
    "readout_mismatch": False,
}


@dataclass
class Case:
    """argv built in a scratch directory; the exit it must give; words its stderr must hold."""

    build: Callable[[Path], list[str]]
    code: int
    words: Callable[[Path], list[str]]


def preset(text: str, *extra: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        (tmp / "p.toml").write_text(text)
        return ["run", str(tmp / "p.toml"), "--out", str(tmp / "out"), *extra]

    return build


def plan(text: str, *extra: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        (tmp / "p.toml").write_text(text)
        return ["plan", str(tmp / "p.toml"), *(fill(a, tmp) for a in extra)]

    return build


def with_file(name: str, data: bytes | str, *argv: str) -> Callable[[Path], list[str]]:
    """Writes tmp/name, then argv with {tmp} filled in."""

    def build(tmp: Path) -> list[str]:
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, bytes):
            path.write_bytes(data)
        else:
            path.write_text(data)
        return [fill(a, tmp) for a in argv]

    return build


def fill(text: str, tmp: Path) -> str:
    return text.replace("{tmp}", str(tmp))


def names(*words: str) -> Callable[[Path], list[str]]:
    return lambda tmp: [fill(w, tmp) for w in words]


def readout(*records: dict | str) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records)


def run_record(tmp: Path, record: dict | str) -> Path:
    run = tmp / "run"
    run.mkdir()
    text = record if isinstance(record, str) else json.dumps(record)
    (run / "run.json").write_text(text)
    return run


P = "{tmp}/p.toml"
CONFIG = "{tmp}/home/.config/tracedeck/config.toml"
SMOKE = Path(__file__).resolve().parents[1] / "presets" / "b3_67_smoke.toml"
FIRST_EVENT = (
    (Path(__file__).parent / "data" / "hello_command_run" / "events.jsonl")
    .read_text()
    .splitlines(keepends=True)[0]
)
CASES: dict[str, Case] = {
    # --- presets -------------------------------------------------------------------------------
    "preset missing": Case(names("run", "{tmp}/nope.toml"), 2, names("{tmp}/nope.toml", "no such")),
    "preset is a directory": Case(lambda tmp: ["run", str(tmp)], 2, names("{tmp}", "a directory")),
    "preset not text": Case(
        with_file("p.toml", b"\xff\xfe\x00garbage", "run", P), 2, names(P, "UTF-8")
    ),
    "preset bad toml": Case(
        with_file("p.toml", "[preset\nname=", "run", P), 2, names(P, "not valid TOML", "line 1")
    ),
    "preset unknown section": Case(
        preset(GOOD + "[bogus]\nx = 1\n"), 2, names(P, "bogus", "unknown section")
    ),
    "preset unknown key": Case(
        preset(GOOD.replace("description", "descr")), 2, names(P, "preset.descr", "unknown key")
    ),
    "preset wrong type": Case(
        preset(GOOD + "[target]\nreconnect_attempts = '5'\n"),
        2,
        names(P, "target.reconnect_attempts", "int"),
    ),
    "preset unknown kind": Case(
        preset(GOOD.replace('"command"', '"nope"')), 2, names(P, "preset.kind", "one of")
    ),
    "preset unknown placeholder": Case(
        preset(GOOD.replace("{word}", "{wrod}")), 2, names(P, "engine.command", "{wrod}")
    ),
    "preset matrix too big": Case(
        preset(
            GOOD.replace(
                'word = ["a", "b"]',
                "a = " + str(list(range(101))) + "\nb = " + str(list(range(101))),
            )
        ),
        2,
        names(P, "matrix", "10,201 cells", "split it"),
    ),
    "preset name makes paths": Case(
        preset(GOOD.replace('name = "t"', 'name = "../t"')), 2, names(P, "preset.name")
    ),
    "preset timeout infinite": Case(
        preset(GOOD + "[target]\nconnect_timeout_s = inf\n"),
        2,
        names(P, "target.connect_timeout_s", "finite"),
    ),
    "preset timeout negative": Case(
        preset(GOOD + "[target]\nkeepalive_s = -1.0\n"), 2, names(P, "target.keepalive_s", "> 0")
    ),
    "preset reconnects negative": Case(
        preset(GOOD + "[target]\nreconnect_attempts = -1\n"),
        2,
        names(P, "target.reconnect_attempts", "0 or more"),
    ),
    "preset relative lock": Case(
        preset(GOOD + "[target]\nlock = 'gpu.lock'\n"), 2, names(P, "target.lock", "absolute")
    ),
    "fetch absolute path": Case(
        preset(GOOD + "[artifacts]\nfetch = ['/etc/passwd']\n"),
        2,
        names(P, "artifacts.fetch[0]", "absolute"),
    ),
    "fetch leaves the run": Case(
        preset(GOOD + "[artifacts]\nfetch = ['../../x']\n"),
        2,
        names(P, "artifacts.fetch[0]", "'..'"),
    ),
    "matrix value leaves the run": Case(
        preset(GOOD.replace('"b"]', '"../../../etc"]') + "[artifacts]\nfetch = ['{word}/x']\n"),
        2,
        names(P, "artifacts.fetch[0]", "cell 2", "word=../../../etc"),
    ),
    "trace path absolute": Case(
        preset(GOOD + "[traces]\nfollow = ['/tmp/x.jsonl']\n"),
        2,
        names(P, "traces.follow[0]"),
    ),
    "artifacts dir per cell": Case(
        preset(GOOD + "[artifacts]\ndir = 'runs/{word}'\n"),
        2,
        names(P, "artifacts.dir", "{word}"),
    ),
    "artifacts dir per run": Case(
        preset(GOOD + "[artifacts]\ndir = 'runs/{run_id}'\n"),
        2,
        names(P, "artifacts.dir", "{run_id}"),
    ),
    "thresholds NaN in a preset": Case(
        lambda tmp: ["run", str(SMOKE), "--set", "thresholds.p99_abs_diff_max=nan"],
        2,
        names(str(SMOKE), "thresholds.p99_abs_diff_max", "finite"),
    ),
    "thresholds negative in a preset": Case(
        lambda tmp: ["run", str(SMOKE), "--set", "thresholds.top1_agreement_min=-0.5"],
        2,
        names(str(SMOKE), "thresholds.top1_agreement_min"),
    ),
    "judge on nowhere": Case(
        preset(GOOD + "[judge]\non = 'gpu'\n"), 2, names(P, "judge.on", "auto, host, console")
    ),
    "judge on the host for a kind that cannot": Case(
        preset(GOOD + "[judge]\non = 'host'\n"), 2, names(P, "judge.on", "console only")
    ),
    "--set without a value": Case(preset(GOOD, "--set", "matrix"), 2, names("key.path=VALUE")),
    "--set unknown key": Case(
        preset(GOOD, "--set", "target.nope=1"), 2, names("target.nope", "unknown key")
    ),
    "--out is a file": Case(
        lambda tmp: [*preset(GOOD)(tmp)[:2], "--out", str(tmp / "p.toml")],
        2,
        names("--out {tmp}/p.toml", "directory"),
    ),
    "--out under a file": Case(
        lambda tmp: [*preset(GOOD)(tmp)[:2], "--out", str(tmp / "p.toml" / "sub")],
        2,
        names("--out {tmp}/p.toml/sub"),
    ),
    "--out under /proc": Case(
        lambda tmp: [*preset(GOOD)(tmp)[:2], "--out", "/proc/tracedeck-runs"],
        2,
        names("--out /proc/tracedeck-runs", "cannot write"),
    ),
    "--target closed port": Case(
        preset(
            GOOD + "[target]\nconnect_timeout_s = 5.0\nreconnect_attempts = 0\n",
            "--target",
            "ssh://127.0.0.1:1",
        ),
        3,
        names("127.0.0.1:1"),
    ),
    "--target not a target": Case(preset(GOOD, "--target", "ssh://"), 2, names("ssh://")),
    "host config not toml": Case(
        lambda tmp: _host_config(tmp, "[hosts.gpu\n") + preset(GOOD)(tmp),
        2,
        names("{tmp}/home/.config/tracedeck/config.toml"),
    ),
    "host config relative lock": Case(
        lambda tmp: _host_config(tmp, "[hosts.local]\nlock = 'x.lock'\n") + preset(GOOD)(tmp),
        2,
        names("{tmp}/home/.config/tracedeck/config.toml", "hosts.local.lock"),
    ),
    # --- fleets and Slurm ------------------------------------------------------------------------
    "fleet hosts not a list": Case(
        lambda tmp: _fleet(tmp, '[fleets.rack]\nhosts = "gpu1"\n'),
        2,
        names(CONFIG, "fleets.rack.hosts"),
    ),
    "fleet hosts empty": Case(
        lambda tmp: _fleet(tmp, "[fleets.rack]\nhosts = []\n"),
        2,
        names(CONFIG, "fleets.rack.hosts"),
    ),
    "fleet hosts missing": Case(
        lambda tmp: _fleet(tmp, "[fleets.rack]\n"), 2, names(CONFIG, "fleets.rack.hosts", "missing")
    ),
    "fleet host not a target": Case(
        lambda tmp: _fleet(tmp, '[fleets.rack]\nhosts = ["gpu1", "ssh://"]\n'),
        2,
        names(CONFIG, "fleets.rack.hosts[1]", "ssh://"),
    ),
    "fleet host is a slurm cluster": Case(
        lambda tmp: _fleet(tmp, '[fleets.rack]\nhosts = ["slurm://login/gpu"]\n'),
        2,
        names(CONFIG, "fleets.rack.hosts[0]", "Slurm"),
    ),
    "fleet host listed twice": Case(
        lambda tmp: _fleet(tmp, '[fleets.rack]\nhosts = ["gpu1", "gpu1"]\n'),
        2,
        names(CONFIG, "fleets.rack.hosts[1]", "twice"),
    ),
    "fleet unknown key": Case(
        lambda tmp: _fleet(tmp, '[fleets.rack]\nhosts = ["gpu1"]\nbusy = "skip"\n'),
        2,
        names(CONFIG, "fleets.rack.busy", "unknown key"),
    ),
    "fleet named like a host": Case(
        lambda tmp: _fleet(
            tmp, "[hosts.rack]\nlock = '/tmp/r.lock'\n[fleets.rack]\nhosts = ['a']\n"
        ),
        2,
        names(CONFIG, "fleets.rack", "ambiguous"),
    ),
    "fleet not a table": Case(
        lambda tmp: _fleet(tmp, "fleets = 3\n"), 2, names(CONFIG, "fleets", "table")
    ),
    "--target list with an empty host": Case(
        preset(GOOD, "--target", "gpu1,,gpu2"), 2, names("gpu1,,gpu2", "host 2", "empty")
    ),
    "--target list with a host twice": Case(
        preset(GOOD, "--target", "gpu1,gpu1"), 2, names("gpu1,gpu1", "twice")
    ),
    "--target list with a slurm cluster": Case(
        preset(GOOD, "--target", "gpu1,slurm://login/gpu"), 2, names("slurm://login/gpu", "Slurm")
    ),
    "--target slurm without login": Case(
        preset(GOOD, "--target", "slurm:///debug"), 2, names("slurm:///debug", "login host")
    ),
    "--target slurm partition path": Case(
        preset(GOOD, "--target", "slurm://login/a/b"), 2, names("slurm://login/a/b", "partition")
    ),
    "preset fleet.busy": Case(
        preset(GOOD + '[fleet]\nbusy = "never"\n'), 2, names(P, "fleet.busy", "skip, wait")
    ),
    "preset fleet.requeue not bool": Case(
        preset(GOOD + '[fleet]\nrequeue = "yes"\n'), 2, names(P, "fleet.requeue", "bool")
    ),
    "preset unknown scheduler": Case(
        preset(GOOD + '[target]\nscheduler = "pbs"\n'), 2, names(P, "target.scheduler", "pbs")
    ),
    "preset bad time limit": Case(
        preset(GOOD + '[target]\ntime_limit = "soon"\n'), 2, names(P, "target.time_limit", "soon")
    ),
    "preset bad gres": Case(
        preset(GOOD + '[target]\ngres = "gpu 1"\n'), 2, names(P, "target.gres", "gpu:1")
    ),
    "preset bad partition": Case(
        preset(GOOD + '[target]\npartition = "a b"\n'), 2, names(P, "target.partition")
    ),
    "preset sbatch line not an option": Case(
        preset(GOOD + '[target]\nsbatch = ["qos=high"]\n'), 2, names(P, "target.sbatch[0]", "--")
    ),
    "preset sbatch line tracedeck owns": Case(
        preset(GOOD + '[target]\nsbatch = ["--array=0-9"]\n'),
        2,
        names(P, "target.sbatch[0]", "--array", "set by tracedeck"),
    ),
    "preset sbatch line abbreviating an option tracedeck owns": Case(
        preset(GOOD + '[target]\nsbatch = ["--qos=high", "--arr=0"]\n'),
        2,
        names(P, "target.sbatch[1]", "--arr is --array, is set by tracedeck"),
    ),
    "preset sbatch line renaming the job": Case(
        preset(GOOD + '[target]\nsbatch = ["--job=mine"]\n'),
        2,
        names(P, "target.sbatch[0]", "--job-name", "set by tracedeck"),
    ),
    "preset sbatch line with a newline": Case(
        preset(GOOD + '[target]\nsbatch = ["--qos=a\\nrm -rf /"]\n'),
        2,
        names(P, "target.sbatch[0]"),
    ),
    "workdir ~user": Case(
        preset(GOOD + "[target]\nworkdir = '~bob/x'\n"), 2, names(P, "target.workdir", "~user")
    ),
    "runs empty": Case(
        preset(GOOD + "[target]\nruns = ' '\n"), 2, names(P, "target.runs", "name a directory")
    ),
    # --- plan ----------------------------------------------------------------------------------
    "plan preset missing": Case(
        names("plan", "{tmp}/nope.toml"), 2, names("{tmp}/nope.toml", "no such")
    ),
    "plan not a target": Case(plan(GOOD, "--target", "ssh://"), 2, names("ssh://")),
    "plan unknown placeholder": Case(
        plan(GOOD.replace("{word}", "{wrod}")), 2, names(P, "engine.command", "{wrod}")
    ),
    "plan --check closed port": Case(
        plan(
            GOOD + "[target]\nconnect_timeout_s = 5.0\n",
            "--target",
            "ssh://127.0.0.1:1",
            "--check",
        ),
        3,
        names("127.0.0.1:1", "reachable"),
    ),
    "plan --check no interpreter": Case(
        plan(
            GOOD.replace("echo {word}", "{python} -c pass"),
            "--set",
            'target.python="/nonexistent/py"',
            "--check",
        ),
        3,
        names("python", "/nonexistent/py", "not found"),
    ),
    # --- run directories ------------------------------------------------------------------------
    "attach unknown run id": Case(
        names("attach", "20990101-000000-nope-beef", "--out", "{tmp}"),
        2,
        names("20990101-000000-nope-beef", "by-id"),
    ),
    "prune says nothing": Case(names("prune"), 2, names("--older-than", "--keep")),
    "prune bad age": Case(
        names("prune", "--older-than", "2x", "--out", "{tmp}"), 2, names("--older-than '2x'")
    ),
    "prune empty age": Case(
        names("prune", "--older-than", "", "--out", "{tmp}"), 2, names("--older-than ''")
    ),
    "prune negative keep": Case(names("prune", "--keep", "-1"), 2, names("--keep -1")),
    "prune --runs alone": Case(
        names("prune", "--keep", "1", "--runs", "x"), 2, names("--runs", "--target")
    ),
    "prune no records": Case(
        names("prune", "--keep", "1", "--out", "{tmp}/none"), 2, names("{tmp}/none")
    ),
    "prune not a target": Case(
        names("prune", "--keep", "0", "--target", "ssh://"), 2, names("ssh://")
    ),
    "prune unreachable target": Case(
        names("prune", "--keep", "0", "--target", "ssh://127.0.0.1:1"), 3, names("127.0.0.1:1")
    ),
    # --- analyze -------------------------------------------------------------------------------
    "analyze --output is a file": Case(
        with_file(
            "t.jsonl",
            readout(READOUT_LINE),
            "analyze",
            "{tmp}/t.jsonl",
            "--output",
            "{tmp}/t.jsonl",
        ),
        2,
        names("--output {tmp}/t.jsonl", "a file is in the way"),
    ),
    "analyze --output inside the tree": Case(
        with_file(
            "tree/runs/kv_aligned_1/seed_0/prefill/metadata.json",
            "{}",
            "analyze",
            "{tmp}/tree",
            "--output",
            "{tmp}/tree/report",
        ),
        2,
        names("--output {tmp}/tree/report", "inside the tree judged"),
    ),
    # --- analyze -------------------------------------------------------------------------------
    "analyze missing path": Case(
        names("analyze", "{tmp}/nothing"), 2, names("{tmp}/nothing", "no such")
    ),
    "analyze unknown kind": Case(
        with_file("t.jsonl", readout(READOUT_LINE), "analyze", "--kind", "zz", "{tmp}/t.jsonl"),
        2,
        names("--kind zz", "unknown run kind"),
    ),
    "readout empty": Case(
        with_file("t.jsonl", "", "analyze", "{tmp}/t.jsonl"), 2, names("{tmp}/t.jsonl", "empty")
    ),
    "readout blank lines only": Case(
        with_file("t.jsonl", "\n \n\t\n", "analyze", "{tmp}/t.jsonl"),
        2,
        names("{tmp}/t.jsonl"),
    ),
    "readout not json": Case(
        with_file("t.jsonl", readout(READOUT_LINE, "{oops"), "analyze", "{tmp}/t.jsonl"),
        2,
        names("{tmp}/t.jsonl:2:", "JSON"),
    ),
    "readout missing field": Case(
        with_file(
            "t.jsonl",
            readout({k: v for k, v in READOUT_LINE.items() if k != "top1_id"}),
            "analyze",
            "{tmp}/t.jsonl",
        ),
        2,
        names("{tmp}/t.jsonl:1:", "top1_id"),
    ),
    "readout wrong type": Case(
        with_file("t.jsonl", readout({**READOUT_LINE, "step": "zero"}), "analyze", "{tmp}/t.jsonl"),
        2,
        names("{tmp}/t.jsonl:1:", "step"),
    ),
    "readout binary": Case(
        with_file("t.jsonl", b"\x00\x01\x02\xff\n", "analyze", "{tmp}/t.jsonl"),
        2,
        names("{tmp}/t.jsonl:1:"),
    ),
    "nothing to judge": Case(
        with_file("d/notes.txt", "hello", "analyze", "{tmp}/d"),
        2,
        names("{tmp}/d", "not something tracedeck can judge"),
    ),
    "threshold not k=v": Case(
        names("analyze", "--kind", "equivalence", "--threshold", "oops", "{tmp}"),
        2,
        names("--threshold 'oops'", "KEY=VALUE"),
    ),
    "threshold NaN": Case(
        names("analyze", "--kind", "equivalence", "--threshold", "p99_abs_diff_max=nan", "{tmp}"),
        2,
        names("p99_abs_diff_max", "finite"),
    ),
    "threshold infinite": Case(
        names("analyze", "--kind", "equivalence", "--threshold", "max_abs_diff_max=inf", "{tmp}"),
        2,
        names("max_abs_diff_max", "finite"),
    ),
    "workers not a number": Case(
        names("analyze", "--kind", "equivalence", "--workers", "0", "{tmp}"),
        2,
        names("--workers", "1 or more"),
    ),
    "threshold unknown": Case(
        names("analyze", "--kind", "equivalence", "--threshold", "nope=1", "{tmp}"),
        2,
        names("nope"),
    ),
    "seeds not numbers": Case(
        names("analyze", "--kind", "equivalence", "--seeds", "a,b", "{tmp}"),
        2,
        names("--seeds"),
    ),
    "dsa trace garbage": Case(
        with_file("trace/block0/trace_steps_0_2.jsonl", "{not json\n", "analyze", "{tmp}/trace"),
        1,  # a DSA trace is what is judged: a broken one is TRACE_INVALID, located
        names("{tmp}/trace/block0/trace_steps_0_2.jsonl:1:", "not valid JSON", "TRACE_INVALID"),
    ),
    "kv log garbage": Case(
        with_file(
            "test-kvcache-invariance.log",
            "random words\n",
            "analyze",
            "--kind",
            "kv_invariance",
            "{tmp}/test-kvcache-invariance.log",
        ),
        3,  # the test's log shows no backend ran: the engine's failure, not a verdict
        names("{tmp}/test-kvcache-invariance.log", "no backend ran"),
    ),
    # --- run records ---------------------------------------------------------------------------
    "replay without events": Case(
        lambda tmp: ["replay", "--headless", str(run_record(tmp, "{}"))],
        2,
        names("{tmp}/run/events.jsonl", "no recorded events"),
    ),
    "replay corrupt middle line": Case(
        lambda tmp: _events(tmp, FIRST_EVENT + "{bad\n" + FIRST_EVENT),
        2,
        names("{tmp}/run/events.jsonl:2:"),
    ),
    "replay unknown event": Case(
        lambda tmp: _events(tmp, '{"type": "nope"}\n'),
        2,
        names("{tmp}/run/events.jsonl:1:", "unknown event type"),
    ),
    "attach not a run": Case(names("attach", "{tmp}"), 2, names("{tmp}", "not a run")),
    "attach corrupt run.json": Case(
        lambda tmp: ["attach", str(run_record(tmp, "{oops"))],
        2,
        names("{tmp}/run/run.json"),
    ),
    "attach run.json holds a list": Case(
        lambda tmp: ["attach", str(run_record(tmp, "[1, 2]"))],
        2,
        names("{tmp}/run/run.json"),
    ),
    "cancel run.json missing keys": Case(
        lambda tmp: ["cancel", str(run_record(tmp, {"run_id": "x"}))],
        2,
        names("{tmp}/run/run.json"),
    ),
    "trust port out of range": Case(names("trust", "127.0.0.1:99999"), 2, names("127.0.0.1:99999")),
    "trust port not a number": Case(names("trust", "127.0.0.1:ssh"), 2, names("127.0.0.1:ssh")),
    "trust unresolvable host": Case(
        names("trust", "nosuchhost.invalid"),
        3,
        names("nosuchhost.invalid:22", "fetch the host key"),
    ),
    "trust nothing listening": Case(
        names("trust", "127.0.0.1:1"), 3, names("127.0.0.1:1", "fetch the host key")
    ),
    "watch symlinked block dir": Case(
        lambda tmp: _linked_block(tmp), 2, names("{tmp}/watched/block16", "symbolic link")
    ),
    "watch shard line over 64 MiB": Case(
        lambda tmp: _bad_shard(tmp, b'{"x":"' + b"x" * (65 << 20) + b'"}'),
        1,  # the trace is what is judged: an unreadable record is TRACE_INVALID, located
        names("{tmp}/trace/block16/trace_steps_0_2.jsonl:1:", "TRACE_INVALID"),
    ),
    "watch record nested 200000 deep": Case(
        lambda tmp: _bad_shard(tmp, b"", deep=True),
        1,
        names("{tmp}/trace/block16/trace_steps_0_2.jsonl:1:", "TRACE_INVALID"),
    ),
    "analyze record nested 200000 deep": Case(
        lambda tmp: [
            "analyze",
            _bad_shard(tmp, b"", deep=True)[1],
        ],
        1,
        names("{tmp}/trace/block16/trace_steps_0_2.jsonl:1:", "TRACE_INVALID"),
    ),
    "watch host that never speaks": Case(
        lambda tmp: ["watch", f"ssh://root@127.0.0.1:{_silent_port()}/{tmp}/trace", "--idle", "1"],
        3,
        names("no SSH answer from root@127.0.0.1:", "within"),
    ),
}

_SILENT: list[socket.socket] = []


def _silent_port() -> int:
    """A TCP port that accepts connections and never says a word (no SSH banner)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    _SILENT.append(server)  # kept open: connections wait in its backlog, never answered
    return server.getsockname()[1]


def _bad_shard(tmp: Path, line: bytes, deep: bool = False) -> list[str]:
    """A finished DSA trace (summary.json there) whose first shard starts with `line` (deep: a
    copy of its first record with an array nested 200,000 deep added)."""
    block = write_trace(tmp / "trace")
    shard = block / "trace_steps_0_2.jsonl"
    data = shard.read_bytes()
    if deep:
        line = data.split(b"\n", 1)[0][:-1] + b',"deep":' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    shard.write_bytes(line + b"\n" + data)
    return ["watch", str(tmp / "trace"), "--idle", "1", "--headless"]


def _linked_block(tmp: Path) -> list[str]:
    block = write_trace(tmp / "elsewhere")
    (tmp / "watched").mkdir()
    (tmp / "watched" / block.name).symlink_to(block)
    return ["watch", str(tmp / "watched"), "--idle", "1", "--headless"]


def _fleet(tmp: Path, text: str) -> list[str]:
    """A config with the given fleets, and a run aimed at the fleet `rack`."""
    return _host_config(tmp, text) + preset(GOOD, "--target", "rack")(tmp)


def _host_config(tmp: Path, text: str) -> list[str]:
    config = tmp / "home" / ".config" / "tracedeck" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(text)
    return []


def _events(tmp: Path, text: str) -> list[str]:
    run = run_record(tmp, "{}")
    (run / "events.jsonl").write_text(text)
    return ["replay", "--headless", str(run)]


@pytest.mark.parametrize("name", list(CASES))
def test_a_bad_input_is_refused_naming_what_is_wrong(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TRACEDECK_HOME", str(home / "td"))
    argv = case.build(tmp_path)
    try:
        code = main(argv)  # any other exception escaping here is a traceback the operator sees
    except SystemExit as exc:  # argparse's own refusal of a malformed option
        code = exc.code
    said = capsys.readouterr()
    text = said.err + said.out  # a verdict's first fail is part of the result, on stdout
    handled = bad_input(text)
    assert code == case.code, f"{argv} exited {code}: {text}"
    assert "Traceback" not in text
    for word in case.words(tmp_path):
        assert word in text, f"{word!r} not in: {text}"
    assert_nothing_left(tmp_path)  # whatever it launched or half-launched is gone, lock free
    handled()
