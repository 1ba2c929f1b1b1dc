"""An event's recorded line is orjson.dumps(event.to_dict()) byte for byte, for every event type."""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import random
from typing import Any

import numpy as np
import orjson
import pytest
from dsa_writer import record

from runners.events import Event, OutputLines, TraceBatch
from runners.kinds import event_types
from runners.kinds.dsa_trace import TraceBook


class Code(enum.IntEnum):
    OK = 0


@dataclasses.dataclass
class Inner:
    shown: str = "s"
    _hidden: int = 2  # orjson's own form of a dataclass leaves this out; asdict keeps it


def rich() -> dict[str, Any]:
    return {
        "f32": np.float32(1.5),
        "i64": np.int64(-3),
        "array": np.arange(4, dtype=np.int32),
        "tuple": (1, "x", None),
        "inner": Inner(),
        "inners": [Inner("t", 5)],
        "code": Code.OK,
        "nested": [{"x": None, "y": [1.0, float("inf")]}],
        "unicode": "naïve ✓",
    }


def value_for(declared: str) -> Any:
    head = declared.split("|")[0].strip()
    if head.startswith("list[dict"):
        return [rich(), {}]
    if head.startswith("list[int"):
        return [1, 2, 3]
    if head.startswith("list"):
        return ["a", "b"]
    if head == "dict[str, str]":
        return {"a": "b"}
    if head.startswith("dict[str, float"):
        return {"a": 0.5, "b": np.float64(2.0)}
    if head.startswith("dict[str, int"):
        return {"a": 1}
    if head.startswith("dict"):
        return rich()
    return {"int": 7, "float": 1.25, "str": "word", "bool": True}.get(head, "other")


def sample(cls: type[Event], host: str) -> Event:
    """An event of cls with a value in every field (set directly: to_json reads fields only)."""
    made = object.__new__(cls)
    for f in dataclasses.fields(cls):
        setattr(made, f.name, value_for(str(f.type)))
    made.host = host
    made.t = 1780000000.25
    return made


def old_form(event: Event) -> bytes:
    return orjson.dumps(event.to_dict(), option=orjson.OPT_SERIALIZE_NUMPY)


@pytest.mark.parametrize("host", ["", "gpu1:22"])
@pytest.mark.parametrize("name", sorted(event_types()))
def test_every_event_type_is_recorded_as_its_dict(name: str, host: str) -> None:
    event = sample(event_types()[name], host)
    line = event.to_json()
    assert line == old_form(event)
    data = orjson.loads(line)
    assert data["type"] == name and ("host" in data) == bool(host)
    if "inner" in line.decode():
        assert '"_hidden":2' in line.decode()


def test_a_real_trace_digest_is_recorded_as_before() -> None:
    rng = random.Random(0)
    key = hashlib.sha1(b"prefix-0").hexdigest()
    records = [
        record(request, layer, 40 + s, 32, 16, 24, request > 0, rng, 1000 + s, key)
        for request in range(2)
        for s in range(3)
        for layer in range(3)
    ]
    records[4]["offset_min"] += 1  # an invalid record: the digest holds a first fail too
    file = "/run/artifacts/dsa/block16/trace_steps_0_2.jsonl"
    digest = TraceBook(32, 3).feed(file, [orjson.dumps(r) for r in records], 1)
    assert digest["invalid"] == 1 and digest["summary"]
    event = TraceBatch(cell=0, file=file, first_line=1, last_line=18, end_offset=9, digest=digest)
    assert event.to_json() == old_form(event)


def test_a_value_json_cannot_hold_is_refused_as_before() -> None:
    event = OutputLines(cell=0, stream="stdout", lines=["a"], file="f", end_offset=1)
    event.lines = [{1, 2}]  # type: ignore[list-item]
    with pytest.raises(TypeError, match="not JSON serializable: set"):
        event.to_json()
    with pytest.raises(TypeError, match="not JSON serializable: set"):
        old_form(event)
