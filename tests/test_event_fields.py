"""Recorded events decode only into their declared shapes: each plain field's JSON type is checked."""

from __future__ import annotations

import enum
import time
from typing import Any

import pytest

from runners.events import CORE_EVENTS, CellFinished, OutputLines, RunStarted, event_from_dict
from runners.kinds import event_types

OUTPUT = {"type": "output", "cell": 1, "stream": "stdout", "lines": ["a"], "file": "f", "end_offset": 3, "t": 1.0}  # fmt: skip
FINISHED = {"type": "cell_finished", "cell": 0, "state": "passed", "exit_code": 0, "duration_s": 1.5, "t": 2.0}  # fmt: skip


class Code(enum.IntEnum):
    OK = 0


@pytest.mark.parametrize(
    ("base", "field", "value", "declared"),
    [
        (OUTPUT, "cell", "1", "int"),
        (OUTPUT, "cell", True, "int"),  # a bool is no int here
        (OUTPUT, "cell", 1.0, "int"),
        (OUTPUT, "lines", "a", "list[str]"),
        (OUTPUT, "stream", None, "str"),
        (OUTPUT, "t", "now", "float"),
        (FINISHED, "exit_code", 0.5, "int | None"),
        (FINISHED, "duration_s", [1], "float | None"),
        (FINISHED, "host", 3, "str"),
    ],
)
def test_a_field_of_another_json_type_is_refused_by_name(
    base: dict[str, Any], field: str, value: Any, declared: str
) -> None:
    with pytest.raises(ValueError) as info:
        event_from_dict({**base, field: value}, CORE_EVENTS)
    assert str(info.value) == f"{base['type']}: field {field!r} is {value!r}, not {declared}"


def test_the_types_each_field_allows_are_taken() -> None:
    out = event_from_dict({**OUTPUT, "host": "gpu1"}, CORE_EVENTS)
    assert out == OutputLines(cell=1, stream="stdout", lines=["a"], file="f", end_offset=3, t=1.0, host="gpu1")  # fmt: skip
    done = event_from_dict({**FINISHED, "exit_code": None, "duration_s": 2}, CORE_EVENTS)
    assert isinstance(done, CellFinished) and done.exit_code is None and done.duration_s == 2
    # Not JSON's own types, but what they say (an event built in code, then its dict).
    assert event_from_dict({**FINISHED, "exit_code": Code.OK}, CORE_EVENTS).exit_code == 0


def test_a_missing_or_unknown_field_is_named() -> None:
    short = {k: v for k, v in OUTPUT.items() if k != "file"}
    with pytest.raises(ValueError, match="^output: .*'file'"):
        event_from_dict(short, CORE_EVENTS)
    with pytest.raises(ValueError, match="^output: .*'colour'"):
        event_from_dict({**OUTPUT, "colour": "red"}, CORE_EVENTS)
    with pytest.raises(ValueError, match="^unknown event type 'nope'"):
        event_from_dict({**OUTPUT, "type": "nope"}, CORE_EVENTS)


RUN_STARTED = {"type": "run_started", "run_id": "r", "preset": "p", "kind": "command", "target": "local", "local_dir": "/l", "remote_dir": "/r", "cells": [], "profile": "none", "env": {}}  # fmt: skip


def test_decoding_makes_the_event_its_constructor_makes() -> None:
    """Events are made without their __init__ where it only sets fields: the same fields,
    defaults and factories (a fresh list each time, the time of decoding when `t` is absent);
    a class whose __init__ does more (CellFinished checks its state word) still runs it."""
    before = time.time()
    one, two = (event_from_dict(RUN_STARTED, CORE_EVENTS) for _ in range(2))
    want = RunStarted(**{k: v for k, v in RUN_STARTED.items() if k != "type"}, t=one.t)
    assert one == want and one.notes == [] and one.notes is not two.notes
    assert before <= one.t <= time.time() and not one.attached and one.host == ""
    for recorded in (OUTPUT, {**OUTPUT, "host": "h"}, {**RUN_STARTED, "notes": ["n"], "t": 5.0}):
        made = event_from_dict(recorded, CORE_EVENTS)
        assert made == type(made)(**{k: v for k, v in recorded.items() if k != "type"})
    with pytest.raises(ValueError, match="field 'state' is 'lost!', not one of"):
        event_from_dict({**FINISHED, "state": "lost!"}, CORE_EVENTS)


