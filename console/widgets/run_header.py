"""The run's header: preset, target, run id, lock holder, determinism profile, elapsed time."""

from __future__ import annotations

from rich.text import Text
from textual.widgets import Static

from console.run_model import RunModel
from console.widgets.text import clean, clock
from runners.cells import CellState, params_label
from runners.kinds import all_kinds

CONNECTION_STYLES = {"lost": "bold red", "retrying": "bold yellow", "restored": "green"}


def holder_text(holder: dict[str, object]) -> str:
    who = f"{holder.get('user', '?')}@{holder.get('console_host', '?')}"
    extra: list[str] = []
    if holder.get("run_id"):
        extra.append(f"run {holder['run_id']}")
    if holder.get("preset"):
        extra.append(f"preset {holder['preset']}")
    if holder.get("pgid"):
        extra.append(f"pgid {holder['pgid']}")
    if holder.get("raw"):
        extra.append(str(holder["raw"]))
    return clean(f"{who} ({', '.join(extra)})" if extra else who)


class RunHeader(Static):
    """Four lines redrawn when the header changes and once a second for the clock."""

    DEFAULT_CSS = """
    RunHeader {
        height: 4;
        padding: 0 1;
        text-wrap: nowrap;
        text-overflow: ellipsis;
        background: $panel;
    }
    """

    def __init__(self, mode: str, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.mode = mode

    def shown_mode(self, model: RunModel) -> str:
        """LIVE/ATTACHED while the run goes on; ENDED once it finished (REPLAY stays REPLAY)."""
        if model.finished is None or self.mode.startswith("REPLAY"):
            return self.mode
        return "ENDED"

    def show(self, model: RunModel, now: float | None) -> None:
        h = model.header
        line1 = Text.assemble(
            ("preset ", "dim"),
            (clean(h.preset or "?"), "bold"),
            f" ({clean(h.kind)})",
            ("  target ", "dim"),
            (clean(h.target or "?"), "bold"),
            ("  run ", "dim"),
            clean(h.run_id or "?"),
            ("  ", ""),
            (self.shown_mode(model), "reverse"),
        )
        if model.finished is not None and (h.holder or h.lock) and not h.lock_busy:
            # The engine's lock goes with its process group: once the run ended it is free.
            lock = Text.assemble(
                ("lock ", "dim"),
                clean(h.lock or "?"),
                " released at the run's end (was held by ",
                holder_text(h.holder) if h.holder else "?",
                ")",
            )
        elif h.lock_busy:
            lock = Text.assemble(
                ("lock BUSY ", "bold red"), clean(h.lock), " held by ", holder_text(h.holder)
            )
        elif h.holder:
            lock = Text.assemble(
                ("lock ", "dim"), clean(h.lock), " held by ", holder_text(h.holder)
            )
        elif h.fleet:
            lock = Text("locks: each host takes its own (the hosts lines show them)", style="dim")
        elif model.job.job_id:
            lock = Text("lock: each cell takes its node's lock when Slurm runs it", style="dim")
        else:
            lock = Text("lock: not taken yet", style="dim")
        env = params_label(h.env) or "(no variables)"
        line3 = Text.assemble(("determinism ", "dim"), clean(h.profile or "?"), ": ", clean(env))
        counts = model.cell_counts()
        kind = all_kinds().get(h.kind)
        judged_apart = kind is not None and not kind.cell_exit_is_verdict
        # where the kind judges outputs, a cell that exited 0 has not "passed" anything
        states = (
            ", ".join(
                f"{n} {'exited 0' if judged_apart and state == CellState.PASSED else state}"
                for state, n in sorted(counts.items())
            )
            or "no cells"
        )
        conn = model.connection
        if conn is None and self.mode.startswith("REPLAY"):
            connection = Text("recorded run, no connection", style="dim")
        elif conn is None or conn.state == "restored":
            connection = Text("connected" if conn is None else "connection restored", style="green")
        else:
            attempt = f" (attempt {conn.attempt})" if conn.attempt else ""
            connection = Text(
                f"connection {conn.state}{attempt}: {clean(conn.message)}",
                style=CONNECTION_STYLES.get(conn.state, "bold red"),
            )
        line4 = Text.assemble(
            ("elapsed ", "dim"),
            (clock(model.elapsed(now)), "bold"),
            ("  cells ", "dim"),
            states,
            ("  errors ", "dim"),
            (str(len(model.errors)), "bold red" if model.errors else ""),
            ("  ", ""),
            connection,
        )
        text = Text("\n").join([line1, lock, line3, line4])
        text.no_wrap = True
        text.overflow = "ellipsis"
        self.update(text, layout=False)
