"""Typed events: the one stream every consumer (headless printer, recorder, console) reads.

Core events are defined here (CORE_EVENTS); a run kind defines its own events in its module
and declares them (Kind.events). Decoding a recorded event takes the table of types to decode
with (runners.kinds.event_types() gives every usable kind's); nothing registers on import.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar, dataclass_transform

import orjson

from runners.cells import CellState

E = TypeVar("E", bound="type[Event]")


@dataclass_transform(kw_only_default=False)
def event(cls: E) -> E:
    """Make an Event subclass a slotted dataclass; its `type` word must be its own."""
    made = dataclass(slots=True)(cls)
    if not isinstance(made.__dict__.get("type"), str):
        raise TypeError(f"{cls.__name__}: an event class must set its own `type` word")
    return made


@dataclass(slots=True)
class Event:
    type: ClassVar[str] = "event"
    t: float = field(default_factory=time.time, kw_only=True)
    # The host of a fleet run the event comes from (its spec as the operator wrote it); "" for a
    # run on one host and for the run's own events (verdicts). Recorded only when set, so the
    # records of one-host runs are what they always were, and old records decode unchanged.
    host: str = field(default="", kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if not data["host"]:
            del data["host"]
        data["type"] = self.type
        return data

    def to_json(self) -> bytes:
        """orjson.dumps(self.to_dict()), byte for byte, without to_dict's deep copy of every
        value (a TraceBatch's digest: 1.6 ms an event, where these take 25 us)."""
        data = {name: getattr(self, name) for name in _field_names(type(self))}
        if not data["host"]:
            del data["host"]
        data["type"] = self.type
        return orjson.dumps(data, default=_nested, option=_JSON_OPTIONS)


_JSON_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_PASSTHROUGH_DATACLASS


def _nested(value: Any) -> Any:
    """A dataclass inside an event's value, as asdict makes it (orjson's own form would leave
    out its fields whose names begin with an underscore)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    raise TypeError(f"Type is not JSON serializable: {type(value).__name__}")


@functools.cache
def _field_names(cls: type[Event]) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


@event
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
    # Said once at the top of the run: where it is judged and why (e.g. on the console,
    # because the host's python lacks numpy).
    notes: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        for n, cell in enumerate(self.cells):  # what every reader of the cells takes from them
            index = cell.get("index") if isinstance(cell, dict) else None
            if type(index) is not int or not isinstance(cell.get("params"), dict):
                raise ValueError(
                    f"run_started: field 'cells' item {n} is {repr(cell)[:80]}, not a cell (an "
                    "integer index and a params object)"
                )


@event
class EngineVersion(Event):
    """What the preset's [engine] version_command printed on the target before the run
    (its first line); error says why there is none (it failed, timed out, printed nothing)."""

    type: ClassVar[str] = "engine_version"
    command: str
    version: str
    error: str = ""


@event
class LockAcquired(Event):
    type: ClassVar[str] = "lock_acquired"
    lock: str
    holder: dict[str, Any]


@event
class LockBusy(Event):
    type: ClassVar[str] = "lock_busy"
    lock: str
    holder: dict[str, Any]


@event
class CellStarted(Event):
    """A cell began on the target; cell -1 is the setup step."""

    type: ClassVar[str] = "cell_started"
    cell: int
    params: dict[str, Any]
    command: str


@event
class OutputLines(Event):
    """Complete lines a cell wrote, with the byte offset in `file` they end at."""

    type: ClassVar[str] = "output"
    cell: int
    stream: str
    lines: list[str]
    file: str
    end_offset: int


@event
class TraceBatch(Event):
    """Lines first_line..last_line of a followed trace file, up to byte end_offset.

    The raw records are not recorded: `digest` is the run kind's compact account of them
    (what its judge and panel fold), so a long trace grows the record by its digests only.
    `cell` is the cell that wrote the lines (-1 the setup step, -2 outside every cell).
    """

    type: ClassVar[str] = "trace"
    cell: int
    file: str
    first_line: int
    last_line: int
    end_offset: int
    digest: dict[str, Any] | None = None
    # Trace events recorded before digests carried the parsed records; they are dropped on
    # decoding (the rows they fed were recorded as their own events).
    records: dataclasses.InitVar[list[dict[str, Any]] | None] = None

    def __post_init__(self, records: list[dict[str, Any]] | None) -> None:
        return None


@event
class ArtifactFetched(Event):
    type: ClassVar[str] = "artifact"
    cell: int
    path: str
    size: int
    sha256: str


@event
class ArtifactHeld(Event):
    """An artifact a passed cell wrote that stays on the target (it is judged there); `tracedeck
    fetch` brings it home when the operator asks."""

    type: ClassVar[str] = "artifact_held"
    cell: int
    path: str


@event
class ArtifactFailed(Event):
    """An artifact a passed cell should bring home did not come.

    missing: the file is not on the target (the engine did not write it); otherwise the
    transfer failed (link, disk) and `reason` says how.
    """

    type: ClassVar[str] = "artifact_failed"
    cell: int
    path: str
    reason: str
    missing: bool


@event
class CellFinished(Event):
    """state: a runners.cells.CellState word (passed, failed, skipped, cancelled, lost)."""

    type: ClassVar[str] = "cell_finished"
    cell: int
    state: str
    exit_code: int | None
    duration_s: float | None
    stderr_tail: str = ""  # the end of a failed cell's stderr, for whoever explains the failure
    # The scheduler's word when it ended the cell (Slurm: TIMEOUT, NODE_FAIL, PREEMPTED,
    # CANCELLED...): the cell was killed, never judged; "" when the cell ended by itself.
    scheduler: str = ""

    def __post_init__(self) -> None:
        try:  # a plain word on the wire, checked on decoding
            self.state = CellState(self.state).value
        except ValueError:
            words = ", ".join(s.value for s in CellState)
            raise ValueError(
                f"cell_finished: field 'state' is {repr(self.state)[:60]}, not one of {words}"
            ) from None


@event
class Connection(Event):
    """state: lost | retrying | restored."""

    type: ClassVar[str] = "connection"
    state: str
    message: str
    attempt: int = 0


@event
class Error(Event):
    type: ClassVar[str] = "error"
    message: str
    where: str = ""
    # False for trouble reaching the target, which says nothing about the engine's results.
    affects_verdict: bool = True


@event
class RunFinished(Event):
    """verdict is the kind's global verdict word; exit_code follows the CLI's contract."""

    type: ClassVar[str] = "run_finished"
    verdict: str
    exit_code: int
    summary: dict[str, Any]


@event
class HostAssigned(Event):
    """A fleet run started a batch of cells on `host` (the event's host): its own run directory,
    lock and marker (member), so that attach, cancel and replay find every host's part."""

    type: ClassVar[str] = "host_assigned"
    member: str  # the batch's run id on the host (TRACEDECK_RUN_ID of its processes)
    cells: list[int]
    run_dir: str
    lock: str
    workdir: str
    python: str
    judge_python: str = ""  # judged on the host with this python; "": on the console


@event
class HostState(Event):
    """A fleet host's state changed: connecting, waiting (its lock is busy), running, done,
    skipped (busy, and the operator chose to skip busy hosts), lost, failed."""

    type: ClassVar[str] = "host_state"
    state: str
    message: str = ""


@event
class CellRequeued(Event):
    """A cell of a lost host goes back to the queue, to run on another host of the fleet."""

    type: ClassVar[str] = "cell_requeued"
    cell: int
    reason: str


@event
class JobSubmitted(Event):
    """The run's cells went to a batch scheduler as one job array (Slurm: sbatch --parsable)."""

    type: ClassVar[str] = "job_submitted"
    scheduler: str
    job_id: str
    cells: list[int]
    partition: str = ""


@event
class SchedulerState(Event):
    """What the scheduler says of one cell's task: PENDING (reason), RUNNING (node),
    COMPLETED, FAILED, TIMEOUT, CANCELLED, NODE_FAIL, PREEMPTED, OUT_OF_MEMORY..."""

    type: ClassVar[str] = "scheduler_state"
    cell: int
    state: str
    reason: str = ""
    node: str = ""
    job_id: str = ""
    exit_code: int | None = None


@event
class Progress(Event):
    """Long work under way: a large artifact coming home, a tree being judged, a long trace
    being followed. For whoever watches live (console, headless terminal); never recorded.

    what: "fetch" | "judge" | "follow"; unit: "bytes" | "pairs" | "tokens" | "records";
    total None when unknown (a trace still being written); rate in units per second;
    eta_s None when it cannot be told; finished on the last one of a piece of work.
    """

    type: ClassVar[str] = "progress"
    what: str
    label: str
    done: float
    total: float | None
    unit: str
    rate: float | None = None
    eta_s: float | None = None
    finished: bool = False
    cell: int = -2


def type_table(classes: Iterable[type[Event]]) -> dict[str, type[Event]]:
    """Type word -> class; TypeError when two classes claim one word."""
    table: dict[str, type[Event]] = {}
    for cls in classes:
        taken = table.get(cls.type)
        if taken is not None and taken is not cls:
            raise TypeError(
                f"event type {cls.type!r} of {cls.__module__}.{cls.__qualname__} is already "
                f"taken by {taken.__module__}.{taken.__qualname__}"
            )
        table[cls.type] = cls
    return table


CORE_EVENTS: dict[str, type[Event]] = type_table(
    [
        RunStarted,
        EngineVersion,
        LockAcquired,
        LockBusy,
        CellStarted,
        OutputLines,
        TraceBatch,
        ArtifactFetched,
        ArtifactHeld,
        ArtifactFailed,
        CellFinished,
        Connection,
        Error,
        RunFinished,
        HostAssigned,
        HostState,
        CellRequeued,
        JobSubmitted,
        SchedulerState,
        Progress,
    ]
)


def event_from_dict(data: dict[str, Any], types: Mapping[str, type[Event]]) -> Event:
    """Rebuild an event from its recorded form with a table of types (runners.kinds.
    event_types()); raises ValueError for a type the table does not hold."""
    return event_from_owned(dict(data), types)


def event_from_owned(data: dict[str, Any], types: Mapping[str, type[Event]]) -> Event:
    """event_from_dict for a dict nobody else holds (just parsed): it is consumed, not copied.
    A field whose JSON type is not its declared one is a ValueError naming it (a record
    damaged or edited by hand is said, never read into a wrong shape)."""
    kind = data.pop("type", None)
    cls = types.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown event type {kind!r}")
    try:
        return _builder(cls)(data, kind)
    except TypeError as exc:  # a field missing, or one no such event has
        raise ValueError(f"{kind}: {exc}") from None


_ABSENT = object()
# JSON types a declared field type may hold (anything else is not checked: enums, Any)
_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,), "float": (int, float), "str": (str,), "bool": (bool,),
    "dict": (dict,), "list": (list,), "tuple": (list,), "None": (type(None),),
}  # fmt: skip


