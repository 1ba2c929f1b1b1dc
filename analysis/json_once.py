"""A JSON object read with each key once: one that gives a key twice says two things (a plain
parse keeps the last, another reader the first) and is believed in neither reading."""

from __future__ import annotations

from typing import Any


class GivenTwice(ValueError):
    """A JSON object that gives a key twice: (key, first value, second value)."""


def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json.loads(..., object_pairs_hook=once): raises GivenTwice at a repeated key."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise GivenTwice(key, out[key], value)
        out[key] = value
    return out
