"""Long work under way (an artifact coming home, a pair being judged, a trace being followed):
one line each, shown only while there is some."""

from __future__ import annotations

from rich.text import Text

from console.widgets.steady import SteadyStatic
from console.widgets.text import clean
from runners.events import Progress
from runners.progress import progress_text

SHOWN = 3


class ProgressView(SteadyStatic):
    DEFAULT_CSS = """
    ProgressView { height: auto; max-height: 4; padding: 0 1; color: $text-muted; display: none; }
    ProgressView.-busy { display: block; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.shown: list[str] = []

    def show(self, progress: dict[tuple[str, str], Progress]) -> None:
        items = list(progress.values())
        self.shown = [progress_text(p) for p in items[-SHOWN:]]
        if len(items) > SHOWN:
            self.shown.insert(0, f"... and {len(items) - SHOWN} more")
        self.set_class(bool(items), "-busy")
        text = Text("\n".join(clean(line) for line in self.shown))
        text.no_wrap = True
        text.overflow = "ellipsis"
        self.show_text(text)
