"""The run's global verdict, shown big and coloured once the run finishes."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.run_model import RunModel
from console.widgets.text import clean
from runners.cells import CellState
from runners.kinds import tone


class VerdictBanner(Static):
    """A status line while the run goes on; the verdict word and exit code at the end."""

    DEFAULT_CSS = """
    VerdictBanner {
        height: auto;
        padding: 0 1;
        text-style: bold;
        background: $boost;
    }
    VerdictBanner.-pass { background: $success; color: $text; }
    VerdictBanner.-drift { background: $warning; color: $text; }
    VerdictBanner.-fail { background: $error; color: $text; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("waiting for the run to start", id=id, markup=False)
        self.verdict: str | None = None

    def show(self, model: RunModel, status: str = "") -> None:
        """The running line (with the panel's status), or the verdict once the run finished."""
        finished = model.finished
        for word in ("pass", "drift", "fail"):
            self.remove_class(f"-{word}")
        if finished is None:
            counts = model.cell_counts()
            total = sum(counts.values())
            done = sum(v for k, v in counts.items() if CellState(k).ended)
            line = f"running: {done}/{total} cells done" + (f"; {status}" if status else "")
            # One line while running: no relayout needed (a relayout redraws every widget).
            self.update(Text(clean(line)), layout=False)
            return
        self.verdict = finished.verdict
        # A non-zero exit is never shown as a pass, whatever the word says.
        shade = tone(model.header.kind, finished.verdict) if finished.exit_code == 0 else "fail"
        self.add_class(f"-{shade}")
        text = Text(f"{clean(finished.verdict)}  (exit {finished.exit_code})")
        summary = finished.summary if isinstance(finished.summary, dict) else {}
        # Why, unless it simply passed: a failure, an engine error, a loosened pass say it here.
        keys = ("error",) if shade == "pass" else ("reason", "error")
        for key in keys:
            if summary.get(key):
                text.append("\n" + clean(summary[key]), style="not bold")
        for problem in (summary.get("engine_errors") or [])[:3]:
            text.append("\nengine error: " + clean(problem), style="not bold")
        self.update(text)

    def show_stopped(self, text: str) -> None:
        """The feed ended without a verdict: say so plainly; this is never a pass."""
        for word in ("pass", "drift"):
            self.remove_class(f"-{word}")
        self.add_class("-fail")
        self.update(Text(clean(text)))