def _check_field(kind: str, name: str, value: Any, allowed: tuple[type, ...], text: str) -> None:
    """The field check itself, for a value whose exact type is not one the field allows."""
    if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
        raise ValueError(f"{kind}: field {name!r} is {repr(value)[:60]}, not {text}")


@functools.cache
def _builder(cls: type[Event]) -> Callable[[dict[str, Any], str], Event]:
    """build(data, kind): the event, written out for cls one statement per field (decoding a
    long record makes every event, and a loop over the fields cost more than the parse).

    Each plain field present is checked (a value of an exact JSON type the field allows passes
    at once; any other is _check_field's: a subclass such as bool for an int field is refused
    there), in field order, and so are the items of a list field and the values of a dict
    field whose item type is plain (list[str], dict[str, float]; not Any). The event is then
    made without the dataclass's __init__ and its
    keyword binding, where that only sets the fields; else (a field missing, one no such event
    has, a class with a __post_init__ or a field __init__ does not set) by cls(**data), whose
    TypeError says what is wrong."""
    fields = dataclasses.fields(cls)
    direct = not hasattr(cls, "__post_init__") and all(f.init for f in fields)
    plain = {name: (allowed, text) for name, allowed, text in _field_types(cls)}
    inner = {f.name: got for f in fields if (got := _element_types(str(f.type))) is not None}
    names: dict[str, Any] = {
        "_ABSENT": _ABSENT,
        "_check_field": _check_field,
        "_check_elements": _check_elements,
        "_join": "".join,
        "cls": cls,
    }
    body = ["def build(data, kind):", "    found = 0", "    whole = True"]
    for i, f in enumerate(fields):
        body.append(f"    value = data.get({f.name!r}, _ABSENT)")
        if f.default is not dataclasses.MISSING:
            names[f"default{i}"] = f.default
            body.append(f"    if value is _ABSENT: v{i} = default{i}")
        elif f.default_factory is not dataclasses.MISSING:
            names[f"factory{i}"] = f.default_factory
            body.append(f"    if value is _ABSENT: v{i} = factory{i}()")
        else:
            body.append("    if value is _ABSENT: whole = False")
        body += ["    else:", "        found += 1"]
        if f.name in plain:
            names[f"allowed{i}"], names[f"text{i}"] = plain[f.name]
            body += [
                f"        if type(value) not in allowed{i}:",
                f"            _check_field(kind, {f.name!r}, value, allowed{i}, text{i})",
            ]
        if f.name in inner:  # a list's items, a dict's values
            each, names[f"etext{i}"], of_dict = inner[f.name]
            names[f"each{i}"] = each
            check = f"_check_elements(kind, {f.name!r}, value, each{i}, etext{i})"
            if each == (str,):  # output lines: str.join checks them in C
                items = "value.values()" if of_dict else "value"
                body += [
                    "        if value:",
                    "            try:",
                    f"                _join({items})",
                    "            except TypeError:",
                    f"                {check}",
                ]
            else:
                body += ["        if value:", f"            {check}"]
        body.append(f"        v{i} = value")
    if direct:
        body += ["    if whole and found == len(data):", "        made = object.__new__(cls)"]
        body += [f"        made.{f.name} = v{i}" for i, f in enumerate(fields)]
        body.append("        return made")
    body.append("    return cls(**data)")
    exec(compile("\n".join(body), f"<builder of {cls.__qualname__}>", "exec"), names)
    return names["build"]  # type: ignore[no-any-return]


