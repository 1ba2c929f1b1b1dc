"""The kind contract has one path each (issue 22): event types come from the registry passed
in, a digest is applied the same way live and on attach, the rule "an engine crash or a
cut-short run is never a verdict" holds for every kind from the base judge, and a kind
without an analyze entry is a usage error naming it, never a traceback."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
from dsa_writer import write_trace
from runhelp import ROOT, cli_env, run_dirs, tracedeck

import runners.kinds
from runners.cells import PlannedCell
from runners.events import CORE_EVENTS, CellFinished, RunFinished, TraceBatch, event_from_dict
from runners.exits import EXIT_FAIL, EXIT_INFRA, EXIT_PASS
from runners.kind import ENGINE_ERROR, Ending, Judge, JudgeContext, Kind
from runners.kinds import all_kinds, event_types, load_preset
from runners.kinds.readout import ReadoutJudge
from runners.presets import resolve_preset

# -- event types: the registry is passed in, nothing registers on import ---------------------------


def test_decoding_uses_the_table_it_is_given() -> None:
    recorded = {"type": "pair_verdict", "seed": 0, "kv_aligned": 1, "verdict": "PASS_EQUIV"}
    recorded |= {"metrics": {}, "thresholds": {}, "first_fail": None, "metrics_path": "m"}
    with pytest.raises(ValueError, match="unknown event type 'pair_verdict'"):
        event_from_dict(recorded, CORE_EVENTS)
    assert type(event_from_dict(recorded, event_types())).__name__ == "PairVerdict"
    assert set(CORE_EVENTS) < set(event_types())


def test_the_core_loads_no_kind_on_import() -> None:
    """Decoding and preset loading take the registry; importing them imports no kind."""
    code = (
        "import sys, runners.events, runners.record, runners.presets, runners.plan, "
        "runners.kind, runners.cells; "
        "print([m for m in sys.modules if m.startswith('runners.kinds')])"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


CLASH = '''
"""A kind whose event takes a core event's type word."""
from typing import ClassVar

from runners.events import Event, event
from runners.kind import Judge, Kind


@event
class Clash(Event):
    type: ClassVar[str] = "cell_finished"
    cell: int


class ClashKind(Kind):
    name = "clash"
    judge_class = Judge
    events = (Clash,)


