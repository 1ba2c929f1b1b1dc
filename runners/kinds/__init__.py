"""The run kinds: every module in this package that defines `KIND` is one, found at first use.

A kind is one module here (preset section and checks, judge, verdict words, headless lines,
`analyze` entry), its pure judgement in analysis/, and its panel in console/panels/. Nothing
else names a kind. Further kind packages on sys.path merge into this one (pkgutil.extend_path),
so a kind can be added without editing any file of tracedeck.
"""

from __future__ import annotations

import importlib
import pkgutil
import traceback
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runners.kind import Kind

__path__ = pkgutil.extend_path(__path__, __name__)

_KINDS: dict[str, Kind] | None = None
_PROBLEMS: list[str] = []


def _discover() -> dict[str, Kind]:
    from runners.kind import Kind

    found: dict[str, Kind] = {}
    _PROBLEMS.clear()
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
        found[kind.name] = kind
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
