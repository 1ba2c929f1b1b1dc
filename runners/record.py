"""The local record of a run: run.json (what was launched where) and events.jsonl (what happened)."""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from analysis.regular_file import open_regular
from runners.atomic import write_atomic
from runners.events import Event, event_from_owned
from runners.targets.base import TargetError

# type word -> event class, as runners.kinds.event_types() gives it (the registry is passed in)
Types = Mapping[str, type[Event]]

RUN_JSON = "run.json"
EVENTS = "events.jsonl"
RECORD_LOCK = "record.lock"
# The names a run's local directory keeps for tracedeck itself (the record, its writer's lock,
# the plan, a cancel asked): an artifact fetched home never takes one of them.
RECORD_FILES = frozenset({RUN_JSON, EVENTS, RECORD_LOCK, "plan.json", "cancel"})


def record_name_problem(rel: str) -> str | None:
    """Why an artifact's path would replace a file of the run's record, else None."""
    first = Path(rel).parts[0] if Path(rel).parts else ""
    if first in RECORD_FILES or first.removesuffix(".part") in RECORD_FILES:
        return f"is the run's own {first} (tracedeck's record): an artifact never replaces it"
    return None


CHUNK = 4 << 20


@dataclass(slots=True)
class RunRecord:
    run_id: str
    preset: str
    kind: str
    source: str
    overrides: list[str]
    preset_data: dict[str, Any]
    target: str
    remote_dir: str
    lock: str
    local_dir: str
    started_at: str
    user: str
    console_host: str
    date: str
    extra: dict[str, Any] = field(default_factory=dict)
    options: list[str] = field(default_factory=list)  # the operator's command-line options

    def save(self) -> None:
        write_atomic(
            Path(self.local_dir) / RUN_JSON, orjson.dumps(asdict(self), option=orjson.OPT_INDENT_2)
        )

    @classmethod
    def load(cls, local_dir: str | os.PathLike[str]) -> RunRecord:
        path = Path(local_dir) / RUN_JSON
        try:
            with open_regular(path) as fh:  # a FIFO named run.json would hang every lister
                data = orjson.loads(fh.read())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path}: no run record here; pass a run directory written by `tracedeck run`"
            ) from None
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        except OSError as exc:
            raise ValueError(f"{path}: cannot read the run record ({exc.strerror})") from None
        if not isinstance(data, dict):
            raise ValueError(f"{path}: holds a JSON {type(data).__name__}, not a run record")
        fields = {f.name: f for f in dataclasses.fields(cls)}
        required = {
            n
            for n, f in fields.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        }
        missing = sorted(required - set(data))
        if missing:
            raise ValueError(f"{path}: not a run record: missing {', '.join(missing)}")
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise ValueError(f"{path}: not a run record of this version: {', '.join(unknown)}")
        for name in ("preset_data", "extra"):
            if name in data and not isinstance(data[name], dict):
                raise ValueError(f"{path}: {name} must be an object")
        return cls(**data)


class RecordBusy(Exception):
    """Another console writes this run's record: this one may only view it."""


class RecordError(TargetError):
    """The record could not be written (a full disk, a read-only directory), naming the file."""

    def __init__(self, errno: int | None, message: str) -> None:
        super().__init__(message)
        self.errno = errno
        self.strerror = message


def try_lock(local_dir: str | os.PathLike[str]) -> int | None:
    """The fd of an exclusive lock on the run's record.lock, or None when another holds it."""
    path = Path(local_dir) / RECORD_LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def record_writer(local_dir: str | os.PathLike[str]) -> tuple[int, str] | None:
    """(pid, state) of the console holding the run's record lock, as /proc/locks and
    /proc/PID/stat name it (state T: stopped, say by a Ctrl-Z); None when that cannot be told
    (no /proc, or a lock on a filesystem whose device /proc/locks names otherwise)."""
    try:
        st = os.stat(Path(local_dir) / RECORD_LOCK)
        locks = Path("/proc/locks").read_text()
    except OSError:
        return None
    where = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in locks.splitlines():
        f = line.split()  # N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE 0 EOF ("N: ->": waits)
        if len(f) >= 6 and f[1] == "FLOCK" and f[5] == where and f[4].isdigit():
            try:
                stat = Path(f"/proc/{f[4]}/stat").read_bytes()
            except OSError:
                return None
            return int(f[4]), stat[stat.rfind(b")") + 2 :].split()[0].decode()
    return None


