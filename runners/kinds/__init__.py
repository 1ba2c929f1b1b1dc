"""The run kinds: every module in this package that defines `KIND` is one, found at first use.

A kind is one module here (preset section and checks, judge, verdict words, headless lines,
`analyze` entry), its pure judgement in analysis/, and its panel in console/panels/. Nothing
else names a kind. Further kind packages on sys.path merge into this one (pkgutil.extend_path),
so a kind can be added without editing any file of tracedeck.

This package's own module is the registry: it is passed to what needs the kinds (event
decoding: event_types(); preset loading: load_preset()), so nothing below it imports it.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import traceback

from runners.events import CORE_EVENTS, Event
from runners.kind import Kind
from runners.presets import Preset
from runners.presets import load_preset as _load_preset

__path__ = pkgutil.extend_path(__path__, __name__)

_KINDS: dict[str, Kind] | None = None
_EVENTS: dict[str, type[Event]] = {}
_PROBLEMS: list[str] = []


def _discover() -> dict[str, Kind]:
    found: dict[str, Kind] = {}
    _PROBLEMS.clear()
    _EVENTS.clear()
    _EVENTS.update(CORE_EVENTS)
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("_"):
            continue
        name = f"{__name__}.{info.name}"
        try:
            module = importlib.import_module(name)
            kind = getattr(module, "KIND", None)
            if not isinstance(kind, Kind):
                raise TypeError("defines no KIND (a runners.kind.Kind instance)")
            kind.validate_definition()
        except Exception as exc:  # a broken plug-in is reported, never half-listed
            last = traceback.extract_tb(exc.__traceback__)[-1:] if exc.__traceback__ else []
            where = f" ({last[0].filename}:{last[0].lineno})" if last else ""
            _PROBLEMS.append(f"run kind module {name}{where}: {exc}")
            continue
        if kind.name in found:
            _PROBLEMS.append(f"run kind {kind.name!r} is defined twice ({name}); the first wins")
            continue
        taken = [
            f"{cls.type!r} (taken by {_EVENTS[cls.type].__module__})"
            for cls in kind.events
            if _EVENTS.get(cls.type, cls) is not cls
        ]
        if taken:
            _PROBLEMS.append(f"run kind module {name}: event type {', '.join(taken)}")
            continue
        found[kind.name] = kind
        _EVENTS.update({cls.type: cls for cls in kind.events})
    return found


def all_kinds() -> dict[str, Kind]:
    """Every usable kind by name, in name order; broken ones are in problems()."""
    global _KINDS
    if _KINDS is None:
        _KINDS = _discover()
    return _KINDS


def problems() -> list[str]:
    """Why a kind module could not be used (shown by `tracedeck presets` and the console)."""
    all_kinds()
    return list(_PROBLEMS)


def reload() -> dict[str, Kind]:
    """Discover again (after a package directory was added to __path__)."""
    global _KINDS
    _KINDS = None
    return all_kinds()


def get(name: str) -> Kind:
    """The kind of that name; KeyError with the known names when there is none."""
    kinds = all_kinds()
    if name not in kinds:
        raise KeyError(f"unknown run kind {name!r}; known: {', '.join(kinds) or 'none'}")
    return kinds[name]


def event_types() -> dict[str, type[Event]]:
    """Every event type a record may hold, by type word: the core's and each usable kind's."""
    all_kinds()
    return dict(_EVENTS)


def tone(kind_name: str, word: str | None) -> str:
    """The tone of a verdict word for a kind by name; an unknown kind's words are failures."""
    kind = all_kinds().get(kind_name)
    return kind.tone(word) if kind is not None else "fail"


def load_preset(
    path: str | os.PathLike[str],
    overrides: list[str] | None = None,
    options: frozenset[str] = frozenset(),
) -> Preset:
    """runners.presets.load_preset with every usable kind."""
    return _load_preset(path, overrides, options, kinds=all_kinds())
