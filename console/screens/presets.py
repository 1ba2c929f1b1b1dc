"""The first screen: pick a preset, a target and overrides, validate them, launch the run."""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import orjson
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.screen import Screen
from textual.widgets import Button, DataTable, Footer, Input, Label, Select, Static, TextArea

from console.screens.dialogs import HostKeyDialog
from console.screens.plan import PlanScreen
from console.screens.sources import LiveSource
from console.widgets.text import clean, plain
from runners.atomic import write_atomic
from runners.config import check_target, fleet_names
from runners.events import Event
from runners.kinds import load_preset
from runners.presets import SHIPPED_DIR, Preset, PresetError, user_dir
from runners.preview import preview
from runners.run import Run
from runners.targets.base import HostKeyUnknown, TargetError
from runners.targets.factory import ssh_config_aliases
from runners.trust import trust_host

RECENT_FILE = "recent_targets.json"
RECENT_MAX = 10
PRESET_DEFAULT = "__preset__"


def recent_path(out_dir: Path) -> Path:
    return out_dir.parent / RECENT_FILE


def load_recent(out_dir: Path) -> list[str]:
    """Targets used before, newest first; a damaged file counts as empty (it is only a list)."""
    try:
        data = orjson.loads(recent_path(out_dir).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return []
    return [t for t in data if isinstance(t, str)][:RECENT_MAX] if isinstance(data, list) else []


def remember_target(out_dir: Path, target: str) -> None:
    targets = [target] + [t for t in load_recent(out_dir) if t != target]
    with contextlib.suppress(OSError):  # only a convenience list: never worth failing a launch
        write_atomic(recent_path(out_dir), orjson.dumps(targets[:RECENT_MAX]))


def parse_overrides(text: str) -> list[str]:
    """One key.path=VALUE per line; blank lines and # comments are skipped."""
    lines = (line.strip() for line in text.splitlines())
    return [line for line in lines if line and not line.startswith("#")]


@dataclass(slots=True)
class PresetEntry:
    path: Path
    preset: Preset | None
    error: str | None

    @property
    def name(self) -> str:
        return self.preset.name if self.preset is not None else self.path.stem

    @property
    def origin(self) -> str:
        if self.path.parent == SHIPPED_DIR:
            return f"shipped {self.path.name}"
        if self.path.parent == user_dir():
            return f"user {self.path.name}"
        return self.path.name


def load_entries(paths: list[Path]) -> list[PresetEntry]:
    entries = []
    for path in paths:
        try:
            entries.append(PresetEntry(path, load_preset(path), None))
        except PresetError as exc:
            entries.append(PresetEntry(path, None, str(exc)))
    return entries


class PresetsScreen(Screen[None]):
    """Presets table, target chooser, overrides. Enter on a preset (or ctrl+p) shows the plan
    of its run, started from there; ctrl+r starts it straight away."""

    BINDINGS = [
        Binding("ctrl+r", "start", "Start run", priority=True),
        Binding("ctrl+p", "plan", "Plan", priority=True),
        Binding("ctrl+t", "focus_target", "Target"),
        Binding("ctrl+o", "focus_overrides", "Overrides"),
        Binding("ctrl+l", "focus_presets", "Presets"),
    ]

    class Launched(Message):
        def __init__(self, session: Run, buffer: deque[Event], target: str) -> None:
            super().__init__()
            self.session, self.buffer, self.target = session, buffer, target

    class LaunchFailed(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    class HostKeyNeeded(Message):
        def __init__(self, error: HostKeyUnknown, preset: Preset, target: str) -> None:
            super().__init__()
            self.error, self.preset, self.target = error, preset, target

    def __init__(self, out_dir: Path, preset_paths: list[Path]) -> None:
        super().__init__()
        self.out_dir = out_dir
        self.entries = load_entries(preset_paths)
        self.launching = False
        # Overrides belong to the preset they were typed for: each preset keeps its own text.
        self.overrides_by_preset: dict[Path, str] = {}
        self._overrides_for: Path | None = None

    def compose(self) -> ComposeResult:
        with Horizontal(id="presets-body"):
            with Vertical(id="presets-left"):
                yield Label("Presets", classes="section-title")
                yield DataTable(id="presets", cursor_type="row", zebra_stripes=True)
                yield Static("", id="preset-detail", markup=False)
            with Vertical(id="presets-right"):
                yield Label("Target", classes="section-title")
                yield Select(
                    self._target_options(),
                    value=PRESET_DEFAULT,
                    allow_blank=False,
                    id="target-choice",
                )
                yield Input(
                    placeholder="or type one: local | ssh://user@host:port | alias",
                    id="target-typed",
                )
                yield Label("Overrides (key.path=VALUE, one per line)", classes="section-title")
                yield TextArea(
                    "",
                    id="overrides",
                    soft_wrap=False,
                    tab_behavior="focus",
                    placeholder="e.g. matrix.seed=[0]",
                )
                yield Static("", id="preset-error", markup=False)
                with Horizontal(id="preset-buttons"):
                    yield Button("Start run (ctrl+r)", id="start", variant="success")
                    yield Button("Plan (ctrl+p)", id="plan")
        yield Footer()

    def _target_options(self) -> list[tuple[Text, str]]:
        options: list[tuple[Text, str]] = [
            (Text("preset default"), PRESET_DEFAULT),
            (Text("local"), "local"),
        ]
        seen = {"local"}
        for target in load_recent(self.out_dir):
            if target not in seen:
                seen.add(target)
                options.append((plain(f"{target}  (recent)"), target))
        for name, hosts in fleet_names().items():
            if name not in seen:
                seen.add(name)
                options.append((plain(f"{name}  (fleet: {', '.join(hosts)})"), name))
        for alias in ssh_config_aliases():
            if alias not in seen:
                seen.add(alias)
                options.append((plain(f"{alias}  (~/.ssh/config)"), alias))
        return options

    def on_mount(self) -> None:
        table = self.query_one("#presets", DataTable)
        self._fill_table(None)
        table.focus()
        entry = self.selected()
        self._overrides_for = entry.path if entry is not None else None
        self._show_detail()

    def _rows(self) -> list[tuple[Text, Text, Text, Text]]:
        rows = []
        for entry in self.entries:
            if entry.preset is not None:
                p = entry.preset
                rows.append(
                    (
                        plain(p.name, "bold"),
                        plain(p.kind),
                        Text(str(p.cell_count()), justify="right"),
                        plain(p.description),
                    )
                )
            else:
                rows.append(
                    (
                        plain(entry.name, "bold red"),
                        Text("error", style="red"),
                        Text(""),
                        plain(entry.error or ""),
                    )
                )
        return rows

    def _fixed_widths(self, rows: list[tuple[Text, Text, Text, Text]]) -> list[int]:
        """The name, kind and cells columns: as wide as their widest value or label."""
        labels = ("name", "kind", "cells")
        return [max([len(label)] + [r[i].cell_len for r in rows]) for i, label in enumerate(labels)]

    def _fill_table(self, description_width: int | None) -> None:
        """The presets' rows; a description wider than `description_width` ends in an ellipsis
        (None: as wide as the longest, before the table's width is known)."""
        table = self.query_one("#presets", DataTable)
        row = table.cursor_row
        rows = self._rows()
        table.clear(columns=True)
        for (label, key), width in zip(
            (("name", "name"), ("kind", "kind"), ("cells", "cells")),
            self._fixed_widths(rows),
            strict=True,
        ):
            table.add_column(label, key=key, width=width)
        table.add_column("description", key="description", width=description_width)
        for entry, values in zip(self.entries, rows, strict=True):
            table.add_row(*values, key=str(entry.path))
        if 0 < row < len(self.entries):
            table.move_cursor(row=row, animate=False)

    def on_resize(self) -> None:
        self.call_after_refresh(self._fit_description)

    def _fit_description(self) -> None:
        """Size the description column to the room left, so a long one is cut with an
        ellipsis (the table's right edge cut "top-32" to "top-3" with no sign of it)."""
        table = self.query_one("#presets", DataTable)
        room = table.scrollable_content_region.width
        if room <= 0:
            return
        pad = 2 * table.cell_padding
        others = sum(w + pad for w in self._fixed_widths(self._rows()))
        width = max(12, room - others - pad)
        column = table.columns.get("description")  # type: ignore[call-overload]
        if column is not None and not column.auto_width and column.width == width:
            return
        self._fill_table(width)

    def _swap_overrides(self) -> None:
        """Keep the overrides typed for the preset left; show those of the one selected."""
        entry = self.selected()
        path = entry.path if entry is not None else None
        if path == self._overrides_for:
            return
        area = self.query_one("#overrides", TextArea)
        if self._overrides_for is not None:
            self.overrides_by_preset[self._overrides_for] = area.text
        self._overrides_for = path
        area.load_text(self.overrides_by_preset.get(path, "") if path is not None else "")

    # -- selection and detail -----------------------------------------------------------------

    def selected(self) -> PresetEntry | None:
        table = self.query_one("#presets", DataTable)
        if not self.entries or table.cursor_row < 0:
            return None
        return self.entries[min(table.cursor_row, len(self.entries) - 1)]

    def _show_detail(self) -> None:
        entry = self.selected()
        detail = self.query_one("#preset-detail", Static)
        if entry is None:
            detail.update(Text("no presets found; put .toml files in ~/.config/tracedeck/presets"))
            return
        if entry.preset is None:
            detail.update(Text(clean(entry.error or ""), style="red"))
            return
        p = entry.preset
        overrides = parse_overrides(self.query_one("#overrides", TextArea).text)
        matrix_title = "matrix\n"
        if overrides:
            try:
                p = load_preset(entry.path, overrides)
                matrix_title = "matrix (with the overrides)\n"
            except PresetError:
                matrix_title = "matrix (the preset's: the overrides do not load, see Start/Plan)\n"
        matrix = "\n".join(f"  {k} = {clean(v)}" for k, v in p.matrix.items())
        text = Text.assemble(
            (clean(p.name), "bold"),
            f" ({clean(p.kind)}, {p.cell_count()} cells)\n",
            clean(p.description),
            "\n",
            (matrix_title, "dim"),
            matrix,
            "\n",
            ("determinism ", "dim"),
            clean(p.section("determinism")["profile"]),
            ("   default target ", "dim"),
            clean(p.section("target")["host"]),
            ("   from ", "dim"),
            clean(entry.origin),
        )
        detail.update(text)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._swap_overrides()
        self._show_detail()
        self.query_one("#preset-error", Static).update("")

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        self.action_plan()

    def on_text_area_changed(self, event: TextArea.Changed) -> None:
        if event.text_area.id == "overrides":
            self._show_detail()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "start":
            self.action_start()
        elif event.button.id == "plan":
            self.action_plan()

    def action_focus_target(self) -> None:
        self.query_one("#target-choice").focus()

    def action_focus_overrides(self) -> None:
        self.query_one("#overrides").focus()

    def action_focus_presets(self) -> None:
        self.query_one("#presets").focus()

    # -- starting ---------------------------------------------------------------------------------

    def show_error(self, text: str) -> None:
        self.query_one("#preset-error", Static).update(Text(clean(text), style="bold red"))

    def show_status(self, text: str) -> None:
        self.query_one("#preset-error", Static).update(Text(clean(text), style="bold"))

    def chosen_target(self, preset: Preset) -> str:
        typed = self.query_one("#target-typed", Input).value.strip()
        if typed:
            return typed
        choice = self.query_one("#target-choice", Select).value
        if choice in (PRESET_DEFAULT, Select.NULL):
            return str(preset.section("target")["host"])
        return str(choice)

    def chosen(self) -> tuple[Preset, str] | None:
        """The selected preset with its overrides, and the target, checked; None (with the
        error shown) when either is wrong."""
        entry = self.selected()
        if entry is None:
            self.show_error("no preset selected")
            return None
        overrides = parse_overrides(self.query_one("#overrides", TextArea).text)
        try:
            preset = load_preset(entry.path, overrides)
        except PresetError as exc:
            self.show_error(str(exc))
            return None
        target = self.chosen_target(preset)
        try:
            check_target(target)
        except ValueError as exc:
            self.show_error(str(exc))
            return None
        return preset, target

    def action_start(self) -> None:
        """Validate the preset with its overrides and the target, then launch in a worker."""
        if self.launching:
            return
        picked = self.chosen()
        if picked is not None:
            self.launch(*picked)

    def action_plan(self) -> None:
        """The plan of the run Start would launch (nothing starts until it says so)."""
        if self.launching:
            return
        picked = self.chosen()
        if picked is None:
            return
        preset, target = picked
        try:
            view = preview(preset, target, self.out_dir)
        except (PresetError, ValueError) as exc:
            self.show_error(str(exc))
            return
        self.query_one("#preset-error", Static).update("")

        def answered(start: bool | None) -> None:
            if start:
                self.launch(preset, target)

        self.app.push_screen(PlanScreen(view), answered)

    def launch(self, preset: Preset, target: str) -> None:
        self.launching = True
        self.show_status(f"launching {preset.name} on {target} ...")
        self.run_worker(
            self._launch(preset, target), group="launch", exclusive=True, exit_on_error=False
        )

    async def _launch(self, preset: Preset, target: str) -> None:
        """Create and launch the session; only posts messages back."""
        buffer: deque[Event] = deque()
        try:
            session = Run.create(preset, target, self.out_dir, buffer.append)
        except (PresetError, ValueError, OSError) as exc:
            self.post_message(self.LaunchFailed(str(exc)))
            return
        try:
            await session.launch()
        except HostKeyUnknown as exc:
            await session.close()
            self.post_message(self.HostKeyNeeded(exc, preset, target))
            return
        except (TargetError, OSError) as exc:
            await session.close()
            self.post_message(self.LaunchFailed(str(exc)))
            return
        except BaseException:
            await session.close()
            raise
        self.post_message(self.Launched(session, buffer, target))

    async def _trust_then_launch(self, error: HostKeyUnknown, preset: Preset, target: str) -> None:
        try:
            await trust_host(error.host, error.port, expected_fingerprint=error.fingerprint)
        except (TargetError, OSError) as exc:
            self.post_message(self.LaunchFailed(str(exc)))
            return
        await self._launch(preset, target)

    def on_presets_screen_launched(self, message: Launched) -> None:
        from console.screens.run import RunScreen

        self.launching = False
        self.show_status("")
        remember_target(self.out_dir, message.target)
        self.app.push_screen(RunScreen(LiveSource(message.session, message.buffer)))

    def on_presets_screen_launch_failed(self, message: LaunchFailed) -> None:
        self.launching = False
        self.show_error(message.text)

    def on_presets_screen_host_key_needed(self, message: HostKeyNeeded) -> None:
        error = message.error

        def answered(trust: bool | None) -> None:
            if trust:
                self.show_status(f"trusting {error.host} and launching ...")
                self.run_worker(
                    self._trust_then_launch(error, message.preset, message.target),
                    group="launch",
                    exclusive=True,
                    exit_on_error=False,
                )
            else:
                self.launching = False
                self.show_error(f"{error}; not trusted")

        self.app.push_screen(HostKeyDialog(error), answered)
