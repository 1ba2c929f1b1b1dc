"""Run-kind panels: every module here that defines `PANEL` (a KindPanel subclass) is one.

The run screen mounts the panel whose `kind` is the run's; a kind without one gets the empty
base panel. Further panel packages on sys.path merge into this one (pkgutil.extend_path).
"""

from __future__ import annotations

import importlib
import pkgutil

from console.panel import KindPanel

__path__ = pkgutil.extend_path(__path__, __name__)

_PANELS: dict[str, type[KindPanel]] | None = None
_PROBLEMS: list[str] = []


def all_panels() -> dict[str, type[KindPanel]]:
    """Panel classes by kind name."""
    global _PANELS
    if _PANELS is None:
        found: dict[str, type[KindPanel]] = {}
        _PROBLEMS.clear()
        for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
            if info.name.startswith("_"):
                continue
            try:
                module = importlib.import_module(f"{__name__}.{info.name}")
                panel = getattr(module, "PANEL", None)
                if not (isinstance(panel, type) and issubclass(panel, KindPanel) and panel.kind):
                    raise TypeError("defines no PANEL (a KindPanel subclass with a kind)")
            except Exception as exc:  # a broken plug-in is reported, not half-used
                _PROBLEMS.append(f"panel module {__name__}.{info.name}: {exc}")
                continue
            found[panel.kind] = panel
        _PANELS = found
    return _PANELS


def problems() -> list[str]:
    all_panels()
    return list(_PROBLEMS)


def reload() -> dict[str, type[KindPanel]]:
    global _PANELS
    _PANELS = None
    return all_panels()


def detail_screens() -> list[tuple[str, type]]:
    """(kind, detail screen class) of every panel that has one, for the help screen."""
    return [(k, p.detail_class) for k, p in all_panels().items() if p.detail_class is not None]


def panel_for(kind: str) -> KindPanel:
    """A new panel for a run of that kind (the empty base panel when it has none)."""
    return all_panels().get(kind, KindPanel)(id="kind-panel")