def writer_present(local_dir: str | os.PathLike[str]) -> bool:
    """Does a console hold the run's record lock (is someone writing its events)?"""
    fd = try_lock(local_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


class Recorder:
    """The one writer of a run's record: appends each event to events.jsonl as it happens (a
    crash leaves a replayable record) and holds record.lock for as long as it lives."""

    def __init__(self, local_dir: str | os.PathLike[str]) -> None:
        self.path = Path(local_dir) / EVENTS
        lock = try_lock(local_dir)
        if lock is None:
            raise RecordBusy(
                f"{local_dir}: another console is following this run and writes its record"
            )
        self._lock = lock
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError:
            os.close(lock)
            raise

    def __call__(self, event: Event) -> None:
        data = event.to_json() + b"\n"
        try:
            while data:
                data = data[os.write(self._fd, data) :]
        except OSError as exc:
            raise RecordError(
                exc.errno,
                f"cannot record the run in {self.path}: {exc.strerror}; the run goes on on "
                f"its target: free the space, then `tracedeck attach {self.path.parent}`",
            ) from exc

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            os.close(self._lock)
            self._fd = -1


@dataclass(slots=True)
class Recorded:
    events: list[Event]
    torn_tail: bytes  # an incomplete last line left by a console that was killed mid-write


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of a record, and the torn tail after the last newline."""
    cut = data.rfind(b"\n") + 1
    return data[:cut].split(b"\n")[:-1], data[cut:]


def decode_event(path: str | os.PathLike[str], number: int, line: bytes, types: Types) -> Event:
    """One recorded line as an event; ValueError naming the file and line when it is not one."""
    try:
        data = orjson.loads(line)
        if not isinstance(data, dict):
            raise TypeError(f"a JSON {type(data).__name__}, not an object")
        return event_from_owned(data, types)
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}:{number}: not a tracedeck event ({exc})") from None


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector off while a batch of events is decoded.

    Decoding makes many small containers and no cycles; each few hundred of them would start
    a collection that walks everything alive (a long record: most of the decoding time).
    Refcounting frees as usual meanwhile; the collector runs again afterwards."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def decode_lines(
    path: str | os.PathLike[str], first_number: int, lines: list[bytes], types: Types
) -> tuple[list[Event], tuple[int, ValueError] | None]:
    """The events of consecutive lines (numbered from first_number; blank ones skipped), and
    the number and error of the first malformed line (the events before it are returned)."""
    events: list[Event] = []
    append = events.append
    with paused_gc():
        for number, line in enumerate(lines, first_number):
            if line.strip():
                try:
                    append(decode_event(path, number, line, types))
                except ValueError as exc:
                    return events, (number, exc)
    return events, None


def iter_events(path: str | os.PathLike[str], types: Types) -> Iterator[Event]:
    """The recorded events in order, read a chunk at a time (memory stays flat whatever the
    record's size); a torn last line is left out, a malformed complete line is an error."""
    number = 0
    pending = b""
    with open_regular(path) as fh:
        while chunk := fh.read(CHUNK):
            lines, pending = split_lines(pending + chunk)
            events, error = decode_lines(path, number + 1, lines, types)
            number += len(lines)
            yield from events
            if error is not None:
                raise error[1]


def recorded_count(local_dir: str | os.PathLike[str], types: Types) -> int:
    """How many complete events a run's record holds."""
    path = Path(local_dir) / EVENTS
    return sum(1 for _ in iter_events(path, types)) if path.exists() else 0


def torn_tail(path: str | os.PathLike[str]) -> bytes:
    """What follows the record's last newline (a console killed mid-write leaves it)."""
    with open_regular(path) as fh:
        size = fh.seek(0, 2)
        back = min(size, CHUNK)
        fh.seek(size - back)
        tail = fh.read()
    cut = tail.rfind(b"\n") + 1
    if cut == 0 and back < size:
        raise ValueError(f"{path}: the last {back} bytes hold no newline: not an events record")
    return tail[cut:]


def read_events(path: str | os.PathLike[str], types: Types) -> Recorded:
    """Every recorded event; a malformed complete line is an error naming its line."""
    return Recorded(list(iter_events(path, types)), torn_tail(path))


def drop_torn_tail(path: str | os.PathLike[str]) -> None:
    """Cut a torn last line, so the record goes on from its last complete event."""
    tail = torn_tail(path)
    if tail:
        os.truncate(path, Path(path).stat().st_size - len(tail))


BY_ID = "by-id"
FLEET = "fleet"  # run.json extra key of a fleet run (runners/run.py): its hosts, batches


def local_runs(out_dir: str | os.PathLike[str]) -> list[Path]:
    """Every run directory under a run-records root (each holds a run.json). The OUT/by-id/ID
    links are not followed: each run is listed once, where it lies."""
    return sorted(path.parent for path in Path(out_dir).glob(f"**/{RUN_JSON}"))


def find_local_run(run_id: str, out_dir: str | os.PathLike[str]) -> Path | None:
    """The local directory of the run with that id: OUT/by-id/ID, else found by a scan of the
    records (runs recorded before the links existed); None when there is none."""
    link = Path(out_dir) / BY_ID / run_id
    if "/" not in run_id and (link / RUN_JSON).is_file():
        return Path(os.path.normpath(link.parent / os.readlink(link)))
    found: list[Path] = []
    for local in local_runs(out_dir):
        try:
            if RunRecord.load(local).run_id == run_id:
                found.append(local)
        except (OSError, ValueError, TypeError):
            continue  # another tool's run.json; not one of ours
    if len(found) > 1:  # a copied or edited record: which one is meant is not a guess
        raise ValueError(
            f"run id {run_id!r} is recorded by {len(found)} directories under {out_dir}: "
            f"{', '.join(str(f) for f in found)}; pass the directory itself"
        )
    return found[0] if found else None
