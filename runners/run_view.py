"""A recorded run read back as a diff, a JUnit report or a trend sees it (analysis.run_compare).

Reads the run's record (run.json, events.jsonl) and what came home with it (the engine's
metadata.json files, for its identity); the items are the run kind's own reading of the events.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from analysis.run_compare import FAIL, RunSide
from runners.events import Event, RunFinished
from runners.exits import EXIT_FAIL
from runners.kinds import all_kinds, event_types
from runners.record import EVENTS, RunRecord, iter_events, paused_gc

# The engine's own identity in the metadata it writes (seed 000 2.1: git_commit), in the order
# they are shown; "unknown" and empty values say nothing and are left out.
ENGINE_FIELDS = ("git_commit", "engine", "engine_version", "torch_version", "device")
VERSION_EVENT = "engine_version"
# The engine's JSON documents that carry its identity: B3.67 metadata.json (seed 000), the 03C
# result.json, a DSA summary.json; small ones only (they are read whole).
IDENTITY_FILES = ("metadata.json", "result.json", "summary.json")
IDENTITY_MAX_BYTES = 1 << 20


def load_side(local_dir: Path, events: list[dict[str, Any]] | None = None) -> RunSide:
    """The run in local_dir as a RunSide; ValueError / FileNotFoundError naming the file.
    events: the record's events as its lines hold them, when the caller has read them."""
    record = RunRecord.load(local_dir)
    path = Path(local_dir) / EVENTS
    if events is None:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: the run recorded no events; nothing to compare")
        events = [e.to_dict() for e in iter_events(path, event_types())]
    kind = all_kinds().get(record.kind)
    if kind is None:
        raise ValueError(f"{local_dir}: run kind {record.kind!r} is not known to this tracedeck")
    started = next((e for e in events if e["type"] == "run_started"), None)
    finished = next((e for e in reversed(events) if e["type"] == "run_finished"), None)
    summary = finished["summary"] if finished else None
    items = kind.compare_items(events, summary)
    verdict = finished["verdict"] if finished else None
    exit_code = finished["exit_code"] if finished else None
    tone = kind.tone(verdict) if verdict is not None else None
    if exit_code not in (0, None):  # a non-zero exit is never a pass, whatever the word says
        tone = FAIL
    problems = []
    failing = [i for i in items if i.tone == FAIL]
    if exit_code == 0 and failing:  # a pass its own items deny: an edited record, or a bug
        problems.append(
            f"{path}: the record's verdict {verdict} (exit 0) is contradicted by its own events "
            f"({failing[0].klass} {failing[0].key}: {failing[0].verdict}): not believed"
        )
        verdict, exit_code, tone = f"{verdict} (contradicted)", EXIT_FAIL, FAIL
    if summary:
        problems += [str(x) for x in summary.get("engine_errors", [])]
        problems += [str(x) for x in summary.get("errors", [])]
        if summary.get("error"):
            problems.append(str(summary["error"]))
    matrix = dict(record.preset_data.get("matrix") or {})
    return RunSide(
        run_id=record.run_id,
        preset=record.preset,
        kind=record.kind,
        matrix=matrix,
        verdict=verdict,
        tone=tone,
        exit_code=exit_code,
        items=items,
        identity=identity(record, started, events, Path(local_dir)),
        started_at=record.started_at,
        path=str(local_dir),
        problems=problems,
    )


def item_words(local_dir: Path) -> Callable[[Event], Event]:
    """For a replay: a function that returns a recorded event as it may be shown. An event
    stating an item's verdict word that the item's recomputation from the event's own data
    (Kind.item_of) contradicts comes back with its word marked: a forged PASS_EQUIV for a
    pair whose own metrics fail is never printed as that pass. ValueError / FileNotFoundError
    when the record cannot be read (as RunRecord.load)."""
    kind = all_kinds().get(RunRecord.load(local_dir).kind)
    if kind is None or not kind.item_events:
        return as_recorded  # no event of this kind states an item's word
    stating = kind.item_events

    def shown(event: Event) -> Event:
        if not isinstance(event, stating):
            return event
        item = kind.item_of(event)
        word = getattr(event, "verdict", None)
        if not isinstance(word, str):
            return event
        same_word = item.verdict.split(" (")[0] == word
        if same_word and (item.tone == FAIL) == (kind.tone(word) == FAIL):
            return event
        why = f"recomputed {item.verdict}" if not same_word else item.first_fail or "a failure"
        mark = f"{word} (contradicted: {why})"
        return dataclasses.replace(event, verdict=mark)  # type: ignore[type-var]

    return shown


