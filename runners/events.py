"""Typed events: the one stream every consumer (headless printer, recorder, console) reads."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

import orjson


@dataclass(slots=True)
class Event:
    type: ClassVar[str] = "event"
    t: float = field(default_factory=time.time, kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["type"] = self.type
        return data

    def to_json(self) -> bytes:
        return orjson.dumps(self.to_dict(), option=orjson.OPT_SERIALIZE_NUMPY)


@dataclass(slots=True)
class RunStarted(Event):
    type: ClassVar[str] = "run_started"
    run_id: str
    preset: str
    kind: str
    target: str
    local_dir: str
    remote_dir: str
    cells: list[dict[str, Any]]
    profile: str
    env: dict[str, str]
    attached: bool = False


@dataclass(slots=True)
class LockAcquired(Event):
    type: ClassVar[str] = "lock_acquired"
    lock: str
    holder: dict[str, Any]


@dataclass(slots=True)
class LockBusy(Event):
    type: ClassVar[str] = "lock_busy"
    lock: str
    holder: dict[str, Any]


@dataclass(slots=True)
class CellStarted(Event):
    """A cell began on the target; cell -1 is the setup step."""

    type: ClassVar[str] = "cell_started"
    cell: int
    params: dict[str, Any]
    command: str


@dataclass(slots=True)
class OutputLines(Event):
    """Complete lines a cell wrote, with the byte offset in `file` they end at."""

    type: ClassVar[str] = "output"
    cell: int
    stream: str
    lines: list[str]
    file: str
    end_offset: int


@dataclass(slots=True)
class TraceRecords(Event):
    """Parsed JSONL trace records followed from the target, batched."""

    type: ClassVar[str] = "trace"
    cell: int
    file: str
    records: list[dict[str, Any]]
    first_line: int
    last_line: int
    end_offset: int


@dataclass(slots=True)
class ArtifactFetched(Event):
    type: ClassVar[str] = "artifact"
    cell: int
    path: str
    size: int
    sha256: str


@dataclass(slots=True)
class CellFinished(Event):
    """state: passed | failed | cancelled | lost."""

    type: ClassVar[str] = "cell_finished"
    cell: int
    state: str
    exit_code: int | None
    duration_s: float | None


@dataclass(slots=True)
class PairVerdict(Event):
    """One prefill-vs-decode pair judged (B3.67 section 2.2 metrics.json content)."""

    type: ClassVar[str] = "pair_verdict"
    seed: int
    kv_aligned: int
    verdict: str
    metrics: dict[str, Any]
    thresholds: dict[str, float]
    first_fail: dict[str, Any] | None
    metrics_path: str


@dataclass(slots=True)
class ReadoutRow(Event):
    """One prompt's readout judgement (B3.11/B3.12), re-sent as it fills in."""

    type: ClassVar[str] = "readout_row"
    cell: int
    row: dict[str, Any]


@dataclass(slots=True)
class Connection(Event):
    """state: lost | retrying | restored."""

    type: ClassVar[str] = "connection"
    state: str
    message: str
    attempt: int = 0


@dataclass(slots=True)
class Error(Event):
    type: ClassVar[str] = "error"
    message: str
    where: str = ""
    # False for trouble reaching the target, which says nothing about the engine's results.
    affects_verdict: bool = True


@dataclass(slots=True)
class RunFinished(Event):
    """verdict is the kind's global verdict word; exit_code follows the CLI's contract."""

    type: ClassVar[str] = "run_finished"
    verdict: str
    exit_code: int
    summary: dict[str, Any]


EVENT_TYPES: dict[str, type[Event]] = {
    cls.type: cls
    for cls in (
        RunStarted,
        LockAcquired,
        LockBusy,
        CellStarted,
        OutputLines,
        TraceRecords,
        ArtifactFetched,
        CellFinished,
        PairVerdict,
        ReadoutRow,
        Connection,
        Error,
        RunFinished,
    )
}


def event_from_dict(data: dict[str, Any]) -> Event:
    """Rebuild an event from its recorded form; raises ValueError for an unknown type."""
    data = dict(data)
    kind = data.pop("type", None)
    cls = EVENT_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        raise ValueError(f"unknown event type {kind!r}")
    return cls(**data)
