"""Where a run's cells run when that is more than one host: a status line per fleet host
(connected, lock held, cells done, last error), or the Slurm job's line (its cells by state)."""

from __future__ import annotations

from rich.text import Text

from console.run_model import RunModel
from console.widgets.steady import SteadyStatic
from console.widgets.text import clean

HOST_STYLES = {
    "running": "green",
    "idle": "green",
    "done": "green",
    "connecting": "yellow",
    "waiting": "bold yellow",
    "skipped": "bold yellow",
    "lost": "bold red",
    "failed": "bold red",
}


# States in which the host's lock is not known to be free (held by another run, or unseen).
QUIET = ("waiting", "skipped", "lost", "failed")


class HostsLine(SteadyStatic):
    """Hidden for a run on one host; one line per fleet host, or the scheduler's line."""

    DEFAULT_CSS = """
    HostsLine {
        height: auto;
        max-height: 8;
        padding: 0 1;
        background: $panel;
        text-wrap: nowrap;
        text-overflow: ellipsis;
        display: none;
    }
    HostsLine.-shown { display: block; }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)

    def show(self, model: RunModel) -> None:
        lines = [host_line(model, spec) for spec in model.hosts]
        if model.job.job_id:
            lines.append(job_line(model))
        if not lines:
            return
        self.add_class("-shown")
        text = Text("\n").join(lines)
        text.no_wrap = True
        text.overflow = "ellipsis"
        self.show_text(text)


def host_line(model: RunModel, spec: str) -> Text:
    row = model.hosts[spec]
    style = HOST_STYLES.get(row.state, "")
    lock = (
        f"lock {row.lock} held"
        if row.lock_held
        else (f"lock {row.lock} free" if row.lock and row.state not in QUIET else "")
    )
    parts = [
        Text(clean(spec), style="bold"),
        Text(" "),
        Text(clean(row.state), style=style),
        Text(f"  cells {len(row.done)}/{len(row.cells)} done"),
    ]
    conn_style = "" if row.connection == "connected" else "bold red"
    parts += [Text("  "), Text(clean(row.connection), style=conn_style)]
    if lock:
        parts += [Text("  "), Text(clean(lock), style="dim")]
    if row.message and row.state in ("waiting", "skipped", "lost", "failed"):
        parts.append(Text(f"  {clean(row.message)}", style=style))
    if row.last_error:
        parts += [Text("  last error: ", style="dim"), Text(clean(row.last_error), style="red")]
    return Text.assemble(*parts)


def job_line(model: RunModel) -> Text:
    job = model.job
    counts = model.sched_counts()
    states = ", ".join(f"{n} {word}" for word, n in sorted(counts.items())) or "submitted"
    where = f" on partition {job.partition}" if job.partition else ""
    return Text.assemble(
        (f"{clean(job.scheduler)} job {clean(job.job_id)}", "bold"),
        clean(where),
        "  ",
        clean(states),
    )
