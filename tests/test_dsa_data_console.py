"""The DSA detail screen's what-if and tiers tabs (issue 26), driven by Pilot on a real trace."""

from __future__ import annotations

import json
from pathlib import Path

from dsa_writer import write_trace
from test_console import wait_for
from textual.widgets import Select, TabbedContent

from analysis.dsa_tiers import tiers_dir
from analysis.dsa_whatif import whatif_dir
from console.panels.dsa_trace import DsaDetail, DsaWatchApp, DsaWatchScreen
from console.widgets.dsa_charts import ColumnHistogram
from console.widgets.dsa_data_tabs import SIZES, DsaDataTabs, sweep

SIZE = (120, 50)


async def test_the_detail_screen_draws_the_whatif_and_tiers_tabs_from_a_worker(
    tmp_path: Path,
) -> None:
    folder = write_trace(tmp_path / "t", requests=5, steps=3, topk=32)
    screen = DsaWatchScreen(str(tmp_path / "t"), idle_s=0.5, topk=32)
    app = DsaWatchApp(screen)
    async with app.run_test(size=SIZE) as pilot:
        await wait_for(pilot, lambda: screen.outcome is not None, 60, "the watch to end")
        await pilot.press("d")
        await wait_for(pilot, lambda: isinstance(app.screen, DsaDetail), 10, "the detail screen")
        tabs = app.screen.query_one(DsaDataTabs)
        await wait_for(pilot, lambda: tabs.whatif is not None, 120, "the what-if")
        want = json.loads(json.dumps(whatif_dir(str(folder), list(SIZES), 32)))
        assert tabs.whatif == want and tabs.jobs_started == 1  # computed in a child process
        note = str(tabs.query_one("#dd-wi-note").render())
        assert "45 of 45 records, recorded at block 16" in note
        table = str(tabs.query_one("#dd-wi-table").render())
        assert "block 4" in table and "block 256" in table and "unique_blocks p50" in table
        touched = tabs.query_one("#dd-wi-touched", ColumnHistogram)
        at64 = next(s for s in want["sizes"] if s["block_size"] == 64)
        assert "n=45" in str(touched.render())
        unique = tabs.query_one("#dd-wi-unique", ColumnHistogram)
        drawn64 = str(unique.render())
        # the selector redraws the distributions for another size
        tabs.query_one("#dd-wi-size", Select).value = 4
        at4 = next(s for s in want["sizes"] if s["block_size"] == 4)
        assert at4["hist"]["unique_blocks"] != at64["hist"]["unique_blocks"]
        await wait_for(pilot, lambda: str(unique.render()) != drawn64, 10, "size 4's histograms")
        lo, hi = at4["hist"]["unique_blocks"][0][0], at4["hist"]["unique_blocks"][-1][1]
        assert unique.labels == (f"{lo:g}", f"{hi:g}")
        # the tiers tab replays on activation, a policy change replays again
        tabs.query_one(TabbedContent).active = "dd-tiers"
        await wait_for(pilot, lambda: bool(tabs.tiers), 120, "the tier simulation")
        assert tabs.tiers == json.loads(json.dumps(tiers_dir(str(folder), sweep(4096), "lru")))
        curve = str(tabs.query_one("#dd-ti-curve").render())
        assert "hit ratio by HBM capacity" in curve and "   4096 " in curve
        tabs.query_one("#dd-ti-policy", Select).value = "lfu"
        await wait_for(
            pilot, lambda: bool(tabs.tiers) and tabs.tiers["policy"] == "lfu", 120, "lfu"
        )
        await pilot.press("escape", "q")


async def test_the_tabs_say_when_the_trace_is_not_here(tmp_path: Path) -> None:
    from textual.app import App, ComposeResult

    class One(App[None]):
        def compose(self) -> ComposeResult:
            yield DsaDataTabs(lambda: ["/on/another/host/block64"])

    app = One()
    async with app.run_test(size=SIZE) as pilot:
        tabs = app.query_one(DsaDataTabs)
        await pilot.pause()
        note = str(tabs.query_one("#dd-wi-note").render())
        assert "not on this machine (/on/another/host/block64)" in note
        assert tabs.jobs_started == 0