def test_a_wrong_type_is_said_before_a_missing_field_as_before() -> None:
    short = {k: v for k, v in OUTPUT.items() if k != "cell"}
    with pytest.raises(ValueError, match="^output: field 'end_offset' is '3', not int$"):
        event_from_dict({**short, "end_offset": "3"}, CORE_EVENTS)
    with pytest.raises(ValueError, match="^output: field 'cell' is '1', not int$"):
        event_from_dict(
            {**{k: v for k, v in OUTPUT.items() if k != "file"}, "cell": "1"}, CORE_EVENTS
        )


STARTED = {"type": "run_started", "run_id": "r", "preset": "p", "kind": "command", "target": "local", "local_dir": "d", "remote_dir": "r", "cells": [{"index": 0, "params": {"n": 1}, "command": "c"}], "profile": "none", "env": {"A": "1"}, "t": 1.0}  # fmt: skip


@pytest.mark.parametrize(
    ("base", "field", "value", "item", "declared"),
    [
        (OUTPUT, "lines", ["a", 1], 1, "str"),
        (OUTPUT, "lines", [None], None, "str"),
        (OUTPUT, "lines", ["a", {"x": 1}], {"x": 1}, "str"),
        (STARTED, "env", {"A": 1}, 1, "str"),
        (STARTED, "notes", [True], True, "str"),
        (STARTED, "cells", [3], 3, "dict[str, Any]"),
    ],
)
def test_an_item_of_another_json_type_is_refused_by_name(
    base: dict[str, Any], field: str, value: Any, item: Any, declared: str
) -> None:
    with pytest.raises(ValueError) as info:
        event_from_dict({**base, field: value}, CORE_EVENTS)
    assert str(info.value) == f"{base['type']}: field {field!r} holds {item!r}, not {declared}"


def test_items_of_the_declared_types_are_taken() -> None:
    started = event_from_dict({**STARTED, "notes": ["x"], "env": {}}, CORE_EVENTS)
    assert isinstance(started, RunStarted) and started.notes == ["x"] and started.env == {}
    kinds = event_types()
    assigned = {"type": "host_assigned", "host": "h", "member": "m", "run_dir": "d", "lock": "l", "workdir": "w", "python": "p", "cells": [0, 2], "t": 1.0}  # fmt: skip
    assert event_from_dict(assigned, kinds).cells == [0, 2]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="'cells' holds True, not int"):
        event_from_dict({**assigned, "cells": [True]}, kinds)  # a bool is no int here either
    pair = [e for e in kinds.values() if e.type == "pair_verdict"][0]
    with pytest.raises(ValueError, match="'thresholds' holds 'big', not float"):
        event_from_dict({"type": pair.type, "thresholds": {"max": "big"}}, kinds)


@pytest.mark.parametrize(
    "cell", [{"index": 0}, {"params": {}}, {"index": "0", "params": {}}, {"index": 0, "params": []}]
)
def test_a_run_start_whose_cell_is_no_cell_is_refused_by_name(cell: dict[str, Any]) -> None:
    """What the printer, the model and the judges take from every cell: its index and params."""
    with pytest.raises(ValueError, match=r"^run_started: field 'cells' item 1 is .*not a cell"):
        event_from_dict({**STARTED, "cells": [STARTED["cells"][0], cell]}, CORE_EVENTS)


def test_a_cell_end_with_no_state_word_names_the_field() -> None:
    with pytest.raises(ValueError, match="^cell_finished: field 'state' is 'PASSED', not one of pending, "):  # fmt: skip
        event_from_dict({**FINISHED, "state": "PASSED"}, CORE_EVENTS)
