"""The DSA detail screen's data tabs: block-size what-if and the KV-tier simulator.

Both read the trace directory itself (it must be on this machine: `tracedeck watch DIR`, or a
run on host "local") and are computed in a child process (`tracedeck dsa whatif|tiers --json`,
i.e. analysis.dsa_whatif.whatif_dir and analysis.dsa_tiers.tiers_dir): the event loop only
awaits its output and draws it, and a child that is no longer wanted is killed.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.widgets import Select, Static, TabbedContent, TabPane

from analysis.dsa_tiers import POLICIES
from analysis.dsa_whatif import format_whatif
from console.widgets.dsa_charts import ColumnHistogram

SIZES = (4, 8, 16, 32, 64, 128, 256)
MAX_CAPACITIES = (64, 256, 1024, 4096, 16384, 65536)


def sweep(top: int) -> list[int]:
    out, n = [], 1
    while n < top:
        out.append(n)
        n *= 2
    return [*out, top]


class DsaDataTabs(Vertical):
    """what-if (block size selector, its distributions, all sizes side by side) and tiers
    (policy, capacity steps, the hit-ratio curve)."""

    DEFAULT_CSS = """
    DsaDataTabs { height: auto; border-top: solid $primary; }
    DsaDataTabs TabbedContent { height: auto; }
    DsaDataTabs TabPane { height: auto; padding: 0 1; }
    DsaDataTabs Select { width: 24; }
    DsaDataTabs #dd-wi-charts { height: 7; }
    DsaDataTabs .dd-row { height: auto; }
    """

    def __init__(
        self, folders: Callable[[], list[str]], topk: int | None = None, *, id: str | None = None
    ) -> None:
        super().__init__(id=id)
        self.folders = folders
        self.topk = topk
        self.whatif: dict[str, Any] | None = None
        self.tiers: dict[str, Any] | None = None
        self.jobs_started = 0  # child processes started (what-if and tiers run in them)

    def compose(self) -> ComposeResult:
        with TabbedContent(id="dd-data"):
            with TabPane("what-if", id="dd-whatif"):
                with Horizontal(classes="dd-row"):
                    options = [(f"block {b}", b) for b in SIZES]
                    yield Select(options, value=64, allow_blank=False, id="dd-wi-size")
                    yield Static("", id="dd-wi-note", markup=False)
                with Horizontal(id="dd-wi-charts"):
                    yield ColumnHistogram("touched ratio", ("0", "1"), height=5, id="dd-wi-touched")
                    yield ColumnHistogram("unique blocks", ("min", "max"), height=5, id="dd-wi-unique")  # fmt: skip
                yield Static("", id="dd-wi-table", markup=False)
            with TabPane("tiers", id="dd-tiers"):
                with Horizontal(classes="dd-row"):
                    policies = [(p, p) for p in POLICIES]
                    yield Select(policies, value="lru", allow_blank=False, id="dd-ti-policy")
                    caps = [(f"up to {n} blocks", n) for n in MAX_CAPACITIES]
                    yield Select(caps, value=4096, allow_blank=False, id="dd-ti-cap")
                    yield Static("", id="dd-ti-note", markup=False)
                yield Static("", id="dd-ti-curve", markup=False)

    # -- where the trace is ---------------------------------------------------------------------

    def folder(self) -> str | None:
        local = [f for f in self.folders() if Path(f).is_dir()]
        return local[0] if local else None

    def _no_trace(self, note: str) -> bool:
        if self.folder() is not None:
            return False
        where = ", ".join(self.folders()) or "no trace yet"
        self.query_one(note, Static).update(
            f"the trace is not on this machine ({where}): run `tracedeck watch DIR` where it is"
        )
        return True

    async def job(self, *args: str) -> dict[str, Any]:
        """`tracedeck dsa ARGS --json` in a child process; its one directory's result."""
        self.jobs_started += 1
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "console.cli",
            "dsa",
            *args,
            "--json",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            out, err = await proc.communicate()
        finally:
            if proc.returncode is None:  # cancelled (a newer request, the screen closed)
                proc.kill()
                await proc.wait()
        if proc.returncode not in (0, 2) or not out.strip():
            raise RuntimeError(err.decode(errors="replace").strip() or f"exit {proc.returncode}")
        return json.loads(out)["dirs"][0]

    # -- what-if --------------------------------------------------------------------------------

    def on_mount(self) -> None:
        self.compute_whatif()

    def compute_whatif(self) -> None:
        if self._no_trace("#dd-wi-note"):
            return
        self.query_one("#dd-wi-note", Static).update("  computing every block size ...")
        self.run_worker(self._whatif(), exclusive=True, group="dsa-whatif")

    async def _whatif(self) -> None:
        folder = str(self.folder())
        sizes = ",".join(map(str, SIZES))
        topk = ["--topk", str(self.topk)] if self.topk else []
        try:
            got = await self.job("whatif", folder, "--block-sizes", sizes, *topk)
            self.whatif = got
        except Exception as exc:  # noqa: BLE001 - shown, not raised into the console
            failed = f"  what-if failed: {exc}"
        else:
            failed = ""
        try:
            if failed:
                self.query_one("#dd-wi-note", Static).update(failed)
            else:
                self.draw_whatif()
        except NoMatches:  # the screen closed while the child finished: nothing to draw on
            pass

    def draw_whatif(self) -> None:
        got = self.whatif
        if got is None:
            return
        size = self.query_one("#dd-wi-size", Select).value
        entry = next(s for s in got["sizes"] if s["block_size"] == size)
        note = f"  {got['used']} of {got['records']} records, recorded at block {got['block_size']}"
        if got["invalid"]:
            note += f"; {got['invalid']} invalid left out"
        if entry["prefix_undetermined"]:
            note += f"; prefix undetermined in {entry['prefix_undetermined']}"
        self.query_one("#dd-wi-note", Static).update(note)
        hist = entry["hist"]
        self.query_one("#dd-wi-touched", ColumnHistogram).show(
            [h[2] for h in hist["touched_block_ratio"]], 2
        )
        unique = self.query_one("#dd-wi-unique", ColumnHistogram)
        if hist["unique_blocks"]:
            lo, hi = hist["unique_blocks"][0][0], hist["unique_blocks"][-1][1]
            unique.labels = (f"{lo:g}", f"{hi:g}")
        unique.show([h[2] for h in hist["unique_blocks"]], 2)
        table = format_whatif(got).split("\n\n")[1].split("\ntouched_block_ratio histogram")[0]
        self.query_one("#dd-wi-table", Static).update(Text(table))

    def on_select_changed(self, event: Select.Changed) -> None:
        if event.select.id == "dd-wi-size":
            self.draw_whatif()
        elif event.select.id in ("dd-ti-policy", "dd-ti-cap") and self.tiers is not None:
            self.compute_tiers()

    # -- tiers ----------------------------------------------------------------------------------

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        if event.pane.id == "dd-tiers" and self.tiers is None:
            self.compute_tiers()

    def compute_tiers(self) -> None:
        if self._no_trace("#dd-ti-note"):
            return
        self.tiers = {}  # asked for: a policy or capacity change recomputes
        self.query_one("#dd-ti-note", Static).update("  replaying ...")
        policy = self.query_one("#dd-ti-policy", Select).value
        top = self.query_one("#dd-ti-cap", Select).value
        self.run_worker(self._tiers(str(policy), int(top)), exclusive=True, group="dsa-tiers")  # type: ignore[call-overload]

    async def _tiers(self, policy: str, top: int) -> None:
        folder = str(self.folder())
        caps = ",".join(map(str, sweep(top)))
        try:
            got = await self.job("tiers", folder, "--hbm-blocks", caps, "--policy", policy)
            self.tiers = got
        except Exception as exc:  # noqa: BLE001 - shown, not raised into the console
            failed = f"  tiers failed: {exc}"
        else:
            failed = ""
        try:
            if failed:
                self.query_one("#dd-ti-note", Static).update(failed)
            else:
                self.draw_tiers()
        except NoMatches:  # the screen closed while the child finished: nothing to draw on
            pass

    def draw_tiers(self) -> None:
        got = self.tiers
        if not got:
            return
        self.query_one("#dd-ti-note", Static).update(
            f"  {got['policy']}: {got['used']} records in {got['order'].split(' (')[0]}, "
            f"{got['bytes_per_block']} bytes a block"
        )
        text = Text("hit ratio by HBM capacity (blocks)\n", style="bold")
        for t in got["tiers"]:
            h = t["hit_ratio"] or 0.0
            text.append(f"{t['hbm_blocks']:>7} ")
            text.append(f"{'█' * round(40 * h):<40}", style="cyan")
            rb = t["remote_pool"]["bytes_read"]
            text.append(f" {h:6.3f}  remote {rb:>12} B\n", style="")
        self.query_one("#dd-ti-curve", Static).update(text)
