"""Progress of long work: measured in runners (events, never recorded), drawn by the console
and headless (a line redrawn on a terminal, plain lines now and then in a CI log)."""

from __future__ import annotations

import asyncio
import io
from pathlib import Path

import orjson
from test_engines_doc import write_example

from console.headless import CLEAR, Printer, ProgressShow
from runners.events import Progress, RunFinished
from runners.kinds import load_preset
from runners.kinds.equivalence import analyze_tree
from runners.progress import Meter, ProgressLines, progress_text
from runners.run import Run


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_meter_rate_eta_and_text() -> None:
    clock, seen = Clock(), []
    meter = Meter("fetch", "a/logits.jsonl.gz", "bytes", seen.append, clock=clock)
    meter.update(0, 100 << 20)
    clock.now += 2
    meter.update(50 << 20)
    meter.update(60 << 20)  # within 0.25 s of the last: not sent
    clock.now += 2
    meter.update(100 << 20)
    meter.finish()
    assert [p.done for p in seen] == [0, 50 << 20, 100 << 20, 100 << 20]
    assert progress_text(seen[1]) == (
        "fetch a/logits.jsonl.gz: 50.0 MiB of 100.0 MiB (50%), 25.0 MiB/s, ETA 2s"
    )
    assert seen[-1].finished and progress_text(seen[-1]).endswith("25.0 MiB/s, done")
    records = Progress(
        what="follow", label="t.jsonl", done=12345, total=None, unit="records", rate=2000.0
    )
    assert progress_text(records) == "follow t.jsonl: 12,345 records, 2,000.0 records/s"


def test_plain_lines_for_a_log_only_for_long_work() -> None:
    clock = Clock()
    lines = ProgressLines(every_s=5.0, clock=clock)

    def p(done: float, finished: bool = False) -> Progress:
        return Progress(
            what="judge", label="tree", done=done, total=10, unit="pairs", finished=finished
        )

    assert not lines.wants(p(1))  # the first second says nothing
    clock.now += 1.5
    assert lines.wants(p(2))
    clock.now += 1
    assert not lines.wants(p(3))
    clock.now += 5
    assert lines.wants(p(6))
    assert lines.wants(p(10, finished=True))  # it was shown: its end is too
    assert not lines.wants(p(1)) and not lines.wants(p(1, finished=True))  # short: silent


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_headless_redraws_one_line_on_a_terminal_and_clears_it_before_output() -> None:
    out = Tty()
    printer = Printer(out=out)
    printer(Progress(what="fetch", label="x.bin", done=1, total=4, unit="bytes"))
    printer(Progress(what="fetch", label="x.bin", done=2, total=4, unit="bytes"))
    printer(RunFinished(verdict="PASS", exit_code=0, summary={}))
    text = out.getvalue()
    assert text.startswith(CLEAR + "fetch x.bin: 1 B of 4 B (25%)")
    assert CLEAR + "fetch x.bin: 2 B of 4 B (50%)" in text
    assert (CLEAR + "RESULT: PASS (exit 0)\n") in text  # the progress line gave way
    plain = io.StringIO()
    show = ProgressShow(plain)
    show.plain = ProgressLines(every_s=5.0, clock=(clock := Clock()))
    show.show(Progress(what="fetch", label="x.bin", done=1, total=4, unit="bytes"))
    clock.now += 2
    show.show(Progress(what="fetch", label="x.bin", done=2, total=4, unit="bytes"))
    assert plain.getvalue() == "progress: fetch x.bin: 2 B of 4 B (50%)\n"
    json_out = io.StringIO()
    Printer(out=json_out, json_lines=True)(Progress(what="a", label="b", done=1, total=2, unit="x"))
    assert json_out.getvalue() == ""  # --json prints the record's events only


BIG = """
[preset]
name = "big"
kind = "command"
description = "a large artifact and a long trace"

[target]
runs = "{runs}"
lock = "{lock}"

[engine]
command = "head -c 33554432 /dev/zero > {{out}}/big.bin && seq 1 3000 > {{out}}/t.jsonl"

[matrix]
n = [1]

[artifacts]
fetch = ["big.bin"]

[traces]
follow = ["t.jsonl"]
"""


def run_session(preset_path: Path, out: Path, overrides: list[str] | None = None) -> list:
    seen: list = []

    async def go() -> None:
        preset = load_preset(preset_path, overrides or [])
        session = Run.create(preset, "local", out, seen.append)
        await session.launch()
        await session.follow()
        await session.close()

    asyncio.run(go())
    return seen


def test_a_run_reports_fetch_and_follow_progress_and_never_records_it(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_text(BIG.format(runs=tmp_path / "remote", lock=tmp_path / "lock"))
    seen = run_session(path, tmp_path / "out")
    fetch = [e for e in seen if isinstance(e, Progress) and e.what == "fetch"]
    assert fetch[-1].finished and fetch[-1].done == fetch[-1].total == 32 << 20
    assert fetch[-1].unit == "bytes" and fetch[-1].label == "big.bin"
    follow = [e for e in seen if isinstance(e, Progress) and e.what == "follow"]
    assert follow[-1].finished and follow[-1].done == 3000 and follow[-1].label == "t.jsonl"
    assert seen[-1].verdict == "PASS"
    [local] = [p.parent for p in (tmp_path / "out").glob("**/run.json")]
    recorded = [
        orjson.loads(line)["type"] for line in (local / "events.jsonl").read_bytes().splitlines()
    ]
    assert "progress" not in recorded and "artifact" in recorded


def test_judging_reports_tokens_live_and_pairs_in_analyze(tmp_path: Path) -> None:
    engine, preset = write_example(tmp_path)
    overrides = [
        f'vars.engine="{engine}"',
        "matrix.seed=[0]",
        f'target.runs="{tmp_path}/remote"',
        f'target.lock="{tmp_path}/lock"',
    ]
    seen = run_session(preset, tmp_path / "out", overrides)
    judged = [e for e in seen if isinstance(e, Progress) and e.what == "judge"]
    assert {e.label for e in judged if e.finished} == {"kv_aligned=1 seed=0", "kv_aligned=0 seed=0"}
    assert all(e.unit == "tokens" and e.total == 8 for e in judged)
    [local] = [p.parent for p in (tmp_path / "out").glob("**/run.json")]
    pairs: list[tuple[int, int]] = []
    analyze_tree(
        local, output=tmp_path / "report", progress=lambda done, total: pairs.append((done, total))
    )
    assert pairs == [(1, 2), (2, 2)]


def test_a_backlog_read_at_once_is_no_rate() -> None:
    """A new shard's first read brings its backlog in a millisecond: no 3,192,168 records/s."""
    clock, seen = Clock(), []
    meter = Meter("follow", "shard-1.jsonl", "records", seen.append, clock=clock)
    clock.now += 0.001
    meter.update(3192)
    assert seen[-1].rate is None and "/s" not in progress_text(seen[-1])
    clock.now += 2
    meter.update(3292)
    assert seen[-1].rate == 50.0
