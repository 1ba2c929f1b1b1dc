"""The local record of a run: run.json (what was launched where) and events.jsonl (what happened)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import orjson

from runners.atomic import write_atomic
from runners.events import Event, event_from_dict

RUN_JSON = "run.json"
EVENTS = "events.jsonl"


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
            data = orjson.loads(path.read_bytes())
        except FileNotFoundError:
            raise FileNotFoundError(
                f"{path}: no run record here; pass a run directory written by `tracedeck run`"
            ) from None
        except orjson.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc})") from None
        return cls(**data)


class Recorder:
    """Appends each event to events.jsonl as it happens, so a crash leaves a replayable record."""

    def __init__(self, local_dir: str | os.PathLike[str]) -> None:
        self.path = Path(local_dir) / EVENTS
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def __call__(self, event: Event) -> None:
        os.write(self._fd, event.to_json() + b"\n")

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(slots=True)
class Recorded:
    events: list[Event]
    torn_tail: bytes  # an incomplete last line left by a console that was killed mid-write


def split_lines(data: bytes) -> tuple[list[bytes], bytes]:
    """The complete lines of a record, and the torn tail after the last newline."""
    cut = data.rfind(b"\n") + 1
    return data[:cut].split(b"\n")[:-1], data[cut:]


def decode_event(path: str | os.PathLike[str], number: int, line: bytes) -> Event:
    """One recorded line as an event; ValueError naming the file and line when it is not one."""
    try:
        return event_from_dict(orjson.loads(line))
    except (orjson.JSONDecodeError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}:{number}: not a tracedeck event ({exc})") from None


def read_events(path: str | os.PathLike[str]) -> Recorded:
    """Every recorded event; a malformed complete line is an error naming its line."""
    lines, torn = split_lines(Path(path).read_bytes())
    events = [
        decode_event(path, number, line)
        for number, line in enumerate(lines, start=1)
        if line.strip()
    ]
    return Recorded(events, torn)


def drop_torn_tail(path: str | os.PathLike[str], recorded: Recorded) -> None:
    if recorded.torn_tail:
        size = Path(path).stat().st_size
        os.truncate(path, size - len(recorded.torn_tail))
