"""Templates with {placeholders}: parsed strictly, rendered shell-quoted or plain."""

from __future__ import annotations

import shlex
import string
from typing import Any


class TemplateError(ValueError):
    """A template that is not a plain `text {name} text`."""


def template_fields(template: str) -> list[str]:
    """The placeholder names of a template, in order; TemplateError when one is not plain."""
    names: list[str] = []
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as exc:
        raise TemplateError(f"bad template ({exc}); write literal braces as {{{{ }}}}") from None
    for _, name, spec, conv in parsed:
        if name is None:
            continue
        if not name or not name.isidentifier() or spec or conv:
            raise TemplateError(f"placeholder {{{name}}} must be a plain {{name}}")
        names.append(name)
    return names


def render(template: str, values: dict[str, Any]) -> str:
    """Fill {placeholders}, each value shell-quoted: data can never become shell syntax."""
    parts: list[str] = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(literal)
        if name is not None:
            parts.append(shlex.quote(text(values[name])))
    return "".join(parts)


def render_plain(template: str, values: dict[str, Any]) -> str:
    """Fill {placeholders} without quoting, for paths and env values that are quoted later."""
    parts: list[str] = []
    for literal, name, _, _ in string.Formatter().parse(template):
        parts.append(literal)
        if name is not None:
            parts.append(text(values[name]))
    return "".join(parts)


def text(value: Any) -> str:
    """A template value as text: booleans as 1/0, everything else as str()."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)
