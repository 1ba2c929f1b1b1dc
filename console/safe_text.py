"""Untrusted text (an engine's output, names, messages) made safe to show on a terminal."""

from __future__ import annotations

import re
from typing import Any

# C0 but tab and newline, DEL, C1 (ESC among them: terminal escapes), and the format characters
# that reorder or hide text (bidi overrides and isolates, zero-width ones): engine text is shown
# as it is, never able to move the cursor, retitle the terminal or make "SSAP" read "PASS"
_CONTROL = re.compile(
    "[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u2069\ufeff]"
)


def clean(value: Any) -> str:
    """str(value) with tabs expanded and control and format characters (terminal escapes,
    bidi overrides) replaced."""
    return _CONTROL.sub("\ufffd", str(value).expandtabs(4))