KIND = ClashKind()
'''


def own_event(module: str, word: str) -> str:
    """A kind module whose one event class has the type word given."""
    return (
        CLASH.replace("ClashKind", f"{module.title()}Kind")
        .replace('name = "clash"', f'name = "{module}"')
        .replace('"cell_finished"', f'"{word}"')
    )


@pytest.fixture
def plugged(tmp_path: Path) -> Iterator[Path]:
    """A kinds folder merged into the registry for the test."""
    folder = tmp_path / "runners" / "kinds"
    folder.mkdir(parents=True)
    runners.kinds.__path__.append(str(folder))
    try:
        yield folder
    finally:
        runners.kinds.__path__.remove(str(folder))
        runners.kinds.reload()


def test_a_kind_whose_event_type_is_a_core_one_is_refused_naming_it(plugged: Path) -> None:
    (plugged / "clash.py").write_text(textwrap.dedent(CLASH))
    runners.kinds.reload()
    assert "clash" not in all_kinds()
    [problem] = runners.kinds.problems()
    assert "runners.kinds.clash" in problem and "'cell_finished'" in problem
    assert event_types()["cell_finished"] is CellFinished


def test_two_kinds_with_one_event_type_the_second_is_refused_naming_the_first(
    plugged: Path,
) -> None:
    (plugged / "alpha.py").write_text(textwrap.dedent(own_event("alpha", "shared_word")))
    (plugged / "beta.py").write_text(textwrap.dedent(own_event("beta", "shared_word")))
    runners.kinds.reload()
    assert "alpha" in all_kinds() and "beta" not in all_kinds()
    [problem] = runners.kinds.problems()
    assert problem == (
        "run kind module runners.kinds.beta: event type 'shared_word' "
        "(taken by runners.kinds.alpha)"
    )
    assert event_types()["shared_word"].__module__ == "runners.kinds.alpha"


# -- digests: applied one way, live and on attach ------------------------------------------------


def readout_judge(tmp_path: Path) -> ReadoutJudge:
    preset = load_preset(
        resolve_preset("b3_11_readout"),
        ['matrix.prompt=["p0_short"]', 'readout.prompts=["alpha", "beta", "gamma"]'],
    )
    cells = [PlannedCell(0, {"prompt": "p0_short"}, "true", {})]
    ctx = JudgeContext(preset=preset, local_dir=tmp_path, date="d", emit=lambda e: None)
    ctx.cells = cells
    judge = all_kinds()["readout"].judge(ctx)
    assert isinstance(judge, ReadoutJudge)
    return judge


def readout_lines() -> list[bytes]:
    """Two prompts' prefill_last lines with a broken prefill_last line between them."""
    sample = ROOT / "presets" / "samples" / "b3_12_mi300x.jsonl"
    prefill = json.loads(sample.read_text().splitlines()[0])
    prefill.pop("prompt", None)
    broken = {k: v for k, v in prefill.items() if k != "top1_id"}
    return [json.dumps(line).encode() for line in (prefill, broken, prefill)]


def follow(judge: Judge, cell: int, file: str, batches: list[list[bytes]]) -> list[TraceBatch]:
    """Lines as the follower hands them over; the TraceBatch events the record gets."""
    recorded, line, offset = [], 1, 0
    for lines in batches:
        offset += sum(len(raw) + 1 for raw in lines)
        digest = judge.take_lines(cell, file, lines, line, offset)
        event = TraceBatch(cell, file, line, line + len(lines) - 1, offset, digest.data)
        recorded.append(event_from_dict(json.loads(event.to_json()), event_types()))
        line += len(lines)
    return recorded  # type: ignore[return-value]


def test_a_readout_judge_attached_holds_what_the_live_one_holds(tmp_path: Path) -> None:
    """A bad prefill_last line between two prompts: live, it used to take the preset's next
    name (the second prompt became "gamma"), while an attach named it "beta"."""
    live = readout_judge(tmp_path)
    recorded = follow(live, 0, "/r/artifacts/t.jsonl", [readout_lines()[:2], readout_lines()[2:]])
    attached = readout_judge(tmp_path)
    for event in recorded:
        attached.fold(event)
    names = [row["prompt"] for row in live.book.rows().values()]
    assert names == ["alpha", "beta"]
    assert live.book.rows() == attached.book.rows()
    assert (live.named, live.opened) == (attached.named, attached.opened)


def test_a_digest_changes_nothing_until_it_is_applied(tmp_path: Path) -> None:
    judge = readout_judge(tmp_path)
    digest = judge.digest(0, "/r/artifacts/t.jsonl", readout_lines(), 1)
    assert digest.data is not None and len(digest.data["facts"]) == 2
    assert judge.book.rows() == {} and judge.named == {} and judge.opened == {}


def dsa_judge(tmp_path: Path) -> Judge:
    kind = all_kinds()["dsa_trace"]
    assert kind.smoke is not None
    preset = load_preset(resolve_preset(kind.smoke[0]), ["dsa.topk=32", "vars.topk=32"])
    ctx = JudgeContext(preset=preset, local_dir=tmp_path, date="d", emit=lambda e: None)
    return kind.judge(ctx)


def test_a_dsa_judge_attached_mid_trace_goes_on_as_the_live_one(tmp_path: Path) -> None:
    """Attached after half the trace, then following the rest live: the same book and verdict
    as a judge that followed it all (the records after the attach are checked against the ones
    before it)."""
    block = write_trace(tmp_path / "trace", requests=6, per_file=3, layers=3, steps=3)
    shards = sorted(p for p in block.iterdir() if p.name.startswith("trace_steps"))
    assert len(shards) == 2
    batches = {
        f"/r/artifacts/{block.name}/{p.name}": [
            lines[i : i + 7] for lines in [p.read_bytes().splitlines()] for i in range(0, 99, 7)
        ]
        for p in shards
    }
    live = dsa_judge(tmp_path)
    recorded = {file: follow(live, 0, file, [b for b in got if b]) for file, got in batches.items()}
    first, second = list(batches)
    resumed = dsa_judge(tmp_path)
    for event in recorded[first]:
        resumed.fold(event)
    follow(resumed, 0, second, [b for b in batches[second] if b])
    ending = Ending("done")
    assert resumed.book.totals() == live.book.totals()  # type: ignore[attr-defined]
    assert resumed.book.totals()["records"] > 0  # type: ignore[attr-defined]
    assert resumed.verdict(ending).summary == live.verdict(ending).summary


# -- the rule every kind shares, applied once by the base judge ----------------------------------


class Liar(Judge):
    """A kind's judge that says its pass word whatever happened."""

    def verdict(self, ending: Ending) -> RunFinished:
        summary = {"word": self.kind.pass_word, "reason": "every item passed"}
        return RunFinished(verdict=self.kind.pass_word, exit_code=EXIT_PASS, summary=summary)


class FailingItems(Judge):
    """A judge that found a failing item (judged apart from the crashed one)."""

    def verdict(self, ending: Ending) -> RunFinished:
        summary = {"word": "BAD", "reason": "item 2 differs"}
        return RunFinished(verdict="BAD", exit_code=EXIT_FAIL, summary=summary)


def judged(judge_class: type[Judge], apart: bool, ending: Ending, *ends: CellFinished) -> Any:
    class Made(Kind):
        name = "made"
        judge_class = Judge
        pass_word, fail_word = "GOOD", "BAD"
        pass_words = frozenset({"GOOD"})
        judges_items_apart: ClassVar[bool] = apart
        verdict_key = "word"

    preset = load_preset(resolve_preset("hello_command"))
    cells = [PlannedCell(i, {"n": i}, "true", {}) for i in range(2)]
    ctx = JudgeContext(preset=preset, local_dir=Path("."), date="d", emit=lambda e: None)
    ctx.cells = cells
    judge = judge_class(Made(), ctx)
    for end in ends:
        judge.fold(end)
    return judge.finish(ending)


PASSED = CellFinished(cell=0, state="passed", exit_code=0, duration_s=1.0)
CRASHED = CellFinished(cell=1, state="failed", exit_code=7, duration_s=1.0, stderr_tail="boom")


@pytest.mark.parametrize("apart", [False, True])
def test_a_crashed_engine_is_never_a_pass_whatever_the_kind_says(apart: bool) -> None:
    result = judged(Liar, apart, Ending("done"), PASSED, CRASHED)
    assert (result.verdict, result.exit_code) == (ENGINE_ERROR, EXIT_INFRA)
    assert result.summary["word"] == ENGINE_ERROR
    assert result.summary["engine_errors"] == [
        "cell 2/2 (n=1): the engine crashed (exit 7); stderr ends: boom"
    ]
    assert result.summary["reason"].startswith("cell 2/2 (n=1): the engine crashed (exit 7)")


def test_a_failure_found_in_another_item_stands_for_a_kind_judging_items_apart() -> None:
    result = judged(FailingItems, True, Ending("done"), PASSED, CRASHED)
    assert (result.verdict, result.exit_code) == ("BAD", EXIT_FAIL)
    assert "engine_errors" not in result.summary


def test_a_crash_outranks_a_failure_for_a_kind_judging_the_run_whole() -> None:
    result = judged(FailingItems, False, Ending("done"), PASSED, CRASHED)
    assert (result.verdict, result.exit_code) == (ENGINE_ERROR, EXIT_INFRA)


@pytest.mark.parametrize("apart", [False, True])
def test_a_run_cut_short_ends_with_its_ending_word_in_every_place(apart: bool) -> None:
    result = judged(Liar, apart, Ending("cancelled", "operator pressed c"), PASSED)
    assert (result.verdict, result.summary["word"]) == ("CANCELLED", "CANCELLED")
    assert result.summary["reason"].startswith("the run ended CANCELLED before it was judged")
    assert result.summary["error"] == "operator pressed c"


def test_a_clean_run_keeps_the_kinds_own_word() -> None:
    passed = CellFinished(cell=1, state="passed", exit_code=0, duration_s=1.0)
    result = judged(Liar, False, Ending("done"), PASSED, passed)
    assert (result.verdict, result.exit_code, result.summary["word"]) == ("GOOD", 0, "GOOD")
    assert result.summary["reason"] == "every item passed"


# -- analyze is a capability the CLI can see ------------------------------------------------------


def test_analyze_on_a_run_of_a_kind_without_analyze_is_a_usage_error(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    out = tmp_path / "out"
    isolated = [f'target.runs="{tmp_path}/remote"', f'target.lock="{tmp_path}/lock"']
    sets = [a for s in ["matrix.n=[1]", *isolated] for a in ("--set", s)]
    done = tracedeck("run", "hello_command", "--out", str(out), *sets, env=cli_env(home))
    assert done.returncode == 0, done.stdout + done.stderr
    [local] = run_dirs(out)
    assert not all_kinds()["command"].analyzes and all_kinds()["readout"].analyzes
    for extra in ([], ["--kind", "command"]):
        got = tracedeck("analyze", str(local), *extra, env=cli_env(home))
        assert got.returncode == 2, got.stdout + got.stderr
        assert "Traceback" not in got.stderr
        assert "the command kind has no analyze" in got.stderr, got.stderr
        assert "kinds with one: dsa_trace, equivalence, kv_invariance, readout" in got.stderr