def _check_elements(kind: str, name: str, value: Any, allowed: tuple[type, ...], text: str) -> None:
    """Each item of a list field, each value of a dict field, of a JSON type its declared
    element type allows (a bool is no int here either)."""
    for item in value.values() if isinstance(value, dict) else value:
        if type(item) not in allowed and (
            not isinstance(item, allowed) or (isinstance(item, bool) and bool not in allowed)
        ):
            raise ValueError(f"{kind}: field {name!r} holds {repr(item)[:60]}, not {text}")


@functools.cache
def _element_types(declared: str) -> tuple[tuple[type, ...], str, bool] | None:
    """(the JSON types, the declared type, whether of a dict) of a list field's items or a
    dict field's values where that type is plain; None where it is Any (or no list or dict)."""
    for part in (p.strip() for p in declared.split("|")):
        if not part.endswith("]"):
            continue
        of_dict = part.startswith("dict[")
        if part.startswith("list["):
            inner = part[5:-1]
        elif of_dict:
            inner = part[5:-1].split(",", 1)[1].strip()
        else:
            continue
        allowed = _JSON_TYPES.get(inner.split("[", 1)[0])
        return (allowed, inner, of_dict) if allowed is not None else None
    return None


@functools.cache
def _field_types(cls: type[Event]) -> list[tuple[str, tuple[type, ...], str]]:
    """(field, the JSON types its declared type allows, the declared type) for the fields
    whose declared type is plain (int, str, float, bool, dict[...], list[...], | None)."""
    out = []
    for f in dataclasses.fields(cls):
        text = str(f.type)
        allowed: tuple[type, ...] = ()
        for part in (p.strip() for p in text.split("|")):
            got = _JSON_TYPES.get(part.split("[", 1)[0])
            if got is None:
                break
            allowed += got
        else:
            out.append((f.name, allowed, text))
    return out