def as_recorded(event: Event) -> Event:
    """A recorded event shown as it was recorded."""
    return event


def believed_end(
    local_dir: Path, end: RunFinished, events: list[dict[str, Any]] | None = None
) -> RunFinished:
    """A recorded run's end as a replay shows it: a pass its own events deny (load_side) is
    shown as what load_side makes of it (its word marked contradicted, exit 1, the reason)."""
    if end.exit_code != 0:
        return end
    side = load_side(local_dir, events)
    if side.exit_code == 0 or side.exit_code is None:
        return end
    summary = {**end.summary, "error": side.problems[0] if side.problems else ""}
    return RunFinished(
        verdict=str(side.verdict), exit_code=side.exit_code, summary=summary, t=end.t
    )


def checked_end(local_dir: Path, end: RunFinished, lines: list[bytes] | None = None) -> RunFinished:
    """believed_end for a screen: a record that cannot be read back is shown unchecked (exit
    2, why), never as the pass it says. lines: the record's lines, when the screen holds them
    (a replay: decoded once more as plain JSON, not read and made events again)."""
    try:
        with paused_gc():  # 100k decoded lines: most of the time was collections, not parsing
            events = None if lines is None else [orjson.loads(ln) for ln in lines if ln.strip()]
            return believed_end(Path(local_dir), end, events)
    except (OSError, ValueError, KeyError, TypeError, orjson.JSONDecodeError) as exc:
        error = f"the record cannot be read back to check its verdict: {exc}"
        summary = {**end.summary, "error": error}
        return RunFinished(
            verdict=f"{end.verdict} (unchecked)", exit_code=2, summary=summary, t=end.t
        )


def identity(
    record: RunRecord, started: dict[str, Any] | None, events: list[dict[str, Any]], local: Path
) -> dict[str, str]:
    """What the run ran on and with: engine, determinism, host, thresholds, options."""
    out: dict[str, str] = {}
    version = next((e for e in events if e["type"] == VERSION_EVENT), None)
    if version is not None:
        out["engine version"] = version.get("version") or f"unknown ({version.get('error')})"
    for name, value in engine_metadata(local, events).items():
        out[f"engine {name}" if name != "engine" else "engine"] = value
    data = record.preset_data
    out["engine command"] = str((data.get("engine") or {}).get("command", ""))
    if started is not None:
        out["determinism profile"] = str(started.get("profile", ""))
        flags = started.get("env") or {}
        out["determinism flags"] = " ".join(f"{k}={v}" for k, v in sorted(flags.items()))
    hosts = sorted({e["host"] for e in events if e.get("host")})
    out["host"] = ", ".join(hosts) if hosts else record.target
    out["console host"] = record.console_host
    if data.get("thresholds"):
        out["thresholds"] = " ".join(f"{k}={v}" for k, v in sorted(data["thresholds"].items()))
    if record.options:
        out["options"] = " ".join(f"--{o.replace('_', '-')}" for o in record.options)
    return {k: v for k, v in out.items() if v != ""}


def engine_metadata(local: Path, events: list[dict[str, Any]]) -> dict[str, str]:
    """The engine's identity from the JSON documents that came home (seed 000: every cell's
    metadata.json carries git_commit); values that differ across cells are all named."""
    seen: dict[str, list[str]] = {}
    for e in events:
        if e["type"] != "artifact" or e["path"].rsplit("/", 1)[-1] not in IDENTITY_FILES:
            continue
        if e.get("size", 0) > IDENTITY_MAX_BYTES:
            continue
        try:
            meta = json.loads((local / e["path"]).read_text())
        except (OSError, ValueError):
            continue  # a metadata file that did not stay: the identity is just not known
        if not isinstance(meta, dict):
            continue
        for name in ENGINE_FIELDS:
            value = meta.get(name)
            if value in (None, "", "unknown"):
                continue
            values = seen.setdefault(name, [])
            if str(value) not in values:
                values.append(str(value))
    return {name: " / ".join(values) for name, values in seen.items()}
