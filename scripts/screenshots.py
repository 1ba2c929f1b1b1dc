"""The README's screenshots, taken by the console itself (Textual's save_screenshot) from the
shipped presets and the recorded runs in tests/data, at 120x40.

    .venv/bin/python scripts/screenshots.py          # (re)write docs/screens/*.svg
    .venv/bin/python scripts/screenshots.py --check  # exit 1 naming each stale file

tests/test_screenshots.py runs --check: a README whose pictures no longer match the console
fails the suite until this script is run again.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCREENS = ROOT / "docs" / "screens"
DATA = ROOT / "tests" / "data"
SIZE = (120, 40)
# file name -> (recorded run to open, or None for the presets screen; keys pressed then)
SHOTS: dict[str, tuple[str | None, tuple[str, ...]]] = {
    "presets.svg": (None, ("down",)),
    "run_equivalence.svg": ("equivalence_fail", ()),
    "run_dsa.svg": ("dsa_run", ()),
    "run_kv_invariance.svg": ("kv_invariance_run", ()),
    "readout_traces.svg": ("readout_run", ("d", "down", "down", "down")),
}


async def take(run: str | None, keys: tuple[str, ...], out_dir: Path) -> str:
    sys.path.insert(0, str(ROOT))
    from console.app import create_app
    from console.screens.run import RunScreen
    from console.widgets.banner import VerdictBanner

    app = create_app(out_dir=out_dir, replay_dir=DATA / run if run else None, speed=0)
    async with app.run_test(size=SIZE) as pilot:
        if run is not None:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 30
            while True:
                screen = app.screen
                if (
                    isinstance(screen, RunScreen)
                    and not screen.buffer
                    and screen.query_one("#banner", VerdictBanner).verdict is not None
                ):
                    break
                if loop.time() > deadline:
                    raise SystemExit(f"screenshots: {run} did not finish replaying")
                await pilot.pause(0.05)
            await pilot.pause(0.4)  # the charts redraw at most every quarter second
        for key in keys:
            await pilot.press(key)
        await pilot.pause(0.2)
        return app.export_screenshot(title="tracedeck")


def render_all() -> dict[str, str]:
    """Every screenshot's SVG text, taken with HOME and the records in a fresh directory (no
    recent target or ~/.ssh alias of this machine shows)."""
    with tempfile.TemporaryDirectory(prefix="tracedeck-shots-") as tmp:
        os.environ["HOME"] = str(Path(tmp) / "home")
        os.environ["TRACEDECK_HOME"] = str(Path(tmp) / "td")
        os.environ.pop("XDG_CONFIG_HOME", None)
        (Path(tmp) / "home").mkdir()
        out = Path(tmp) / "td" / "runs"
        return {name: asyncio.run(take(run, keys, out)) for name, (run, keys) in SHOTS.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if stale")
    parser.add_argument("--dir", type=Path, default=SCREENS, help="where the SVGs are")
    args = parser.parse_args(argv)
    shots = render_all()
    if args.check:
        stale = [
            name
            for name, svg in shots.items()
            if not (args.dir / name).is_file() or (args.dir / name).read_text() != svg
        ]
        for name in stale:
            print(f"stale: {args.dir / name} (run: python scripts/screenshots.py)")
        return 1 if stale else 0
    args.dir.mkdir(parents=True, exist_ok=True)
    for name, svg in shots.items():
        (args.dir / name).write_text(svg)
        print(f"wrote {args.dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
